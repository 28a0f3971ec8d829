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


def for_keras(dataset: tf.data.Dataset, device: str = None, buffer_size: int = 2) -> tf.data.Dataset:
    """({"dense": ..., "C1": ..., ...}, label) batches, as `model.fit` takes them.

    device (e.g. "/gpu:0"): the batches are copied there `buffer_size` batches ahead
    (tf.data's prefetch_to_device), so the host-to-device copy overlaps the step; it
    must then be the dataset's last transformation.
    """
    ds = dataset.map(lambda d, c, y: ({"dense": d, **c}, y))
    if device:
        ds = ds.apply(tf.data.experimental.prefetch_to_device(device, buffer_size))
    return ds


def check_policy(on_error: str) -> str:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    return on_error
