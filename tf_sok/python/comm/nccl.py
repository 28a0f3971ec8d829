"""The lookup's all-to-all and all-gather by NCCL, driven from tf_sok's own ops
on TensorFlow's GPU stream; everything else from the communicator it wraps.

Under Horovod each collective otherwise passes through Horovod's background
thread and its negotiation cycle (about 1-2 ms per op whatever its size); under
MirroredStrategy through the strategy's cross-device copies. Here an exchange is
a kernel launch on the stream that already holds the data. The wrapped
communicator still names the ranks, sends the NCCL id from rank 0 to the others
(Horovod), places the tables' shards (tf.distribute) and all-reduces the dense
gradients.

MirroredStrategy hosts every rank in one process, one GPU each: one NCCL
communicator per replica device, created together (one thread per device, as
NCCL requires of ranks in one process). NCCL needs the replicas' collectives in
flight together, which a `tf.function` gives (every replica's ops in one graph,
run concurrently) but eager `strategy.run` does not (TensorFlow runs eager
replicas one after another), so eagerly the lookup uses the strategy's own
collectives: the same results, more slowly.

NCCL needs every rank to issue the same collectives in the same order. Inside a
graph TensorFlow may run independent ops in any order, so each collective this
communicator adds to a graph takes a control dependency on the previous one
(program order: forward in the order the lookups were called, backward in the
order the gradient tape visits them, identical on every rank). Eagerly, ops
run in program order anyway.
"""
import itertools
import logging
import os
import threading
from typing import Dict, List, Optional, Tuple

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps

from tf_sok.python.comm.base import Communicator, KeyRouting, RoutedKeys
from tf_sok.python.ops import array_ops, collective_ops

_log = logging.getLogger("tf_sok")
MAX_WIDTHS = 64  # embedding widths one planned exchange handles (kMaxGroups in key_exchange_gpu.cu)
_keys = itertools.count(1)
# (bootstrap type, ranks here, size, their GPUs) -> ({rank: communicator key}, NCCL version): one NCCL
# communicator per rank
_joined: Dict[Tuple, Tuple[Dict[int, int], str]] = {}


_COLLECTIVE_OPS = frozenset(("TfSokNcclAllToAll", "TfSokNcclAllGather", "TfSokNcclExchangeSplits",
                             "TfSokNcclRouteKeys"))


@auto_control_deps.register_acd_resource_resolver
def _ordered_per_rank(op, reads, writes):
    """tf.function chains every stateful op that touches no resource in program order.
    MirroredStrategy traces replica 0's step, then replica 1's, into one graph, so that
    chain would make replica 1's first collective wait for replica 0's last one, which
    waits for replica 1: a hang. These ops are ordered per rank by NcclCommunicator
    instead; each stands for a resource of its own here, which takes it off the chain."""
    if op.type not in _COLLECTIVE_OPS or not op.outputs or op.outputs[0] in writes:
        return False
    writes.add(op.outputs[0])
    return True


class NcclUnavailable(RuntimeError):
    """NCCL cannot run on every rank; raised on every rank alike (exchange="auto" falls back)."""


def _agree_available(bootstrap: Communicator) -> None:
    """Raises NcclUnavailable on every rank if any rank cannot use NCCL, before any rank
    starts a collective that the others would never join."""
    if not collective_ops.available():
        why = "the tf_sok op library was built without CUDA (no nvcc at build time)"
    elif not tf.config.list_logical_devices("GPU"):
        why = "this process sees no GPU"
    else:
        ok, text = collective_ops.probe()
        why = None if ok else text
    if why is None and bootstrap.per_replica_tables:
        why = _replica_devices_problem(bootstrap)
    missing = int(why is not None)
    if bootstrap.per_replica_tables:   # every rank is in this process: one verdict for all
        missing *= bootstrap.size
    elif bootstrap.size > 1:
        with tf.init_scope(), tf.device("/cpu:0"):
            missing = int(bootstrap.allreduce([tf.constant([missing], tf.int32)], "sum",
                                              name="tf_sok.nccl_available")[0].numpy()[0])
    if missing:
        raise NcclUnavailable(f"exchange='nccl' is unavailable on {missing} of {bootstrap.size} rank(s); on this "
                              f"rank: {why or 'available'}; use exchange='framework'")


def _replica_devices_problem(strategy_comm) -> Optional[str]:
    """Why the replicas of a MirroredStrategy cannot be NCCL ranks, or None."""
    devices = [tf.DeviceSpec.from_string(strategy_comm.device(r)) for r in strategy_comm.local_ranks]
    if any((d.device_type or "").upper() != "GPU" for d in devices):
        return "the strategy's replicas are not one GPU each: " + ", ".join(d.to_string() for d in devices)
    if len(tf.config.list_logical_devices("GPU")) != len(tf.config.list_physical_devices("GPU")):
        return "the GPUs are split into logical devices, and NCCL needs one physical GPU per rank"
    return None


