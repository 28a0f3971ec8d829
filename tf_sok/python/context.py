"""The one explicit tf_sok context: which communicator and gradient reduction."""
import dataclasses
import logging
import os
import sys
from typing import Optional

import tensorflow as tf

from tf_sok.python.comm import Communicator, SingleProcess

_log = logging.getLogger("tf_sok")
_REDUCTIONS = ("sum", "mean")
_EXCHANGES = ("auto", "nccl", "framework")


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
    horovod_on = hvd is not None and hvd.is_initialized()
    if tf.distribute.has_strategy():
        if horovod_on:
            raise ValueError("sok.init(): both Horovod and a tf.distribute strategy are active; use one of them")
        if not tf.distribute.in_cross_replica_context():
            raise RuntimeError("sok.init(): call it under strategy.scope(), not inside strategy.run")
        from tf_sok.python.comm.strategy import StrategyCommunicator

        return StrategyCommunicator(tf.distribute.get_strategy())
    if horovod_on:
        from tf_sok.python.comm.horovod import HorovodCommunicator

        return HorovodCommunicator(hvd)
    return SingleProcess()


def _with_exchange(comm: Communicator, exchange: str) -> Communicator:
    """`comm`, or an NcclCommunicator over it when the lookup's data should move by NCCL."""
    from tf_sok.python.comm.nccl import NcclCommunicator, NcclUnavailable
    from tf_sok.python.ops import collective_ops

    if exchange == "framework" or comm.moves_data_by_nccl:
        return comm
    if exchange == "nccl":
        return NcclCommunicator(comm)
    # auto: NCCL where the ranks can use it (each says so: Horovod ranks with a GPU each — decided by all
    # ranks together, since a rank that chose alone could leave the others waiting — or a
    # MirroredStrategy's replicas on GPUs of their own); the communicator's own collectives elsewhere
    if comm.nccl_ranks is not None and collective_ops.available():
        try:
            return NcclCommunicator(comm)
        except NcclUnavailable as e:  # every rank lands here alike
            _log.info("tf_sok: the lookup's data moves by the %s's collectives: %s", type(comm).__name__, e)
    return comm


_COMM_TOOLS = ("horovod", "single")


def _sok_comm_tool(comm_tool: str) -> Communicator:
    """The communicator SOK's `comm_tool` names: "horovod" (initialised already) or "single"."""
    if comm_tool not in _COMM_TOOLS:
        raise ValueError(f"sok.init(): comm_tool must be one of {_COMM_TOOLS}, got {comm_tool!r} (tf.distribute "
                         f"strategies are found by calling sok.init() under strategy.scope())")
    if comm_tool == "single":
        return SingleProcess()
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None or not hvd.is_initialized():
        raise RuntimeError("sok.init(comm_tool=\"horovod\"): import horovod.tensorflow and call hvd.init() first")
    from tf_sok.python.comm.horovod import HorovodCommunicator

    return HorovodCommunicator(hvd)


def _use_legacy_optimizers() -> None:
    """SOK's use_legacy_optimizer: where tf.keras is tf_keras (TF_USE_LEGACY_KERAS=1), its optimizers
    module becomes the legacy one (OptimizerV2), as SOK does; under Keras 3 nothing changes."""
    try:
        legacy = tf.keras.optimizers.legacy
        if legacy.Optimizer.__name__ == "OptimizerV2":
            tf.keras.optimizers = legacy
            tf.optimizers = legacy
            _log.info("tf_sok: tf.keras.optimizers is now tf.keras.optimizers.legacy (use_legacy_optimizer=True)")
    except AttributeError:
        pass


def init(communicator: Optional[Communicator] = None, *, sparse_grad_reduction: str = "sum",
         exchange: Optional[str] = None, comm_tool: Optional[str] = None,
         use_legacy_optimizer: bool = True) -> Context:
    """Initialises tf_sok; call once before creating variables.

    Args:
      communicator: how ranks talk; default: the tf.distribute strategy whose
        `scope()` is active (MirroredStrategy or MultiWorkerMirroredStrategy:
        each replica is a rank); else Horovod when `horovod.tensorflow` is
        imported and initialised (`hvd.init()`); else a single process.
      sparse_grad_reduction: "sum" (every rank's contributions to a row are
        summed at its owner, as SOK/HugeCTR) or "mean" (averaged across ranks,
        like Horovod's dense gradients). Equal in a single process.
      exchange: how the lookup's ids and vectors travel between ranks:
        "nccl" (tf_sok's own NCCL ops on the GPU stream; Horovod ranks with a
        GPU each, or MirroredStrategy replicas on one GPU each), "framework" (the communicator's collectives: Horovod's ops,
        tf.distribute's copies and collectives) or "auto" (default; "nccl"
        where it applies). The TF_SOK_EXCHANGE environment variable sets the
        default.
      comm_tool: SOK's argument ("horovod": the initialised Horovod, else an
        error; "single": one process); also accepted as the first positional
        argument, as SOK scripts pass it. Default: detected as above.
      use_legacy_optimizer: SOK's argument: where tf.keras is tf_keras
        (TF_USE_LEGACY_KERAS=1), tf.keras.optimizers becomes its legacy module, as
        SOK does; a no-op under Keras 3.

    Example:
        >>> import tf_sok as sok
        >>> sok.init().num_ranks
        1
    """
    global _context
    if isinstance(communicator, str):
        communicator, comm_tool = None, communicator
    if comm_tool is not None:
        if communicator is not None:
            raise ValueError("sok.init(): give a communicator or a comm_tool, not both")
        communicator = _sok_comm_tool(comm_tool)
    if use_legacy_optimizer:
        _use_legacy_optimizers()
    if sparse_grad_reduction not in _REDUCTIONS:
        raise ValueError(f"sparse_grad_reduction must be one of {_REDUCTIONS}, got {sparse_grad_reduction!r}")
    exchange = exchange or os.environ.get("TF_SOK_EXCHANGE") or "auto"
    if exchange not in _EXCHANGES:
        raise ValueError(f"exchange must be one of {_EXCHANGES}, got {exchange!r}")
    _context = Context(_with_exchange(communicator or _detect_communicator(), exchange), sparse_grad_reduction)
    _log.info("tf_sok initialised: ranks %s of %d here (%s), sparse gradient reduction %s",
              _context.communicator.local_ranks if _context.communicator.per_replica_tables else [_context.rank],
              _context.num_ranks, type(_context.communicator).__name__, sparse_grad_reduction)
    return _context


def check_creation_scope(ctx: Context, what: str) -> None:
    """Tables must be created under the strategy that sok.init() picked up, and
    with no strategy when it picked up none."""
    per_replica = ctx.communicator.per_replica_tables
    active = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if active is not None and not per_replica:
        raise RuntimeError(f"{what}: created under a tf.distribute strategy scope, but sok.init() was called "
                           f"outside it; call sok.init() inside strategy.scope() before creating tables")
    if per_replica and active is not ctx.communicator.strategy:
        raise RuntimeError(f"{what}: sok.init() was called under a tf.distribute strategy; create tables inside "
                           f"that strategy's scope()")


def context() -> Context:
    """The current context; a single-process one if `init` was not called."""
    return _context if _context is not None else init()
