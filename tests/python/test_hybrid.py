"""Hybrid dynamic tables (a host tier with a cache of hot rows, var_type="hybrid") against the
same table without one: lookups, gradients and every optimizer's steps identical, evicted rows
coming back with their updates and state, budgets of 0 rows, 1 row and the whole table; the
cache's counters against a plain-Python model of the cache; checkpoints and dumps."""
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tf_sok.data import zipf_ranks
from tests.helpers import to_ragged
from tests.python.optimizers.test_optimizers import CASES
from tests.python.test_dynamic import random_keys

DIM = 4
OPTIMIZERS = {**{k: (cls, hp) for k, (cls, hp, _) in CASES.items()},
              "adamax": (sok.optimizers.Adamax, {}), "adadelta": (sok.optimizers.Adadelta, {})}


def _gib(rows, widths):
    """max_hbm_for_vectors (GiB) that holds `rows` rows of arrays of these widths."""
    return rows * 4 * sum(widths) / 2**30


def _slot_widths(opt):
    return [DIM if not s.per_row else 1 for s in opt.slot_specs()]


def _tables(name, budget_rows, opt_cls=None, hp=None):
    """(plain table, hybrid table, their optimizers): same initial values per key."""
    plain = sok.DynamicVariable(DIM, initializer="normal", seed=3, name=f"{name}_plain")
    probe = opt_cls(learning_rate=0.05, **hp) if opt_cls else None
    widths = [DIM] + (_slot_widths(probe) if probe else [])
    hybrid = sok.DynamicVariable(DIM, initializer="normal", seed=3, name=f"{name}_hybrid", var_type="hybrid",
                                 max_hbm_for_vectors=_gib(budget_rows, widths))
    opts = (opt_cls(learning_rate=0.05, **hp), opt_cls(learning_rate=0.05, **hp)) if opt_cls else (None, None)
    return plain, hybrid, opts


def _state(table, opt):
    arrays = [table] + (list(opt.slots(table)) if opt is not None else [])
    keys, parts = table.export_state(arrays)
    parts = [p.numpy() for p in parts]
    return {int(k): [p[i] for p in parts] for i, k in enumerate(keys.numpy())}


def _assert_same_tables(a, b, opt_a=None, opt_b=None, atol=1e-7, rtol=1e-5, row_rtol=0.0):
    """row_rtol: each element may also differ by this share of its row's largest magnitude (state
    such as FTRL's linear term sums terms far larger than itself: their rounding, not its own)."""
    sa, sb = _state(a, opt_a), _state(b, opt_b)
    assert set(sa) == set(sb)
    for k in sa:
        for x, y in zip(sa[k], sb[k]):
            # equal up to float32 rounding: a key's duplicate gradients are summed in its rows' order
            scale = float(np.max(np.abs(y))) if np.size(y) else 0.0
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol + row_rtol * scale, err_msg=f"key {k}")


def _batches(rng, pool, steps, batch=24):
    out = []
    for _ in range(steps):
        lens = rng.integers(0, 4, batch)
        picks = zipf_ranks(rng, len(pool), int(lens.sum()), 1.1)
        out.append((lens, pool[picks]))
    return out


# every optimizer with a budget of a few percent of the keys and with the whole table; budgets of
# nothing and of one row with an optimizer without state and one with two slots
@pytest.mark.parametrize("case,budget_rows", [(c, b) for c in sorted(OPTIMIZERS) for b in (16, 10**6)] +
                         [(c, b) for c in ("sgd", "adam") for b in (0, 1)])
def test_training_equals_the_table_without_a_host_tier(rng, case, budget_rows):
    cls, hp = OPTIMIZERS[case]
    pool = random_keys(rng, 300)
    plain, hybrid, (opt_p, opt_h) = _tables(f"t_{case}_{budget_rows}", budget_rows, cls, hp)

    def step(table, opt, ids, target):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, ids, combiners="sum")
            loss = tf.reduce_sum(out * target)
        opt.apply_gradients([(tape.gradient(loss, table), table)])
        return out

    step_p = tf.function(lambda ids, target: step(plain, opt_p, ids, target))
    step_h = tf.function(lambda ids_, target_: step(hybrid, opt_h, ids_, target_))
    for lens, keys in _batches(rng, pool, 6):
        last = len(set(keys.tolist()))
        ids = to_ragged(lens, keys)
        target = tf.constant(rng.standard_normal((len(lens), DIM)).astype(np.float32))
        np.testing.assert_allclose(step_h(ids, target).numpy(), step_p(ids, target).numpy(), rtol=1e-5, atol=1e-7)
    _assert_same_tables(plain, hybrid, opt_p, opt_h)
    assert hybrid.size.numpy()[0] == plain.size.numpy()[0]
    stats = sok.cache_stats(hybrid)
    assert stats["cached"] <= max(budget_rows, last)   # a step's own keys may exceed the budget
    if budget_rows <= 16:
        assert stats["evicted"] > 0 and stats["bytes_to_host"] > 0


