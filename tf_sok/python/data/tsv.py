"""Criteo raw TSV: `label \\t I1..I13 \\t C1..C26` per line, integers in decimal,
categoricals as hex strings, any field but the label may be empty (missing).

Lines are read per file with their line numbers, parsed a batch at a time by
TensorFlow ops in parallel, and prefetched. A missing integer reads as 0; a
missing categorical gives an empty id list; a hex categorical becomes
int(hex, 16) % vocab_size of its table. A malformed line (wrong column count,
non-integer value, non-hex categorical, a truncated last line) raises
InvalidArgumentError naming the file and line, or, with on_error="skip", is
dropped and counted in `stats.skipped` (batches then hold fewer rows).
"""
from typing import Optional, Sequence, Union

import tensorflow as tf

from tf_sok.python.data.pipeline import ReadStats, check_policy, finish
from tf_sok.python.data.schema import NUM_DENSE, CriteoSchema

_INT = r"-?[0-9]*"
_HEX = r"[0-9a-fA-F]{0,15}"


def hex_to_int(s: tf.Tensor) -> tf.Tensor:
    """int64 value of each hex string (1-15 digits) in a 1-D string tensor."""
    cp = tf.strings.unicode_decode(s, "UTF-8")
    v = tf.cast(cp.flat_values, tf.int64)
    digit = tf.where(v <= 57, v - 48, tf.where(v >= 97, v - 87, v - 55))
    pos = tf.ragged.range(cp.row_lengths()).flat_values
    exp = tf.repeat(cp.row_lengths(), cp.row_lengths()) - 1 - pos
    return tf.math.unsorted_segment_sum(tf.bitwise.left_shift(digit, 4 * exp), cp.value_rowids(), tf.size(s))


def _problems(cols: tf.Tensor, ncols: tf.Tensor, schema: CriteoSchema) -> tf.Tensor:
    """Per line, what is wrong with it ('' when nothing)."""
    n = schema.num_columns
    reason = tf.fill(tf.shape(ncols), "")
    checks = [(tf.logical_not(tf.strings.regex_full_match(cols[:, 0], "[01]")), "the label is not 0 or 1")]
    for i in range(NUM_DENSE):
        checks.append((tf.logical_not(tf.strings.regex_full_match(cols[:, 1 + i], _INT)),
                       f"integer feature I{i + 1} is not an integer"))
    for i in range(len(schema.vocab_sizes)):
        checks.append((tf.logical_not(tf.strings.regex_full_match(cols[:, 1 + NUM_DENSE + i], _HEX)),
                       f"categorical feature C{i + 1} is not a hex string of at most 15 digits"))
    for bad, text in reversed(checks):  # the first failing check wins
        reason = tf.where(bad, text, reason)
    wrong_count = tf.strings.join(["has ", tf.strings.as_string(ncols), f" tab-separated fields, expected {n}"])
    return tf.where(tf.not_equal(ncols, n), wrong_count, reason)


def parse_lines(files, line_numbers, lines, schema: CriteoSchema, on_error: str = "raise",
                stats: Optional[ReadStats] = None):
    """Parses a batch of raw lines into (dense_raw [b, 13] int64, cats, label [b])."""
    split = tf.strings.split(lines, sep="\t")
    ncols = split.row_lengths()
    cols = split.to_tensor(default_value="", shape=[None, schema.num_columns])
    reason = _problems(cols, ncols, schema)
    ok = tf.equal(reason, "")
    if on_error == "raise":
        first = tf.argmin(tf.cast(ok, tf.int32))
        check = tf.debugging.Assert(tf.reduce_all(ok), [tf.strings.join([
            "Criteo TSV ", files[first], ", line ", tf.strings.as_string(line_numbers[first]), ": ",
            reason[first]])])
        with tf.control_dependencies([check]):
            cols = tf.identity(cols)
    else:
        if stats is not None:
            stats.skipped.assign_add(tf.reduce_sum(tf.cast(tf.logical_not(ok), tf.int64)))
        cols = tf.boolean_mask(cols, ok)
    label = tf.strings.to_number(cols[:, 0], tf.float32)
    dense_str = cols[:, 1:1 + NUM_DENSE]
    dense = tf.strings.to_number(tf.where(tf.equal(dense_str, ""), "0", dense_str), tf.int64)
    cats = {}
    for i, (name, vocab) in enumerate(zip(schema.categorical_names, schema.vocab_sizes)):
        s = cols[:, 1 + NUM_DENSE + i]
        present = tf.not_equal(s, "")
        ids = hex_to_int(tf.boolean_mask(s, present)) % vocab
        cats[name] = tf.RaggedTensor.from_row_lengths(ids, tf.cast(present, tf.int64))
    return dense, cats, label


def read_tsv(files: Union[str, Sequence[str]], batch_size: int, schema: CriteoSchema = CriteoSchema(),
             on_error: str = "raise", stats: Optional[ReadStats] = None, drop_remainder: bool = False,
             parallel_files: int = 4, raw: bool = False) -> tf.data.Dataset:
    """A tf.data pipeline over Criteo TSV files (raw=True: integer features untransformed,
    label [b], as the Parquet/TFRecord writers store them).

    Example:
        >>> ds = sok.data.read_tsv("day_0.tsv", batch_size=4096)
        >>> dense, cats, label = next(iter(ds))   # [4096, 13], {"C1": ragged, ...}, [4096, 1]
    """
    check_policy(on_error)
    files = [files] if isinstance(files, str) else list(files)
    if not files:
        raise ValueError("read_tsv: no files given")

    def numbered(f):
        return tf.data.TextLineDataset(f).enumerate(start=1).map(lambda i, line: (f, i, line))

    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        numbered, cycle_length=min(parallel_files, len(files)), block_length=batch_size,
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    post = (lambda *x: x) if raw else finish
    ds = ds.map(lambda f, n, l: post(*parse_lines(f, n, l, schema, on_error, stats)),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)
