"""Parquet (via pyarrow; tensorflow-io's ops do not load on TF 2.21) and TFRecord
(tf.train.Example) forms of the Criteo data, readers and writers.

Both store what the TSV parser produces before the shared transform: `label`
(float), `I1`..`I13` raw integers (missing = 0) and `C1`..`C26` categorical ids
already reduced modulo their table sizes, as variable-length lists (multi-hot;
an empty list is a missing value). Parquet readers also accept plain integer
categorical columns (null = missing).
"""
import glob
import os
from typing import Iterator, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_sok.python.data.pipeline import finish
from tf_sok.python.data.schema import NUM_DENSE, CriteoSchema


def _files(path_or_files: Union[str, Sequence[str]], suffix: str):
    if isinstance(path_or_files, str):
        found = sorted(glob.glob(os.path.join(path_or_files, f"*{suffix}"))) if os.path.isdir(path_or_files) \
            else [path_or_files]
    else:
        found = list(path_or_files)
    if not found:
        raise ValueError(f"no {suffix} files in {path_or_files!r}")
    return found


def _signature(schema: CriteoSchema):
    return (tf.TensorSpec([None, NUM_DENSE], tf.int64),
            {n: tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1, row_splits_dtype=tf.int64)
             for n in schema.categorical_names},
            tf.TensorSpec([None], tf.float32))


def _parquet_batches(path: str, batch_size: int, schema: CriteoSchema) -> Iterator:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    names = set(f.schema_arrow.names)
    missing = [c for c in ("label", *schema.dense_names, *schema.categorical_names) if c not in names]
    if missing:
        raise ValueError(f"Parquet file {path} lacks Criteo columns {missing}")
    for batch in f.iter_batches(batch_size=batch_size):
        cols = {n: batch.column(n) for n in batch.schema.names}
        dense = np.stack([cols[n].fill_null(0).to_numpy(zero_copy_only=False) for n in schema.dense_names], 1)
        cats = {}
        for name, vocab in zip(schema.categorical_names, schema.vocab_sizes):
            c = cols[name]
            if hasattr(c, "flatten"):  # list<int64>: multi-hot
                values = c.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
                lengths = c.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
            else:  # one id per row, null = missing
                valid = c.is_valid().to_numpy(zero_copy_only=False)
                values = c.drop_null().to_numpy(zero_copy_only=False).astype(np.int64)
                lengths = valid.astype(np.int64)
            if values.size and (values.min() < 0 or values.max() >= vocab):
                raise ValueError(f"Parquet file {path}: column {name} has id outside [0, {vocab})")
            cats[name] = tf.RaggedTensor.from_row_lengths(values, lengths.astype(np.int64))
        label = cols["label"].fill_null(0).to_numpy(zero_copy_only=False).astype(np.float32)
        yield dense.astype(np.int64), cats, label


def read_parquet(path_or_files, batch_size: int, schema: CriteoSchema = CriteoSchema(),
                 parallel_files: int = 4) -> tf.data.Dataset:
    """Criteo batches from Parquet files (a directory, a file or a list of files).

    Example:
        >>> ds = sok.data.read_parquet("criteo_parquet/", batch_size=4096)
    """
    files = _files(path_or_files, ".parquet")
    sig = _signature(schema)

    def one(path):
        return tf.data.Dataset.from_generator(
            lambda p: _parquet_batches(p.decode(), batch_size, schema), output_signature=sig, args=(path,))

    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        one, cycle_length=min(parallel_files, len(files)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.map(finish, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def write_parquet(batches, path: str, schema: CriteoSchema = CriteoSchema()) -> int:
    """Writes raw batches (dense_raw, cats, label) to one Parquet file; returns rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fields = [pa.field("label", pa.float32())] + [pa.field(n, pa.int64()) for n in schema.dense_names] + \
        [pa.field(n, pa.list_(pa.int64())) for n in schema.categorical_names]
    rows = 0
    with pq.ParquetWriter(path, pa.schema(fields)) as w:
        for dense, cats, label in batches:
            dense, label = np.asarray(dense), np.asarray(label).reshape(-1)
            arrays = [pa.array(label.astype(np.float32))] + [pa.array(dense[:, i]) for i in range(NUM_DENSE)]
            for n in schema.categorical_names:
                r = cats[n]
                arrays.append(pa.ListArray.from_arrays(pa.array(r.row_splits.numpy()), pa.array(r.values.numpy())))
            w.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(fields)))
            rows += len(label)
    return rows


def read_tfrecord(path_or_files, batch_size: int, schema: CriteoSchema = CriteoSchema(),
                  parallel_files: int = 4) -> tf.data.Dataset:
    """Criteo batches from TFRecord files of tf.train.Example (VarLen int64 categoricals).

    Example:
        >>> ds = sok.data.read_tfrecord("criteo_tfrecord/", batch_size=4096)
    """
    files = _files(path_or_files, ".tfrecord")
    spec = {"label": tf.io.FixedLenFeature([1], tf.float32), "dense": tf.io.FixedLenFeature([NUM_DENSE], tf.int64)}
    spec.update({n: tf.io.VarLenFeature(tf.int64) for n in schema.categorical_names})

    def parse(serialized):
        ex = tf.io.parse_example(serialized, spec)
        cats = {n: tf.RaggedTensor.from_sparse(ex[n]) for n in schema.categorical_names}
        return finish(ex["dense"], cats, ex["label"][:, 0])

    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=min(parallel_files, len(files)), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True)
    return ds.batch(batch_size).map(parse, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def write_tfrecord(batches, path: str, schema: CriteoSchema = CriteoSchema()) -> int:
    """Writes raw batches (dense_raw, cats, label) as tf.train.Example records; returns rows written."""
    rows = 0
    feat = tf.train.Feature
    with tf.io.TFRecordWriter(path) as w:
        for dense, cats, label in batches:
            dense, label = np.asarray(dense), np.asarray(label).reshape(-1)
            lists = {n: cats[n].to_list() for n in schema.categorical_names}
            for i in range(len(label)):
                f = {"label": feat(float_list=tf.train.FloatList(value=[float(label[i])])),
                     "dense": feat(int64_list=tf.train.Int64List(value=dense[i].tolist()))}
                for n in schema.categorical_names:
                    f[n] = feat(int64_list=tf.train.Int64List(value=lists[n][i]))
                w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
            rows += len(label)
    return rows
