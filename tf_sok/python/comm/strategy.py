"""Communication between the replicas of a tf.distribute strategy.

Each replica is a rank: `MirroredStrategy` hosts all ranks in one process
(one per device), `MultiWorkerMirroredStrategy` spreads them over worker
processes. Collectives are called from replica context (inside
`strategy.run`, which `model.fit` uses).

All-to-all:
- MirroredStrategy: a `merge_call` that slices each replica's send buffer and
  concatenates the slices on the receiving device, so every row is copied
  once, device to device, inside the process.
- MultiWorkerMirroredStrategy: TensorFlow's collective all-to-all
  (`CollectiveAllToAllV2`, the strategy's group and ordering token). It moves
  equal-sized chunks, so each rank pads its chunk to the largest pair count of
  the step (learned with one small all-gather of the send counts); per-rank
  traffic is N x that largest chunk, which stays near the per-rank batch when
  the owners are balanced. Needs a `tf.function` (as the strategy's own
  all-gather does).
Both are differentiable: the gradient is the reverse exchange.
"""
import contextlib
from typing import List

import tensorflow as tf
from tensorflow.python.distribute import values as distribute_values
from tensorflow.python.ops import collective_ops
from tensorflow.python.ops import resource_variable_ops

from tf_sok.python.comm.base import Communicator, check_reduction
from tf_sok.python.context_errors import replica_context_required
from tf_sok.python.ops import array_ops

_MIRRORED, _MULTI_WORKER = "MirroredStrategy", "MultiWorkerMirroredStrategy"


def strategy_kind(strategy) -> str:
    """Which supported strategy `strategy` is; ValueError for the others."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return _MULTI_WORKER
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        return _MIRRORED
    raise ValueError(f"tf_sok supports tf.distribute.MirroredStrategy and MultiWorkerMirroredStrategy; got "
                     f"{type(strategy).__name__}. Use one of them, Horovod, or no strategy")


def _plain_creator(next_creator, **kwargs):  # noqa: ARG001 (skips the strategy's mirroring creator)
    return resource_variable_ops.default_variable_creator_v2(None, **kwargs)


def _replica_context(strategy):
    """`strategy`'s replica context, or a clear error anywhere else."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or tf.distribute.in_cross_replica_context() or ctx.strategy is not strategy:
        replica_context_required()
    return ctx


