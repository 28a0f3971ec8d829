"""Batches cut from large in-memory blocks with TensorFlow ops.

A block is (dense [n, 13] float32 (the readers' transform of the raw integers, see pipeline.finish,
done by the block's builder), {C_i: (values int64 or int32, row_splits int64)}, label [n] float32,
value_cuts [batches, 2, features] int64), built by vectorised code (pyarrow, NumPy) once per block
and laid out batch by batch, so that cutting a batch copies nothing: batch j's ids of
feature k are values[cuts[j, 0, k]:cuts[j, 1, k]], starting on a 64-byte boundary, and its row
splits (from 0) are row_splits[j * s : j * s + rows_j + 1], s = `splits_stride(batch_size)`.
`block_batches` cuts the batches with `tf_sok_aligned_slices`, which shares the block's memory for
slices that start aligned (TensorFlow's own slicing copies a slice unless both its ends are
aligned). No per-row work; ragged ids stay values + row_splits — as RaggedTensors, or with
`ragged_pairs` as (values, row_splits) pairs of plain tensors: a RaggedTensor crosses each of
tf.data's boundaries (a map, a prefetch, the iterator) encoded as a variant, decoded and encoded
again each time: batches of 65,536 rows from the Parquet reader through `for_keras` and `to_device`
took 13.8 ms of host CPU each as RaggedTensors and 2.7 ms as pairs (26 one-hot features, 2 cores;
`e2e_bench.py --sections readers`, benchmarks/RESULTS.md).
"""
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_sok.python.data.pipeline import finish
from tf_sok.python.data.schema import NUM_DENSE, CriteoSchema


ALIGN = 64   # bytes: where each array of a block, and each batch's part of one, starts


