"""Wrapper of the fused sparse optimizer apply op."""
from typing import Sequence

import tensorflow as tf

from tf_sok.python.ops.loader import ops


def sparse_apply(var_handles: Sequence, slot_handles: Sequence, step_handles: Sequence, learning_rate,
                 indices: Sequence, grads: Sequence, *, algorithm: str, table_names: Sequence[str],
                 indices_unique: bool = False, checked: bool = False, **hyper):
    """Applies `grads[t]` (rows `indices[t]`) to table t and its state, all tables in one op.

    `slot_handles` / `step_handles` are table-major (every slot of table 0, then of table 1, ...).
    `indices_unique` promises each table's indices as the lookup gradient emits them:
    ascending, repeats being zero padding (skipped); a decreasing index is an error.
    `checked`: the indices are a tf_sok lookup gradient's own rows; a GPU then does not wait
    for the check's verdict (a bad index still stops every write).
    """
    id_dtype = tf.int64 if any(i.dtype == tf.int64 for i in indices) else tf.int32
    return ops().tf_sok_sparse_apply(
        vars=list(var_handles), slots=list(slot_handles), steps=list(step_handles),
        learning_rate=tf.cast(learning_rate, tf.float32), indices=[tf.cast(i, id_dtype) for i in indices],
        grads=list(grads), algorithm=algorithm, indices_unique=indices_unique, checked=checked,
        table_names=list(table_names), **hyper)