def _cache_model(max_keys, batches, policy="lru", capacity=None):
    """Plain-Python cache over a host tier: per call, found keys are touched; missing keys come in,
    evicting the untouched keys of lowest (score, key), all of them if the call needs more room. The
    score: LRU, the last call that touched the key; LFU, the number of calls that touched it since it
    entered the table (counted on while the host tier holds it, not only while cached). With a
    capacity the cache holds at most that many keys and the table then drops, of the keys not
    cached, those written back longest ago (LRU) or those of lowest (count, key) (LFU).
    Returns per call (positions missing, keys taken in, of them new to the table, keys written back,
    keys dropped, the table's keys)."""
    max_keys = max_keys if capacity is None else min(max_keys, capacity)
    score, table, count, clock, out = {}, {}, {}, 0, []   # table: key -> when it was written back
    for batch in batches:
        clock += 1
        distinct = list(dict.fromkeys(batch.tolist()))
        for k in distinct:
            count[k] = count.get(k, 0) + 1
        found = [k for k in distinct if k in score]
        new = [k for k in distinct if k not in score]
        missing = sum(1 for k in batch.tolist() if k not in score)
        for k in found:
            score[k] = clock if policy == "lru" else count[k]
        need = len(score) + len(new) - max_keys
        gone = []
        if need > 0:
            gone = [k for _, k in sorted((s, k) for k, s in score.items() if k not in found)[:need]]
            for k in gone:
                del score[k]
        fresh = [k for k in new if k not in table]
        for k in new:
            score[k] = clock if policy == "lru" else count[k]
            table[k] = None
        for j, k in enumerate(gone):   # in the order they were evicted
            table[k] = (clock, j)
        dropped = []
        if capacity is not None and len(table) > capacity:
            cold = [k for k in table if k not in score]
            order = sorted(cold, key=(lambda k: table[k]) if policy == "lru" else (lambda k: (count[k], k)))
            dropped = order[:len(table) - capacity]
            for k in dropped:
                del table[k]
                count[k] = 0
        out.append((missing, len(new), len(fresh), len(gone), len(dropped), set(table)))
    return out


@pytest.mark.parametrize("policy,budget_rows", [(p, b) for p in ("lru", "lfu") for b in (0, 1, 7, 40)])
def test_cache_counters_follow_a_cache_model(rng, policy, budget_rows):
    pool = random_keys(rng, 60)
    # 80 calls: enough for LFU's counts of keys out of the cache to decide evictions
    batches = [pool[zipf_ranks(rng, 60, rng.integers(1, 12), 1.1)] for _ in range(80)]
    table = sok.DynamicVariable(DIM, initializer="uniform", name=f"c{policy}{budget_rows}", var_type="hybrid",
                                max_hbm_for_vectors=_gib(budget_rows, [DIM]), evict_strategy=policy)
    plain = sok.DynamicVariable(DIM, initializer="uniform", name=f"p{policy}{budget_rows}")
    before = sok.cache_stats(table)
    row_bytes = 4 * DIM
    for b, (missing, loaded, fresh, evicted, _, _) in zip(batches, _cache_model(budget_rows, batches, policy)):
        np.testing.assert_array_equal(tf.gather(table, b).numpy(), tf.gather(plain, b).numpy())
        now = sok.cache_stats(table)
        delta = {k: now[k] - before[k] for k in ("finds", "lookups", "misses", "loaded", "new_keys", "evicted",
                                                  "bytes_to_device", "bytes_to_host", "bytes_in_gathered")}
        # (a few keys a call: their rows are read in place, none gathered by the host's threads)
        assert delta == {"finds": 1, "lookups": len(b), "misses": missing, "loaded": loaded, "new_keys": fresh,
                         "evicted": evicted, "bytes_to_device": (loaded - fresh) * row_bytes,
                         "bytes_to_host": evicted * row_bytes, "bytes_in_gathered": 0}
        assert now["keys"] == plain.size.numpy()[0] and now["cached"] <= max(budget_rows, len(set(b.tolist())))
        before = now
    assert 0.0 <= sok.cache_stats(table)["hit_rate"] <= 1.0


def test_an_evicted_key_comes_back_with_its_update_and_state(rng):
    cls, hp = OPTIMIZERS["adam"]
    plain, hybrid, (opt_p, opt_h) = _tables("back", 2, cls, hp)
    a, others = random_keys(rng, 3), random_keys(rng, 50)
    for table, opt in ((plain, opt_p), (hybrid, opt_h)):
        for keys in (a, others, a):   # a trained, pushed out by 50 others (budget: 2 rows), trained again
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.nn.embedding_lookup(table, tf.constant(keys)) ** 2)
            opt.apply_gradients([(tape.gradient(loss, table), table)])
    _assert_same_tables(plain, hybrid, opt_p, opt_h)


