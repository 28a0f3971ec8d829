"""Wrapper of the sparse optimizer apply op."""
from typing import Sequence

import tensorflow as tf

from tf_sok.python.ops.loader import ops


def sparse_apply(var_handle, slot_handles: Sequence, step_handles: Sequence, learning_rate, indices,
                 grads, *, algorithm: str, table_name: str, **hyper):
    """Applies `grads` (rows `indices`) to the table and its slots in place."""
    return ops().tf_sok_sparse_apply(
        var=var_handle, slots=list(slot_handles), steps=list(step_handles),
        learning_rate=tf.cast(learning_rate, tf.float32), indices=indices, grads=grads,
        algorithm=algorithm, table_name=table_name, **hyper)