def aligned_empty(shape, dtype, align: int = ALIGN) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary.

    A block's arrays are built in such memory: TensorFlow takes an aligned NumPy array from a
    generator as a tensor without copying it (an unaligned one is copied, holding the GIL, which
    serialises readers running side by side)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dtype.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def splits_stride(batch_size: int) -> int:
    """Row-splits entries from one batch's splits to the next in a block: batch_size + 1, rounded up
    to a whole 64 bytes."""
    per = ALIGN // 8
    return -(-(batch_size + 1) // per) * per


def ragged_bytes(ids: int, rows: int, batch_size: int, id_dtype) -> int:
    """An upper bound on the bytes `batched_ragged` allocates for `ids` ids over `rows` rows (with
    each array's own alignment)."""
    batches = -(-rows // batch_size)
    return ids * np.dtype(id_dtype).itemsize + (batches + 1) * ALIGN + \
        (max(batches, 1) * splits_stride(batch_size) * 8 + ALIGN)


def batched_ragged(parts: Sequence[np.ndarray], ends: np.ndarray, batch_size: int, id_dtype, alloc=aligned_empty):
    """One feature of a block laid out batch by batch (see the module's doc): (values, row_splits,
    cuts [batches, 2]) from its ids, the concatenation of `parts`, and `ends`, each row's end in
    them. Each batch's ids are copied once, from the parts, to their aligned place."""
    id_dtype = np.dtype(id_dtype)
    rows = len(ends)
    batches = -(-rows // batch_size)
    r0 = np.arange(batches, dtype=np.int64) * batch_size
    r1 = np.minimum(r0 + batch_size, rows)
    last = ends[r1 - 1].astype(np.int64) if batches else np.zeros([0], np.int64)
    first = np.concatenate([[0], last[:-1]]).astype(np.int64) if batches else last
    per = ALIGN // id_dtype.itemsize
    padded = -(-(last - first) // per) * per
    cuts = np.empty([batches, 2], np.int64)
    cuts[:, 0] = np.cumsum(padded) - padded
    cuts[:, 1] = cuts[:, 0] + (last - first)
    values = alloc([int(cuts[-1, 1]) if batches else 0], id_dtype)
    stride = splits_stride(batch_size)
    splits = alloc([(batches - 1) * stride + int(r1[-1] - r0[-1]) + 1 if batches else 1], np.int64)
    if not batches:
        splits[0] = 0
    part_ends = np.cumsum([len(p) for p in parts], dtype=np.int64)
    for j in range(batches):
        at, lo, hi = j * stride, int(r0[j]), int(r1[j])
        splits[at] = 0
        np.subtract(ends[lo:hi], first[j], out=splits[at + 1:at + 1 + hi - lo], casting="unsafe")
        at, lo, hi = int(cuts[j, 0]), int(first[j]), int(last[j])
        k = int(np.searchsorted(part_ends, lo, side="right"))
        while lo < hi:
            base = int(part_ends[k]) - len(parts[k])
            take = min(hi, int(part_ends[k])) - lo
            np.copyto(values[at:at + take], parts[k][lo - base:lo - base + take], casting="same_kind")
            at, lo, k = at + take, lo + take, k + 1
    return values, splits, cuts


def block_signature(schema: CriteoSchema, id_dtype=tf.int64):
    """(dense, {name: (values of id_dtype, row_splits int64)}, label, value_cuts) of a block."""
    splits, values = tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], id_dtype)
    return (tf.TensorSpec([None, NUM_DENSE], tf.float32), {n: (values, splits) for n in schema.categorical_names},
            tf.TensorSpec([None], tf.float32), tf.TensorSpec([None, 2, len(schema.categorical_names)], tf.int64))


def finish_block(dense_raw, cats: Dict[str, Tuple[tf.Tensor, tf.Tensor]], label):
    """The readers' transform (see pipeline.finish) over a whole block."""
    dense, _, label = finish(dense_raw, {}, label)
    return dense, cats, label


def _static_rows(t, rows: Optional[int], extra: int = 0):
    """`t` with its leading dimension rows (+ extra) in its static shape (as it is where rows is None)."""
    return t if rows is None else tf.ensure_shape(t, [rows + extra] + t.shape[1:].as_list())


def ragged_feature(values, splits, ragged_pairs: bool):
    """One batch's categorical feature as the pipeline yields it."""
    return (values, splits) if ragged_pairs else tf.RaggedTensor.from_row_splits(values, splits, validate=False)


def slice_rows(block, start, end, rows: Optional[int] = None, ragged_pairs: bool = False):
    """Rows [start, end) of a finished block as one batch (ids as RaggedTensors, or pairs: see the
    module's doc). `rows`: the batch's
    row count where every batch of the pipeline has it: the batch's shapes are then static, so that
    TensorFlow folds the batch-size arithmetic of a training step (a loss' gradient, Keras' loss
    tracker) instead of copying shapes back from the GPU, each copy a wait for the device."""
    dense, cats, label = block

    def fixed(t, extra=0):
        return _static_rows(t, rows, extra)
    out = {}
    for name, (values, splits) in cats.items():
        first, last = splits[start], splits[end]
        out[name] = ragged_feature(values[first:last], fixed(splits[start:end + 1] - first, 1), ragged_pairs)
    return fixed(dense[start:end]), out, fixed(label[start:end])


def aligned_slices(tensors, begin, end):
    """Rows [begin[i], end[i]) of each host tensor, sharing its memory where the slice starts aligned."""
    from tf_sok.python.ops.loader import ops

    with tf.device("/cpu:0"):
        return ops().tf_sok_aligned_slices(list(tensors), tf.cast(begin, tf.int64), tf.cast(end, tf.int64))


def block_batches(block, batch_size: int, drop_remainder: bool = False, ragged_pairs: bool = False) -> tf.data.Dataset:
    """The batches of one block laid out batch by batch, in order (the last one shorter unless
    dropped; with `drop_remainder`, every batch has `batch_size` rows in its static shape; ids as
    RaggedTensors, or pairs: see the module's doc)."""
    dense, cats, label, cuts = block
    label = tf.reshape(label, [-1, 1])
    names = list(cats)
    n = tf.shape(label, out_type=tf.int64)[0]
    count = n // batch_size if drop_remainder else (n + batch_size - 1) // batch_size
    stride = splits_stride(batch_size)
    rows = batch_size if drop_remainder else None

    def fixed(t, extra=0):
        return _static_rows(t, rows, extra)

    def one(j):
        r0 = j * batch_size
        r1 = tf.minimum(r0 + batch_size, n)
        at = tf.fill([len(names)], j * stride)
        begin = tf.concat([[r0], cuts[j, 0], at, [r0]], 0)
        end = tf.concat([[r1], cuts[j, 1], at + (r1 - r0) + 1, [r1]], 0)
        parts = aligned_slices([dense] + [cats[k][0] for k in names] + [cats[k][1] for k in names] + [label],
                               begin, end)
        f = len(names)
        out = {k: ragged_feature(parts[1 + i], fixed(parts[1 + f + i], 1), ragged_pairs) for i, k in enumerate(names)}
        return fixed(parts[0]), out, fixed(parts[-1])
    return tf.data.Dataset.range(count).map(one)


def batched_blocks(blocks: tf.data.Dataset, batch_size: int, drop_remainder: bool = False,
                   ragged_pairs: bool = False) -> tf.data.Dataset:
    return blocks.flat_map(lambda d, c, y, k: block_batches((d, c, y, k), batch_size, drop_remainder, ragged_pairs))


def checked_pairs(what: str, ragged_pairs) -> bool:
    if not isinstance(ragged_pairs, bool):
        raise TypeError(f"{what}: ragged_pairs must be True or False, got {ragged_pairs!r}")
    return ragged_pairs