def test_checkpoint_and_dump_round_trips(rng, tmp_path):
    cls, hp = OPTIMIZERS["adagrad"]
    plain, hybrid, (opt_p, opt_h) = _tables("ck", 5, cls, hp)
    pool = random_keys(rng, 80)

    def train(table, opt, batches):
        for lens, keys in batches:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(sok.lookup_sparse(table, to_ragged(lens, keys), combiners="mean") ** 2)
            opt.apply_gradients([(tape.gradient(loss, table), table)])

    first, second = _batches(rng, pool, 3), _batches(rng, pool, 3)
    train(hybrid, opt_h, first)
    ckpt = tf.train.Checkpoint(table=hybrid, opt=opt_h)
    path = ckpt.write(str(tmp_path / "ck"))
    sok.dump(str(tmp_path / "dump"), [hybrid], optimizer=opt_h)
    train(hybrid, opt_h, second)
    after = _state(hybrid, opt_h)
    ckpt.read(path).assert_consumed()
    train(hybrid, opt_h, second)
    assert {k: [v.tolist() for v in vs] for k, vs in _state(hybrid, opt_h).items()} == \
        {k: [v.tolist() for v in vs] for k, vs in after.items()}
    # the dump of the hybrid table loads into a table without a host tier (same name), which trains on alike
    del plain, opt_p
    twin = sok.DynamicVariable(DIM, initializer="normal", seed=3, name="ck_hybrid")
    opt_t = cls(learning_rate=0.05, **hp)
    sok.load(str(tmp_path / "dump"), [twin], optimizer=opt_t)
    train(twin, opt_t, second)
    _assert_same_tables(twin, hybrid, opt_t, opt_h)
    # and a dump of that table loads back into the hybrid one
    sok.dump(str(tmp_path / "dump2"), [twin], optimizer=opt_t)
    train(hybrid, opt_h, first)
    sok.load(str(tmp_path / "dump2"), [hybrid], optimizer=opt_h)
    _assert_same_tables(twin, hybrid, opt_t, opt_h)


