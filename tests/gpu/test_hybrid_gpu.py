"""Hybrid tables on the GPU (the cache in HBM, every row in pinned host memory that the CUDA kernels
read in place, evicted rows copied back) against the same table on the CPU and against the table
without a host tier on the GPU: lookups, every optimizer's steps, the cache's counters, checkpoints."""
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tf_sok.data import zipf_ranks
from tests.helpers import to_ragged
from tests.python.test_dynamic import random_keys
from tests.python.test_hybrid import (DIM, OPTIMIZERS, _assert_same_tables, _cache_model, _gib, _slot_widths,
                                      check_tier_growth)
from tests.python.test_read_lookup import check_read

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                                  reason="no GPU visible to TensorFlow"),
              pytest.mark.usefixtures("tier_keys")]   # every test both ways (tests/gpu/conftest.py)


def _train(table, opt, batches, device, **lookup_kw):
    @tf.function
    def step(ids, target):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, ids, combiners="sum", **lookup_kw)
            loss = tf.reduce_sum(out * target)
        opt.apply_gradients([(tape.gradient(loss, table), table)])
        return out

    outs = []
    with tf.device(device):
        for lens, keys, target in batches:
            outs.append(step(to_ragged(lens, keys), tf.constant(target)).numpy())
    return outs


def _assert_close_at_row_scale(got, want, rtol=1e-4, atol=2e-5, row_rtol=1e-5):
    """|got - want| within atol + rtol |want| + row_rtol (the largest |want| of its row), elementwise."""
    tol = atol + rtol * np.abs(want) + row_rtol * np.abs(want).max(axis=1, keepdims=True)
    bad = np.argwhere(np.abs(got - want) > tol)
    assert len(bad) == 0, (f"{len(bad)} of {want.size} elements apart beyond tolerance, first at {bad[0].tolist()}: "
                           f"{got[tuple(bad[0])]} against {want[tuple(bad[0])]}")


@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_gpu_hybrid_trains_as_the_cpu_hybrid_and_the_all_hbm_table(rng, case, monkeypatch):
    """K steps of each optimizer on a GPU hybrid table (a cache of ~3 % of the keys), the same table on
    the CPU and the table without a tier on the GPU: the same lookups, tables and cache counters. The
    GPU's finds gather the first half of the records they take in on the host's threads (new keys
    among them) while the kernel reads the rest in place (TF_SOK_READ_GATHER_MIN_ROWS=1,
    TF_SOK_GATHER_SHARE=0.5)."""
    monkeypatch.setenv("TF_SOK_READ_GATHER_MIN_ROWS", "1")
    monkeypatch.setenv("TF_SOK_GATHER_SHARE", "0.5")
    cls, hp = OPTIMIZERS[case]
    pool = random_keys(rng, 20_000)
    batches = []
    for _ in range(8):
        lens = rng.integers(0, 6, 2048)
        keys = pool[zipf_ranks(rng, len(pool), int(lens.sum()), 1.05)]
        batches.append((lens, keys, rng.standard_normal((2048, DIM)).astype(np.float32)))
    budget = _gib(600, [DIM] + _slot_widths(cls(learning_rate=0.05, **hp)))   # ~3% of the keys
    tables, opts, outs = [], [], []
    for device, hybrid in (("/GPU:0", True), ("/CPU:0", True), ("/GPU:0", False)):
        with tf.device(device):
            kw = dict(var_type="hybrid", max_hbm_for_vectors=budget) if hybrid else {}
            t = sok.DynamicVariable(DIM, initializer="normal", seed=4, name=f"{case}_{device[1:4]}_{hybrid}", **kw)
        assert device[1:4] in t.device
        opt = cls(learning_rate=0.05, **hp)
        outs.append(_train(t, opt, batches, device))
        tables.append(t)
        opts.append(opt)
    # the GPU's and the CPU's kernels round differently, and the GPU sums a key's duplicate gradients
    # with atomics (in no fixed order): the runs drift apart at float32 rounding level, which for a
    # sum of rows near 10 that cancels to 5e-4 is that of its terms (1e-5 of the sample's largest
    # output on top of the element's own tolerance)
    for a, b, c in zip(*outs):
        _assert_close_at_row_scale(a, b)
        _assert_close_at_row_scale(a, c)
    # GPU against CPU: the kernels' rounding apart (FTRL / RMSprop state near 10 differed by 1.5e-5
    # relative after the steps; an FTRL linear term of 0.52 in a row reaching 379 by 1.7e-4, the
    # rounding of the large terms it sums), the same tables
    _assert_same_tables(tables[0], tables[1], opts[0], opts[1], atol=2e-5, rtol=1e-4, row_rtol=1e-5)
    _assert_same_tables(tables[0], tables[2], opts[0], opts[2], atol=2e-5, row_rtol=1e-5)
    gpu, cpu = sok.cache_stats(tables[0]), sok.cache_stats(tables[1])
    gathered = gpu.pop("bytes_in_gathered")
    assert cpu.pop("bytes_in_gathered") == 0 and 0 < gathered < gpu["bytes_to_device"]
    assert gpu == cpu and gpu["evicted"] > 0 and gpu["bytes_to_device"] > 0


