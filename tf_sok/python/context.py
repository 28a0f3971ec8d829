"""The one explicit tf_sok context: which communicator and gradient reduction."""
import dataclasses
import logging
import sys
from typing import Optional

import tensorflow as tf

from tf_sok.python.comm import Communicator, SingleProcess

_log = logging.getLogger("tf_sok")
_REDUCTIONS = ("sum", "mean")


@dataclasses.dataclass
class Context:
    communicator: Communicator
    sparse_grad_reduction: str = "sum"

    @property
    def rank(self) -> int:
        return self.communicator.rank

    @property
    def num_ranks(self) -> int:
        return self.communicator.size

    _eager_collectives: int = 0

    def collective_index(self) -> int:
        """Ordinal of the next tf_sok collective step in this program order.

        In a tf.function it counts per traced graph; eagerly, per process. Every
        rank runs the same program, so equal ordinals name the same step, and a
        rank that diverges is caught by the signature check instead of hanging.
        """
        if tf.executing_eagerly():
            self._eager_collectives += 1
            return self._eager_collectives
        graph = tf.compat.v1.get_default_graph()
        n = getattr(graph, "_tf_sok_collectives", 0) + 1
        graph._tf_sok_collectives = n
        return n


_context: Optional[Context] = None


def _detect_communicator() -> Communicator:
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():
        from tf_sok.python.comm.horovod import HorovodCommunicator

        return HorovodCommunicator(hvd)
    return SingleProcess()


def init(communicator: Optional[Communicator] = None, *, sparse_grad_reduction: str = "sum") -> Context:
    """Initialises tf_sok; call once before creating variables.

    Args:
      communicator: how ranks talk; default: Horovod when `horovod.tensorflow`
        is imported and initialised (`hvd.init()`), else a single process.
      sparse_grad_reduction: "sum" (every rank's contributions to a row are
        summed at its owner, as SOK/HugeCTR) or "mean" (averaged across ranks,
        like Horovod's dense gradients). Equal in a single process.

    Example:
        >>> import tf_sok as sok
        >>> sok.init().num_ranks
        1
    """
    global _context
    if sparse_grad_reduction not in _REDUCTIONS:
        raise ValueError(f"sparse_grad_reduction must be one of {_REDUCTIONS}, got {sparse_grad_reduction!r}")
    _context = Context(communicator or _detect_communicator(), sparse_grad_reduction)
    _log.info("tf_sok initialised: rank %d of %d, sparse gradient reduction %s",
              _context.rank, _context.num_ranks, sparse_grad_reduction)
    return _context


def context() -> Context:
    """The current context; a single-process one if `init` was not called."""
    return _context if _context is not None else init()
