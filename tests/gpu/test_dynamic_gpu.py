"""Dynamic tables on the GPU (the index in HBM, CUDA kernels) against the same tables on the CPU
(the host index) and against the plain-Python references of tests/python/test_dynamic.py: the
same values per key, the same evicted keys, the same admission, checkpoints that move between
them."""
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.python.test_dynamic import _reference_model, call_evicting, give_wide_scores, held, random_keys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                                  reason="no GPU visible to TensorFlow")]


def pair(**kwargs):
    with tf.device("/GPU:0"):
        gpu = sok.DynamicVariable(name="on_gpu", **kwargs)
    with tf.device("/CPU:0"):
        cpu = sok.DynamicVariable(name="on_cpu", **kwargs)
    assert "GPU" in gpu.device and "CPU" in cpu.device
    return gpu, cpu


def assert_same_tables(a, b, rtol=1e-6, atol=1e-6):
    ha, hb = held(a), held(b)
    assert set(ha) == set(hb)
    for k in ha:
        np.testing.assert_allclose(ha[k], hb[k], rtol=rtol, atol=atol, err_msg=f"key {k}")


def test_find_insert_and_initial_values_match_the_host_index(rng):
    keys = random_keys(rng, 50_000)
    for init in ("uniform", "normal", "truncated_normal", "7"):
        gpu, cpu = pair(dimension=16, initializer=init, init_capacity=1000, seed=3)
        batch = np.concatenate([keys, rng.choice(keys, 20_000)])      # repeats within the batch
        with tf.device("/GPU:0"):
            got = tf.gather(gpu, tf.constant(batch)).numpy()
        with tf.device("/CPU:0"):
            want = tf.gather(cpu, tf.constant(batch)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert gpu.size.numpy()[0] == len(keys)
        assert tf.shape(gpu).numpy()[0] >= len(keys)


@pytest.mark.parametrize("dim", [3, 40])
@pytest.mark.parametrize("capacity", [16, 500_000])
def test_keys_inserted_together_get_rows_of_their_own(rng, dim, capacity):
    """One find inserts few keys repeated at many positions (their threads race for one bucket each)
    into a table that must grow (capacity 16: probe, then insert) or has room for every position
    (found and inserted in one pass): every key gets a row of its own (values assigned per key read
    back at every position), the initial values are the host's, at widths under and over a warp."""
    keys = random_keys(rng, 3000)
    gpu, cpu = pair(dimension=dim, initializer="truncated_normal", init_capacity=capacity, seed=5)
    batch = rng.choice(keys, 400_000)
    with tf.device("/GPU:0"):
        got = tf.gather(gpu, tf.constant(batch)).numpy()
    with tf.device("/CPU:0"):
        want = tf.gather(cpu, tf.constant(batch)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    distinct = np.unique(batch)
    assert gpu.size.numpy()[0] == len(distinct)
    values = rng.standard_normal((len(distinct), dim)).astype(np.float32)
    with tf.device("/GPU:0"):
        sok.assign(gpu, tf.constant(distinct), tf.constant(values))
        back = tf.gather(gpu, tf.constant(batch)).numpy()
    np.testing.assert_array_equal(back, values[np.searchsorted(distinct, batch)])


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_matches_the_python_model_on_the_gpu(rng, policy):
    pool = random_keys(rng, 3000)
    batches = [rng.choice(pool, rng.integers(1, 600)) for _ in range(40)]
    max_keys = 700
    with tf.device("/GPU:0"):
        table = sok.DynamicVariable(4, initializer="normal", max_capacity=max_keys, evict_strategy=policy,
                                    init_capacity=64, name="bounded")
    want_keys, want_evicted = _reference_model(max_keys, policy, batches)
    for b, want in zip(batches, want_evicted):
        with tf.device("/GPU:0"):
            _, ev_keys, _ = sok.sparse_read_and_evict(table, tf.constant(b))
        assert sorted(ev_keys.numpy().tolist()) == want
    assert set(held(table)) == want_keys


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_few_victims_among_many_rows_match_the_python_model_on_the_gpu(rng, policy):
    """A table of 100K keys filled over calls of 20K Zipf-drawn ids (scores spread over calls), then
    calls that each evict a few thousand of its ~90K untouched rows: the evicted keys, every call, are
    the model's, as are the keys held at the end."""
    pool = random_keys(rng, 160_000)
    weights = 1.0 / np.arange(1, len(pool) + 1) ** 0.6
    batches = [rng.choice(pool, 20_000, p=weights / weights.sum()) for _ in range(20)]
    max_keys = 100_000
    with tf.device("/GPU:0"):
        table = sok.DynamicVariable(2, initializer="zeros", max_capacity=max_keys, evict_strategy=policy,
                                    init_capacity=1024, name="many_rows")
    want_keys, want_evicted = _reference_model(max_keys, policy, batches)
    assert sum(0 < len(w) < 25_000 for w in want_evicted) >= 4
    for i, (b, want) in enumerate(zip(batches, want_evicted)):
        with tf.device("/GPU:0"):
            _, ev_keys, _ = sok.sparse_read_and_evict(table, tf.constant(b))
        assert sorted(ev_keys.numpy().tolist()) == want, f"call {i}"
    assert set(held(table)) == want_keys


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_victims_among_wide_tied_scores_match_numpy_and_the_cpu_on_the_gpu(rng, policy):
    """Scores of 41 bits, many tied (the GPU sorts its evictable rows by key, then by the score's bits):
    the first call's victims are NumPy's lowest (score, key); later calls evict what the CPU table
    evicts, and both end up holding the same keys."""
    max_keys = 20_000
    pool = random_keys(rng, max_keys + 12_000)
    gpu, cpu = pair(dimension=2, initializer="zeros", max_capacity=max_keys, evict_strategy=policy,
                    init_capacity=1024)
    for part in np.array_split(pool[:max_keys], 4):
        gather_on_each(gpu, cpu, tf.constant(part))
    give_wide_scores(gpu, "/GPU:0")
    give_wide_scores(cpu, "/CPU:0")
    batch, want = call_evicting(rng, np.array(sorted(held(cpu))), pool[max_keys:])
    for call in range(4):
        got = []
        for table, device in ((gpu, "/GPU:0"), (cpu, "/CPU:0")):
            with tf.device(device):
                got.append(sorted(sok.sparse_read_and_evict(table, tf.constant(batch))[1].numpy().tolist()))
        assert got[0] == got[1], f"call {call}"
        if call == 0:
            assert got[0] == want
        fresh = pool[max_keys + 3000 * (call + 1):]
        batch = rng.permutation(np.concatenate([fresh[:3000], rng.choice(np.array(sorted(held(cpu))), 2000)]))
    assert set(held(gpu)) == set(held(cpu))


@pytest.mark.parametrize("case", ["adam_lru_admission", "adagrad_lfu"])
def test_training_on_the_gpu_equals_the_cpu(rng, case):
    keys = random_keys(rng, 5000)
    opt_cls = {"adam_lru_admission": sok.optimizers.Adam, "adagrad_lfu": sok.optimizers.Adagrad}[case]
    kwargs = dict(dimension=8, initializer="normal", init_capacity=256, max_capacity=3000,
                  evict_strategy="lru" if "lru" in case else "lfu", min_frequency=2 if "admission" in case else 1)
    gpu, cpu = pair(**kwargs)
    opts = {id(gpu): opt_cls(learning_rate=0.05), id(cpu): opt_cls(learning_rate=0.05)}

    def make_step(table, device):
        opt = opts[id(table)]

        @tf.function
        def step(ids, target):
            with tf.device(device):
                with tf.GradientTape() as tape:
                    out = sok.lookup_sparse(table, ids, combiners="mean")
                    loss = tf.reduce_sum(out * target)
                opt.apply_gradients([(tape.gradient(loss, table), table)])
        return step

    steps = {"gpu": make_step(gpu, "/GPU:0"), "cpu": make_step(cpu, "/CPU:0")}
    for _ in range(12):
        lens = rng.integers(0, 6, 512)
        ids = tf.RaggedTensor.from_row_lengths(rng.choice(keys, int(lens.sum())), lens)
        target = tf.constant(rng.standard_normal((512, 8)).astype(np.float32))
        steps["gpu"](ids, target)
        steps["cpu"](ids, target)
    # 12 Adam steps amplify float summation-order differences (GPU atomics) in rows of tiny gradients
    assert_same_tables(gpu, cpu, rtol=1e-3, atol=1e-4)


def gather_on_each(gpu, cpu, keys):
    with tf.device("/GPU:0"):
        tf.gather(gpu, keys)
    with tf.device("/CPU:0"):
        tf.gather(cpu, keys)


def test_checkpoints_move_between_gpu_and_cpu_tables(rng, tmp_path):
    keys = random_keys(rng, 2000)
    gpu, cpu = pair(dimension=4, initializer="uniform", max_capacity=1500, evict_strategy="lfu", min_frequency=2)
    for _ in range(5):
        gather_on_each(gpu, cpu, tf.constant(rng.choice(keys, 900)))
    assert_same_tables(gpu, cpu)
    path = tf.train.Checkpoint(t=gpu).save(str(tmp_path / "g"))
    with tf.device("/CPU:0"):
        restored = sok.DynamicVariable(4, initializer="uniform", max_capacity=1500, evict_strategy="lfu",
                                       min_frequency=2, name="back_on_cpu")
    tf.train.Checkpoint(t=restored).restore(path).assert_consumed()
    assert_same_tables(restored, gpu)
    # both go on alike: scores, admission counts and rows came along
    gather_on_each(gpu, restored, tf.constant(rng.choice(keys, 900)))
    assert_same_tables(restored, gpu)


def test_low_frequency_filter_draws_the_same_keys_on_the_gpu(rng):
    keys = random_keys(rng, 3000)
    gpu, cpu = pair(dimension=4, initializer="ones", min_frequency=2)
    for _ in range(4):
        b = tf.constant(rng.choice(keys, 1500)[:, None])
        with tf.device("/GPU:0"):
            g = sok.lookup_sparse(gpu, b, combiners="sum", use_low_frequency_filter=True, filter_ratio=0.3)
        with tf.device("/CPU:0"):
            c = sok.lookup_sparse(cpu, b, combiners="sum", use_low_frequency_filter=True, filter_ratio=0.3)
        np.testing.assert_array_equal(g.numpy(), c.numpy())
    assert_same_tables(gpu, cpu)
    assert 0 < gpu.size.numpy()[0] < len(keys)


def test_one_find_for_many_tables_trains_like_the_host(rng):
    """lookup_sparse over several dynamic tables finds all of them with one op (one wait on the GPU):
    bounded LRU / LFU tables, one with admission, trained with Adam, equal the same on the CPU."""
    pool = random_keys(rng, 4000)
    kinds = [dict(max_capacity=900, evict_strategy="lru"), dict(max_capacity=1200, evict_strategy="lfu"),
             dict(min_frequency=2), {}]     # a step brings at most 600 distinct keys per table
    states = []
    for device in ("/GPU:0", "/CPU:0"):
        with tf.device(device):
            tables = [sok.DynamicVariable(8, initializer="normal", init_capacity=64, seed=i, name=f"t{i}", **k)
                      for i, k in enumerate(kinds)]
            opt = sok.optimizers.Adam(learning_rate=0.05)
        states.append((device, tables, opt))
    steps = [[to_lens(rng, pool) for _ in kinds] for _ in range(12)]
    for device, tables, opt in states:
        for feats in steps:
            with tf.device(device):
                with tf.GradientTape() as tape:
                    ids = [tf.RaggedTensor.from_row_lengths(tf.constant(k), tf.constant(lens)) for lens, k in feats]
                    outs = sok.lookup_sparse(tables, ids, combiners=["sum", "mean", "sqrtn", "sum"])
                    loss = tf.add_n([tf.reduce_sum(tf.sin(o)) for o in outs])
                opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
    for g, c in zip(states[0][1], states[1][1]):
        assert_same_tables(g, c, rtol=1e-5, atol=1e-6)


def to_lens(rng, pool):
    lens = rng.integers(0, 4, 200)
    return lens.astype(np.int64), rng.choice(pool[:2500], int(lens.sum()))


def test_row_splits_and_ranges_check_on_the_gpu_matches_numpy(rng):
    from tests.python.test_dynamic import check_splits_and_ranges
    for _ in range(3):
        check_splits_and_ranges(rng, "/GPU:0")