@pytest.mark.parametrize("budget_rows", [0, 3, 10**6])
def test_incremental_model_dump_of_a_hybrid_table_equals_the_plain_tables(rng, budget_rows, tmp_path):
    """sok.incremental_model_dump reads a hybrid table through its cache: for every time between
    steps, the keys those steps used (also keys written back to host memory since) with the current
    values, equal to the same table without a host tier; after a checkpoint restore, touches count
    from the restore on."""
    import time

    cls, hp = OPTIMIZERS["adam"]
    plain, hybrid, (opt_p, opt_h) = _tables(f"inc{budget_rows}", budget_rows, cls, hp)
    pool = random_keys(rng, 60)
    stamps, used = [], []
    for lens, keys in _batches(rng, pool, 6, batch=8):
        stamps.append(time.time())
        time.sleep(0.003)
        used.append(set(keys.tolist()))
        for table, opt in ((plain, opt_p), (hybrid, opt_h)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(sok.lookup_sparse(table, to_ragged(lens, keys), combiners="sum") ** 2)
            opt.apply_gradients([(tape.gradient(loss, table), table)])
        time.sleep(0.003)
    for k, t in enumerate(stamps + [time.time() + 60]):
        want_keys, want_values = sok.incremental_model_dump(plain, t)
        got_keys, got_values = sok.incremental_model_dump(hybrid, t)
        assert set(got_keys.tolist()) == set(want_keys.tolist()) == set().union(*used[k:]), k
        want = dict(zip(want_keys.tolist(), want_values))
        for key, value in zip(got_keys.tolist(), got_values):
            np.testing.assert_allclose(value, want[key], rtol=1e-5, atol=1e-7, err_msg=f"key {key}")
    if budget_rows == 3:
        assert sok.cache_stats(hybrid)["evicted"] > 0      # keys touched, then written back, were found
    path = tf.train.Checkpoint(table=hybrid, opt=opt_h).write(str(tmp_path / "ck"))
    tf.train.Checkpoint(table=hybrid, opt=opt_h).read(path).assert_consumed()
    assert len(sok.incremental_model_dump(hybrid, 0)[0]) == 0
    later = rng.choice(pool, 5)
    sok.lookup_sparse(hybrid, tf.constant(later[:, None]), combiners="sum")
    assert set(sok.incremental_model_dump(hybrid, 0)[0].tolist()) == set(later.tolist())


def test_sparse_read_and_evict_on_a_hybrid_table_evicts_nothing(rng):
    """The keys a hybrid table's cache writes back stay in the table: sok.sparse_read_and_evict gives
    the embeddings of the table without a tier and no evicted keys, while the cache evicts."""
    plain, hybrid, _ = _tables("sre", 2)
    pool = random_keys(rng, 40)
    for _ in range(5):
        ids = tf.constant(rng.choice(pool, 6))
        got, ev_keys, ev_values = sok.sparse_read_and_evict(hybrid, ids)
        np.testing.assert_array_equal(got.numpy(), tf.gather(plain, ids).numpy())
        assert ev_keys.shape == (0,) and ev_values.shape == (0, DIM)
    assert sok.cache_stats(hybrid)["evicted"] > 0
    assert hybrid.size.numpy()[0] == plain.size.numpy()[0]


@pytest.mark.parametrize("policy,budget_rows", [("lru", b) for b in (0, 1, 6, 10**6)] + [("lfu", 10**6)])
def test_a_bounded_hybrid_table_evicts_as_the_bounded_table_without_a_tier(rng, policy, budget_rows, tmp_path):
    """max_capacity on a hybrid table: its host tier drops the keys not cached of least recent use,
    which are the keys an LRU table without a tier evicts: the same evicted keys and values per call
    (sok.sparse_read_and_evict), the same keys, values and Adam state after training steps between,
    at most max_capacity keys; a dropped key that comes back starts at its initial value. Both
    tables restored from checkpoints midway go on alike (the order of last use comes back). LFU: with
    a cache that holds the whole table, the keys the cache writes back are the ones dropped, those an
    LFU table without a tier evicts (smaller caches: test_a_bounded_hybrid_tables_keys_follow_...)."""
    cls, hp = OPTIMIZERS["adam"]
    widths = [DIM] + _slot_widths(cls(learning_rate=0.05, **hp))
    kw = dict(initializer="normal", seed=3, max_capacity=30, evict_strategy=policy)
    plain = sok.DynamicVariable(DIM, name=f"bp{policy}{budget_rows}", **kw)
    hybrid = sok.DynamicVariable(DIM, name=f"bh{policy}{budget_rows}", var_type="hybrid",
                                 max_hbm_for_vectors=_gib(budget_rows, widths), **kw)
    opt_p, opt_h = cls(learning_rate=0.05, **hp), cls(learning_rate=0.05, **hp)
    pool = random_keys(rng, 90)
    evicted_total = 0
    checkpoints = [tf.train.Checkpoint(table=t, opt=o) for t, o in ((plain, opt_p), (hybrid, opt_h))]
    for step in range(12):
        if step == 4:
            paths = [c.write(str(tmp_path / f"c{i}")) for i, c in enumerate(checkpoints)]
        if step == 7:
            for c, path in zip(checkpoints, paths):
                c.read(path).assert_consumed()
        ids = tf.constant(rng.choice(pool, rng.integers(1, 9)))
        dropped = sok.cache_stats(hybrid)["dropped"]
        (gp, kp, vp), (gh, kh, vh) = (sok.sparse_read_and_evict(t, ids) for t in (plain, hybrid))
        assert sok.cache_stats(hybrid)["dropped"] - dropped == len(kh.numpy())
        np.testing.assert_allclose(gh.numpy(), gp.numpy(), rtol=1e-5, atol=1e-7)
        assert sorted(kh.numpy().tolist()) == sorted(kp.numpy().tolist()), step
        want = dict(zip(kp.numpy().tolist(), vp.numpy()))
        for key, value in zip(kh.numpy().tolist(), vh.numpy()):
            np.testing.assert_allclose(value, want[key], rtol=1e-5, atol=1e-7)
        evicted_total += len(kp.numpy())
        lens, keys = _batches(rng, pool, 1, batch=6)[0]
        for table, opt in ((plain, opt_p), (hybrid, opt_h)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(sok.lookup_sparse(table, to_ragged(lens, keys), combiners="sum") ** 2)
            opt.apply_gradients([(tape.gradient(loss, table), table)])
        assert hybrid.size.numpy()[0] == plain.size.numpy()[0] <= 30
    assert evicted_total > 0
    _assert_same_tables(plain, hybrid, opt_p, opt_h)


@pytest.mark.parametrize("policy,budget_rows", [(p, b) for p in ("lru", "lfu") for b in (0, 1, 6)])
def test_a_bounded_hybrid_tables_keys_follow_the_cache_model(rng, policy, budget_rows):
    """max_capacity with a cache smaller than it: per call the keys missed, taken in, new to the table,
    written back and dropped, and the table's keys, are those of the plain-Python model (_cache_model
    with a capacity: LRU drops the keys written back longest ago, LFU those of lowest count)."""
    pool = random_keys(rng, 90)
    batches = [pool[zipf_ranks(rng, 90, rng.integers(1, 12), 1.1)] for _ in range(60)]
    table = sok.DynamicVariable(DIM, initializer="uniform", name=f"bm{policy}{budget_rows}", var_type="hybrid",
                                max_hbm_for_vectors=_gib(budget_rows, [DIM]), evict_strategy=policy,
                                max_capacity=30)
    before = sok.cache_stats(table)
    names = ("misses", "loaded", "new_keys", "evicted", "dropped")
    for step, (b, (*want, keys)) in enumerate(zip(batches, _cache_model(budget_rows, batches, policy, 30))):
        tf.gather(table, tf.constant(b))
        now = sok.cache_stats(table)
        assert [now[k] - before[k] for k in names] == want, step
        assert set(sok.export(table)[0].numpy().tolist()) == keys, step
        before = now
    assert sok.cache_stats(table)["dropped"] > 0


@pytest.mark.parametrize("budget_rows,capacity", [(1, None), (7, None), (7, 30)])
def test_an_lfu_tables_counts_come_back_from_a_checkpoint(rng, tmp_path, budget_rows, capacity):
    """An LFU hybrid table's checkpoint holds every key's count, cached or in host memory: a new table
    restored from it midway goes on as the plain-Python cache model of all the calls says (keys
    missed, taken in, written back, dropped, held), which counts restarted at the restore would not."""
    pool = random_keys(rng, 90)
    batches = [pool[zipf_ranks(rng, 90, rng.integers(1, 12), 1.1)] for _ in range(90)]
    kw = dict(initializer="uniform", var_type="hybrid", max_hbm_for_vectors=_gib(budget_rows, [DIM]),
              evict_strategy="lfu", max_capacity=capacity)
    table = sok.DynamicVariable(DIM, name=f"lfuck{budget_rows}{capacity}a", **kw)
    model = _cache_model(budget_rows, batches, "lfu", capacity)
    names = ("misses", "loaded", "new_keys", "evicted", "dropped")
    for b in batches[:45]:
        tf.gather(table, tf.constant(b))
    path = tf.train.Checkpoint(table=table).write(str(tmp_path / "ck"))
    twin = sok.DynamicVariable(DIM, name=f"lfuck{budget_rows}{capacity}b", **kw)
    tf.train.Checkpoint(table=twin).read(path).assert_consumed()
    before = sok.cache_stats(twin)
    for step, (b, (*want, keys)) in enumerate(zip(batches[45:], model[45:]), 45):
        np.testing.assert_array_equal(tf.gather(twin, tf.constant(b)).numpy(), tf.gather(table, tf.constant(b)).numpy())
        now = sok.cache_stats(twin)
        assert [now[k] - before[k] for k in names] == want, step
        assert set(sok.export(twin)[0].numpy().tolist()) == keys, step
        before = now
    assert sok.cache_stats(twin)["evicted"] > 0


@pytest.mark.parametrize("budget_rows", [2, 10**6])
def test_a_batch_over_a_bounded_hybrid_tables_capacity_is_refused_unchanged(rng, budget_rows):
    """A lookup whose own keys exceed a hybrid table's max_capacity is an InvalidArgumentError naming
    the table (as for the table without a tier), and the table is unchanged: same keys and values,
    and it goes on training alike."""
    plain = sok.DynamicVariable(DIM, initializer="normal", seed=3, name="over_p", max_capacity=5,
                                evict_strategy="lru")
    hybrid = sok.DynamicVariable(DIM, initializer="normal", seed=3, name="over_h", max_capacity=5,
                                 var_type="hybrid", max_hbm_for_vectors=_gib(budget_rows, [DIM]))
    pool = random_keys(rng, 20)
    for t in (plain, hybrid):
        tf.gather(t, tf.constant(pool[:4]))
    before = _state(hybrid, None)
    for t, name in ((plain, "over_p"), (hybrid, "over_h")):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=f"dynamic table '{name}' cannot hold this batch's keys: it uses 8 distinct keys "
                                 f"and max_capacity is 5"):
            tf.gather(t, tf.constant(pool[4:12]))
    assert {k: v[0].tolist() for k, v in _state(hybrid, None).items()} == \
        {k: v[0].tolist() for k, v in before.items()}
    for _ in range(3):
        ids = tf.constant(rng.choice(pool, 4))
        np.testing.assert_array_equal(tf.gather(hybrid, ids).numpy(), tf.gather(plain, ids).numpy())
    _assert_same_tables(plain, hybrid)


@pytest.mark.parametrize("budget_rows,capacity", [(0, None), (3, None), (10**6, None), (2, 25), (10**6, 25)])
def test_admission_on_a_hybrid_table_equals_the_table_without_a_tier(rng, budget_rows, capacity, tmp_path):
    """min_frequency on a hybrid table: a key new to the table is inserted at its second sighting
    (reading zeros, untrained, until then), a key the cache wrote back comes back at once, a key
    the bound dropped counts its sightings again: the same lookups, and the same keys, values and
    Adagrad state after training steps, as the table without a tier; also after both are restored
    from checkpoints midway."""
    cls, hp = OPTIMIZERS["adagrad"]
    widths = [DIM] + _slot_widths(cls(learning_rate=0.05, **hp))
    kw = dict(initializer="normal", seed=3, min_frequency=2, max_capacity=capacity,
              evict_strategy="lru" if capacity else None)
    plain = sok.DynamicVariable(DIM, name=f"ap{budget_rows}_{capacity}", **kw)
    hybrid = sok.DynamicVariable(DIM, name=f"ah{budget_rows}_{capacity}", var_type="hybrid",
                                 max_hbm_for_vectors=_gib(budget_rows, widths), **kw)
    opts = [cls(learning_rate=0.05, **hp) for _ in range(2)]
    checkpoints = [tf.train.Checkpoint(table=t, opt=o) for t, o in zip((plain, hybrid), opts)]
    pool = random_keys(rng, 70)
    zeros = 0
    for step in range(12):
        if step == 5:
            paths = [c.write(str(tmp_path / f"a{i}")) for i, c in enumerate(checkpoints)]
        if step == 8:
            for c, path in zip(checkpoints, paths):
                c.read(path).assert_consumed()
        lens, keys = _batches(rng, pool, 1, batch=6)[0]
        outs = []
        for table, opt in zip((plain, hybrid), opts):
            with tf.GradientTape() as tape:
                out = sok.lookup_sparse(table, to_ragged(lens, keys), combiners="sum")
                loss = tf.reduce_sum(out ** 2)
            opt.apply_gradients([(tape.gradient(loss, table), table)])
            outs.append(out.numpy())
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-7)
        zeros += int(((outs[0] == 0).all(1) & (lens > 0)).sum())
        assert hybrid.size.numpy()[0] == plain.size.numpy()[0]
    assert zeros > 0                                        # keys waiting for admission read zeros
    if budget_rows < 10:
        assert sok.cache_stats(hybrid)["evicted"] > 0
    _assert_same_tables(plain, hybrid, *opts)