@pytest.mark.parametrize("policy,budget_rows", [(p, b) for p in ("lru", "lfu") for b in (0, 1, 300)])
def test_gpu_cache_counters_follow_the_cache_model(rng, policy, budget_rows):
    pool = random_keys(rng, 2000)
    batches = [pool[zipf_ranks(rng, 2000, rng.integers(1, 500), 1.1)] for _ in range(20)]
    with tf.device("/GPU:0"):
        table = sok.DynamicVariable(DIM, initializer="uniform", name=f"g{policy}{budget_rows}", var_type="hybrid",
                                    max_hbm_for_vectors=_gib(budget_rows, [DIM]), evict_strategy=policy)
        plain = sok.DynamicVariable(DIM, initializer="uniform", name=f"gp{policy}{budget_rows}")
    before = sok.cache_stats(table)
    for b, (missing, loaded, fresh, evicted, _, _) in zip(batches, _cache_model(budget_rows, batches, policy)):
        with tf.device("/GPU:0"):
            np.testing.assert_array_equal(tf.gather(table, b).numpy(), tf.gather(plain, b).numpy())
        now = sok.cache_stats(table)
        assert (now["misses"] - before["misses"], now["loaded"] - before["loaded"],
                now["new_keys"] - before["new_keys"], now["evicted"] - before["evicted"]) == \
            (missing, loaded, fresh, evicted)
        before = now


