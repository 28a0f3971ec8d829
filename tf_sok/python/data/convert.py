"""Converts Criteo TSV files to Parquet or TFRecord.

    python -m tf_sok.data.convert --input day_0.tsv [day_1.tsv ...] --output out_dir --format parquet|tfrecord
        [--vocab-sizes 1000,...(26)] [--max-vocab 10000000] [--rows-per-file 1000000]
        [--on-error raise|skip] [--workers N]

Lines are parsed a block at a time by pyarrow's multi-threaded CSV reader and
checked and converted by vectorised pyarrow/NumPy code; input files are
converted in parallel by `--workers` processes. Categorical hex values are
reduced modulo their table sizes on the way (the output holds ids); integer
features are stored raw. The schema used (table sizes) goes into the output
(Parquet metadata and `_tf_sok_schema.json`), where the readers find it; reading
the output gives exactly what `read_tsv` (which shares this parser) gives with the same schema.
"""
import argparse
import concurrent.futures
import logging
import os
import sys
import time
from typing import List, Optional, Sequence

import numpy as np

from tf_sok.python.data.schema import KAGGLE_CARDINALITIES, NUM_DENSE, CriteoSchema, write_schema_file

_log = logging.getLogger("tf_sok.data.convert")
_BLOCK_BYTES = 64 << 20
_HEX_DIGIT = np.full(256, -1, np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_DIGIT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_DIGIT[_c] = 10 + _i


class _BadLine(ValueError):
    pass


def _checks(schema: CriteoSchema):
    """(column, regex, what is wrong) in column order: the first failing check names a line's problem."""
    out = [("label", "^[01]$", "the label is not 0 or 1")]
    out += [(n, "^-?[0-9]*$", f"integer feature {n} is not an integer") for n in schema.dense_names]
    out += [(n, "^[0-9a-fA-F]{0,15}$", f"categorical feature {n} is not a hex string of at most 15 digits")
            for n in schema.categorical_names]
    return out


def hex_ids(strings) -> Optional[np.ndarray]:
    """int64 values of a pyarrow string array of 1-15 hex digits each; None if one is not."""
    n = len(strings)
    if n == 0:
        return np.zeros(0, np.int64)
    offsets, data = _string_buffers(strings)
    lengths = np.diff(offsets)
    if (lengths == 8).all():  # Criteo's tokens: the C hex decoder (which also checks them), 4 bytes each
        try:
            raw = bytes.fromhex(data.tobytes().decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return None
        if len(raw) != 4 * n:  # fromhex skips spaces
            return None
        return np.frombuffer(raw, ">u4").astype(np.int64)
    width = int(lengths.max())
    if width > 15 or lengths.min() < 1:
        return None
    offsets = offsets - offsets[0]
    pos = np.arange(width)
    present = pos < lengths[:, None]
    digits = _HEX_DIGIT[data[np.where(present, offsets[:-1, None] + pos, 0)]]
    if (digits[present] < 0).any():
        return None
    value = np.zeros(n, np.int64)
    for k in range(width):
        value = np.where(present[:, k], value * 16 + digits[:, k], value)
    return value


def _string_buffers(strings):
    n = len(strings)
    offsets = np.frombuffer(strings.buffers()[1], np.int32)[strings.offset:strings.offset + n + 1]
    data = np.frombuffer(strings.buffers()[2], np.uint8) if strings.buffers()[2] is not None else np.zeros(0, np.uint8)
    return offsets, data[offsets[0]:offsets[-1]]


def _parse_block(table, schema: CriteoSchema):
    """(label, integer columns, [(ids, present)] per categorical) of a block whose integer
    columns parsed as int64 (null = missing), or None when a line is bad (then `_bad_rows`
    over the block read as strings says which and why)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    label = table.column("label").combine_chunks()
    if label.null_count or not np.isin(label.to_numpy(zero_copy_only=False), (0, 1)).all():
        return None
    cats = []
    for n in schema.categorical_names:
        col = table.column(n).combine_chunks()
        present = pc.not_equal(col, "")
        ids = hex_ids(pc.filter(col, present))
        if ids is None:
            return None
        cats.append((ids, present.to_numpy(zero_copy_only=False)))
    ints = [table.column(n).combine_chunks().fill_null(0) for n in schema.dense_names]
    return label.cast(pa.float32()), ints, cats


def _bad_rows(table, schema: CriteoSchema) -> List:
    """(bad mask, reason of each bad row): the first failing check of each line, in column order."""
    import pyarrow.compute as pc

    bad = np.zeros(table.num_rows, bool)
    reason = np.full(table.num_rows, "", object)
    for column, regex, what in _checks(schema):
        wrong = ~pc.match_substring_regex(table.column(column), regex).to_numpy(zero_copy_only=False)
        reason[wrong & ~bad] = what
        bad |= wrong
    return bad, reason


def convert_block(parsed, schema: CriteoSchema):
    """A parsed block (see _parse_block) -> the Parquet layout tf_sok reads."""
    import pyarrow as pa

    from tf_sok.python.data.columnar import id_arrow_type, parquet_fields
    label, ints, cats = parsed
    arrays = [label] + ints
    id_dtype = id_arrow_type(schema).to_pandas_dtype()
    for (ids, present), vocab in zip(cats, schema.vocab_sizes):  # one id or none per row: nullable integers
        full = np.zeros(len(present), id_dtype)
        full[present] = ids % vocab
        arrays.append(pa.array(full, mask=~present))
    return pa.Table.from_arrays(arrays, schema=parquet_fields(schema, multi_hot=False))


def _csv_options(schema: CriteoSchema, typed: bool, on_width):
    import pyarrow as pa
    import pyarrow.csv as pcsv

    names = ["label", *schema.dense_names, *schema.categorical_names]
    types = {n: pa.string() for n in names}
    if typed:
        types.update({n: pa.int64() for n in schema.dense_names}, label=pa.int8())
    return dict(read_options=pcsv.ReadOptions(column_names=names, use_threads=True, block_size=8 << 20),
                parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False,
                                                double_quote=False, ignore_empty_lines=False,
                                                invalid_row_handler=on_width),
                convert_options=pcsv.ConvertOptions(column_types=types, strings_can_be_null=False,
                                                    null_values=[""], quoted_strings_can_be_null=False))


def _line_chunks(path: str):
    """(first line number, buffer) chunks of whole lines (the last may lack its newline),
    without copying: each read ends at its last newline and the next starts after it."""
    line = 1
    with open(path, "rb") as f:
        while True:
            buf = f.read(_BLOCK_BYTES)
            if not buf:
                return
            cut = buf.rfind(b"\n") + 1
            if cut == 0 or len(buf) < _BLOCK_BYTES:  # a line longer than a chunk, or the file's end
                rest = f.read()
                buf, cut = buf + rest, len(buf) + len(rest)
            view = memoryview(buf)[:cut]
            f.seek(cut - len(buf), os.SEEK_CUR)
            yield line, view
            line += int(np.count_nonzero(np.frombuffer(view, np.uint8) == 10))


def tsv_blocks(path: str, schema: CriteoSchema, on_error: str = "raise", counts=None):
    """Yields converted blocks of one TSV file; bad lines raise ValueError naming the
    file and line, or are skipped and counted in counts["skipped"]."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    counts = counts if counts is not None else {}
    counts.setdefault("skipped", 0)
    for line, chunk in _line_chunks(path):
        wrong_width = []

        def on_width(row):
            wrong_width.append(row)
            return "skip" if on_error == "skip" else "error"

        def read(typed):
            wrong_width.clear()
            try:
                return pcsv.read_csv(pa.py_buffer(chunk), **_csv_options(schema, typed, on_width))
            except pa.ArrowInvalid as e:
                if on_error == "skip" or not wrong_width:
                    if typed:
                        return None
                    raise _BadLine(f"Criteo TSV {path}: {e}") from None
                at, fields = _first_wrong_width(chunk, schema.num_columns)
                raise _BadLine(f"Criteo TSV {path}, line {line + at}: has {fields} tab-separated fields, "
                               f"expected {schema.num_columns}") from None

        table = read(True)
        parsed = None if table is None else _parse_block(table, schema)
        if parsed is None:  # some line is bad: find which and why over the lines as strings
            table = read(False)
            bad, reason = _bad_rows(table, schema)
            if on_error == "raise":
                first = int(np.argmax(bad))
                raise _BadLine(f"Criteo TSV {path}, line {line + first}: {reason[first]}")
            if not bad.any():
                raise _BadLine(f"Criteo TSV {path}, lines from {line}: an integer feature does not fit int64")
            table = _retyped(table.filter(pa.array(~bad)), schema)
            counts["skipped"] += int(bad.sum())
            parsed = _parse_block(table, schema)
        counts["skipped"] += len(wrong_width)
        yield convert_block(parsed, schema)


def _first_wrong_width(chunk: bytes, expected: int):
    """(index, field count) of the chunk's first line without `expected` fields."""
    data = np.frombuffer(chunk, np.uint8)
    ends = np.flatnonzero(data == 10)
    if not len(ends) or ends[-1] != len(data) - 1:
        ends = np.append(ends, len(data))
    tabs = np.concatenate([[0], np.cumsum(data == 9)])
    fields = np.diff(np.concatenate([[0], tabs[ends]])) + 1
    wrong = np.flatnonzero(fields != expected)
    return (int(wrong[0]), int(fields[wrong[0]])) if len(wrong) else (0, -1)


def _retyped(table, schema: CriteoSchema):
    """A block of checked string columns with the label and integer columns cast as the typed read gives them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    cols = {n: table.column(n) for n in table.column_names}
    cols["label"] = pc.cast(cols["label"], pa.int8())
    for n in schema.dense_names:
        c = cols[n]
        cols[n] = pc.cast(pc.if_else(pc.equal(c, ""), pa.scalar(None, pa.string()), c), pa.int64())
    return pa.table(cols)


def _convert_one(index: int, path: str, output: str, fmt: str, schema: CriteoSchema, rows_per_file: int,
                 on_error: str) -> dict:
    """Converts one TSV file into part-<index>-<k> files."""
    import pyarrow.parquet as pq

    counts, files, rows = {"skipped": 0}, [], 0
    writer, in_file = None, 0

    def close():
        if writer is not None:
            writer.close()

    try:
        for block in _ahead(tsv_blocks(path, schema, on_error, counts)):
            while block.num_rows:
                if writer is None or in_file >= rows_per_file:
                    close()
                    name = os.path.join(output, f"part-{index:05d}-{len(files):05d}.{fmt}")
                    files.append(name)
                    writer = pq.ParquetWriter(name, block.schema, compression="lz4") if fmt == "parquet" \
                        else _TFRecordWriter(name)
                    in_file = 0
                take = min(block.num_rows, rows_per_file - in_file)
                writer.write_table(block.slice(0, take))
                block, in_file, rows = block.slice(take), in_file + take, rows + take
    finally:
        close()
    return {"rows": rows, "skipped": counts["skipped"], "files": files}


def _ahead(blocks, depth: int = 2):
    """The same items, produced by a thread `depth` ahead of the consumer (pyarrow's parsing
    and Parquet writing release the GIL, so parsing the next chunk overlaps writing this one)."""
    import queue
    import threading

    q: "queue.Queue" = queue.Queue(depth)
    done = object()

    def produce():
        try:
            for b in blocks:
                q.put(b)
            q.put(done)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer)
            q.put(e)

    threading.Thread(target=produce, daemon=True).start()
    while True:
        item = q.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


class _TFRecordWriter:
    """tf.train.Example records from converted blocks (serialised row by row: slower than Parquet)."""

    def __init__(self, path: str):
        import tensorflow as tf

        self._tf = tf
        self._w = tf.io.TFRecordWriter(path)

    def write_table(self, table) -> None:
        tf = self._tf
        feat = tf.train.Feature
        cols = {n: table.column(n).to_pylist() for n in table.column_names}
        dense = np.stack([np.asarray(cols[f"I{i + 1}"], np.int64) for i in range(NUM_DENSE)], 1)
        cats = [n for n in table.column_names if n.startswith("C")]
        for i in range(table.num_rows):
            f = {"label": feat(float_list=tf.train.FloatList(value=[cols["label"][i]])),
                 "dense": feat(int64_list=tf.train.Int64List(value=dense[i].tolist()))}
            for n in cats:  # one id or none (null)
                v = cols[n][i]
                f[n] = feat(int64_list=tf.train.Int64List(value=[] if v is None else [v]))
            self._w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())

    def close(self) -> None:
        self._w.close()


def convert(inputs: Sequence[str], output: str, fmt: str, schema: CriteoSchema, rows_per_file: int = 1_000_000,
            on_error: str = "raise", workers: int = 0) -> dict:
    """Converts TSV files (in parallel, `workers` processes; 0: one per file up to the
    CPU count); returns {"rows": ..., "skipped": ..., "files": [...]}.

    Example:
        >>> convert(["day_0.tsv"], "criteo_parquet", "parquet", sd.CriteoSchema.capped(10_000_000))
    """
    if fmt not in ("parquet", "tfrecord"):
        raise ValueError(f"format must be 'parquet' or 'tfrecord', got {fmt!r}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    if not inputs:
        raise ValueError("convert: no input files")
    os.makedirs(output, exist_ok=True)
    workers = min(len(inputs), workers or os.cpu_count() or 1)
    jobs = [(i, p, output, fmt, schema, rows_per_file, on_error) for i, p in enumerate(inputs)]
    if workers <= 1:
        results = [_convert_one(*j) for j in jobs]
    else:
        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_convert_one, *zip(*jobs)))
    write_schema_file(output, schema)
    return {"rows": sum(r["rows"] for r in results), "skipped": sum(r["skipped"] for r in results),
            "files": [f for r in results for f in r["files"]]}


def main(argv=None):
    p = argparse.ArgumentParser(description="Convert Criteo TSV to Parquet or TFRecord")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--format", required=True, choices=["parquet", "tfrecord"])
    p.add_argument("--vocab-sizes", help="26 comma-separated table sizes (default: Criteo Kaggle's, capped)")
    p.add_argument("--max-vocab", type=int, default=10_000_000)
    p.add_argument("--rows-per-file", type=int, default=1_000_000)
    p.add_argument("--on-error", default="raise", choices=["raise", "skip"])
    p.add_argument("--workers", type=int, default=0, help="processes (default: one per input file, up to the cores)")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.vocab_sizes.split(",")] if a.vocab_sizes else KAGGLE_CARDINALITIES
    schema = CriteoSchema.capped(a.max_vocab, sizes)
    t0 = time.time()
    try:
        res = convert(a.input, a.output, a.format, schema, a.rows_per_file, a.on_error, a.workers)
    except _BadLine as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    secs = time.time() - t0
    print(f"converted {res['rows']:,} rows ({res['skipped']:,} bad lines skipped) into {len(res['files'])} "
          f"{a.format} file(s) under {a.output} in {secs:.1f}s ({res['rows'] / max(secs, 1e-9):,.0f} rows/s)")
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
