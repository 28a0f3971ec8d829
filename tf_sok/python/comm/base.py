"""The interface every communication backend implements."""
import abc
import contextlib
import dataclasses
from typing import List, Optional, Tuple

import tensorflow as tf


def check_reduction(op: str) -> None:
    if op not in ("sum", "mean"):
        raise ValueError(f"unknown reduction {op!r}: use 'sum' or 'mean'")


@dataclasses.dataclass(frozen=True)
class KeyRouting:
    """What the lookup's exchange needs to check and route its ids and to plan
    the rest (`Communicator.route_keys`). Per feature: its table, the table's
    global row count and both names; per table: -1 (row-wise) or the rank owning
    it, and its width group (tables of one embedding width share an all-to-all)."""
    step: int
    signature: int
    feature_table: Tuple[int, ...]
    feature_rows: Tuple[int, ...]
    table_owner: Tuple[int, ...]
    table_group: Tuple[int, ...]
    num_groups: int
    feature_names: Tuple[str, ...]
    table_names: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RoutedKeys:
    """The exchange's plan made in one step by a backend (`Communicator.route_keys`).
    As an owner: `table_rows` split by `table_counts` (host) are the local rows each
    table looks up (one per key received, repeats across senders kept), with row
    splits `unit_splits` split by table_counts + 1; per width group g,
    `group_gather[g]` picks the vectors to return from the group's tables' lookups
    concatenated in table order (each row once: a permutation, whose inverse is
    `group_scatter[g]`), `group_send[g]` (host) of them to each rank. As a
    sender: `group_recv[g]` (host) vectors come back from each rank, and `slot` (one
    per id, the features' ids concatenated) is each id's row among its group's."""
    table_rows: tf.Tensor
    table_counts: tf.Tensor
    unit_splits: tf.Tensor
    group_gather: List[tf.Tensor]
    group_scatter: List[tf.Tensor]
    group_send: List[tf.Tensor]
    group_recv: List[tf.Tensor]
    slot: tf.Tensor


class Communicator(abc.ABC):
    """Collectives used by the lookup and the optimizers.

    Implementations: `SingleProcess` (one rank; collectives are identities),
    `HorovodCommunicator` (one rank per process) and `StrategyCommunicator`
    (one rank per tf.distribute replica; a process may host several);
    `NcclCommunicator` wraps a Horovod one and moves the lookup's data by NCCL.
    """

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def alltoall(self, tensor: tf.Tensor, splits: tf.Tensor, name: str = None, recv_splits: tf.Tensor = None) -> tuple:
        """Sends the next `splits[i]` rows of `tensor` to rank i (in rank order);
        returns (received rows in rank order, received_splits). Differentiable.
        `recv_splits`, when the caller knows what each rank sends here, lets a
        backend skip exchanging the sizes (and the wait to read them)."""

    @abc.abstractmethod
    def allgather(self, tensor: tf.Tensor, name: str = None) -> tf.Tensor:
        """Every rank's `tensor`, concatenated along the first axis in rank order."""

    @abc.abstractmethod
    def allreduce(self, tensors: list, op: str = "mean", name: str = None) -> list:
        """Reduces each tensor across ranks ("sum" or "mean"), as one group."""

    @abc.abstractmethod
    def broadcast(self, tensor: tf.Tensor, root: int = 0, name: str = None) -> tf.Tensor:
        """Rank `root`'s value of `tensor` on every rank."""

    def route_keys(self, ids: List[tf.Tensor], routing: KeyRouting) -> Optional[RoutedKeys]:
        """The lookup's exchange planned in one step, where a backend can: checks every
        rank's ids (one int64 vector per feature) against their tables (the same error on
        every rank), moves the distinct keys (table << 40 | row) to their owners and lays
        out what the rest of the step needs without waiting again. None (the default)
        leaves it to separate collectives."""
        return None

    @property
    def local_ranks(self) -> List[int]:
        """The ranks whose table shards live in this process."""
        return [self.rank]

    def outside_replicas(self) -> bool:
        """True where tables cannot be used because no replica is running (tf.distribute only)."""
        return False

    @property
    def per_replica_tables(self) -> bool:
        """True when this process holds one shard per local rank (tf.distribute)."""
        return False

    def placement(self, rank: int):
        """Where the state of `rank`'s shards is created (a context manager)."""
        return contextlib.nullcontext()

    def reduce_dense_gradients(self, grads: list) -> list:
        """Dense gradients as the dense optimizer should apply them (averaged over ranks)."""
        if self.size == 1:
            return list(grads)
        return self.allreduce([tf.convert_to_tensor(g) for g in grads], "mean", name="tf_sok.dense_gradients")

    @property
    def mirrors_dense_variables(self) -> bool:
        """True when the framework keeps dense variables identical on every rank itself."""
        return self.size == 1

    # -- what the backend can do (the context picks the exchange by these, never by type) ----------
    @property
    def nccl_ranks(self) -> Optional[str]:
        """Whether tf_sok's NCCL exchange can run over these ranks, and how they are laid out:
        "process" (one rank per process, which has a GPU of its own), "replica" (this process's
        replicas, one GPU each, in `device(rank)`), or None (it cannot)."""
        return None

    @property
    def moves_data_by_nccl(self) -> bool:
        """True when this communicator's all-to-alls are tf_sok's NCCL exchange already."""
        return False

    def device(self, rank: int) -> Optional[str]:
        """The device of local rank `rank`, where the communicator places ranks (else None)."""
        return None

    @property
    def strategy(self):
        """The tf.distribute strategy whose replicas are the ranks, or None."""
        return None
