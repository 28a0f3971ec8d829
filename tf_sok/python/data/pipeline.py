"""What every reader yields: (dense [b, 13] float32, {C1..C26: ragged int64 [b, (ids)]},
label [b, 1] float32). Readers produce raw values; `finish` applies the one
transform all formats share (log(1 + max(x, 0)) on the integer features)."""
from dataclasses import dataclass, field

import tensorflow as tf


@dataclass
class ReadStats:
    """Counters a reader updates while it runs (e.g. lines skipped with on_error="skip")."""

    skipped: tf.Variable = field(default_factory=lambda: tf.Variable(0, dtype=tf.int64, trainable=False))


def finish(dense_raw, cats, label):
    dense = tf.math.log1p(tf.maximum(tf.cast(dense_raw, tf.float32), 0.0))
    return dense, cats, tf.reshape(tf.cast(label, tf.float32), [-1, 1])


def for_keras(dataset: tf.data.Dataset, device: str = None, buffer_size: int = 2, id_dtype=None) -> tf.data.Dataset:
    """({"dense": ..., "C1": ..., ...}, label) batches, as `model.fit` takes them.

    device (e.g. "/gpu:0"): the batches are copied there `buffer_size` batches ahead
    (`to_device`), so the host-to-device copy overlaps the step; it must then be the
    dataset's last transformation. id_dtype=tf.int32: the ids travel as int32 (half the
    bytes to copy; for tables under 2**31 rows — the lookup takes int32 ids as they are).
    """
    if id_dtype is not None and tf.as_dtype(id_dtype) not in (tf.int32, tf.int64):
        raise ValueError(f"for_keras: id_dtype must be tf.int32 or tf.int64, got {id_dtype}")

    def arrange(d, c, y):
        if id_dtype is not None:
            c = {k: v.with_values(tf.cast(v.values, id_dtype)) if isinstance(v, tf.RaggedTensor)
                 else tf.cast(v, id_dtype) for k, v in c.items()}
        return {"dense": d, **c}, y

    ds = dataset.map(arrange, num_parallel_calls=tf.data.AUTOTUNE if id_dtype is not None else None)
    return to_device(ds, device, buffer_size) if device else ds


def to_device(dataset: tf.data.Dataset, device: str, buffer_size: int = 2) -> tf.data.Dataset:
    """`dataset` with its batches copied to `device` `buffer_size` ahead (tf.data's
    prefetch_to_device; ragged ids included): the last transformation of a pipeline."""
    return dataset.apply(tf.data.experimental.prefetch_to_device(device, buffer_size))


def check_policy(on_error: str) -> str:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    return on_error
