"""Synthetic data with Criteo's shape and a label a model can learn.

26 categorical features with configurable cardinalities (Criteo Kaggle's by
default, capped), Zipf-distributed ids (alpha 1.05-1.3), one id per feature or
multi-hot (e.g. MLPerf DLRM-DCNv2's sizes), 13 integer features. The click
probability is a logistic function of the integer features and of hidden
per-id scores, so AUC measures learning.
"""
import dataclasses
from typing import Iterator, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_sok.python.data.blocks import checked_pairs, finish_block, slice_rows
from tf_sok.python.data.pipeline import checked_id_dtype
from tf_sok.python.data.schema import DCNV2_HOTNESS, NUM_CATEGORICAL, NUM_DENSE, CriteoSchema
from tf_sok.python.data.zipf import zipf_ranks


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    schema: CriteoSchema = CriteoSchema.capped(1_000_000)
    alpha: float = 1.1                          # Zipf exponent of the ids
    hotness: Union[int, Tuple[int, ...]] = 1    # ids per feature per row (max, multi-hot draws 1..h)
    missing: float = 0.02                       # fraction of missing values
    truth_seed: int = 20261130                  # the hidden model: same for every split

    def __post_init__(self):
        if not 1.0 < self.alpha <= 3.0:
            raise ValueError(f"SyntheticConfig: alpha must be in (1, 3], got {self.alpha}")

    def hot(self, f: int) -> int:
        return self.hotness if isinstance(self.hotness, int) else self.hotness[f]

    @staticmethod
    def dcnv2(schema: CriteoSchema = CriteoSchema.capped(1_000_000), alpha: float = 1.1) -> "SyntheticConfig":
        return SyntheticConfig(schema=schema, alpha=alpha, hotness=DCNV2_HOTNESS)


