"""sok.prefetch: the next batch's rows brought into hybrid tables' caches during a step. Training
with it equals the table without a tier (it moves rows, never values); the keys it brought in are
hits at the next lookup (against a plain-Python set of the keys seen so far); tables it passes
over and the errors of bad arguments."""
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.helpers import to_ragged
from tests.python.test_dynamic import random_keys
from tests.python.test_hybrid import DIM, OPTIMIZERS, _assert_same_tables, _batches, _gib, _tables


def train(table, opt, batches, targets, with_prefetch, device="/CPU:0"):
    """Steps over batches (ragged ids) with targets; with_prefetch: each step prefetches the next
    batch's ids after its lookup. Returns the outputs."""
    @tf.function
    def step(ids, next_ids, target):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, ids, combiners="sum")
            loss = tf.reduce_sum(out * target)
        if with_prefetch:
            sok.prefetch([table], [next_ids])
        opt.apply_gradients([(tape.gradient(loss, table), table)])
        return out

    with tf.device(device):
        return [step(ids, batches[(i + 1) % len(batches)], tf.constant(target)).numpy()
                for i, (ids, target) in enumerate(zip(batches, targets))]


# budgets of no row, one row, less than a batch's keys (the prefetch finds no room: every cached row
# belongs to the step or the one before) and of a few batches' keys, with several optimizers
@pytest.mark.parametrize("case,budget_rows", [("sgd", 0), ("adam", 1), ("adagrad", 16), ("ftrl", 60),
                                              ("adam", 80), ("rmsprop", 10**6)])
def test_training_with_prefetch_equals_the_table_without_a_tier(rng, case, budget_rows):
    cls, hp = OPTIMIZERS[case]
    pool = random_keys(rng, 300)
    plain, hybrid, (opt_p, opt_h) = _tables(f"pf_{case}_{budget_rows}", budget_rows, cls, hp)
    batches = [to_ragged(lens, keys) for lens, keys in _batches(rng, pool, 12)]
    targets = [rng.standard_normal((int(b.nrows()), DIM)).astype(np.float32) for b in batches]
    out_h = train(hybrid, opt_h, batches, targets, True)
    out_p = train(plain, opt_p, batches, targets, False)
    for a, b in zip(out_h, out_p):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    _assert_same_tables(plain, hybrid, opt_p, opt_h)
    stats = sok.cache_stats(hybrid)
    assert stats["prefetched"] <= stats["loaded"]
    if budget_rows == 0 or budget_rows == 10**6:
        assert stats["prefetched"] == 0   # no row to take a key into / every key the table holds is cached


def lfu_scores(table):
    """{key: score} of the keys a hybrid table's cache holds (its index's export)."""
    from tf_sok.python.ops.loader import ops

    with tf.device(table._index_device):
        keys, _, scores, *_ = ops().tf_sok_dynamic_export(table._index.resource_handle)
    return dict(zip(keys.numpy().tolist(), scores.numpy().tolist()))


def check_lfu_scores_count_the_steps(rng, device, name, budget_rows, with_prefetch):
    """An LFU cache over a host tier scores a key by the steps that looked it up since it entered the
    table, whether it stayed cached, was written back and came back, or came back by a prefetch (which
    counts nothing itself): every cached key's score is its number of batches (plain Python)."""
    pool = random_keys(rng, 120)
    with tf.device(device):
        table = sok.DynamicVariable(DIM, initializer="normal", name=name, var_type="hybrid",
                                    max_hbm_for_vectors=_gib(budget_rows, [DIM]), evict_strategy="lfu")
    raw = _batches(rng, pool, 14)
    batches = [to_ragged(lens, keys) for lens, keys in raw]
    targets = [rng.standard_normal((int(b.nrows()), DIM)).astype(np.float32) for b in batches]
    train(table, sok.optimizers.SGD(learning_rate=0.05), batches, targets, with_prefetch, device)
    steps = {}
    for _, keys in raw:
        for k in set(keys.tolist()):
            steps[k] = steps.get(k, 0) + 1
    scores = lfu_scores(table)
    assert scores and scores == {k: steps[k] for k in scores}
    assert sok.cache_stats(table)["evicted"] > 0
    if with_prefetch and budget_rows > 40:
        assert sok.cache_stats(table)["prefetched"] > 0


@pytest.mark.parametrize("budget_rows,with_prefetch", [(1, False), (16, False), (16, True), (60, True)])
def test_lfu_scores_count_every_step_that_used_a_key(rng, budget_rows, with_prefetch):
    check_lfu_scores_count_the_steps(rng, "/CPU:0", f"lfu_count_{budget_rows}_{with_prefetch}", budget_rows,
                                     with_prefetch)


