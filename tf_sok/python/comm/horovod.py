"""Communication through Horovod's TensorFlow collectives (Gloo, MPI or NCCL)."""
import tensorflow as tf

from tf_sok.python.comm.base import Communicator, check_reduction
from tf_sok.python.comm.watchdog import watched


class HorovodCommunicator(Communicator):
    """Wraps an initialised `horovod.tensorflow` (call `hvd.init()` first).

    Collectives are named by the caller so that every rank matches the same
    operation whatever its graph looks like, and each runs under the collective
    watchdog (`tf_sok.python.comm.watchdog`): a rank left waiting by its peers ends
    after TF_SOK_COLLECTIVE_TIMEOUT seconds, naming the collective.
    """

    def __init__(self, hvd=None):
        if hvd is None:
            import horovod.tensorflow as hvd  # noqa: WPS433 (optional dependency)
        if not hvd.is_initialized():
            raise RuntimeError("HorovodCommunicator: call hvd.init() before sok.init()")
        self._hvd = hvd

    @property
    def rank(self) -> int:
        return self._hvd.rank()

    @property
    def size(self) -> int:
        return self._hvd.size()

    @property
    def nccl_ranks(self):
        return "process" if self.size > 1 else None

    def _what(self, kind: str, name) -> str:
        return f"Horovod {kind} {name!r} on rank {self.rank} of {self.size}"

    def alltoall(self, tensor, splits, name=None, recv_splits=None):
        return watched(self._what("alltoall", name), lambda: self._hvd.alltoall(
            tensor, splits=tf.cast(splits, tf.int32), name=name, ignore_name_scope=True), [tensor, splits])

    def allgather(self, tensor, name=None):
        return watched(self._what("allgather", name),
                       lambda: self._hvd.allgather(tensor, name=name, ignore_name_scope=True), [tensor])

    def allreduce(self, tensors, op="mean", name=None):
        check_reduction(op)
        tensors = list(tensors)
        if not tensors:
            return []
        return watched(self._what("allreduce", name), lambda: self._hvd.grouped_allreduce(
            tensors, op=self._hvd.Average if op == "mean" else self._hvd.Sum, name=name), tensors)

    def broadcast(self, tensor, root=0, name=None):
        return watched(self._what("broadcast", name),
                       lambda: self._hvd.broadcast(tensor, root, name=name, ignore_name_scope=True), [tensor])
