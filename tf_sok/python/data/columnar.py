"""Parquet (via pyarrow; tensorflow-io's ops do not load on TF 2.21) and TFRecord
(tf.train.Example) forms of the Criteo data, readers and writers.

Both store what the TSV parser produces before the shared transform: `label`
(float), `I1`..`I13` raw integers (missing = 0) and `C1`..`C26` categorical ids
already reduced modulo their table sizes, as variable-length lists (multi-hot;
an empty list is a missing value). Parquet readers also accept plain integer
categorical columns (null = missing).

The Parquet reader reads blocks of many batches with pyarrow's C++ reader
(several files at once), turns each block into flat arrays with vectorised
NumPy, and cuts batches from it with TensorFlow ops: no Python runs per batch.
"""
import glob
import os
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_sok.python.data.blocks import (ALIGN, aligned_empty, batched_blocks, batched_ragged, block_signature, checked_pairs,
                                       ragged_bytes)
from tf_sok.python.data.pipeline import checked_id_dtype, finish, finish_dense_into
from tf_sok.python.data.schema import METADATA_KEY, NUM_DENSE, CriteoSchema, schema_file_of, write_schema_file

BLOCK_ROWS = 1 << 18  # rows per block a Parquet reader turns into batches at once (rounded to whole batches)


def _files(path_or_files: Union[str, Sequence[str]], suffix: str):
    if isinstance(path_or_files, str):
        found = sorted(glob.glob(os.path.join(path_or_files, f"*{suffix}"))) if os.path.isdir(path_or_files) \
            else [path_or_files]
    else:
        found = list(path_or_files)
    if not found:
        raise ValueError(f"no {suffix} files in {path_or_files!r}")
    return found


def _parquet_schema(path: str) -> Optional[CriteoSchema]:
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    return CriteoSchema.from_json(meta[METADATA_KEY], path) if METADATA_KEY in meta else None


def schema_of(path_or_files, fmt: Optional[str] = None) -> Optional[CriteoSchema]:
    """The schema a converter stored with its output (None if it stored none).

    Example:
        >>> schema = sd.schema_of("criteo_parquet/")      # the tables' sizes for the model
    """
    if fmt is None:
        is_dir = isinstance(path_or_files, str) and os.path.isdir(path_or_files)
        fmt = "parquet" if is_dir and glob.glob(os.path.join(path_or_files, "*.parquet")) or \
            str(path_or_files).endswith(".parquet") else "tfrecord"
    files = _files(path_or_files, f".{fmt}")
    return (_parquet_schema(files[0]) if fmt == "parquet" else None) or schema_file_of(files)


def _resolve_schema(files, fmt: str, schema: Optional[CriteoSchema]) -> CriteoSchema:
    """The schema to read with: the files' own by default; a given one must hold the files' ids."""
    stored = (_parquet_schema(files[0]) if fmt == "parquet" else None) or schema_file_of(files)
    if schema is None:
        return stored or CriteoSchema()
    if stored is not None:
        stored.check_fits(schema, f"{os.path.dirname(os.path.abspath(files[0]))} ({fmt})")
    return schema