def test_gpu_hybrid_checkpoint_restores_on_the_cpu_and_back(rng, tmp_path):
    cls, hp = OPTIMIZERS["adam"]
    pool = random_keys(rng, 5000)
    budget = _gib(100, [DIM, DIM, DIM])
    batches = [(l, pool[rng.choice(5000, int(l.sum()))], rng.standard_normal((512, DIM)).astype(np.float32))
               for l in (rng.integers(0, 4, 512) for _ in range(4))]
    with tf.device("/GPU:0"):
        gpu = sok.DynamicVariable(DIM, initializer="normal", seed=1, name="ck", var_type="hybrid",
                                  max_hbm_for_vectors=budget)
    opt_g = cls(learning_rate=0.05, **hp)
    _train(gpu, opt_g, batches[:2], "/GPU:0")
    path = tf.train.Checkpoint(t=gpu, o=opt_g).write(str(tmp_path / "ck"))
    with tf.device("/CPU:0"):
        cpu = sok.DynamicVariable(DIM, initializer="normal", seed=1, name="ck", var_type="hybrid",
                                  max_hbm_for_vectors=budget)
    opt_c = cls(learning_rate=0.05, **hp)
    _train(cpu, opt_c, batches[:1], "/CPU:0")      # builds the optimizer's state, then overwritten
    tf.train.Checkpoint(t=cpu, o=opt_c).read(path).assert_consumed()
    _train(gpu, opt_g, batches[2:], "/GPU:0")
    _train(cpu, opt_c, batches[2:], "/CPU:0")
    _assert_same_tables(gpu, cpu, opt_g, opt_c, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("capacity", [None, 300])
def test_gpu_lfu_counts_come_back_from_a_checkpoint_on_either_device(rng, tmp_path, capacity):
    """An LFU hybrid table saved on the GPU midway, restored into new tables on the GPU and on the
    CPU: both go on as the cache model of all the calls says (the counts of keys cached and in host
    memory came back)."""
    pool = random_keys(rng, 1000)
    batches = [pool[zipf_ranks(rng, 1000, rng.integers(1, 200), 1.1)] for _ in range(24)]
    kw = dict(initializer="uniform", var_type="hybrid", max_hbm_for_vectors=_gib(60, [DIM]), evict_strategy="lfu",
              max_capacity=capacity)
    model = _cache_model(60, batches, "lfu", capacity)
    with tf.device("/GPU:0"):
        saved = sok.DynamicVariable(DIM, name=f"glfu{capacity}", **kw)
        for b in batches[:12]:
            tf.gather(saved, tf.constant(b))
    path = tf.train.Checkpoint(t=saved).write(str(tmp_path / "ck"))
    names = ("misses", "loaded", "new_keys", "evicted", "dropped")
    for device in ("/GPU:0", "/CPU:0"):
        with tf.device(device):
            table = sok.DynamicVariable(DIM, name=f"glfu{capacity}{device[1]}", **kw)
        tf.train.Checkpoint(t=table).read(path).assert_consumed()
        before = sok.cache_stats(table)
        for step, (b, (*want, keys)) in enumerate(zip(batches[12:], model[12:]), 12):
            with tf.device(device):
                tf.gather(table, tf.constant(b))
            now = sok.cache_stats(table)
            assert [now[k] - before[k] for k in names] == want, (device, step)
            assert set(sok.export(table)[0].numpy().tolist()) == keys, (device, step)
            before = now
        assert sok.cache_stats(table)["evicted"] > 0


@pytest.mark.parametrize("gather_min,share", [(-1, 1.0), (1, 1.0), (1, 0.5)])
@pytest.mark.parametrize("budget_rows", [None, 0, 16])
def test_gpu_read_gives_values_and_initial_values_and_changes_nothing(rng, budget_rows, gather_min, share,
                                                                     monkeypatch):
    """Lookups with training=False on the GPU (ReadRowsKernel: rows of width 4 as float4 words, of
    width 6 as floats; a hybrid table's keys not cached read from pinned host memory in place, or
    with TF_SOK_READ_GATHER_MIN_ROWS=1 gathered by the host's threads and copied over: all of them,
    or the first half while the kernel reads the rest in place, TF_SOK_GATHER_SHARE=0.5)."""
    monkeypatch.setenv("TF_SOK_READ_GATHER_MIN_ROWS", str(gather_min))
    monkeypatch.setenv("TF_SOK_GATHER_SHARE", str(share))
    check_read(rng, budget_rows, "/GPU:0", keys=400, dims=(DIM, 6), batch=300, gather_min=gather_min,
               gather_share=share)


def test_gpu_read_of_many_keys_gathers_their_host_rows(rng, monkeypatch):
    """A read of ~160,000 ids of which ~40,000 of keys in host memory only, gathering from 20,000
    rows: table a's host rows gathered by the host's threads in chunks of 4,096 ids, 16 chunks a
    group (three groups, each sent over by the thread that completes it); table b's read (~80,000
    ids, ~6,000 of them in host memory) waits for its rows and then reads them in place. Values
    against NumPy. Then two such tables, gathering half (TF_SOK_GATHER_SHARE=0.5): table a's first
    ~80,000 ids gathered while the kernel reads the rest's rows in place, each about half its rows."""
    monkeypatch.setenv("TF_SOK_READ_GATHER_MIN_ROWS", "20000")
    monkeypatch.setenv("TF_SOK_GATHER_SHARE", "1")
    a, b = check_read(rng, 3, "/GPU:0", keys=40, dims=(DIM, 6), batch=40000, gather_min=20000)
    assert sok.cache_stats(a)["bytes_read_gathered"] > 0 and sok.cache_stats(a)["bytes_read_in_place"] == 0
    assert sok.cache_stats(b)["bytes_read_in_place"] > 0 and sok.cache_stats(b)["bytes_read_gathered"] == 0
    monkeypatch.setenv("TF_SOK_READ_GATHER_MIN_ROWS", "1000")
    monkeypatch.setenv("TF_SOK_GATHER_SHARE", "0.5")
    a, _ = check_read(rng, 4, "/GPU:0", keys=40, dims=(DIM, 6), batch=40000, gather_min=1000, gather_share=0.5)
    stats = sok.cache_stats(a)
    assert 0.3 < stats["bytes_read_gathered"] / (stats["bytes_read_gathered"] + stats["bytes_read_in_place"]) < 0.7


def test_host_link_bandwidth_is_measured_each_way():
    got = sok.host_link_bandwidth(64, repeats=2)
    assert set(got) == {"copy_to_device", "copy_to_host", "read_in_place", "write_in_place"}
    for name, gbps in got.items():   # PCIe 3 x16 (~12 GB/s) up to NVLink-C2C (900 GB/s)
        assert 1.0 < gbps < 1000.0, (name, gbps)


@pytest.mark.parametrize("case", ["adagrad", "adam"])
def test_gpu_static_table_with_a_host_tier_trains_as_the_plain_table(rng, case):
    """sok.Variable(..., max_hbm_for_vectors=...) on the GPU against the same table without a tier on
    the GPU and on the CPU; ids outside [0, rows) fail on the GPU as on the CPU."""
    cls, hp = OPTIMIZERS[case]
    rows = 50_000
    init = rng.standard_normal((rows, DIM)).astype(np.float32)
    order = rng.permutation(rows)
    batches = []
    for _ in range(6):
        lens = rng.integers(0, 6, 2048)
        ids = order[zipf_ranks(rng, rows, int(lens.sum()), 1.05)].astype(np.int64)
        batches.append((lens, ids, rng.standard_normal((2048, DIM)).astype(np.float32)))
    budget = _gib(1500, [DIM] + _slot_widths(cls(learning_rate=0.05, **hp)))   # 3% of the rows
    tables, opts, outs = [], [], []
    for device, tier in (("/GPU:0", True), ("/GPU:0", False), ("/CPU:0", False)):
        with tf.device(device):
            t = sok.Variable(init, name=f"static_{case}_{device[1:4]}_{tier}",
                             **(dict(max_hbm_for_vectors=budget) if tier else {}))
        opt = cls(learning_rate=0.05, **hp)
        outs.append(_train(t, opt, batches, device))
        tables.append(t)
        opts.append(opt)
    for a, b, c in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=2e-5)
    keys, parts = tables[0].export_state([tables[0]] + list(opts[0].slots(tables[0])))
    keys = keys.numpy()
    assert len(keys) == rows
    for part, plain in zip(parts, [tables[1]] + list(opts[1].slots(tables[1]))):
        np.testing.assert_allclose(part.numpy(), tf.gather(plain, keys).numpy().reshape(part.shape),
                                   rtol=1e-4, atol=2e-5)
    assert sok.cache_stats(tables[0])["evicted"] > 0
    with tf.device("/GPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match=rf"id {rows} is outside \[0, {rows}\) of table"):
        sok.lookup_sparse(tables[0], tf.ragged.constant([[1, rows]], tf.int64), feature_names=["f"])


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_keys_touched_since_a_time_on_the_gpu_are_the_cpus(rng, policy):
    """incremental_model_dump of a GPU hybrid table (the store's marks written by the write-back
    kernel for evicted keys) gives the keys and values of the same table on the CPU, at every
    time between steps, with a cache of 1 % of the keys."""
    import time

    pool = random_keys(rng, 5000)
    batches, stamps = [], []
    for _ in range(6):
        lens = rng.integers(0, 4, 512)
        keys = pool[zipf_ranks(rng, len(pool), int(lens.sum()), 1.05)]
        batches.append((lens, keys, rng.standard_normal((512, DIM)).astype(np.float32)))
    tables = []
    for device in ("/GPU:0", "/CPU:0"):
        with tf.device(device):
            tables.append(sok.DynamicVariable(DIM, initializer="normal", seed=2, name=f"touch_{policy}{device[1:4]}",
                                              var_type="hybrid", max_hbm_for_vectors=_gib(50, [DIM]),
                                              evict_strategy=policy))
    opts = [sok.optimizers.SGD(learning_rate=0.05) for _ in tables]
    for b in batches:
        stamps.append(time.time())
        time.sleep(0.003)
        for t, o, device in zip(tables, opts, ("/GPU:0", "/CPU:0")):
            _train(t, o, [b], device)
        time.sleep(0.003)
    assert sok.cache_stats(tables[0])["evicted"] > 0
    for k, t in enumerate(stamps):
        got_keys, got_values = sok.incremental_model_dump(tables[0], t)
        want_keys, want_values = sok.incremental_model_dump(tables[1], t)
        want_set = set().union(*[set(b[1].tolist()) for b in batches[k:]])
        assert set(got_keys.tolist()) == set(want_keys.tolist()) == want_set
        want = dict(zip(want_keys.tolist(), want_values))
        for key, value in zip(got_keys.tolist(), got_values):
            np.testing.assert_allclose(value, want[key], rtol=1e-4, atol=2e-5, err_msg=f"key {key}")


@pytest.mark.parametrize("budget_rows", [40, 10**6])
def test_a_bounded_gpu_hybrid_table_evicts_as_the_cpu_table_without_a_tier(rng, budget_rows):
    """max_capacity on a GPU hybrid table (the keys the cache writes back come to the host with their
    last touching calls; the host tier drops the least recently used): per call the evicted keys and
    values of the bounded LRU table without a tier on the CPU, and the same keys and values after."""
    kw = dict(initializer="normal", seed=6, max_capacity=600, evict_strategy="lru")
    with tf.device("/GPU:0"):
        hybrid = sok.DynamicVariable(DIM, name=f"gb{budget_rows}", var_type="hybrid",
                                     max_hbm_for_vectors=_gib(budget_rows, [DIM]), **kw)
    with tf.device("/CPU:0"):
        plain = sok.DynamicVariable(DIM, name=f"cb{budget_rows}", **kw)
    pool = random_keys(rng, 6000)
    evicted = 0
    for step in range(8):
        ids = tf.constant(pool[zipf_ranks(rng, len(pool), 400, 1.05)])
        with tf.device("/GPU:0"):
            gh, kh, vh = sok.sparse_read_and_evict(hybrid, ids)
        with tf.device("/CPU:0"):
            gp, kp, vp = sok.sparse_read_and_evict(plain, ids)
        np.testing.assert_allclose(gh.numpy(), gp.numpy(), rtol=1e-6, atol=1e-7)
        assert sorted(kh.numpy().tolist()) == sorted(kp.numpy().tolist()), step
        want = dict(zip(kp.numpy().tolist(), vp.numpy()))
        for key, value in zip(kh.numpy().tolist(), vh.numpy()):
            np.testing.assert_allclose(value, want[key], rtol=1e-6, atol=1e-7)
        evicted += len(kp.numpy())
        assert hybrid.size.numpy()[0] == plain.size.numpy()[0] <= 600
    assert evicted > 0
    size = hybrid.size.numpy()[0]
    with tf.device("/GPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match=f"'gb{budget_rows}' cannot hold this batch's keys"):
        tf.gather(hybrid, tf.constant(pool[:700]))     # 700 distinct keys, max_capacity 600
    assert hybrid.size.numpy()[0] == size
    _assert_same_tables(hybrid, plain)


def _gpu_hybrid_against_cpu_plain(rng, tag, kw, **lookup_kw):
    """A GPU hybrid table (a cache of 60 rows) and the same table without a tier on the CPU (`kw`:
    their arguments), trained with SGD over 10 Zipf batches (`lookup_kw`: lookup_sparse's): the same
    lookups, sizes, keys and values. Returns the hybrid table's cache_stats."""
    with tf.device("/GPU:0"):
        hybrid = sok.DynamicVariable(DIM, name=f"g{tag}", var_type="hybrid", max_hbm_for_vectors=_gib(60, [DIM]), **kw)
    with tf.device("/CPU:0"):
        plain = sok.DynamicVariable(DIM, name=f"c{tag}", **kw)
    pool = random_keys(rng, 4000)
    batches = []
    for _ in range(10):
        lens = rng.integers(0, 3, 256)
        keys = pool[zipf_ranks(rng, len(pool), int(lens.sum()), 1.05)]
        batches.append((lens, keys, rng.standard_normal((256, DIM)).astype(np.float32)))
    outs = [_train(t, sok.optimizers.SGD(learning_rate=0.05), batches, device, **lookup_kw)
            for t, device in ((hybrid, "/GPU:0"), (plain, "/CPU:0"))]
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert hybrid.size.numpy()[0] == plain.size.numpy()[0]
    _assert_same_tables(hybrid, plain, atol=1e-6)
    return sok.cache_stats(hybrid)


@pytest.mark.parametrize("capacity", [None, 700])
def test_admission_on_a_gpu_hybrid_table_equals_the_cpu_table_without_a_tier(rng, capacity):
    """min_frequency 2 on a GPU hybrid table (the keys the cache writes back counted as held in the
    device's admission table, those the bound drops forgotten): the lookups, keys and values of the
    same table without a tier on the CPU, trained with SGD."""
    kw = dict(initializer="normal", seed=5, min_frequency=2, max_capacity=capacity,
              evict_strategy="lru" if capacity else None)
    assert _gpu_hybrid_against_cpu_plain(rng, f"a{capacity}", kw)["evicted"] > 0


@pytest.mark.parametrize("min_frequency,capacity", [(1, None), (2, None), (1, 700)])
def test_low_frequency_filter_on_a_gpu_hybrid_table_equals_the_cpu_table_without_a_tier(rng, min_frequency,
                                                                                        capacity):
    """use_low_frequency_filter (ratio 0.5) on a GPU hybrid table: keys new to the table drawn as on
    the CPU, keys the cache wrote back taken in again whatever the draw (the tier asked which of a
    call's missing keys it holds): the lookups, keys and values of the same table without a tier on
    the CPU, trained with SGD."""
    kw = dict(initializer="normal", seed=6, min_frequency=min_frequency, max_capacity=capacity,
              evict_strategy="lru" if capacity else None)
    stats = _gpu_hybrid_against_cpu_plain(rng, f"f{min_frequency}_{capacity}", kw, use_low_frequency_filter=True,
                                          filter_ratio=0.5)
    assert stats["evicted"] > 0 and stats["loaded"] > stats["new_keys"]   # keys came back from the tier


@pytest.mark.parametrize("write_back,read_in", [("copies", "gathered"), ("copies", "in_place"), ("copies", "half"),
                                                ("in_place", "gathered"), ("in_place", "in_place"),
                                                ("in_place", "half")])
def test_rows_written_back_are_the_next_steps_rows(rng, write_back, read_in, monkeypatch):
    """Two key sets take turns, the cache holding one (20,000 rows of dim 64 and their Adagrad state):
    every step reads in exactly the rows the step before wrote back, and a checkpoint export between
    steps reads the tier; all as the table without a tier. The evicted rows go back by copies that the
    host writes into the tier after the step (the default), or written in place by the kernel
    (TF_SOK_WRITE_BACK_COPIES=0); the rows taken in are gathered by the host's threads and copied
    over (a step taking in at least TF_SOK_READ_GATHER_MIN_ROWS), or read in place by the kernel, or
    the first half gathered while the kernel reads the rest in place (TF_SOK_GATHER_SHARE=0.5)."""
    monkeypatch.setenv("TF_SOK_WRITE_BACK_COPIES", "1" if write_back == "copies" else "0")
    monkeypatch.setenv("TF_SOK_READ_GATHER_MIN_ROWS", "-1" if read_in == "in_place" else "1000")
    share = {"gathered": 1.0, "half": 0.5, "in_place": 0.0}[read_in]
    monkeypatch.setenv("TF_SOK_GATHER_SHARE", str(share))
    dim, n = 64, 20_000
    cls, hp = OPTIMIZERS["adagrad"]
    sets = np.split(random_keys(rng, 2 * n), 2)
    probe = cls(learning_rate=0.05, **hp)
    widths = [dim] + [dim if not s.per_row else 1 for s in probe.slot_specs()]
    batches = [(np.ones(n, np.int64), rng.permutation(sets[s % 2]), rng.standard_normal((n, dim)).astype(np.float32))
               for s in range(6)]
    with tf.device("/GPU:0"):
        hybrid = sok.DynamicVariable(dim, initializer="normal", seed=9, name="turns_h", var_type="hybrid",
                                     max_hbm_for_vectors=_gib(n, widths))
        plain = sok.DynamicVariable(dim, initializer="normal", seed=9, name="turns_p")
    opt_h, opt_p = cls(learning_rate=0.05, **hp), cls(learning_rate=0.05, **hp)
    for part in (batches[:3], batches[3:]):
        for a, b in zip(_train(hybrid, opt_h, part, "/GPU:0"), _train(plain, opt_p, part, "/GPU:0")):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        _assert_same_tables(hybrid, plain, opt_h, opt_p, atol=1e-6)
    stats = sok.cache_stats(hybrid)
    assert stats["evicted"] == 5 * n and stats["loaded"] == 6 * n
    # steps 3-6 take in the n records the step before wrote back, the share gathered, the rest read in
    # place (steps 1 and 2 take in keys new to the table: nothing read from the tier)
    assert stats["bytes_to_device"] == 4 * n * 4 * sum(widths)
    assert stats["bytes_in_gathered"] == 4 * round(share * n) * 4 * sum(widths)


def test_a_host_tier_that_grows_many_times_keeps_every_row_on_the_gpu(rng):
    """On a GPU the pinned host tier grows in place, piece after piece (its address kept, nothing
    copied): see check_tier_growth."""
    check_tier_growth(rng, "/GPU:0")