@pytest.mark.parametrize("budget_rows,capacity,min_frequency", [(0, None, 1), (3, None, 1), (10**6, None, 1),
                                                                (2, 25, 1), (3, None, 2)])
def test_low_frequency_filter_on_a_hybrid_table_equals_the_table_without_a_tier(rng, budget_rows, capacity,
                                                                                  min_frequency):
    """use_low_frequency_filter on a hybrid table: a key new to the table is inserted with the drawn
    probability, while a key its cache wrote back to the host tier comes back whatever the draw
    (it is not new): the same lookups, keys, values and Adagrad state after training steps as the
    table without a tier (with a bound, and with admission too). A static table with a host tier
    in the same lookup is never filtered (its rows equal a NumPy gather of the initial values)."""
    cls, hp = OPTIMIZERS["adagrad"]
    widths = [DIM] + _slot_widths(cls(learning_rate=0.05, **hp))
    kw = dict(initializer="normal", seed=3, min_frequency=min_frequency, max_capacity=capacity,
              evict_strategy="lru" if capacity else None)
    tag = f"{budget_rows}_{capacity}_{min_frequency}"
    plain = sok.DynamicVariable(DIM, name=f"fp{tag}", **kw)
    hybrid = sok.DynamicVariable(DIM, name=f"fh{tag}", var_type="hybrid", max_hbm_for_vectors=_gib(budget_rows, widths),
                                 **kw)
    init = rng.standard_normal((30, DIM)).astype(np.float32)
    static = sok.Variable(init, name=f"fs{tag}", max_hbm_for_vectors=_gib(2, [DIM]))
    opts = [cls(learning_rate=0.05, **hp) for _ in range(2)]
    pool = random_keys(rng, 80)
    zeros = came_back = 0
    for step in range(12):
        # the first batch: a sample of one new key each, 40 (or max_capacity: the most a batch may keep),
        # so that some read zeros (all kept: 2**-40, 2**-25)
        first = min(40, capacity or 40)
        lens, keys = (np.ones(first, np.int64), pool[:first]) if step == 0 else _batches(rng, pool, 1, batch=8)[0]
        rows = rng.integers(0, 30, int(lens.sum()))
        outs = []
        for table, opt in zip((plain, hybrid), opts):
            before = sok.cache_stats(hybrid)["loaded"] - sok.cache_stats(hybrid)["new_keys"]
            with tf.GradientTape() as tape:
                out, fixed = sok.lookup_sparse([table, static], [to_ragged(lens, keys), to_ragged(lens, rows)],
                                               combiners="sum", use_low_frequency_filter=True, filter_ratio=0.5)
                loss = tf.reduce_sum(out ** 2)
            opt.apply_gradients([(tape.gradient(loss, table), table)])
            outs.append(out.numpy())
            if table is hybrid:
                came_back += sok.cache_stats(hybrid)["loaded"] - sok.cache_stats(hybrid)["new_keys"] - before
            starts = np.concatenate([[0], np.cumsum(lens)])
            np.testing.assert_allclose(fixed.numpy(), [init[rows[a:b]].sum(0) for a, b in zip(starts[:-1], starts[1:])],
                                       rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-7)
        zeros += int(((outs[0] == 0).all(1) & (lens > 0)).sum())
        assert hybrid.size.numpy()[0] == plain.size.numpy()[0]
    assert zeros > 0                                        # keys the filter left out read zeros
    if budget_rows < 10:
        assert sok.cache_stats(hybrid)["evicted"] > 0 and came_back > 0   # written back, then taken in again
    _assert_same_tables(plain, hybrid, *opts)