def _ids(column, name: str, vocab: int, path: str, id_dtype=np.int64, check: bool = True, alloc=aligned_empty,
         batch_size: Optional[int] = None):
    """(values, row_splits, value_cuts) of one categorical column (an Arrow array or chunked
    array), list<int> or plain int (null = missing), laid out batch by batch (blocks.py): values of
    `id_dtype`, written straight from each chunk (no combined copy first); their range checked in
    one pass by Arrow before the cast (unless `check` is off: the file's statistics showed it).
    `alloc(shape, dtype)` gives the arrays' memory."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):   # multi-hot
        parts = [c.flatten() for c in chunks]
        lengths = np.concatenate([c.value_lengths().fill_null(0).to_numpy(zero_copy_only=False) for c in chunks]) \
            if chunks else np.zeros([0], np.int64)
    elif column.null_count == 0:   # one id per row
        parts, lengths = list(chunks), None
    else:
        parts = [pc.drop_null(c) for c in chunks]
        lengths = np.concatenate([c.is_valid().to_numpy(zero_copy_only=False) for c in chunks])
    total = sum(len(p) for p in parts)
    if total and check:
        bounds = pc.min_max(pa.chunked_array(parts, type=parts[0].type))
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if lo is not None and (lo < 0 or hi >= vocab):
            raise ValueError(f"{path}: column {name} has id {lo if lo < 0 else hi} outside [0, {vocab})")
    rows = len(column) if lengths is None else len(lengths)
    if lengths is None:
        ends = np.arange(1, rows + 1, dtype=np.int64)
    else:
        ends = np.cumsum(lengths, dtype=np.int64)
    return batched_ragged([p.to_numpy(zero_copy_only=False) for p in parts], ends, batch_size or max(rows, 1),
                          id_dtype, alloc)


def block_bytes(table, schema: CriteoSchema, id_dtype=np.int64, batch_size: Optional[int] = None) -> int:
    """An upper bound on the bytes of `arrow_block(table, ...)`'s arrays (each 64-byte aligned)."""
    import pyarrow as pa

    n, ids = table.num_rows, 0
    for name in schema.categorical_names:
        column = table.column(name)
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            ids += sum(len(c.values) for c in column.chunks)
        else:
            ids += len(column)
    features = len(schema.categorical_names)
    batches = -(-n // (batch_size or max(n, 1)))
    per_feature = ragged_bytes(0, n, batch_size or max(n, 1), id_dtype)
    return n * NUM_DENSE * 4 + n * 4 + ids * np.dtype(id_dtype).itemsize + features * per_feature + \
        batches * 2 * features * 8 + 3 * ALIGN


def arrow_block(table, schema: CriteoSchema, where: str, id_dtype=np.int64, in_range=frozenset(), alloc=aligned_empty,
                batch_size: Optional[int] = None):
    """A table in tf_sok's Parquet layout -> a block of flat NumPy arrays laid out batch by batch
    (see blocks.py), its dense features finished (`finish_dense_into`); the ids of columns
    `in_range` are known to be inside their tables (not scanned again). `alloc(shape, dtype)` gives the arrays' memory, in the block's order (dense,
    each feature's values and row_splits, label, value cuts); at most `block_bytes(...)` in all."""
    def col(n):
        return table.column(n).combine_chunks()
    dense = alloc((table.num_rows, NUM_DENSE), np.float32)
    for i, n in enumerate(schema.dense_names):
        finish_dense_into(col(n).fill_null(0).to_numpy(zero_copy_only=False), dense[:, i])
    cats, cuts = {}, []
    for n, v in zip(schema.categorical_names, schema.vocab_sizes):
        values, splits, c = _ids(table.column(n), n, v, where, id_dtype, check=n not in in_range, alloc=alloc,
                                 batch_size=batch_size)
        cats[n] = (values, splits)
        cuts.append(c)
    label = alloc([table.num_rows], np.float32)
    label[:] = col("label").fill_null(0).to_numpy(zero_copy_only=False)
    value_cuts = alloc((len(cuts[0]) if cuts else 0, 2, len(cuts)), np.int64)
    for k, c in enumerate(cuts):
        value_cuts[:, :, k] = c
    return dense, cats, label, value_cuts


def _in_range_by_statistics(f, schema: CriteoSchema) -> frozenset:
    """The categorical columns of ParquetFile `f` whose every row group has min/max statistics
    inside [0, vocab): their ids need no scan. A column without statistics, or with a statistic
    outside its table, is scanned block by block (which names the offending id)."""
    vocab = dict(zip(schema.categorical_names, schema.vocab_sizes))
    ok = {n: True for n in vocab}
    md = f.metadata
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for j in range(rg.num_columns):
            c = rg.column(j)
            name = c.path_in_schema.split(".")[0]
            if name not in ok:
                continue
            st = c.statistics
            good = st is not None and st.has_min_max and isinstance(st.min, int) and 0 <= st.min and \
                st.max < vocab[name]
            ok[name] = ok[name] and good
    return frozenset(n for n, good in ok.items() if good)


def exact_blocks(tables: Iterator, block_rows: int) -> Iterator:
    """Re-cuts a stream of Arrow tables/record batches into tables of exactly `block_rows`
    rows (the last one shorter), so batches cut from them are whole."""
    import pyarrow as pa

    pending, rows = [], 0
    for t in tables:
        pending.extend(t.to_batches() if isinstance(t, pa.Table) else [t])
        rows += t.num_rows
        while rows >= block_rows:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, block_rows)
            rest = table.slice(block_rows)
            pending, rows = rest.to_batches(), rest.num_rows
    if rows:
        yield pa.Table.from_batches(pending)


