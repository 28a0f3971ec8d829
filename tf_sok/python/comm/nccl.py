"""The lookup's all-to-all and all-gather by NCCL, driven from tf_sok's own ops
on TensorFlow's GPU stream; everything else from the communicator it wraps.

Under Horovod each collective otherwise passes through Horovod's background
thread and its negotiation cycle (about 1-2 ms per op whatever its size); here
an exchange is a kernel launch on the stream that already holds the data. The
wrapped communicator still names the ranks, sends the NCCL id from rank 0 to
the others, and all-reduces the dense gradients.

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
from typing import Dict, Optional, Tuple

import tensorflow as tf

from tf_sok.python.comm.base import Communicator, KeyRouting, RoutedKeys
from tf_sok.python.ops import array_ops, collective_ops

_log = logging.getLogger("tf_sok")
MAX_WIDTHS = 64  # embedding widths one planned exchange handles (kMaxGroups in key_exchange_gpu.cu)
_keys = itertools.count(1)
# (bootstrap type, rank, size) -> (communicator key, NCCL version): one NCCL communicator each
_joined: Dict[Tuple, Tuple[int, str]] = {}


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
    missing = int(why is not None)
    if bootstrap.size > 1:
        with tf.init_scope(), tf.device("/cpu:0"):
            missing = int(bootstrap.allreduce([tf.constant([missing], tf.int32)], "sum",
                                              name="tf_sok.nccl_available")[0].numpy()[0])
    if missing:
        raise NcclUnavailable(f"exchange='nccl' is unavailable on {missing} of {bootstrap.size} rank(s); on this "
                              f"rank: {why or 'available'}; use exchange='framework'")


class NcclCommunicator(Communicator):
    """One GPU per rank; `bootstrap` is a multi-process communicator (Horovod).

    Example (under horovodrun, each rank pinned to GPU local_rank):
        >>> sok.init(exchange="nccl").communicator
        NcclCommunicator(rank 0 of 2 on /GPU:0, NCCL 2.28.9, bootstrap HorovodCommunicator)
    """

    def __init__(self, bootstrap: Communicator, device: str = "/GPU:0"):
        if bootstrap.per_replica_tables:
            raise ValueError("exchange='nccl' needs one rank per process (Horovod); under tf.distribute use "
                             "exchange='framework'")
        self._boot = bootstrap
        self._device = device
        joined = (type(bootstrap).__name__, bootstrap.rank, bootstrap.size)
        if joined in _joined:
            self._key, self.version = _joined[joined]
            return
        # NCCL sets up connections lazily at their first use, allocating memory and synchronising the GPU;
        # done while another communicator's kernel (Horovod's all-reduce, or ours) waits on the peer GPU, that
        # can hang both. So: every connection at creation (NCCL >= 2.22 reads this when its first
        # communicator is made), and the framework's own GPU communicator made now, with nothing in flight.
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
        _agree_available(bootstrap)
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
        self._key, self.version = key, version.numpy().decode()
        _joined[joined] = (self._key, self.version)
        _log.info("tf_sok NCCL exchange: rank %d of %d on %s, NCCL %s", self.rank, self.size, device, self.version)

    def __repr__(self):
        return (f"NcclCommunicator(rank {self.rank} of {self.size} on {self._device}, NCCL {self.version}, "
                f"bootstrap {type(self._boot).__name__})")

    @property
    def bootstrap(self) -> Communicator:
        return self._boot

    @property
    def rank(self) -> int:
        return self._boot.rank

    @property
    def size(self) -> int:
        return self._boot.size

    def _ordered(self, make):
        """make()'s op, after the previous collective of this graph (see the module docstring)."""
        if tf.executing_eagerly():
            return make()
        graph = tf.compat.v1.get_default_graph()
        attr = f"_tf_sok_nccl_last_{self._key}"
        last = getattr(graph, attr, None)
        with tf.control_dependencies([last] if last is not None else []):
            out = make()
        setattr(graph, attr, (out[0] if isinstance(out, (list, tuple)) else out).op)   # one op either way
        return out

    def _move(self, x, send, recv):
        """Differentiable all-to-all with both sides' sizes known (the gradient is the reverse move)."""
        def forward(v):
            return self._ordered(lambda: collective_ops.alltoall(v, send, recv, key=self._key))
        if not x.dtype.is_floating:
            return forward(x)

        @tf.custom_gradient
        def move(v):
            def grad(dy):
                return self._move(tf.convert_to_tensor(dy), recv, send)
            return forward(v), grad
        return move(x)

    def alltoall(self, tensor, splits, name=None, recv_splits=None):
        with tf.device("/cpu:0"):  # split sizes stay in host memory
            send = tf.cast(splits, tf.int32)
            recv = None if recv_splits is None else tf.cast(recv_splits, tf.int32)
        with tf.device(self._device):
            if recv is None:
                recv = self._ordered(lambda: collective_ops.exchange_splits(send, key=self._key))
            return self._move(tf.convert_to_tensor(tensor), send, recv), recv

    def route_keys(self, ids, routing: KeyRouting) -> Optional[RoutedKeys]:
        """One op on the stream, one wait (TfSokNcclRouteKeys): the id check, the routing,
        every rank's counts and verdict by one all-gather, the keys by one all-to-all, and
        the layout of the owner side, the return trip and the combine. None (the routed
        path) for more than MAX_WIDTHS embedding widths in one lookup."""
        G = routing.num_groups
        if G > MAX_WIDTHS:   # the op's layout keeps per-width counters in fixed arrays
            return None
        ids = [tf.convert_to_tensor(v) for v in ids]
        with tf.device(self._device):
            out = self._ordered(lambda: collective_ops.route_keys(
                ids, key=self._key, signature=routing.signature, step=routing.step,
                feature_table=routing.feature_table, feature_rows=routing.feature_rows,
                table_owner=routing.table_owner, table_group=routing.table_group, num_groups=G,
                feature_names=routing.feature_names, table_names=routing.table_names))
            gather, scatter = ([out.group_gather], [out.group_scatter]) if G == 1 else \
                (array_ops.split(out.group_gather, out.group_totals, num=G),
                 array_ops.split(out.group_scatter, out.group_totals, num=G))
        return RoutedKeys(table_rows=out.table_rows, table_counts=out.table_counts, unit_splits=out.unit_splits,
                          group_gather=gather, group_scatter=scatter, group_send=list(out.group_send),
                          group_recv=list(out.group_recv), slot=out.slot)

    def allgather(self, tensor, name=None):
        tensor = tf.convert_to_tensor(tensor)
        with tf.device(self._device):
            return self._ordered(lambda: collective_ops.allgather(tensor, key=self._key))

    def allreduce(self, tensors, op="mean", name=None):
        return self._boot.allreduce(tensors, op, name=name)

    def broadcast(self, tensor, root=0, name=None):
        return self._boot.broadcast(tensor, root, name=name)