def zipf_fit_data(rng, samples, batch):
    """Keras fit data: `samples` rows of 1-3 keys drawn at Zipf from 200 random keys (a ragged int64
    feature) with random targets, in batches of `batch`; returns (the rows' keys, the dataset)."""
    pool = random_keys(rng, 200)
    picks = [pool[zipf_ranks(rng, 200, rng.integers(1, 4), 1.1)].tolist() for _ in range(samples)]
    y = rng.standard_normal((samples, 1)).astype(np.float32)
    return picks, tf.data.Dataset.from_tensor_slices((tf.ragged.constant(picks, tf.int64), y)).batch(batch)


def collection_model(cfg, steps_per_execution=1):
    """A Keras model of one ragged int64 feature "f" through an EmbeddingCollection of table `cfg`
    and a Dense layer, compiled (Adam on the table); returns (model, the collection)."""
    inp = keras.Input(shape=(None,), dtype="int64", ragged=True)
    coll = sok.layers.EmbeddingCollection(tables=[cfg], feature_to_table={"f": cfg.name})
    model = keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(coll({"f": inp})["f"]))
    model.compile(optimizer=sok.keras.Optimizer(keras.optimizers.SGD(0.05), sok.optimizers.Adam(0.02)),
                  loss="mse", steps_per_execution=steps_per_execution)
    return model, coll