def criteo_columns(f, path: str, schema: CriteoSchema) -> list:
    """The columns to read from ParquetFile `f`; ValueError naming those it lacks."""
    columns = ["label", *schema.dense_names, *schema.categorical_names]
    missing = [c for c in columns if c not in set(f.schema_arrow.names)]
    if missing:
        raise ValueError(f"Parquet file {path} lacks Criteo columns {missing}")
    return columns


def _parquet_blocks(path: str, block_rows: int, schema: CriteoSchema, groups=None, batch_size: int = 1,
                    id_dtype=np.int64, threads: bool = True) -> Iterator:
    """Yields blocks of exactly `block_rows` rows (the last one shorter) as flat NumPy arrays.

    groups=(first, end): only the batches (of `batch_size` rows, counted from the file's start)
    that start in those row groups, the last one completed from the next row group: pieces of
    one file read side by side give the file's whole batches between them. threads: pyarrow's
    own decoding threads (off when as many pieces as cores are read at once already)."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    columns = criteo_columns(f, path, schema)
    if groups is None:
        stream = f.iter_batches(batch_size=block_rows, columns=columns, use_threads=threads)
    else:
        stream = _row_range(f, columns, groups, batch_size, block_rows, threads)
    in_range = _in_range_by_statistics(f, schema)
    for table in exact_blocks(stream, block_rows):
        yield arrow_block(table, schema, f"Parquet file {path}", id_dtype, in_range, batch_size=batch_size)


def group_starts(md) -> np.ndarray:
    """The first row of each row group of Parquet metadata `md`, and the row count last."""
    sizes = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def piece_bounds(starts: np.ndarray, groups, batch_size: int):
    """Rows [begin, end) of a piece: the whole file (groups None), or from the first batch boundary
    at or after the first row of row groups [first, end) to the first one at or after their end."""
    if groups is None:
        return 0, int(starts[-1])
    up = lambda r: min(-(-int(r) // batch_size) * batch_size, int(starts[-1]))  # noqa: E731
    return up(starts[groups[0]]), up(starts[groups[1]])


def _row_range(f, columns, groups, batch_size: int, chunk: int, threads: bool = True) -> Iterator:
    """Record batches of the rows [begin, end) of file `f` that row groups [first, end) own (piece_bounds)."""
    starts = group_starts(f.metadata)
    sizes = np.diff(starts)
    begin, end = piece_bounds(starts, groups, batch_size)
    if begin >= end:
        return
    g0 = int(np.searchsorted(starts, begin, side="right")) - 1
    g1 = int(np.searchsorted(starts, end, side="left"))
    for g in range(g0, g1):
        lo, hi = max(begin, int(starts[g])) - int(starts[g]), min(end, int(starts[g + 1])) - int(starts[g])
        # a group only partly needed (the last batch's head) is decoded in pieces of what is needed
        size = chunk if hi == sizes[g] else min(chunk, hi)
        for rb in f.iter_batches(batch_size=size, row_groups=[g], columns=columns, use_threads=threads):
            if lo >= rb.num_rows:
                lo, hi = lo - rb.num_rows, hi - rb.num_rows
                continue
            yield rb.slice(lo, min(hi, rb.num_rows) - lo)
            if hi <= rb.num_rows:
                break
            lo, hi = 0, hi - rb.num_rows


def _pieces(files, parallel: int, rows: int):
    """(path, row groups or None) to read side by side: whole files, or, when there are fewer
    files than `parallel`, runs of row groups of about `rows` rows each (at least one group)."""
    import pyarrow.parquet as pq

    if len(files) >= parallel:
        return [(p, None) for p in files]
    out = []
    for path in files:
        md = pq.ParquetFile(path).metadata
        sizes = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        want = max(1, min(-(-parallel // len(files)), -(-sum(sizes) // max(rows, 1))))
        target = -(-sum(sizes) // want)
        first, acc = 0, 0
        for g, n in enumerate(sizes):
            acc += n
            if acc >= target or g == len(sizes) - 1:
                out.append((path, (first, g + 1)))
                first, acc = g + 1, 0
    return out


def parallel_default(files) -> int:
    return max(1, min(len(files), os.cpu_count() or 1))


def read_parquet(path_or_files, batch_size: int, schema: Optional[CriteoSchema] = None,
                 parallel_files: Optional[int] = None,
                 deterministic: bool = True, drop_remainder: bool = False,
                 block_rows: int = BLOCK_ROWS, id_dtype=tf.int64, workers: Optional[int] = None,
                 ragged_pairs: bool = False) -> tf.data.Dataset:
    """Criteo batches from Parquet files (a directory, a file or a list of files).

    `schema=None` reads with the schema the converter stored in the files; a given
    schema (the model's tables) must hold the stored vocabularies, else ValueError
    names both sizes. `parallel_files` pieces (default: one per core) are read at
    once: whole files, or, with fewer files than that, runs of a file's row groups
    (each piece gives the whole batches that start in it). Pieces are interleaved
    batch by batch (in a fixed order when `deterministic`); each file's last batch
    may be shorter unless `drop_remainder`. `id_dtype=tf.int32`: ids come as int32, converted
    while the block is built (half the bytes from there to the GPU; every vocabulary must be
    under 2**31). `workers=k`: the blocks are built by k spawned processes (each imports
    tf_sok once) and come back through shared memory, past the limit Python's lock sets on the
    threads of one process (see block_workers.py); default: threads of this process.
    `ragged_pairs=True`: each categorical feature as its (values, row_splits) pair of plain
    tensors instead of a RaggedTensor — what `for_keras` / `to_device(..., ragged_pairs=True)` and
    tf_sok's layers take — at a fraction of the host time per batch (see blocks.py).

    Example:
        >>> ds = sok.data.read_parquet("criteo_parquet/", batch_size=4096)
    """
    files = _files(path_or_files, ".parquet")
    checked_pairs("read_parquet", ragged_pairs)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"read_parquet: workers must be a positive number of processes, got {workers!r}")
    schema = _resolve_schema(files, "parquet", schema)
    id_dtype = checked_id_dtype("read_parquet", id_dtype, schema.vocab_sizes)
    rows = max(1, block_rows // batch_size) * batch_size
    sig = block_signature(schema, id_dtype)
    parallel = parallel_files or max(1, os.cpu_count() or 1)
    pieces = _pieces(files, parallel, rows)
    threads = min(parallel, len(pieces)) < (os.cpu_count() or 1)   # else the pieces alone fill the cores

    def piece_blocks(k):
        if workers:
            from tf_sok.python.data.block_workers import worker_blocks

            return worker_blocks(workers, pieces[k][0], pieces[k][1], batch_size, rows, schema,
                                 id_dtype.as_numpy_dtype)
        return _parquet_blocks(pieces[k][0], rows, schema, pieces[k][1], batch_size, id_dtype.as_numpy_dtype, threads)

    def one(i):
        blocks = tf.data.Dataset.from_generator(piece_blocks, output_signature=sig, args=(i,))
        return batched_blocks(blocks, batch_size, drop_remainder, ragged_pairs)

    ds = tf.data.Dataset.range(len(pieces)).interleave(
        one, cycle_length=min(parallel, len(pieces)),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    return ds.prefetch(tf.data.AUTOTUNE)


def id_arrow_type(schema: CriteoSchema):
    """The integer type of the ids tf_sok writes: int32 when every table has under 2**31 rows
    (half the bytes to decode; 1.5x the reader's rate on DCNv2's multi-hot rows), else int64."""
    import pyarrow as pa

    return pa.int32() if max(schema.vocab_sizes) < 2**31 else pa.int64()


def multi_hot_type(schema: CriteoSchema):
    """The Arrow type of a multi-hot column tf_sok writes: a list that is never null (an empty list:
    no id) of ids that are never null. Declared so, Parquet stores no definition levels for the
    ids: a DCNv2 block is built in 0.73 of the time nullable lists take (both uncompressed)."""
    import pyarrow as pa

    return pa.list_(pa.field("element", id_arrow_type(schema), nullable=False))


def parquet_fields(schema: CriteoSchema, multi_hot: bool = True):
    """The Arrow schema tf_sok's Parquet files have, the Criteo schema in its metadata:
    categorical ids as lists (multi-hot, `multi_hot_type`) or as nullable integers (one-hot,
    null = missing), of `id_arrow_type(schema)`."""
    import pyarrow as pa

    cats = [pa.field(n, multi_hot_type(schema), nullable=False) for n in schema.categorical_names] if multi_hot \
        else [pa.field(n, id_arrow_type(schema)) for n in schema.categorical_names]
    fields = [pa.field("label", pa.float32())] + [pa.field(n, pa.int64()) for n in schema.dense_names] + cats
    return pa.schema(fields, metadata={METADATA_KEY: schema.to_json().encode()})


def write_parquet(batches, path: str, schema: CriteoSchema = CriteoSchema(), compression: str = "none") -> int:
    """Writes raw batches (dense_raw, cats, label) to one Parquet file (multi-hot columns,
    dictionary-encoded; uncompressed by default: on DCNv2's ids a compression codec saves ~10% of
    the bytes and costs 7-28% more building time); returns rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow_schema = parquet_fields(schema)
    list_type, id_type = multi_hot_type(schema), id_arrow_type(schema)
    rows = 0
    with pq.ParquetWriter(path, arrow_schema, compression=compression) as w:
        for dense, cats, label in batches:
            dense, label = np.asarray(dense), np.asarray(label).reshape(-1)
            arrays = [pa.array(label.astype(np.float32))] + [pa.array(dense[:, i]) for i in range(NUM_DENSE)]
            for n in schema.categorical_names:
                r = cats[n]
                values = np.asarray(r.values.numpy()).astype(id_type.to_pandas_dtype(), copy=False)
                arrays.append(pa.ListArray.from_arrays(pa.array(r.row_splits.numpy(), pa.int32()), pa.array(values),
                                                       type=list_type))
            w.write_table(pa.Table.from_arrays(arrays, schema=arrow_schema))
            rows += len(label)
    write_schema_file(os.path.dirname(os.path.abspath(path)), schema)
    return rows


def read_tfrecord(path_or_files, batch_size: int, schema: Optional[CriteoSchema] = None,
                  parallel_files: Optional[int] = None, deterministic: bool = True,
                  drop_remainder: bool = False, ragged_pairs: bool = False) -> tf.data.Dataset:
    """Criteo batches from TFRecord files of tf.train.Example (VarLen int64 categoricals),
    parsed a batch at a time by TensorFlow's C++ parser; `schema` as in read_parquet
    (stored beside the files as `_tf_sok_schema.json`); `ragged_pairs=True`: categorical
    features as (values, row_splits) pairs, as read_parquet.

    Example:
        >>> ds = sok.data.read_tfrecord("criteo_tfrecord/", batch_size=4096)
    """
    files = _files(path_or_files, ".tfrecord")
    checked_pairs("read_tfrecord", ragged_pairs)
    schema = _resolve_schema(files, "tfrecord", schema)
    spec = {"label": tf.io.FixedLenFeature([1], tf.float32), "dense": tf.io.FixedLenFeature([NUM_DENSE], tf.int64)}
    spec.update({n: tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64) for n in schema.categorical_names})

    def parse(serialized):
        ex = tf.io.parse_example(serialized, spec)
        cats = {n: (ex[n].values, ex[n].row_splits) if ragged_pairs else ex[n] for n in schema.categorical_names}
        return finish(ex["dense"], cats, ex["label"][:, 0])

    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=min(parallel_files or parallel_default(files), len(files)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=deterministic)
    return ds.batch(batch_size, drop_remainder=drop_remainder).map(
        parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic).prefetch(tf.data.AUTOTUNE)