class StrategyCommunicator(Communicator):
    """The replicas of a MirroredStrategy or MultiWorkerMirroredStrategy as ranks."""

    def __init__(self, strategy):
        self.kind = strategy_kind(strategy)
        self._strategy = strategy
        self._devices = list(strategy.extended.worker_devices)
        replicas = strategy.num_replicas_in_sync
        if self.kind == _MIRRORED:
            if len(self._devices) != replicas:
                raise ValueError("tf_sok: a MirroredStrategy spanning several workers is not supported; use "
                                 "MultiWorkerMirroredStrategy")
            first = 0
        else:
            first = int(getattr(strategy.extended, "_id_in_cluster", 0)) * len(self._devices)
        self._local = list(range(first, first + len(self._devices)))
        if self._local[-1] >= replicas:
            raise ValueError(f"tf_sok: this worker's replicas {self._local} exceed the {replicas} in sync; every "
                             f"worker must have the same number of devices")

    @property
    def strategy(self):
        return self._strategy

    @property
    def nccl_ranks(self):
        # MirroredStrategy: one process drives every replica's GPU; across workers TensorFlow's own
        # collectives move the data
        return "replica" if self.kind == _MIRRORED and self.size > 1 else None

    @property
    def size(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def rank(self) -> int:
        rid = tf.get_static_value(_replica_context(self.strategy).replica_id_in_sync_group)
        if rid is None:
            raise RuntimeError("tf_sok: the replica id of this strategy is not known while tracing")
        return int(rid)

    @property
    def local_ranks(self) -> List[int]:
        return list(self._local)

    def outside_replicas(self) -> bool:
        ctx = tf.distribute.get_replica_context()
        return ctx is None or tf.distribute.in_cross_replica_context() or ctx.strategy is not self.strategy

    @property
    def per_replica_tables(self) -> bool:
        return True

    @property
    def mirrors_dense_variables(self) -> bool:
        return True

    def device(self, rank: int) -> str:
        return self._devices[self._local.index(rank)]

    @contextlib.contextmanager
    def placement(self, rank: int):
        """Variables created inside are plain (unmirrored) and live on `rank`'s device."""
        with tf.init_scope(), tf.device(self.device(rank)), tf.variable_creator_scope(_plain_creator):
            yield

    def reduce_dense_gradients(self, grads):
        # Keras optimizers all-reduce (sum) under a strategy themselves, and the
        # strategy-aware loss is already divided by the number of replicas
        return list(grads)

    # -- collectives (replica context) --------------------------------------------------------------
    def allgather(self, tensor, name=None):
        return _replica_context(self.strategy).all_gather(tensor, axis=0)

    def allreduce(self, tensors, op="mean", name=None):
        check_reduction(op)
        tensors = list(tensors)
        if not tensors:
            return []
        reduce_op = tf.distribute.ReduceOp.MEAN if op == "mean" else tf.distribute.ReduceOp.SUM
        return list(_replica_context(self.strategy).all_reduce(reduce_op, tensors))

    def broadcast(self, tensor, root=0, name=None):
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root {root} is not a replica (there are {self.size})")
        every = _replica_context(self.strategy).all_gather(tensor[None], axis=0)
        return every[root]

    def alltoall(self, tensor, splits, name=None, recv_splits=None):
        with tf.device("/cpu:0"):  # split sizes stay in host memory: no device round trip to read them
            splits = tf.cast(splits, tf.int64)
        move = self._merge_exchange if self.kind == _MIRRORED else self._collective_exchange

        @tf.custom_gradient
        def exchange(x):
            y, recv_splits = move(x, splits)

            def grad(dy, *_):
                return move(dy, recv_splits)[0]
            return (y, recv_splits), grad
        return exchange(tensor)

    def _merge_exchange(self, x, send_splits):
        devices = self._devices

        def merge_fn(strategy, xs, ss):
            xs, ss = strategy.experimental_local_results(xs), strategy.experimental_local_results(ss)
            n = len(devices)
            parts = []
            for s in range(n):
                with tf.device(devices[s]):
                    parts.append(array_ops.split(xs[s], ss[s], num=n))
            ys, rs = [], []
            for d in range(n):
                with tf.device(devices[d]):
                    ys.append(tf.concat([parts[s][d] for s in range(n)], 0))
                with tf.device("/cpu:0"):
                    rs.append(tf.stack([ss[s][d] for s in range(n)]))
            return distribute_values.PerReplica(tuple(ys)), distribute_values.PerReplica(tuple(rs))

        # identity() keeps regrouping from mistaking equal per-replica objects for one value
        return _replica_context(self.strategy).merge_call(merge_fn, args=(tf.identity(x), tf.identity(send_splits)))

    def _collective_exchange(self, x, send_splits):
        ctx = _replica_context(self.strategy)
        rank = self.rank
        launchers = getattr(getattr(self.strategy.extended, "_cross_device_ops", None), "_launchers", None)
        if launchers is None:
            raise RuntimeError("tf_sok: this TensorFlow's MultiWorkerMirroredStrategy does not expose its "
                               "collective launchers; the all-to-all needs them")
        launcher = launchers[self._local.index(rank)]
        n = self.size
        counts = ctx.all_gather(send_splits[None, :], axis=0)            # [sender, receiver]
        recv_splits = counts[:, rank]
        chunk = tf.maximum(tf.reduce_max(counts), 1)
        dest = tf.repeat(tf.range(n, dtype=tf.int64), send_splits)
        slot = tf.range(tf.size(dest, out_type=tf.int64)) - tf.gather(tf.cumsum(send_splits, exclusive=True), dest)
        tail = tf.shape(x, out_type=tf.int64)[1:]
        padded = tf.scatter_nd(tf.stack([dest, slot], 1), x, tf.concat([[n, chunk], tail], 0))
        with tf.device(launcher._device):
            received = collective_ops.all_to_all_v2(
                padded, launcher._group_size, launcher._group_key, launcher._next_instance_key(),
                ordering_token=launcher._get_ordering_token())
        keep = tf.range(chunk)[None, :] < recv_splits[:, None]
        return tf.boolean_mask(received, keep), recv_splits