def assert_same_exports(plain, hybrid):
    """The two dynamic tables (or Keras weights of them) hold the same keys and values; returns their exports."""
    a, b = (sok.export(getattr(t, "_dynamic", t)) for t in (plain, hybrid))
    order_a, order_b = np.argsort(a[0].numpy()), np.argsort(b[0].numpy())
    np.testing.assert_array_equal(a[0].numpy()[order_a], b[0].numpy()[order_b])
    np.testing.assert_allclose(b[1].numpy()[order_b], a[1].numpy()[order_a], rtol=1e-6, atol=1e-7)
    return a, b


@pytest.mark.parametrize("capacity", [None, 60])
def test_keras_fit_with_a_host_tier_equals_without_and_logs_the_cache(rng, caplog, capacity):
    """model.fit with a hybrid table (unbounded, and bounded with LRU eviction) equals the table
    without a tier: losses, keys and values; CacheStats logs a line per epoch."""
    picks, ds = zipf_fit_data(rng, 128, 16)
    histories, tables = [], []
    for budget in (None, _gib(6, [DIM, DIM, DIM])):
        cfg = sok.TableConfig(f"k{len(tables)}", 8, DIM, combiner="sum", dynamic=True, initializer="normal", seed=2,
                              max_hbm_for_vectors=budget, max_capacity=capacity,
                              evict_strategy="lru" if capacity else None)
        model, coll = collection_model(cfg)
        with caplog.at_level(logging.INFO, logger="tf_sok"):
            h = model.fit(ds, epochs=2, verbose=0, callbacks=[sok.keras.CacheStats()] if budget else [])
        histories.append(h.history["loss"])
        tables.append(coll.tables[cfg.name])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-6)
    a, b = assert_same_exports(*tables)
    if capacity:
        assert len(a[0].numpy()) == capacity < len(set(sum(picks, [])))
    lines = [r.getMessage() for r in caplog.records if "hit rate" in r.getMessage()]
    assert len(lines) == 2 and all("table 'k1'" in l for l in lines)


