"""Independent references and random inputs shared by the tests."""
import numpy as np
import tensorflow as tf


def random_ragged(rng, batch, vocab, max_len, dtype=np.int64, zipf=None):
    lens = rng.integers(0, max_len + 1, batch)
    n = int(lens.sum())
    if zipf:
        from tf_sok.data import zipf_ranks
        ids = zipf_ranks(rng, vocab, n, zipf)
    else:
        ids = rng.integers(0, vocab, n)
    return lens, ids.astype(dtype)


def to_ragged(lens, values):
    return tf.RaggedTensor.from_row_lengths(values, lens.astype(np.int64))


def np_lookup(table, lens, ids, weights, combiner):
    """NumPy reference of one feature's combined lookup."""
    out = np.zeros((len(lens), table.shape[1]), np.float64)
    pos = 0
    for b, n in enumerate(lens):
        w = np.ones(n) if weights is None else weights[pos:pos + n].astype(np.float64)
        rows = table[ids[pos:pos + n]].astype(np.float64)
        acc = (w[:, None] * rows).sum(0) if n else np.zeros(table.shape[1])
        denom = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        out[b] = acc / denom if denom != 0 else 0.0
        pos += n
    return out


def np_sum_lookup_grad(lens, ids, out_grad, rows):
    """NumPy reference of a summed, unweighted feature's gradient: [rows, dim]."""
    g = np.zeros((rows, out_grad.shape[1]), np.float64)
    np.add.at(g, ids.astype(np.int64), np.repeat(out_grad.astype(np.float64), lens, axis=0))
    return g


def lookup_grad_op(ids_per_table, lens_per_table, grads_per_table, rows=()):
    """Runs TfSokFusedLookupGrad directly (one summed feature per table), on the
    current device; returns its (indices, values) per table."""
    from tf_sok.python.ops.loader import ops

    T = len(ids_per_table)
    indices, values = ops().tf_sok_fused_lookup_grad(
        ids=[tf.constant(i) for i in ids_per_table],
        row_splits=[tf.constant(np.concatenate([[0], np.cumsum(l)]).astype(np.int64)) for l in lens_per_table],
        weights=[tf.zeros([0])] * T, output_grads=[tf.constant(g) for g in grads_per_table], num_tables=T,
        feature_table=list(range(T)), combiners=["sum"] * T, weighted=[False] * T,
        dims=[int(g.shape[1]) for g in grads_per_table], rows=list(rows))
    return [(i.numpy(), v.numpy()) for i, v in zip(indices, values)]


def half_precision_case(rng, hotness, batch=517):
    """Tables of widths 16 (16-byte accesses), 7 (scalar) and 128, five features over them with
    one id per row (hotness "one") or up to 16 ("multi"), mixed combiners, random weights on
    two features, and float32 upstream gradients exactly representable in float16 and bfloat16
    (few mantissa bits)."""
    tables = [rng.standard_normal(s).astype(np.float32) for s in ((400, 16), (90, 7), (3000, 128))]
    feature_table, combiners = [0, 1, 2, 0, 2], ["sum", "mean", "sqrtn", "mean", "sum"]
    ragged, weights, upstream = [], [], []
    for f, t in enumerate(feature_table):
        lens = np.ones(batch, np.int64) if hotness == "one" else rng.integers(0, 17, batch)
        ids = rng.integers(0, tables[t].shape[0], int(lens.sum()))
        ragged.append(to_ragged(lens, ids))
        weights.append(to_ragged(lens, rng.uniform(0.5, 2, len(ids)).astype(np.float32)) if f in (1, 4) else None)
        upstream.append(np.round(rng.standard_normal((batch, tables[t].shape[1])) * 8) / 8)
    return tables, feature_table, combiners, ragged, weights, [u.astype(np.float32) for u in upstream]


