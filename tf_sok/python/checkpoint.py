"""`sok.restore`: a `tf.train.Checkpoint` restored all or nothing."""
import tensorflow as tf

from tf_sok.python.variable import table_meta


def _variables_by_key(checkpoint: tf.train.Checkpoint):
    """(checkpoint key, path, variable) of every variable reachable from `checkpoint` now."""
    from tensorflow.python.checkpoint import save_util

    data, _ = save_util._gather_trackable_data(checkpoint._saver._graph_view, None)  # noqa: SLF001
    for d in data:
        v = d.trackable
        if hasattr(v, "shape") and hasattr(v, "assign"):
            yield f"{d.object_name}/.ATTRIBUTES/VARIABLE_VALUE", d.object_name, v


def restore(checkpoint: tf.train.Checkpoint, save_path: str):
    """Restores `checkpoint` from `save_path` only if every variable the file holds for it has the
    shape of the live variable (tables, dense weights, optimizer slots and counters alike): else one
    ValueError lists every mismatch and nothing is restored. `checkpoint.restore` alone restores
    variable by variable, so a mismatch found late leaves the earlier ones restored.

    Returns what `checkpoint.restore` returns (its status; `.assert_consumed()` etc. work).
    Variables created after this call (e.g. slots of an optimizer not yet built) are restored when
    created, as TensorFlow does; they are not checked here.
    """
    if not save_path:
        raise ValueError("sok.restore: save_path is empty (e.g. no checkpoint in the directory yet)")
    saved = tf.train.load_checkpoint(save_path).get_variable_to_shape_map()
    bad = []
    for key, path, var in _variables_by_key(checkpoint):
        if key not in saved or tf.TensorShape(var.shape).is_compatible_with(saved[key]):   # dynamic: [None, dim]
            continue
        meta = table_meta(var)
        what = f"{path} (table {meta.name!r})" if meta is not None else path
        bad.append(f"{what}: checkpoint {list(saved[key])}, model {list(var.shape)}")
    if bad:
        raise ValueError(f"sok.restore: {save_path} does not fit the model, nothing was restored: " + "; ".join(bad))
    return checkpoint.restore(save_path)