def check_prefetched_keys_are_hits(rng, device, name, keys=300, cache_rows=150, batch=36, steps=30, split=False):
    """A cache of cache_rows rows, batches of at most `batch` distinct keys out of `keys` (a prefetch
    always finds room among the rows no lookup since the last prefetch used): every id of the next
    batch whose key the table holds is cached when that batch is looked up, so its misses are the
    ids of keys new to the table (a plain-Python set of the keys seen). split: the next batch's ids
    given as two lists of the same table (features sharing it), the second a (values, row_splits) pair."""
    pool = random_keys(rng, keys)
    with tf.device(device):
        table = sok.DynamicVariable(DIM, initializer="uniform", name=name, var_type="hybrid",
                                    max_hbm_for_vectors=_gib(cache_rows, [DIM]))
    batches = [rng.choice(pool, rng.integers(1, batch), replace=True) for _ in range(steps)]

    @tf.function(reduce_retracing=True)
    def step(ids, next_ids):
        out = tf.nn.embedding_lookup(table, ids)
        with tf.control_dependencies([out]):
            if split:
                half = tf.size(next_ids) // 2
                pair = (next_ids[half:], tf.stack([tf.constant(0, tf.int64), tf.size(next_ids[half:], tf.int64)]))
                taken = sok.prefetch([table, table], [next_ids[:half], pair])
                tf.debugging.assert_equal(taken[1], tf.constant(0, tf.int64))   # (counted at the first place)
                taken = taken[:1]
            else:
                taken = sok.prefetch([table], [next_ids])
        return out, taken

    seen = set()
    before = sok.cache_stats(table)
    taken_total = 0
    with tf.device(device):
        for i, b in enumerate(batches):
            nxt = batches[i + 1] if i + 1 < len(batches) else batches[0][:0]
            _, taken = step(tf.constant(b), tf.constant(nxt))
            taken_total += int(taken.numpy()[0])
            now = sok.cache_stats(table)
            new_positions = sum(1 for k in b.tolist() if k not in seen)
            if i > 0:   # (the first prefetch may use free rows only: it follows no other)
                assert now["misses"] - before["misses"] == new_positions, f"batch {i}"
            before = now
            seen.update(b.tolist())
    stats = sok.cache_stats(table)
    assert stats["prefetched"] == taken_total > 0
    assert stats["keys"] == len(seen)


@pytest.mark.parametrize("split", [False, True])
def test_prefetched_keys_are_hits_at_the_next_lookup(rng, split):
    check_prefetched_keys_are_hits(rng, "/CPU:0", f"pf_hits_{split}", split=split)


def test_prefetch_passes_over_tables_without_a_tier_or_with_a_bound(rng):
    keys = random_keys(rng, 20)
    plain = sok.DynamicVariable(DIM, name="pf_plain")
    bounded = sok.DynamicVariable(DIM, name="pf_bounded", var_type="hybrid", max_hbm_for_vectors=_gib(2, [DIM]),
                                  max_capacity=50)
    static = sok.Variable(shape=[30, DIM], initializer="uniform", name="pf_static")
    for t in (plain, bounded):
        t.rows_for(tf.constant(keys))
    before = bounded.export_state([bounded])
    taken = sok.prefetch([plain, bounded, static], [tf.constant(keys), tf.constant(keys), tf.constant([1, 2])])
    np.testing.assert_array_equal(taken.numpy(), [0, 0, 0])
    after = bounded.export_state([bounded])
    np.testing.assert_array_equal(np.sort(after[0].numpy()), np.sort(before[0].numpy()))


def test_bad_prefetch_arguments_are_clear_errors(rng):
    table = sok.DynamicVariable(DIM, name="pf_bad", var_type="hybrid", max_hbm_for_vectors=_gib(4, [DIM]))
    with pytest.raises(ValueError, match="1 tables and 2 id lists"):
        sok.prefetch([table], [tf.constant([1]), tf.constant([2])])
    with pytest.raises(TypeError, match="ids of 'pf_bad' must be int32 or int64, got float32"):
        sok.prefetch([table], [tf.constant([1.5])])
    with pytest.raises(TypeError, match="is not a tf_sok table"):
        sok.prefetch([tf.Variable([1.0])], [tf.constant([1])])


def test_keras_fit_with_prefetch_equals_the_table_without_a_tier(rng):
    """model.fit through sok.keras.loop_on_host(prefetch=...): each step prefetches the next batch's
    ids into the hybrid table's cache; losses, keys and values equal fit on the table without a tier
    (Keras' own loop); the prefetches took keys in."""
    from tests.python.test_hybrid import assert_same_exports, collection_model, zipf_fit_data
    _, ds = zipf_fit_data(rng, 256, 8)
    histories, tables = [], []
    for budget in (None, _gib(80, [DIM, DIM, DIM])):
        cfg = sok.TableConfig(f"kp{len(tables)}", 8, DIM, combiner="sum", dynamic=True, initializer="normal",
                              seed=2, max_hbm_for_vectors=budget)
        model, coll = collection_model(cfg, steps_per_execution=1 if budget is None else 5)
        if budget is not None:
            sok.keras.loop_on_host(model, prefetch=lambda batch, coll=coll: sok.prefetch(
                list(coll.tables.values()), [batch[0]]))
        histories.append(model.fit(ds, epochs=2, verbose=0).history["loss"])
        tables.append(coll.tables[cfg.name])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-6)
    assert_same_exports(*tables)
    stats = sok.cache_stats(tables[1])
    assert stats["prefetched"] > 0 and stats["evicted"] > 0, stats


def test_loop_on_host_refuses_prefetch_without_several_steps_per_execution():
    import keras

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=1)
    sok.keras.loop_on_host(model, prefetch=lambda batch: None)
    with pytest.raises(ValueError, match="needs steps_per_execution > 1.*got steps_per_execution=1"):
        model.fit(np.zeros((4, 1), np.float32), np.zeros((4, 1), np.float32), verbose=0)