def lookup_in(dtype, case):
    """Outputs of dtype and the tables' gradients (dense NumPy) of sum(output x upstream), the
    upstream gradients arriving in dtype; on the current device."""
    import tf_sok as sok

    tables_np, feature_table, combiners, ragged, weights, upstream = case
    tables = [sok.Variable(t, name=f"t{i}") for i, t in enumerate(tables_np)]
    with tf.GradientTape() as tape:
        outs = sok.lookup_sparse([tables[t] for t in feature_table], ragged, weights, combiners=combiners,
                                 dtype=dtype)
        loss = tf.add_n([tf.reduce_sum(tf.cast(o * tf.cast(u, dtype), tf.float32)) for o, u in zip(outs, upstream)])
    grads = tape.gradient(loss, tables)
    return [o.numpy() for o in outs], [dense_grad(g, t.shape[0]) for g, t in zip(grads, tables_np)]


def distinct_rows(indices, values):
    """A lookup gradient's (indices, values) without its padding, after checking it: distinct
    indices strictly ascending, then repeats of the last one with zero rows."""
    indices, values = np.asarray(indices), np.asarray(values)
    u = len(np.unique(indices))
    assert (np.diff(indices[:u]) > 0).all(), "distinct indices must come first, strictly ascending"
    assert (indices[u:] == indices[u - 1]).all() and not values[u:].any(), "padding: the last index, zero rows"
    return indices[:u], values[:u]


def dense_grad(g, rows):
    """IndexedSlices (or dense) -> dense NumPy [rows, dim]."""
    return tf.convert_to_tensor(g).numpy() if not isinstance(g, tf.IndexedSlices) else \
        tf.math.unsorted_segment_sum(g.values, g.indices, rows).numpy()


def np_route(keys, num_buckets, table_owner, by_table=False):
    """NumPy reference of TfSokRoute: distinct keys bucket by bucket (ascending
    inside), keys per bucket, each input key's index in the output, and per
    bucket 0, 1, ..., its key count."""
    keys = np.asarray(keys, np.int64)
    uniq = np.unique(keys)
    table, row = uniq >> 40, uniq & ((1 << 40) - 1)
    if by_table:
        bucket, out = table, uniq
    else:
        owner = np.asarray(table_owner, np.int64)[table]
        row_wise = owner < 0
        bucket = np.where(row_wise, row % num_buckets, owner)
        out = np.where(row_wise, (table << 40) | (row // num_buckets), uniq)
    order = np.argsort(bucket, kind="stable")
    place = np.empty(len(uniq), np.int64)
    place[order] = np.arange(len(uniq))
    counts = np.bincount(bucket, minlength=num_buckets)
    unit = np.concatenate([np.arange(c + 1) for c in counts]).astype(np.int64)
    return out[order], counts, place[np.searchsorted(uniq, keys)], unit


def random_route_keys(rng, n, num_tables, max_row):
    """Keys of n ids over num_tables tables, with repeats (a Zipf-like head)."""
    table = rng.integers(0, num_tables, n)
    row = np.where(rng.random(n) < 0.5, rng.integers(0, 16, n), rng.integers(0, max_row, n))
    return (table.astype(np.int64) << 40) | row.astype(np.int64)


def clicks_training_step(table, opt, before=None):
    """A tf.function training step of one summed feature 'clicks' read from `table`
    (loss: sum of its squared pooled outputs); `before()`, if given, runs first in it."""
    import tf_sok as sok

    @tf.function
    def step(ids):
        if before is not None:
            before()
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse([table], [ids], feature_names=["clicks"], combiners="sum")[0]
            loss = tf.reduce_sum(out * out)
        opt.apply_gradients(zip(tape.gradient(loss, [table]), [table]))
        return loss
    return step


def assert_failing_step_writes_nothing(step, ids, table, opt, match):
    """step(ids) raises InvalidArgumentError matching `match`, and the table and its
    optimizer slots are exactly as before."""
    import pytest

    before = table.numpy()
    slots = [s.numpy() for s in opt.slots(table)]
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        step(ids)
    np.testing.assert_array_equal(table.numpy(), before)
    for s, b in zip(opt.slots(table), slots):
        np.testing.assert_array_equal(s.numpy(), b)


def embedding_then_dense(emb, out):
    """A Keras model computing out(emb(ids)) (one tf_sok embedding layer, then a dense head)."""
    import keras

    class EmbeddingThenDense(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb, self.out = emb, out

        def call(self, x):
            return self.out(self.emb(x))
    return EmbeddingThenDense()