def _join_in_threads(uid, keys: Dict[int, int], devices: Dict[int, str], size: int) -> str:
    """Every local rank joins its communicator at once, one thread per GPU (a rank's
    ncclCommInitRank returns when all ranks have called theirs); NCCL's version."""
    versions: List[str] = []
    errors: List[BaseException] = []

    def join(rank):
        try:
            with tf.device(devices[rank]):
                versions.append(collective_ops.init(uid, key=keys[rank], rank=rank, size=size).numpy().decode())
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=join, args=(r,), name=f"tf_sok-nccl-init-{r}") for r in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return versions[0]


class NcclCommunicator(Communicator):
    """One GPU per rank; `bootstrap` names the ranks: a multi-process communicator
    (Horovod, one rank per process) or a MirroredStrategy's (one rank per replica GPU).

    Example (under horovodrun, each rank pinned to GPU local_rank):
        >>> sok.init(exchange="nccl").communicator
        NcclCommunicator(ranks [0] of 2 on /GPU:0, NCCL 2.28.9, bootstrap HorovodCommunicator)
    """

    def __init__(self, bootstrap: Communicator, device: str = "/GPU:0"):
        self._boot = bootstrap
        self._device = device
        self._per_replica = bootstrap.per_replica_tables
        if self._per_replica and bootstrap.nccl_ranks != "replica":
            raise ValueError(f"exchange='nccl' under tf.distribute needs MirroredStrategy (one process); under "
                             f"{type(bootstrap.strategy).__name__} use exchange='framework'")
        ranks = tuple(bootstrap.local_ranks) if self._per_replica else (bootstrap.rank,)
        devices = tuple(bootstrap.device(r) for r in ranks) if self._per_replica else (device,)
        joined = (type(bootstrap).__name__, ranks, bootstrap.size, devices)
        if joined in _joined:
            self._keys, self.version = _joined[joined]
            return
        # NCCL sets up connections lazily at their first use, allocating memory and synchronising the GPU;
        # done while another communicator's kernel (Horovod's all-reduce, or ours) waits on the peer GPU, that
        # can hang both. So: every connection at creation (NCCL >= 2.22 reads this when its first
        # communicator is made), and the framework's own GPU communicator made now, with nothing in flight.
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
        _agree_available(bootstrap)
        if self._per_replica:
            with tf.init_scope():
                keys = {r: next(_keys) for r in ranks}
                version = _join_in_threads(collective_ops.unique_id(), keys, dict(zip(ranks, devices)),
                                           bootstrap.size)
            self._keys, self.version = keys, version
            _joined[joined] = (keys, version)
            _log.info("tf_sok NCCL exchange: ranks %s of %d on %s, NCCL %s", list(ranks), self.size,
                      list(devices), version)
            return
        with tf.init_scope():
            with tf.device(device):
                bootstrap.allreduce([tf.zeros([8])], "sum", name="tf_sok.nccl_warmup")[0].numpy()
            if bootstrap.rank == 0:
                uid = tf.cast(collective_ops.unique_id(), tf.int32)
            else:
                uid = tf.zeros([128], tf.int32)
            uid = bootstrap.broadcast(uid, 0, name="tf_sok.nccl_id")
            key = next(_keys)
            with tf.device(device):
                version = collective_ops.init(uid, key=key, rank=bootstrap.rank, size=bootstrap.size)
        self._keys, self.version = {bootstrap.rank: key}, version.numpy().decode()
        _joined[joined] = (self._keys, self.version)
        _log.info("tf_sok NCCL exchange: rank %d of %d on %s, NCCL %s", self.rank, self.size, device, self.version)

    def __repr__(self):
        devices = [self.device(r) for r in self._keys]
        return (f"NcclCommunicator(ranks {list(self._keys)} of {self.size} on {', '.join(devices)}, NCCL "
                f"{self.version}, bootstrap {type(self._boot).__name__})")

    @property
    def moves_data_by_nccl(self) -> bool:
        return True

    @property
    def strategy(self):
        return self._boot.strategy

    def device(self, rank: int):
        return self._boot.device(rank) if self._per_replica else self._device

    @property
    def _key(self) -> int:
        """The communicator of the rank being built (under MirroredStrategy: the current replica's)."""
        return self._keys[self.rank] if self._per_replica else next(iter(self._keys.values()))

    @property
    def _here(self) -> str:
        """The GPU of the rank being built."""
        return self.device(self.rank)

    def _framework(self) -> bool:
        """True where the wrapped communicator's collectives must move the data: eager
        MirroredStrategy runs its replicas one after another (see the module docstring)."""
        return self._per_replica and tf.executing_eagerly()

    @property
    def bootstrap(self) -> Communicator:
        return self._boot

    @property
    def rank(self) -> int:
        return self._boot.rank

    @property
    def size(self) -> int:
        return self._boot.size

    # where the tables' shards live and how dense gradients meet: the wrapped communicator's
    @property
    def local_ranks(self) -> List[int]:
        return self._boot.local_ranks

    def outside_replicas(self) -> bool:
        return self._boot.outside_replicas()

    @property
    def per_replica_tables(self) -> bool:
        return self._boot.per_replica_tables

    def placement(self, rank: int):
        return self._boot.placement(rank)

    def reduce_dense_gradients(self, grads):
        return self._boot.reduce_dense_gradients(grads)

    @property
    def mirrors_dense_variables(self) -> bool:
        return self._boot.mirrors_dense_variables

    def _ordered(self, make, key: int):
        """make()'s op, after the previous collective of communicator `key` in this graph
        (see the module docstring)."""
        if tf.executing_eagerly():
            return make()
        graph = tf.compat.v1.get_default_graph()
        attr = f"_tf_sok_nccl_last_{key}"
        last = getattr(graph, attr, None)
        with tf.control_dependencies([last] if last is not None else []):
            out = make()
        setattr(graph, attr, (out[0] if isinstance(out, (list, tuple)) else out).op)   # one op either way
        return out

    def _move(self, x, send, recv, key: int, device: str):
        """Differentiable all-to-all with both sides' sizes known (the gradient is the reverse
        move, by the same rank's communicator on the same GPU)."""
        def forward(v):
            with tf.device(device):
                return self._ordered(lambda: collective_ops.alltoall(v, send, recv, key=key), key)
        if not x.dtype.is_floating:
            return forward(x)

        @tf.custom_gradient
        def move(v):
            def grad(dy):
                return self._move(tf.convert_to_tensor(dy), recv, send, key, device)
            return forward(v), grad
        return move(x)

    def alltoall(self, tensor, splits, name=None, recv_splits=None):
        if self._framework():
            return self._boot.alltoall(tensor, splits, name=name, recv_splits=recv_splits)
        with tf.device("/cpu:0"):  # split sizes stay in host memory
            send = tf.cast(splits, tf.int32)
            recv = None if recv_splits is None else tf.cast(recv_splits, tf.int32)
        key, device = self._key, self._here
        with tf.device(device):
            if recv is None:
                recv = self._ordered(lambda: collective_ops.exchange_splits(send, key=key), key)
            return self._move(tf.convert_to_tensor(tensor), send, recv, key, device), recv

    def route_keys(self, ids, routing: KeyRouting) -> Optional[RoutedKeys]:
        """One op on the stream, one wait (TfSokNcclRouteKeys): the id check, the routing,
        every rank's counts and verdict by one all-gather, the keys by one all-to-all, and
        the layout of the owner side, the return trip and the combine. None (the routed
        path) for more than MAX_WIDTHS embedding widths in one lookup."""
        G = routing.num_groups
        if G > MAX_WIDTHS or self._framework():   # the op's layout keeps per-width counters in fixed arrays
            return None
        ids = [tf.convert_to_tensor(v) for v in ids]
        key = self._key
        with tf.device(self._here):
            out = self._ordered(lambda: collective_ops.route_keys(
                ids, key=key, signature=routing.signature, step=routing.step,
                feature_table=routing.feature_table, feature_rows=routing.feature_rows,
                table_owner=routing.table_owner, table_group=routing.table_group, num_groups=G,
                feature_names=routing.feature_names, table_names=routing.table_names), key)
            gather, scatter = ([out.group_gather], [out.group_scatter]) if G == 1 else \
                (array_ops.split(out.group_gather, out.group_totals, num=G),
                 array_ops.split(out.group_scatter, out.group_totals, num=G))
        return RoutedKeys(table_rows=out.table_rows, table_counts=out.table_counts, unit_splits=out.unit_splits,
                          group_gather=gather, group_scatter=scatter, group_send=list(out.group_send),
                          group_recv=list(out.group_recv), slot=out.slot)

    def allgather(self, tensor, name=None):
        if self._framework():
            return self._boot.allgather(tensor, name=name)
        tensor = tf.convert_to_tensor(tensor)
        key = self._key
        with tf.device(self._here):
            return self._ordered(lambda: collective_ops.allgather(tensor, key=key), key)

    def allreduce(self, tensors, op="mean", name=None):
        return self._boot.allreduce(tensors, op, name=name)

    def broadcast(self, tensor, root=0, name=None):
        return self._boot.broadcast(tensor, root, name=name)
