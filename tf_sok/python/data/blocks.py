"""Batches cut from large in-memory blocks with TensorFlow ops.

A block is (dense_raw [n, 13] int64, {C_i: (values [nnz] int64 or int32, row_splits [n+1] int64)},
label [n] float32), built by vectorised code (pyarrow, NumPy) once per block;
`block_batches` turns it into batches of `batch_size` rows by slicing (no
per-row work, ragged ids stay values + row_splits).
"""
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_sok.python.data.pipeline import finish
from tf_sok.python.data.schema import NUM_DENSE, CriteoSchema


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary.

    A block's arrays are built in such memory: TensorFlow takes an aligned NumPy array from a
    generator as a tensor without copying it (an unaligned one is copied, holding the GIL, which
    serialises readers running side by side)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dtype.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def block_signature(schema: CriteoSchema, id_dtype=tf.int64):
    """(dense, {name: (values of id_dtype, row_splits int64)}, label) of a block."""
    splits, values = tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], id_dtype)
    return (tf.TensorSpec([None, NUM_DENSE], tf.int64), {n: (values, splits) for n in schema.categorical_names},
            tf.TensorSpec([None], tf.float32))


def finish_block(dense_raw, cats: Dict[str, Tuple[tf.Tensor, tf.Tensor]], label):
    """The readers' transform (see pipeline.finish) over a whole block."""
    dense, _, label = finish(dense_raw, {}, label)
    return dense, cats, label


def slice_rows(block, start, end, rows: Optional[int] = None):
    """Rows [start, end) of a finished block as one batch (ids as RaggedTensors). `rows`: the batch's
    row count where every batch of the pipeline has it: the batch's shapes are then static, so that
    TensorFlow folds the batch-size arithmetic of a training step (a loss' gradient, Keras' loss
    tracker) instead of copying shapes back from the GPU, each copy a wait for the device."""
    dense, cats, label = block

    def fixed(t, extra=0):   # the leading dimension: rows (+ extra)
        return t if rows is None else tf.ensure_shape(t, [rows + extra] + t.shape[1:].as_list())
    out = {}
    for name, (values, splits) in cats.items():
        first, last = splits[start], splits[end]
        out[name] = tf.RaggedTensor.from_row_splits(values[first:last], fixed(splits[start:end + 1] - first, 1),
                                                    validate=False)
    return fixed(dense[start:end]), out, fixed(label[start:end])


def block_batches(block, batch_size: int, drop_remainder: bool = False) -> tf.data.Dataset:
    """The batches of one raw block, in order (the last one shorter unless dropped; with
    `drop_remainder`, every batch has `batch_size` rows in its static shape)."""
    block = finish_block(*block)
    n = tf.shape(block[2], out_type=tf.int64)[0]
    count = n // batch_size if drop_remainder else (n + batch_size - 1) // batch_size
    return tf.data.Dataset.range(count).map(
        lambda i: slice_rows(block, i * batch_size, tf.minimum((i + 1) * batch_size, n),
                             batch_size if drop_remainder else None))


def batched_blocks(blocks: tf.data.Dataset, batch_size: int, drop_remainder: bool = False) -> tf.data.Dataset:
    return blocks.flat_map(lambda d, c, y: block_batches((d, c, y), batch_size, drop_remainder))
