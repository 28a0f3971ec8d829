"""The interface every communication backend implements."""
import abc

import tensorflow as tf


class Communicator(abc.ABC):
    """Collectives used by the lookup and the optimizers.

    Implementations: `SingleProcess` (one rank; collectives are identities);
    Horovod and tf.distribute plug in behind the same methods.
    """

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def alltoall(self, tensor: tf.Tensor, splits: tf.Tensor) -> tuple:
        """Sends rows `splits[i]` of `tensor` to rank i; returns (received, received_splits)."""

    @abc.abstractmethod
    def allreduce(self, tensors: list, op: str = "mean") -> list:
        """Reduces each tensor across ranks ("sum" or "mean")."""

    @abc.abstractmethod
    def broadcast(self, tensor: tf.Tensor, root: int = 0) -> tf.Tensor:
        """Rank `root`'s value of `tensor` on every rank."""
