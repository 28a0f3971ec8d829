"""Python wrappers of the NCCL collective ops (GPU tensors; CUDA builds only).

Gradients are not registered here: `tf_sok.python.comm.nccl.NcclCommunicator`
attaches them, because it also orders every collective of a graph.
"""
import ctypes
from typing import Tuple

import tensorflow as tf

from tf_sok.python.ops.loader import build_info, library_path, ops


def available() -> bool:
    """True when the op library was built with the CUDA (and so the NCCL) kernels."""
    return build_info()["cuda"]


def probe() -> Tuple[bool, str]:
    """(True, NCCL's version) if libnccl.so.2 (or TF_SOK_NCCL_LIBRARY) opens here, else (False, why)."""
    if not available():
        return False, "the tf_sok op library was built without CUDA (no nvcc at build time)"
    text = ctypes.create_string_buffer(1024)
    ok = ctypes.CDLL(library_path()).TfSokNcclProbe(text, len(text))
    return bool(ok), text.value.decode()


def unique_id() -> tf.Tensor:
    """128 bytes naming a new communicator (made on one rank, sent to the others)."""
    with tf.device("/cpu:0"):
        return ops().tf_sok_nccl_unique_id()


def init(uid: tf.Tensor, *, key: int, rank: int, size: int) -> tf.Tensor:
    """Joins communicator `key` on the current GPU; returns NCCL's version string."""
    return ops().tf_sok_nccl_init(id=tf.cast(uid, tf.uint8), key=key, rank=rank, size=size)


def exchange_splits(send_splits: tf.Tensor, *, key: int) -> tf.Tensor:
    """What every rank sends this one, from what this one sends each (int32, host memory)."""
    return ops().tf_sok_nccl_exchange_splits(send_splits=tf.cast(send_splits, tf.int32), key=key)


def alltoall(x: tf.Tensor, send_splits: tf.Tensor, recv_splits: tf.Tensor, *, key: int) -> tf.Tensor:
    """Rows send_splits[p] of x to rank p; recv_splits[p] rows from rank p, in rank order."""
    return ops().tf_sok_nccl_all_to_all(input=x, send_splits=tf.cast(send_splits, tf.int32),
                                        recv_splits=tf.cast(recv_splits, tf.int32), key=key)


def allgather(x: tf.Tensor, *, key: int) -> tf.Tensor:
    """Every rank's x (the same shape everywhere), concatenated in rank order."""
    return ops().tf_sok_nccl_all_gather(input=x, key=key)


def route_keys(ids, *, key: int, signature: int, step: int, feature_table, feature_rows, table_owner, table_group,
               num_groups: int, feature_names, table_names):
    """The lookup's exchange plan in one op (check, routing, counts, keys, layout; one
    wait) for each feature's int64 ids; see TfSokNcclRouteKeys for the outputs."""
    return ops().tf_sok_nccl_route_keys(
        ids=list(ids), key=key, signature=signature, step=step, feature_table=list(feature_table),
        feature_rows=list(feature_rows), table_owner=list(table_owner), table_group=list(table_group),
        num_groups=num_groups, feature_names=list(feature_names), table_names=list(table_names))


for _op in ("TfSokNcclUniqueId", "TfSokNcclInit", "TfSokNcclExchangeSplits", "TfSokNcclAllToAll",
            "TfSokNcclAllGather", "TfSokNcclRouteKeys"):
    tf.no_gradient(_op)