def write_tfrecord(batches, path: str, schema: CriteoSchema = CriteoSchema()) -> int:
    """Writes raw batches (dense_raw, cats, label) as tf.train.Example records; returns rows written."""
    rows = 0
    feat = tf.train.Feature
    with tf.io.TFRecordWriter(path) as w:
        for dense, cats, label in batches:
            dense, label = np.asarray(dense), np.asarray(label).reshape(-1)
            lists = {n: _lists(cats[n]) for n in schema.categorical_names}
            for i in range(len(label)):
                f = {"label": feat(float_list=tf.train.FloatList(value=[float(label[i])])),
                     "dense": feat(int64_list=tf.train.Int64List(value=dense[i].tolist()))}
                for n in schema.categorical_names:
                    f[n] = feat(int64_list=tf.train.Int64List(value=lists[n][i]))
                w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
            rows += len(label)
    write_schema_file(os.path.dirname(os.path.abspath(path)), schema)
    return rows


def _lists(ids):
    """Per-row id lists of a RaggedTensor or a (values, row_splits) pair of arrays."""
    values, splits = (ids.values.numpy(), ids.row_splits.numpy()) if isinstance(ids, tf.RaggedTensor) else ids
    values = np.asarray(values).tolist()
    return [values[a:b] for a, b in zip(splits[:-1], splits[1:])]
