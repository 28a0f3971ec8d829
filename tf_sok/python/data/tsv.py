"""Criteo raw TSV: `label \\t I1..I13 \\t C1..C26` per line, integers in decimal,
categoricals as hex strings, any field but the label may be empty (missing).

Each file is parsed in blocks of whole lines by pyarrow's multi-threaded CSV reader
and checked and converted by vectorised code (the converter's parser,
tf_sok.python.data.convert), several files at once; batches are cut from the
blocks by TensorFlow ops. A missing integer reads as 0; a missing categorical gives
an empty id list; a hex categorical becomes int(hex, 16) % vocab_size of its
table. A malformed line (wrong column count, non-integer value, non-hex
categorical, a label other than 0/1, a truncated last line) raises
InvalidArgumentError naming the file and line, or, with on_error="skip", is
dropped and counted in `stats.skipped` (batches stay full: rows after it move up).
"""
from typing import Optional, Sequence, Union

import tensorflow as tf

from tf_sok.python.data.blocks import batched_blocks, block_signature, checked_pairs
from tf_sok.python.data.columnar import BLOCK_ROWS, arrow_block, exact_blocks, parallel_default
from tf_sok.python.data.pipeline import ReadStats, check_policy
from tf_sok.python.data.schema import CriteoSchema


def _tsv_blocks(path: str, block_rows: int, batch_size: int, schema: CriteoSchema, on_error: str,
                stats: Optional[ReadStats]):
    from tf_sok.python.data.convert import tsv_blocks

    counts = {"skipped": 0}
    reported = 0
    for table in exact_blocks(tsv_blocks(path, schema, on_error, counts), block_rows):
        if stats is not None and counts["skipped"] > reported:
            stats.skipped.assign_add(counts["skipped"] - reported)
            reported = counts["skipped"]
        yield arrow_block(table, schema, f"Criteo TSV {path}", batch_size=batch_size)
    if stats is not None and counts["skipped"] > reported:
        stats.skipped.assign_add(counts["skipped"] - reported)


def read_tsv(files: Union[str, Sequence[str]], batch_size: int, schema: CriteoSchema = CriteoSchema(),
             on_error: str = "raise", stats: Optional[ReadStats] = None, drop_remainder: bool = False,
             parallel_files: Optional[int] = None, deterministic: bool = True,
             ragged_pairs: bool = False) -> tf.data.Dataset:
    """A tf.data pipeline over Criteo TSV files (each file's last batch may be shorter
    unless `drop_remainder`; `parallel_files` files at once, default one per core;
    `ragged_pairs=True`: categorical features as (values, row_splits) pairs, as `read_parquet`).

    Example:
        >>> ds = sok.data.read_tsv("day_0.tsv", batch_size=4096)
        >>> dense, cats, label = next(iter(ds))   # [4096, 13], {"C1": ragged, ...}, [4096, 1]
    """
    check_policy(on_error)
    checked_pairs("read_tsv", ragged_pairs)
    files = [files] if isinstance(files, str) else list(files)
    if not files:
        raise ValueError("read_tsv: no files given")
    rows = max(1, BLOCK_ROWS // batch_size) * batch_size
    sig = block_signature(schema)

    def one(path):
        blocks = tf.data.Dataset.from_generator(
            lambda p: _tsv_blocks(p.decode(), rows, batch_size, schema, on_error, stats), output_signature=sig, args=(path,))
        return batched_blocks(blocks, batch_size, drop_remainder, ragged_pairs)

    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        one, cycle_length=min(parallel_files or parallel_default(files), len(files)),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    return ds.prefetch(tf.data.AUTOTUNE)
