"""The collective watchdog: bounds how long a rank waits for its peers in a collective.

Ranks whose programs diverge (one ran a lookup fewer and then another collective, one
is stuck, one died under a launcher that does not stop the others) would otherwise wait
for each other forever: Horovod's own stall inspector does not end such jobs (its
response cache coordination wedges first). A collective run through `watched` opens a
watch before it and closes it after its outputs; a watch open longer than
`TF_SOK_COLLECTIVE_TIMEOUT` seconds (default 90; 0 turns the watchdog off) ends the
process with exit code 124 and a message naming the collective, its step and the
rank, so that the launcher (horovodrun, mpirun) stops the whole job.
"""
import ctypes
import os
from typing import Callable, Sequence, TypeVar

import tensorflow as tf

from tf_sok.python.ops.loader import library_path, ops

T = TypeVar("T")

TIMEOUT_ENV = "TF_SOK_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 90.0
EXIT_CODE = 124


def timeout_s() -> float:
    """The watchdog's timeout in seconds (0: off), from TF_SOK_COLLECTIVE_TIMEOUT."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds (0 turns the watchdog off), got {raw!r}") \
            from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} must be a finite number of seconds >= 0, got {raw!r}")
    return value


def watched(what: str, run: Callable[[], T], inputs: Sequence[tf.Tensor] = ()) -> T:
    """`run()` (which issues one collective) under the watchdog; `what` names it in the
    message. In a graph the watch opens once `inputs` are ready (the time counted is the
    collective's own wait, not the work before it), and the outputs pass through the
    stateful close op, which also keeps shape inference from running the collective while
    the graph is traced (it evaluates ops whose inputs are constants)."""
    limit = timeout_s()
    if tf.executing_eagerly():
        if limit <= 0:
            return run()
        token = ops().tf_sok_watch_open(what=what, timeout_s=limit, eager=True)
        try:
            return run()
        finally:
            ops().tf_sok_watch_close(token, [])
    with tf.control_dependencies([t for t in inputs if t is not None]):
        token = ops().tf_sok_watch_open(what=what, timeout_s=limit)
    with tf.control_dependencies([token]):
        out = run()
    return tf.nest.pack_sequence_as(out, ops().tf_sok_watch_close(token, tf.nest.flatten(out)))


@tf.RegisterGradient("TfSokWatchClose")
def _watch_close_grad(op, *grads):
    """The close op passes its inputs on: their gradients are the outputs' (none for the token)."""
    return [None, *grads]


def open_watches() -> int:
    """How many watches are open in this process (for tests)."""
    ops()
    return int(ctypes.CDLL(library_path()).TfSokOpenWatches())
