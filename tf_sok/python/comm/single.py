"""One process: every table is local and every collective is an identity."""
from tf_sok.python.comm.base import Communicator, check_reduction


class SingleProcess(Communicator):
    """The communicator of a single-process job."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def alltoall(self, tensor, splits, name=None, recv_splits=None):
        return tensor, splits

    def allgather(self, tensor, name=None):
        return tensor

    def allreduce(self, tensors, op="mean", name=None):
        check_reduction(op)
        return list(tensors)

    def broadcast(self, tensor, root=0, name=None):
        if root != 0:
            raise ValueError(f"broadcast root {root} does not exist in a single process")
        return tensor