def check_tier_growth(rng, device):
    """A hybrid table on `device` whose host tier new keys grow many times (on a GPU: pinned memory
    extended in place, piece after piece): after batches of new keys, each trained once with SGD,
    every key reads NumPy's value (training=False: read from host memory in place, or the cache),
    and again after a training lookup of all of them has moved rows between the tiers."""
    dim, lr, total = 64, 0.25, 40_000   # 272-byte records: a 2 MiB piece holds ~7,700 of them
    keys = random_keys(rng, total)
    with tf.device(device):
        t = sok.DynamicVariable(dim, initializer="0.5", var_type="hybrid", max_hbm_for_vectors=500 * dim * 4 / 2**30,
                                name=f"grows_{device[1:4]}")
        opt = sok.optimizers.SGD(learning_rate=lr)
    assert device[1:4] in t.device

    @tf.function
    def step(ids, target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(sok.lookup_sparse(t, ids, combiners="sum") * target)
        opt.apply_gradients([(tape.gradient(loss, t), t)])

    expect = np.empty((total, dim), np.float32)
    lo, size = 0, 300
    while lo < total:   # batches of distinct new keys, growing: 300, 450, ... (about 14 extensions of the tier)
        hi = min(total, lo + size)
        target = rng.standard_normal((hi - lo, dim)).astype(np.float32)
        with tf.device(device):
            step(to_ragged(np.ones(hi - lo, np.int64), keys[lo:hi]), tf.constant(target))
        expect[lo:hi] = np.float32(0.5) - np.float32(lr) * target   # one id per sample: the row's gradient
        lo, size = hi, size * 3 // 2
    stats = sok.cache_stats(t)
    assert stats["keys"] == total and stats["cached"] < total // 4   # (a cache holds at least a batch's keys)

    def read(training):
        with tf.device(device):
            return sok.lookup_sparse(t, to_ragged(np.ones(total, np.int64), keys), combiners="sum",
                                     training=training).numpy()

    np.testing.assert_allclose(read(False), expect, rtol=1e-6, atol=1e-6)
    assert sok.cache_stats(t)["reads_from_host"] - stats["reads_from_host"] == total - stats["cached"]
    np.testing.assert_allclose(read(True), expect, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(read(False), expect, rtol=1e-6, atol=1e-6)


def test_a_host_tier_that_grows_many_times_keeps_every_row(rng):
    check_tier_growth(rng, "/CPU:0")


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="max_hbm_for_vectors needs var_type=\"hybrid\""):
        sok.DynamicVariable(DIM, var_type="hbm", max_hbm_for_vectors=1)
    with pytest.raises(ValueError, match="must be a number of GiB >= 0, got -1"):
        sok.DynamicVariable(DIM, var_type="hybrid", max_hbm_for_vectors=-1)
    plain = sok.DynamicVariable(DIM, name="no_tier")
    with pytest.raises(ValueError, match="'no_tier' is not a hybrid table"):
        sok.cache_stats(plain)
    from tf_sok.python.ops.loader import ops   # the ops themselves refuse a table without a tier
    with pytest.raises(tf.errors.InvalidArgumentError, match="'no_tier': has no host tier"):
        ops().tf_sok_dynamic_cache_stats(plain._index.resource_handle)
    hybrid = sok.DynamicVariable(DIM, var_type="hybrid", max_hbm_for_vectors=0.001, name="tiered")
    with pytest.raises(ValueError, match="'tiered' is hybrid"):
        hybrid.touched_since(0)
    with pytest.raises(ValueError, match="'tiered' is hybrid"):
        hybrid.export_rows()
    with pytest.raises(tf.errors.InvalidArgumentError, match="link between host memory and a GPU: place it on a GPU"):
        sok.host_link_bandwidth(1, device="/CPU:0")


def test_delta_dumps_of_a_hybrid_table_load_into_a_plain_one(rng, tmp_path):
    """sok.dump(since=...) reads a hybrid table through its cache: a base dump and two deltas, loaded
    as a chain into a table without a host tier, give the hybrid table's final keys, values and state."""
    cls, hp = OPTIMIZERS["adam"]
    _, hybrid, (_, opt_h) = _tables("delta", 4, cls, hp)
    pool = random_keys(rng, 120)
    paths = []
    for k in range(3):
        for lens, keys in _batches(rng, pool[:40 * (k + 1)], 2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(sok.lookup_sparse(hybrid, to_ragged(lens, keys), combiners="sum") ** 2)
            opt_h.apply_gradients([(tape.gradient(loss, hybrid), hybrid)])
        paths.append(str(tmp_path / f"d{k}"))
        sok.dump(paths[-1], [hybrid], optimizer=opt_h, since=paths[-2] if k else None)
    twin = sok.DynamicVariable(DIM, initializer="normal", seed=3, name="delta_hybrid")
    opt_t = cls(learning_rate=0.05, **hp)
    sok.load(paths, [twin], optimizer=opt_t)
    _assert_same_tables(twin, hybrid, opt_t, opt_h, atol=0)