def raw_batches(num_rows: int, batch_size: int, config: SyntheticConfig = SyntheticConfig(),
                seed: int = 0) -> Iterator:
    """Yields raw (dense [b, 13] int64, {C_i: ragged}, label [b]) NumPy/tf batches."""
    truth = np.random.default_rng(config.truth_seed)
    w_dense = truth.normal(0, 0.4, NUM_DENSE)
    salt = truth.integers(1, 2**31, NUM_CATEGORICAL)
    rng = np.random.default_rng(seed)
    names, vocab = config.schema.categorical_names, config.schema.vocab_sizes
    for start in range(0, num_rows, batch_size):
        b = min(batch_size, num_rows - start)
        dense = np.floor(rng.lognormal(1.0, 1.5, (b, NUM_DENSE))).astype(np.int64)
        dense[rng.random((b, NUM_DENSE)) < config.missing] = 0
        logit = (np.log1p(dense) - 1.5) @ w_dense * 0.5 - 1.8
        cats = {}
        for f, (name, v) in enumerate(zip(names, vocab)):
            h = config.hot(f)
            lens = rng.integers(1, h + 1, b) if h > 1 else np.ones(b, np.int64)
            lens[rng.random(b) < config.missing] = 0
            z = zipf_ranks(rng, v, int(lens.sum()), config.alpha)
            ids = (z * 2654435761 + salt[f]) % v
            score = np.sin(ids * 0.7 + salt[f])  # a fixed pseudo-random score per id
            row = np.repeat(np.arange(b), lens)
            logit += np.bincount(row, score, b) / np.maximum(lens, 1) * 0.6
            cats[name] = tf.RaggedTensor.from_row_lengths(ids.astype(np.int64), lens.astype(np.int64))
        label = (rng.random(b) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        yield dense, cats, label


POOL_ROWS = 1 << 18  # rows generated once and cycled by `synthetic` (rounded up to whole batches)


def synthetic(num_rows: int, batch_size: int, config: SyntheticConfig = SyntheticConfig(),
              seed: int = 0, pool_rows: int = POOL_ROWS, id_dtype=tf.int64, ragged_pairs: bool = False) -> tf.data.Dataset:
    """A tf.data pipeline of synthetic Criteo-shaped batches (same structure as the readers).

    A pool of `pool_rows` rows (rounded up to whole batches; all `num_rows` when
    fewer) is generated once, in memory, and cycled: batches are slices of it,
    so the pipeline costs a few TensorFlow ops per batch and never limits a GPU.
    Every row follows the same hidden model, so a pool generated with another
    seed is a held-out set. The last batch is shorter when `batch_size` does
    not divide `num_rows`; when it does, every batch has `batch_size` rows in its static shape
    (TensorFlow then folds a step's batch-size arithmetic). `id_dtype=tf.int32`: the pool's ids are int32 (converted once, not per
    batch; every vocabulary must be under 2**31), as `for_keras(..., id_dtype=tf.int32)` takes them.
    `ragged_pairs=True`: categorical features as (values, row_splits) pairs, as `read_parquet`.

    Example:
        >>> ds = sok.data.synthetic(1_000_000, 4096, sok.data.SyntheticConfig.dcnv2())
    """
    if num_rows < 1 or batch_size < 1 or pool_rows < 1:
        raise ValueError(f"synthetic: num_rows, batch_size and pool_rows must be positive, got "
                         f"{num_rows}, {batch_size}, {pool_rows}")
    id_dtype = checked_id_dtype("synthetic", id_dtype, config.schema.vocab_sizes)
    checked_pairs("synthetic", ragged_pairs)
    pool_batches = -(-min(num_rows, pool_rows) // batch_size)
    pool = min(num_rows, pool_batches * batch_size)
    dense, cats, label = next(raw_batches(pool, pool, config, seed))
    block = finish_block(tf.constant(dense), {n: (tf.cast(r.values, id_dtype), r.row_splits) for n, r in cats.items()},
                         tf.constant(label))
    count = -(-num_rows // batch_size)
    full = batch_size if num_rows % batch_size == 0 else None   # every batch whole: static shapes

    def one(i):
        start = (i % pool_batches) * batch_size
        rows = tf.minimum(tf.cast(batch_size, tf.int64), num_rows - i * batch_size)
        return slice_rows(block, start, tf.minimum(start + rows, pool), full, ragged_pairs)
    return tf.data.Dataset.range(count).map(one, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def _hex8(values: np.ndarray) -> np.ndarray:
    """Each uint32 as 8 lowercase hex digits (a bytes array of dtype S8)."""
    digits = (values.astype(np.uint64)[:, None] >> np.arange(28, -1, -4, dtype=np.uint64)) & 15
    return np.frombuffer(np.frombuffer(b"0123456789abcdef", np.uint8)[digits].tobytes(), "S8")


def write_criteo_tsv(path: str, num_rows: int, config: SyntheticConfig = SyntheticConfig(), seed: int = 0) -> None:
    """Writes synthetic rows in Criteo's exact text format (one-hot: the first id of each
    feature, as an 8-digit hex token; missing values as empty fields)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    with open(path, "wb") as out:
        for dense, cats, label in raw_batches(num_rows, 65536, config, seed):
            cols = [pa.array(label.astype(np.int64)).cast(pa.string())]
            for j in range(NUM_DENSE):  # 0 = missing
                col = pa.array(dense[:, j])
                cols.append(pc.if_else(pc.equal(col, 0), "", col.cast(pa.string())))
            for name in config.schema.categorical_names:
                r = cats[name]
                lens, starts, vals = r.row_lengths().numpy(), r.row_splits.numpy()[:-1], r.values.numpy()
                first = vals[np.minimum(starts, max(len(vals) - 1, 0))] if len(vals) else np.zeros(len(lens), np.int64)
                tokens = _hex8((first * 40503 + 12345) & 0xFFFFFFFF).astype(object)
                tokens[lens == 0] = b""
                cols.append(pa.array(tokens, pa.binary()).cast(pa.string()))
            table = pa.table(cols, names=[f"c{i}" for i in range(len(cols))])
            pcsv.write_csv(table, out, pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))
