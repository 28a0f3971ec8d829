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
    def alltoall(self, tensor: tf.Tensor, splits: tf.Tensor, name: str = None) -> tuple:
        """Sends the next `splits[i]` rows of `tensor` to rank i (in rank order);
        returns (received rows in rank order, received_splits). Differentiable."""

    @abc.abstractmethod
    def allgather(self, tensor: tf.Tensor, name: str = None) -> tf.Tensor:
        """Every rank's `tensor`, concatenated along the first axis in rank order."""

    @abc.abstractmethod
    def allreduce(self, tensors: list, op: str = "mean", name: str = None) -> list:
        """Reduces each tensor across ranks ("sum" or "mean"), as one group."""

    @abc.abstractmethod
    def broadcast(self, tensor: tf.Tensor, root: int = 0, name: str = None) -> tf.Tensor:
        """Rank `root`'s value of `tensor` on every rank."""
