"""What every reader yields: (dense [b, 13] float32, {C1..C26: ragged int64 [b, (ids)]},
label [b, 1] float32). Readers produce raw values; `finish` applies the one
transform all formats share (log(1 + max(x, 0)) on the integer features)."""
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf


@dataclass
class ReadStats:
    """Counters a reader updates while it runs (e.g. lines skipped with on_error="skip")."""

    skipped: tf.Variable = field(default_factory=lambda: tf.Variable(0, dtype=tf.int64, trainable=False))


def checked_id_dtype(what: str, id_dtype, vocab_sizes=()):
    """tf.int32 or tf.int64 as a tf.DType; ValueError naming `what` for another type, or for int32
    when a vocabulary of `vocab_sizes` has 2**31 rows or more."""
    id_dtype = tf.as_dtype(id_dtype)
    if id_dtype not in (tf.int32, tf.int64):
        raise ValueError(f"{what}: id_dtype must be tf.int32 or tf.int64, got {id_dtype}")
    if id_dtype == tf.int32 and vocab_sizes and max(vocab_sizes) >= 2**31:
        raise ValueError(f"{what}: id_dtype=tf.int32 needs every vocabulary under 2**31, the largest is "
                         f"{max(vocab_sizes)}")
    return id_dtype


def _to_gpu(device) -> bool:
    return bool(device) and tf.DeviceSpec.from_string(device).device_type == "GPU"


def finish(dense_raw, cats, label):
    dense = tf.math.log1p(tf.maximum(tf.cast(dense_raw, tf.float32), 0.0))   # as finish_dense_into
    return dense, cats, tf.reshape(tf.cast(label, tf.float32), [-1, 1])


def finish_dense_into(raw, out):
    """`finish`'s transform of one column of raw integers in NumPy, written to `out` (float32): what
    the block builders run, so that readers hand TensorFlow the dense features finished."""
    np.log1p(np.maximum(raw, 0).astype(np.float32), out=out)


def for_keras(dataset: tf.data.Dataset, device: str = None, buffer_size: int = 2, id_dtype=None,
              ragged_pairs: bool = False) -> tf.data.Dataset:
    """({"dense": ..., "C1": ..., ...}, label) batches, as `model.fit` takes them.

    device (e.g. "/gpu:0"): the batches are copied there `buffer_size` batches ahead
    (`to_device`, from page-locked memory), so the host-to-device copy overlaps the step; it
    must then be the dataset's last transformation. id_dtype=tf.int32: the ids travel as int32 (half the
    bytes to copy; for tables under 2**31 rows — the lookup takes int32 ids as they are).
    ragged_pairs: each ragged feature as its (values, row_splits) pair (see `to_device`). Features
    that come as pairs (the readers' and `synthetic`'s `ragged_pairs=True`, the cheaper form to
    carry through tf.data) stay pairs.
    """
    if id_dtype is not None:
        id_dtype = checked_id_dtype("for_keras", id_dtype)

    # to a GPU: the copy into page-locked memory in the same map (one pass over the batch's tensors)
    pin = _to_gpu(device)

    def ids_as(v):
        if isinstance(v, tf.RaggedTensor):
            return v.with_values(tf.cast(v.values, id_dtype))
        if isinstance(v, tuple):   # a reader's (values, row_splits) pair
            return tf.cast(v[0], id_dtype), v[1]
        return tf.cast(v, id_dtype)

    def arrange(d, c, y):
        if id_dtype is not None:
            c = {k: ids_as(v) for k, v in c.items()}
        return _device_ready(({"dense": d, **c}, y), pin, ragged_pairs)

    ds = dataset.map(arrange, num_parallel_calls=tf.data.AUTOTUNE if id_dtype is not None or pin or ragged_pairs
                     else None)
    return to_device(ds, device, buffer_size, pinned=False) if device else ds


def to_device(dataset: tf.data.Dataset, device: str, buffer_size: int = 2, pinned: bool = True,
              ragged_pairs: bool = False) -> tf.data.Dataset:
    """`dataset` with its batches copied to `device` `buffer_size` ahead (tf.data's
    prefetch_to_device): the last transformation of a pipeline.

    pinned (for a GPU): each batch is first copied, by tf.data's threads, into page-locked host
    memory (`pinned_copy`), so that the copy to the GPU is one asynchronous DMA; from pageable
    memory the CUDA driver stages it, holding one of TensorFlow's threads per tensor meanwhile —
    threads the training step needs to launch its work (measured on an H200: DCNv2's batches of
    65,536 rows kept seven of them busy 13 ms per step).

    ragged_pairs: each ragged tensor (ragged rank 1) travels as its (values, row_splits) pair of
    plain tensors, which tf_sok's layers and `lookup_sparse` take as that ragged feature. A
    RaggedTensor itself crosses tf.data's boundaries as a variant that TensorFlow decodes and encodes
    again on the host each time, and its components stay in host memory through
    `prefetch_to_device`: the step then copies them to the GPU itself. As plain tensors they are
    on the device before the step starts."""
    pin = pinned and _to_gpu(device)

    if pin or ragged_pairs:
        # fused by tf.data with a map just before it (for_keras'): the ragged ids are decoded and
        # encoded again at each map's boundary (fused: 1.07x the rows/s of the two maps apart,
        # DCNv2 batches on 2 cores)
        options = tf.data.Options()
        options.experimental_optimization.map_fusion = True
        dataset = dataset.map(lambda *e: _device_ready(e[0] if len(e) == 1 else e, pin, ragged_pairs),
                              num_parallel_calls=tf.data.AUTOTUNE).with_options(options)
    return dataset.apply(tf.data.experimental.prefetch_to_device(device, buffer_size))


def _device_ready(element, pin: bool, ragged_pairs: bool):
    """The element as it leaves for the device: ragged ids as pairs, copied into page-locked memory."""
    element = as_ragged_pairs(element) if ragged_pairs else element
    return pinned_copy(element) if pin else element


def as_ragged_pairs(element):
    """The element with each ragged tensor of ragged rank 1 as its (values, row_splits) pair."""
    def pair(t):
        if isinstance(t, tf.RaggedTensor) and t.ragged_rank == 1:
            return t.values, t.row_splits
        return t
    return tf.nest.map_structure(pair, element)


def pinned_copy(*element):
    """The element (any nest of tensors, ragged or sparse ones included) with its number and bool
    tensors copied into page-locked host memory (TensorFlow's GPU host allocator; plain host
    memory where no GPU is present). Other tensors (strings, variants) are kept as they are."""
    from tf_sok.python.ops.loader import ops

    structure = element[0] if len(element) == 1 else element
    flat = tf.nest.flatten(structure, expand_composites=True)
    where = [i for i, t in enumerate(flat) if t.dtype.is_numpy_compatible and t.dtype != tf.string]
    if where:
        with tf.device("/cpu:0"):
            copies = ops().tf_sok_pinned_copy([flat[i] for i in where])
        for i, c in zip(where, copies):
            flat[i] = c
    return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)


def check_policy(on_error: str) -> str:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    return on_error
