"""sok.DynamicVariable against plain-Python references: a dict of keys, NumPy lookups and the NumPy
optimizers, a Python model of eviction and admission. Keys are fresh random int64s, huge and
negative ones included."""
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.helpers import np_lookup, to_ragged
from tests.python.optimizers.reference import NumpyOptimizer
from tests.python.optimizers.test_optimizers import CASES, _np_name

EDGE_KEYS = np.array([2**63 - 1, -2**63, -1, 0, 1, 2**40, -2**40], np.int64)


def random_keys(rng, n):
    """n distinct int64 keys, the extremes among them."""
    keys = set(EDGE_KEYS.tolist())
    while len(keys) < n:
        keys.update(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64, endpoint=True).tolist())
    return rng.permutation(np.array(sorted(keys)[:n], np.int64))


def held(var):
    keys, values = sok.export(var)
    return dict(zip(keys.numpy().tolist(), values.numpy()))


def test_new_keys_get_their_initial_value_whatever_the_order_or_table(rng):
    keys = random_keys(rng, 300)
    a = sok.DynamicVariable(8, initializer="uniform", seed=7, name="a")
    b = sok.DynamicVariable(8, initializer="uniform", seed=7, init_capacity=3, name="b")
    c = sok.DynamicVariable(8, initializer="uniform", seed=8, name="c")
    va = tf.gather(a, keys).numpy()
    vb = tf.gather(b, keys[::-1]).numpy()[::-1]
    np.testing.assert_array_equal(va, vb)                       # a function of (key, seed) only
    assert not np.array_equal(va, tf.gather(c, keys).numpy())   # the seed matters
    assert va.min() >= -0.05 and va.max() < 0.05 and abs(va.mean()) < 0.005 and va.std() > 0.025
    np.testing.assert_array_equal(tf.gather(a, keys).numpy(), va)  # found again, unchanged
    assert a.size.numpy().tolist() == [300, 8]
    normal = tf.gather(sok.DynamicVariable(16, initializer="normal", name="n"), keys).numpy()
    assert abs(normal.mean()) < 0.004 and 0.045 < normal.std() < 0.055
    const = sok.DynamicVariable(4, initializer="13", name="k")
    np.testing.assert_array_equal(tf.gather(const, keys[:5]).numpy(), np.full((5, 4), 13.0, np.float32))
    trunc = sok.DynamicVariable(16, initializer=tf.keras.initializers.TruncatedNormal(0.0, 0.1), name="t")
    assert np.abs(tf.gather(trunc, keys).numpy()).max() <= 0.2 + 1e-6


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_fused_lookup_with_static_and_dynamic_tables_matches_numpy(rng, combiner):
    keys = random_keys(rng, 60)
    dim = 5
    values = rng.standard_normal((len(keys), dim)).astype(np.float32)
    dyn = sok.DynamicVariable(dim, initializer="zeros", init_capacity=8, name="dyn")
    sok.assign(dyn, keys, values)
    static = rng.standard_normal((30, dim)).astype(np.float32)
    st = sok.Variable(static, name="static")
    lens = [rng.integers(0, 4, 9) for _ in range(3)]
    picks = [rng.integers(0, len(keys), int(lens[0].sum())), rng.integers(0, 30, int(lens[1].sum())),
             rng.integers(0, len(keys), int(lens[2].sum()))]
    ids = [to_ragged(lens[0], keys[picks[0]]), to_ragged(lens[1], picks[1].astype(np.int32)),
           to_ragged(lens[2], keys[picks[2]])]
    outs = tf.function(lambda *x: sok.lookup_sparse([dyn, st, dyn], list(x), combiners=combiner))(*ids)
    refs = [np_lookup(values, lens[0], picks[0], None, combiner), np_lookup(static, lens[1], picks[1], None, combiner),
            np_lookup(values, lens[2], picks[2], None, combiner)]
    for o, r in zip(outs, refs):
        np.testing.assert_allclose(o.numpy(), r, rtol=1e-5, atol=1e-6)
    assert dyn.size.numpy()[0] == len(keys)


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_steps_match_numpy_with_state_per_key(rng, case):
    cls, hp, _ = CASES[case]
    dim, lr, n_keys = 4, 0.05, 40
    keys = random_keys(rng, n_keys)
    init = rng.standard_normal((n_keys, dim)).astype(np.float32)
    table = sok.DynamicVariable(dim, init_capacity=4, name="t")
    sok.assign(table, keys, init)
    opt = cls(learning_rate=lr, **hp)
    ref = NumpyOptimizer(_np_name(case), init, lr, **hp)

    @tf.function
    def step(ids, target):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, ids, combiners="sum")
            loss = tf.reduce_sum(out * target)
        grad = tape.gradient(loss, table)
        opt.apply_gradients([(grad, table)])

    for _ in range(4):
        lens = rng.integers(0, 4, 12)
        picks = rng.integers(0, n_keys // 2, int(lens.sum()))   # repeats within and across steps
        target = rng.standard_normal((12, dim)).astype(np.float32)
        step(to_ragged(lens, keys[picks]), target)
        ref.apply(picks, np.repeat(target, lens, axis=0))
    got = held(table)
    for i, k in enumerate(keys):
        np.testing.assert_allclose(got[k], ref.w[i], rtol=2e-5, atol=2e-6, err_msg=f"key {k}")


def _reference_model(max_keys, policy, batches):
    """Plain-Python model of a bounded table: per call, found keys are touched; missing keys
    enter, evicting the untouched keys of lowest (score, key). LRU score: last call; LFU: calls."""
    score, clock, evicted = {}, 0, []
    for batch in batches:
        clock += 1
        distinct = list(dict.fromkeys(batch.tolist()))
        found = {k for k in distinct if k in score}
        new = [k for k in distinct if k not in score]
        for k in found:
            score[k] = score[k] + 1 if policy == "lfu" else clock
        need = len(score) + len(new) - max_keys
        out = []
        if need > 0:
            untouched = sorted((s, k) for k, s in score.items() if k not in found)
            out = [k for _, k in untouched[:need]]
            for k in out:
                del score[k]
        for k in new:
            score[k] = 1 if policy == "lfu" else clock
        evicted.append(sorted(out))
    return set(score), evicted


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_follows_the_policy_and_returns_evicted_values(rng, policy):
    pool = random_keys(rng, 40)
    batches = [rng.choice(pool, rng.integers(1, 9)) for _ in range(30)]
    max_keys = 12
    table = sok.DynamicVariable(3, initializer="normal", max_capacity=max_keys, evict_strategy=policy,
                                init_capacity=2, name="bounded")
    free = sok.DynamicVariable(3, initializer="normal", name="unbounded")   # the same initial values
    want_keys, want_evicted = _reference_model(max_keys, policy, batches)
    for b, want in zip(batches, want_evicted):
        before = held(table)
        emb, ev_keys, ev_values = sok.sparse_read_and_evict(table, tf.constant(b))
        np.testing.assert_array_equal(emb.numpy(), tf.gather(free, b).numpy())
        order = np.argsort(ev_keys.numpy())
        assert ev_keys.numpy()[order].tolist() == want
        for k, v in zip(ev_keys.numpy()[order], ev_values.numpy()[order]):
            np.testing.assert_array_equal(v, before[k])
    assert set(held(table)) == want_keys
    assert table.size.numpy()[0] == max_keys


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_over_many_calls_and_a_restore_follows_the_policy(rng, tmp_path, policy):
    """Hundreds of calls on a bounded table (a first call filling it at once: one score shared by all
    its keys), restored from a checkpoint half-way into a new table: the keys each call evicts are
    the model's, as are the keys held at the end."""
    pool = random_keys(rng, 150)
    max_keys = 50
    batches = [pool[:max_keys]] + [rng.choice(pool, rng.integers(1, 30)) for _ in range(300)]
    want_keys, want_evicted = _reference_model(max_keys, policy, batches)
    table = sok.DynamicVariable(2, initializer="ones", max_capacity=max_keys, evict_strategy=policy, name="long")
    for i, (b, want) in enumerate(zip(batches, want_evicted)):
        if i == 150:
            path = tf.train.Checkpoint(table=table).write(str(tmp_path / "ck"))
            table = sok.DynamicVariable(2, initializer="ones", max_capacity=max_keys, evict_strategy=policy,
                                        name="long_restored")
            tf.train.Checkpoint(table=table).read(path).assert_consumed()
        _, ev_keys, _ = sok.sparse_read_and_evict(table, tf.constant(b))
        assert sorted(ev_keys.numpy().tolist()) == want, f"call {i}"
    assert set(held(table)) == want_keys


def wide_scores(keys):
    """Scores of 41 bits from the keys, 183 values among them (ties): what a long training's clock
    (or an LFU count on top of an imported one) gives, far past 2^16 calls."""
    mixed = (keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return (1 << 40) + (mixed % np.uint64(61)).astype(np.int64) * (1 << 17) + (mixed % np.uint64(3)).astype(np.int64)


def give_wide_scores(table, device):
    """The table's index exported, its keys given wide_scores (and the clock the largest), imported back."""
    from tf_sok.python.ops.loader import ops
    with tf.device(device):
        parts = [p.numpy() for p in ops().tf_sok_dynamic_export(table._index.resource_handle)]  # noqa: SLF001
        parts[2] = wide_scores(parts[0])
        parts[6] = parts[6].copy()
        parts[6][0] = parts[2].max()
        ops().tf_sok_dynamic_import(table._index.resource_handle,  # noqa: SLF001
                                    *[tf.constant(p, tf.int64) for p in parts])


def call_evicting(rng, held_keys, pool, n_new=3000, n_touched=2000):
    """A batch of n_new keys from `pool` and n_touched held ones (some twice), and the keys a full table
    evicts for it: the n_new untouched ones of lowest (wide_scores, key), by NumPy's lexsort."""
    touched = rng.choice(held_keys, n_touched, replace=False)
    batch = rng.permutation(np.concatenate([pool[:n_new], touched, touched[:n_touched // 4]]))
    untouched = np.setdiff1d(held_keys, touched)
    return batch, sorted(untouched[np.lexsort((untouched, wide_scores(untouched)))[:n_new]].tolist())


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_victims_among_wide_tied_scores_are_the_lowest_score_then_key(rng, policy):
    max_keys = 20_000
    pool = random_keys(rng, max_keys + 3000)
    table = sok.DynamicVariable(2, initializer="zeros", max_capacity=max_keys, evict_strategy=policy,
                                init_capacity=1024, name="wide_scores")
    for part in np.array_split(pool[:max_keys], 4):
        tf.gather(table, tf.constant(part))
    give_wide_scores(table, "/CPU:0")
    batch, want = call_evicting(rng, np.array(sorted(held(table))), pool[max_keys:])
    _, evicted, _ = sok.sparse_read_and_evict(table, tf.constant(batch))
    assert sorted(evicted.numpy().tolist()) == want


def test_large_batches_find_the_values_assigned_to_their_keys(rng):
    """Batches large enough to be looked up on several host threads: each position reads the value
    assigned to its key (a dict's), missing keys -1 without insert; with insert, the missing keys
    enter at their initial value and the held ones keep theirs."""
    keys = random_keys(rng, 60_000)
    held_keys, new_keys = keys[:40_000], keys[40_000:]
    values = rng.standard_normal((len(held_keys), 3)).astype(np.float32)
    table = sok.DynamicVariable(3, initializer="zeros", name="large")
    sok.assign(table, tf.constant(held_keys), tf.constant(values))
    want = dict(zip(held_keys.tolist(), values))
    batch = rng.choice(keys, 50_000)
    rows = table.rows_for(tf.constant(batch), insert=False).numpy()
    assert ((rows < 0) == ~np.isin(batch, held_keys)).all()
    got = table.sparse_read_rows(tf.constant(np.where(rows < 0, 0, rows))).numpy()
    for k, r, v in zip(batch, rows, got):
        if r >= 0:
            np.testing.assert_array_equal(v, want[int(k)])
    out = tf.gather(table, tf.constant(batch)).numpy()   # inserts the missing keys
    np.testing.assert_array_equal(out, [want.get(int(k), np.zeros(3, np.float32)) for k in batch])
    assert table.size.numpy()[0] == len(set(held_keys.tolist()) | set(batch.tolist()))
    assert len(set(new_keys.tolist()) & set(batch.tolist())) > 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_tables_past_huge_page_sizes_read_the_values_assigned_to_their_keys(rng, hybrid):
    """2.5M keys: the key maps (and a hybrid table's host tier) grow past 64 MiB, from where their
    memory is allocated for huge pages (the small maps' memory freed as they grow). Every sampled
    key reads the value NumPy assigned it, keys not held their initial value (zeros here)."""
    n = 2_500_000
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, n + n // 20, dtype=np.int64))[:n]
    keys = rng.permutation(keys)
    values = rng.standard_normal((len(keys), 2)).astype(np.float32)
    kw = dict(var_type="hybrid", max_hbm_for_vectors=0.01) if hybrid else {}
    table = sok.DynamicVariable(2, initializer="zeros", name=f"past_huge_{hybrid}", **kw)
    for lo in range(0, len(keys), 1 << 19):
        sok.assign(table, tf.constant(keys[lo:lo + (1 << 19)]), tf.constant(values[lo:lo + (1 << 19)]))
    assert table.size.numpy()[0] == len(keys)
    pick = rng.choice(len(keys), 200_000)
    absent = rng.integers(-2**63, 2**63 - 1, 1_000, dtype=np.int64)
    absent = absent[~np.isin(absent, keys)]
    ids = np.concatenate([keys[pick], absent])
    ragged = to_ragged(np.ones(len(ids), np.int64), tf.constant(ids))
    out, = sok.lookup_sparse([table], [ragged], combiners=["sum"], training=False)
    want = np.concatenate([values[pick], np.zeros((len(absent), 2), np.float32)])
    np.testing.assert_array_equal(out.numpy(), want)
    assert table.size.numpy()[0] == len(keys)   # (reads insert nothing)


def test_evicted_key_returns_with_fresh_value_and_optimizer_state(rng):
    keys = random_keys(rng, 3)
    table = sok.DynamicVariable(2, initializer="ones", max_capacity=2, evict_strategy="lru", name="small")
    opt = sok.optimizers.Adagrad(learning_rate=0.5, initial_accumulator_value=0.1, epsilon=1e-7)

    def train(k):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(sok.lookup_sparse(table, tf.constant([[k]]), combiners="sum"))
        opt.apply_gradients([(tape.gradient(loss, table), table)])

    fresh = NumpyOptimizer("adagrad", np.ones((1, 2), np.float32), 0.5, initial_accumulator_value=0.1, epsilon=1e-7)
    fresh.apply(np.array([0]), np.ones((1, 2)))
    train(keys[0]); train(keys[0]); train(keys[1])
    train(keys[2])                       # evicts keys[0] (least recently used)
    assert keys[0] not in held(table)
    train(keys[0])                       # back: initial value and a fresh accumulator, on another key's row
    np.testing.assert_allclose(held(table)[keys[0]], fresh.w[0], rtol=1e-6)


def test_admission_counts_sightings_and_keys_read_zeros_until_admitted(rng):
    keys = random_keys(rng, 6)
    table = sok.DynamicVariable(3, initializer="ones", min_frequency=3, name="admit")
    opt = sok.optimizers.SGD(learning_rate=1.0)
    seen = {}

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, ids, combiners="sum")
            loss = tf.reduce_sum(out)
        opt.apply_gradients([(tape.gradient(loss, table), table)])
        return out

    value = {}
    for _ in range(8):
        batch = rng.choice(keys, 3)
        out = step(tf.constant(batch[:, None])).numpy()
        for k in dict.fromkeys(batch.tolist()):
            seen[k] = seen.get(k, 0) + 1
        for k, row in zip(batch.tolist(), out):
            want = value.get(k, np.ones(3)) if seen[k] >= 3 else np.zeros(3)
            np.testing.assert_allclose(row, want, err_msg=f"key {k} seen {seen[k]} times")
        for k in set(batch.tolist()):
            if seen[k] >= 3:                      # admitted: trained by SGD, gradient 1 per occurrence
                value[k] = value.get(k, np.ones(3)) - batch.tolist().count(k)
    assert set(held(table)) == {k for k, n in seen.items() if n >= 3}


def test_assign_inserts_past_admission_and_unadmitted_keys_still_read_zeros(rng):
    keys = random_keys(rng, 12)
    values = rng.standard_normal((6, 3)).astype(np.float32)
    table = sok.DynamicVariable(3, initializer="ones", min_frequency=4, name="admit_assign")
    sok.assign(table, keys[:6], values)                  # an assignment admits at once
    got = held(table)
    assert set(got) == set(keys[:6].tolist())
    for k, v in zip(keys[:6], values):
        np.testing.assert_array_equal(got[k], v)
    out = sok.lookup_sparse(table, tf.constant(keys[4:8, None]), combiners="sum").numpy()
    np.testing.assert_array_equal(out[:2], values[4:6])
    np.testing.assert_array_equal(out[2:], np.zeros((2, 3), np.float32))   # seen once: not admitted


M64 = (1 << 64) - 1


def _mix(x):   # splitmix64's finaliser, written from its definition
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _kept(key, clock, ratio):
    """The low-frequency filter's documented draw for a new key at a lookup's clock."""
    x = _mix((int(key) & M64) ^ _mix((clock + 0x51ED27) & M64))
    return (x >> 11) * 2.0 ** -53 < float(np.float32(ratio))


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_low_frequency_filter_inserts_the_drawn_share_of_new_keys(rng, ratio):
    known = random_keys(rng, 20)
    values = rng.standard_normal((20, 2)).astype(np.float32)
    new = np.setdiff1d(rng.integers(-2**63, 2**63 - 1, 200, dtype=np.int64, endpoint=True), known)
    table = sok.DynamicVariable(2, initializer="ones", name="filtered")
    sok.assign(table, known, values)                      # the table's first call (clock 1)
    opt = sok.optimizers.SGD(learning_rate=0.5)
    batch = np.concatenate([known[:10], new])
    with tf.GradientTape() as tape:                       # clock 2
        out = sok.lookup_sparse(table, tf.constant(batch[:, None]), combiners="sum",
                                use_low_frequency_filter=True, filter_ratio=ratio)
        loss = tf.reduce_sum(out)
    opt.apply_gradients([(tape.gradient(loss, table), table)])
    kept = {int(k) for k in new if _kept(k, 2, ratio)}
    assert (len(kept) == 0) if ratio == 0 else (60 < len(kept) < 140)
    got = held(table)
    assert set(got) == set(known.tolist()) | kept
    out = out.numpy()
    np.testing.assert_array_equal(out[:10], values[:10])
    for k, row in zip(new, out[10:]):
        np.testing.assert_array_equal(row, np.ones(2) if int(k) in kept else np.zeros(2))
    for k, v in zip(known, values):                        # trained once (SGD, gradient 1) or not touched
        np.testing.assert_allclose(got[k], v - 0.5 * (k in known[:10]), rtol=1e-6)
    for k in kept:
        np.testing.assert_allclose(got[k], np.full(2, 0.5), rtol=1e-6)
    again = sok.lookup_sparse(table, tf.constant(new[:, None]), combiners="sum").numpy()   # row 0 zeros again
    for k, row in zip(new, again):
        if int(k) in kept:
            np.testing.assert_allclose(row, np.full(2, 0.5), rtol=1e-6)
    with pytest.raises(ValueError, match=r"filter_ratio must be a number in \[0, 1\]"):
        sok.lookup_sparse(table, tf.constant(new[:2, None]), use_low_frequency_filter=True, filter_ratio=1.5)


def test_growth_keeps_values_and_state(rng):
    keys = random_keys(rng, 2000)
    table = sok.DynamicVariable(4, initializer="uniform", init_capacity=16, name="grow")
    opt = sok.optimizers.Adam(learning_rate=0.01)
    first = tf.gather(table, keys[:10]).numpy()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(sok.lookup_sparse(table, tf.constant(keys[:10, None]), combiners="sum"))
    opt.apply_gradients([(tape.gradient(loss, table), table)])
    trained = held(table)
    m_before = opt.slots(table)[0].numpy().copy()
    tf.gather(table, keys)                            # 2000 keys: the arrays double several times
    assert tf.shape(table).numpy()[0] >= 2000
    after = held(table)
    for k in keys[:10]:
        np.testing.assert_array_equal(after[k], trained[k])
    assert not np.allclose(first, np.stack([after[k] for k in keys[:10]]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(sok.lookup_sparse(table, tf.constant(keys[-5:, None]), combiners="sum"))
    opt.apply_gradients([(tape.gradient(loss, table), table)])
    m = opt.slots(table)[0].numpy()
    assert m.shape[0] == tf.shape(table).numpy()[0]
    np.testing.assert_array_equal(m[:len(m_before)][np.abs(m_before).sum(1) > 0],
                                  m_before[np.abs(m_before).sum(1) > 0])


def test_export_assign_round_trip(rng):
    keys = random_keys(rng, 100)
    values = rng.standard_normal((100, 6)).astype(np.float32)
    a = sok.DynamicVariable(6, name="a")
    sok.assign(a, keys, values)
    got = held(a)
    assert set(got) == set(keys.tolist())
    for k, v in zip(keys, values):
        np.testing.assert_array_equal(got[k], v)
    b = sok.DynamicVariable(6, name="b")
    sok.assign(b, *sok.export(a))
    for k, v in held(b).items():
        np.testing.assert_array_equal(v, got[k])
    sok.assign(b, keys[:3], values[:3] * 2)                 # overwrite
    for k, v in zip(keys[:3], values[:3] * 2):
        np.testing.assert_array_equal(held(b)[k], v)


def test_full_table_without_eviction_is_an_error_that_changes_nothing(rng):
    keys = random_keys(rng, 10)
    table = sok.DynamicVariable(2, max_capacity=6, name="capped")
    tf.gather(table, keys[:5])
    before = held(table)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"dynamic table 'capped' is full: 5 of max_capacity 6"):
        tf.gather(table, keys[3:])                         # 2 found, 5 new: one too many
    after = held(table)
    assert set(after) == set(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    bounded = sok.DynamicVariable(2, max_capacity=3, evict_strategy="lru", name="tiny")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"'tiny' cannot hold this batch's keys: it uses 4"):
        tf.gather(bounded, keys[:4])
    assert bounded.size.numpy()[0] == 0


def test_bad_keys_and_arguments_raise_clear_errors():
    table = sok.DynamicVariable(2, name="typed")
    with pytest.raises(TypeError, match=r"'typed': keys must be int32 or int64, got float32"):
        tf.gather(table, tf.constant([1.0]))
    with pytest.raises(TypeError, match=r"lookup_sparse feature 'f': ids must be int32 or int64, got float32"):
        sok.lookup_sparse([table], [tf.ragged.constant([[1.0]])], feature_names=["f"])
    with pytest.raises(ValueError, match=r"evict_strategy must be \"lru\" or \"lfu\""):
        sok.DynamicVariable(2, evict_strategy="fifo", name="x")
    with pytest.raises(TypeError, match=r"initializer .* is not supported"):
        sok.DynamicVariable(2, initializer="glorot_uniform", name="x")
    with pytest.raises(TypeError, match=r"unexpected arguments \['capacity'\]"):
        sok.DynamicVariable(2, capacity=4, name="x")
    sok.DynamicVariable(2, max_hbm_for_vectors=1 << 30, max_bucket_size=128, name="ok")   # SOK tuning: ignored
    int32 = sok.DynamicVariable(2, key_type=tf.int32, initializer="normal", name="i32")
    np.testing.assert_array_equal(tf.gather(int32, tf.constant([5], tf.int32)).numpy(),
                                  tf.gather(int32, tf.constant([5], tf.int64)).numpy())


def test_checkpoint_round_trip_then_training_continues_alike(rng, tmp_path):
    keys = random_keys(rng, 30)

    def make():
        table = sok.DynamicVariable(3, initializer="normal", max_capacity=20, evict_strategy="lfu", min_frequency=2,
                                    init_capacity=4, name="ck")
        return table, sok.optimizers.Adam(learning_rate=0.05)

    def train(table, opt, batches):
        for b in batches:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(sok.lookup_sparse(table, tf.constant(b[:, None]), combiners="sum")))
            opt.apply_gradients([(tape.gradient(loss, table), table)])

    batches = [rng.choice(keys, 8) for _ in range(12)]
    table, opt = make()
    train(table, opt, batches[:6])
    path = tf.train.Checkpoint(table=table, opt=opt).save(str(tmp_path / "ck"))
    train(table, opt, batches[6:])
    table2, opt2 = make()
    tf.gather(table2, keys[:3])                 # something to overwrite
    opt2.build([table2])
    tf.train.Checkpoint(table=table2, opt=opt2).restore(path).assert_consumed()
    train(table2, opt2, batches[6:])
    a, b = held(table), held(table2)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_one_find_for_many_tables_equals_a_find_each(rng):
    """rows_for_tables (one TfSokDynamicFindMany op) gives every table the rows, values, evictions
    and admissions that a find per table gives."""
    from tf_sok.python.dynamic_variable import rows_for_tables

    pool = random_keys(rng, 500)
    kinds = [dict(max_capacity=60, evict_strategy="lru"), dict(max_capacity=80, evict_strategy="lfu"),
             dict(min_frequency=2), {}]
    many = [sok.DynamicVariable(3, initializer="normal", seed=i, name=f"m{i}", **k) for i, k in enumerate(kinds)]
    each = [sok.DynamicVariable(3, initializer="normal", seed=i, name=f"e{i}", **k) for i, k in enumerate(kinds)]
    for _ in range(15):
        keys = [rng.choice(pool, rng.integers(1, 50)) for _ in kinds]
        rows = rows_for_tables(many, [tf.constant(k) for k in keys])
        want = [t.rows_for(tf.constant(k)) for t, k in zip(each, keys)]
        for t, r, u, w in zip(many, rows, each, want):
            np.testing.assert_array_equal(t.sparse_read_rows(r).numpy(), u.sparse_read_rows(w).numpy())
    for a, b in zip(many, each):
        ha, hb = held(a), held(b)
        assert set(ha) == set(hb)
        for k in ha:
            np.testing.assert_array_equal(ha[k], hb[k])
    with pytest.raises(tf.errors.InvalidArgumentError, match="given twice"):
        rows_for_tables([many[0], many[0]], [tf.constant([1]), tf.constant([2])])


def row_splits_cases(rng):
    """40 features' row_splits (more than one GPU launch holds; some spanning many blocks), about
    half of them broken at a random place, with the answer NumPy gives."""
    splits, values, want = [], [], []
    for _ in range(40):
        rows = int(rng.choice([0, 1, 7, 1023, 1024, 1025, 5000, 70_000]))
        s = np.concatenate([[0], np.cumsum(rng.integers(0, 3, rows))]).astype(np.int64)
        count = int(s[-1])
        fault = rng.integers(0, 5)
        if fault == 1 and rows > 1:        # a decrease somewhere inside
            i = int(rng.integers(1, rows + 1))
            s[i] = s[i - 1] - 1
        elif fault == 2:                   # does not start at 0
            s[0] = 1
        elif fault == 3:                   # does not end at the id count
            count += 1
        splits.append(s)
        values.append(np.zeros(count, np.int64))
        want.append(bool(s[0] == 0 and s[-1] == count and np.all(np.diff(s) >= 0)))
    return splits, values, want


def check_splits_and_ranges(rng, device):
    """TfSokRowSplitsValid on `device` against NumPy: the splits' verdicts, and the ids' range
    verdicts and offending ids of features with a bound (none, all in range, some below 0, some at or
    above the bound, none at all), the others unchecked."""
    from tf_sok.python.ops.loader import ops
    splits, values, want = row_splits_cases(rng)
    with tf.device(device):
        got = ops().tf_sok_row_splits_valid([tf.constant(s) for s in splits], [tf.constant(v) for v in values])
    assert device[1:4] in got[0].device
    assert got[0].numpy().tolist() == want and got[1].numpy().all() and not got[2].numpy().any()
    assert not all(want) and any(want)
    bounds, ids = [], []
    for _ in range(40):
        rows = int(rng.integers(1, 1 << 40)) if rng.random() < 0.8 else -1
        v = rng.integers(0, max(rows, 2), int(rng.choice([0, 1, 100, 2047, 2048, 2049, 5000, 70_000])))
        kind = rng.integers(0, 3)
        if len(v) and kind == 1:   # some below 0
            v[rng.integers(0, len(v), 3)] = -rng.integers(1, 1 << 50, 3)
        elif len(v) and kind == 2:   # some at or above the bound
            v[rng.integers(0, len(v), 3)] = max(rows, 0) + rng.integers(0, 1 << 50, 3)
        bounds.append(rows)
        ids.append(v.astype(np.int64))
    splits = [np.array([0, len(v)], np.int64) for v in ids]
    with tf.device(device):
        valid, in_range, bad = ops().tf_sok_row_splits_valid([tf.constant(s) for s in splits],
                                                             [tf.constant(v) for v in ids], rows=bounds)
    assert valid.numpy().all()
    for r, v, ok, b in zip(bounds, ids, in_range.numpy(), bad.numpy()):
        want_ok = r < 0 or len(v) == 0 or (v.min() >= 0 and v.max() < r)
        assert ok == want_ok, (r, v.min(), v.max())
        assert b == (0 if want_ok else (v.min() if v.min() < 0 else v.max()))
    assert not in_range.numpy().all() and in_range.numpy().any()


def test_row_splits_and_ranges_check_matches_numpy(rng):
    check_splits_and_ranges(rng, "/CPU:0")
    from tf_sok.python.ops.loader import ops
    # a bound per feature or none; int64 ids for a range check
    with pytest.raises(tf.errors.InvalidArgumentError, match="rows must be empty or give one bound per feature"):
        ops().tf_sok_row_splits_valid([tf.constant([0, 1], tf.int64)], [tf.constant([1], tf.int64)], rows=[3, 4])
    with pytest.raises(tf.errors.InvalidArgumentError, match="a range check .* needs int64 values, got int32"):
        ops().tf_sok_row_splits_valid([tf.constant([0, 1], tf.int64)], [tf.constant([1], tf.int32)], rows=[3])


def test_an_assignment_sets_new_keys_without_drawing_their_initial_values(rng):
    """rows_for(values_given=True), an assignment's find (sok.assign, sok.load): new keys' rows hold
    zeros until the caller writes them, not the initializer's draw; held keys keep their values; the
    assigned values read back exactly, and the optimizer state of the new rows is its fill."""
    dim = 4
    held, new = random_keys(rng, 300)[:200], random_keys(rng, 300)[200:]
    new = new[~np.isin(new, held)]
    values = rng.standard_normal((len(held), dim)).astype(np.float32)
    table = sok.DynamicVariable(dim, initializer="normal", name="given")
    sok.assign(table, tf.constant(held), tf.constant(values))
    batch = rng.permutation(np.concatenate([held[:50], new]))
    rows = table.rows_for(tf.constant(batch), admit_all=True, values_given=True).numpy()
    got = table.sparse_read_rows(tf.constant(rows)).numpy()
    want = dict(zip(held.tolist(), values))
    np.testing.assert_array_equal(got, [want.get(int(k), np.zeros(dim, np.float32)) for k in batch])
    drawn = sok.DynamicVariable(dim, initializer="normal", name="drawn")   # the same keys, drawn
    assert (np.abs(tf.gather(drawn, tf.constant(new)).numpy()) > 0).all()
    opt = sok.optimizers.Adagrad(0.1, initial_accumulator_value=0.25)
    opt.build([table])
    more = rng.standard_normal((len(new), dim)).astype(np.float32)
    fresh = random_keys(rng, 400)[300:]
    fresh = fresh[~np.isin(fresh, np.concatenate([held, new]))]
    sok.assign(table, tf.constant(np.concatenate([new, fresh])),
               tf.constant(np.concatenate([more, np.ones((len(fresh), dim), np.float32)])))
    np.testing.assert_array_equal(tf.gather(table, tf.constant(new)).numpy(), more)
    np.testing.assert_array_equal(tf.gather(table, tf.constant(fresh)).numpy(), np.ones((len(fresh), dim)))
    fresh_rows = table.rows_for(tf.constant(fresh), insert=False).numpy()
    np.testing.assert_array_equal(tf.gather(opt.slot(table, "accumulator"), tf.constant(fresh_rows)).numpy(),
                                  np.full((len(fresh), dim), 0.25, np.float32))


@pytest.mark.parametrize("in_graph", [False, True])
def test_an_assignment_of_values_not_one_row_per_key_raises_and_inserts_nothing(rng, in_graph):
    """sok.assign with values of the wrong shape: a ValueError (eager) or InvalidArgumentError (in a
    tf.function, shapes unknown) naming the table, before any key is inserted; the table keeps its keys
    and values (checked against NumPy)."""
    dim = 3
    table = sok.DynamicVariable(dim, initializer="normal", name="shape_checked")
    held = random_keys(rng, 40)
    values = rng.standard_normal((len(held), dim)).astype(np.float32)
    sok.assign(table, tf.constant(held), tf.constant(values))
    new = random_keys(rng, 80)[40:]
    new = new[~np.isin(new, held)]
    new = new[:len(new) - (len(new) - 1) % dim]   # (values no reshape to [-1, dim] could take either)
    bad = rng.standard_normal((len(new), dim + 1)).astype(np.float32)
    if in_graph:
        assign = tf.function(lambda k, v: sok.assign(table, k, v),
                             input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, None], tf.float32)])
        with pytest.raises(tf.errors.InvalidArgumentError, match="shape_checked"):
            assign(tf.constant(new), tf.constant(bad))
    else:
        with pytest.raises(ValueError, match=r"shape_checked.*values must be \[len\(keys\), dim\]"):
            sok.assign(table, tf.constant(new), tf.constant(bad))
    assert table.size.numpy()[0] == len(held)
    keys, got = (x.numpy() for x in sok.export(table))
    order = np.argsort(keys)
    np.testing.assert_array_equal(keys[order], np.sort(held))
    np.testing.assert_array_equal(got[order], values[np.argsort(held)])
