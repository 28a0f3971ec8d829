"""The CUDA kernels compute the same function as the CPU kernels (GPU:0 vs CPU,
same random inputs). Skipped, with a reason, where no GPU is visible."""
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tf_sok.data import zipf_ranks
from tests.helpers import (assert_failing_step_writes_nothing, clicks_training_step, dense_grad, distinct_rows,
                           half_precision_case, lookup_grad_op, lookup_in, np_lookup, np_sum_lookup_grad, random_ragged, to_ragged)
from tests.python.optimizers.test_optimizers import CASES, multi_table_steps, run_multi_table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                                   reason="no GPU visible to TensorFlow")]


def _abs_mass(tables_np, feature_table, ragged, weights, combiners, upstream):
    """Per table, sum over contributions of |coefficient x upstream|: float32
    sums in different orders (CPU vs GPU) may differ by a few ulps of this."""
    mass = [np.zeros(t.shape, np.float64) for t in tables_np]
    for f, t in enumerate(feature_table):
        lens = ragged[f].row_lengths().numpy()
        ids = ragged[f].values.numpy()
        w = np.ones(len(ids)) if weights is None or weights[f] is None else \
            weights[f].values.numpy().astype(np.float64)
        row = np.repeat(np.arange(len(lens)), lens)
        wsum = np.bincount(row, w, len(lens))
        wsq = np.bincount(row, w * w, len(lens))
        denom = {"sum": np.ones(len(lens)), "mean": wsum, "sqrtn": np.sqrt(wsq)}[combiners[f]]
        scale = np.divide(1.0, denom, out=np.zeros(len(lens)), where=denom != 0)
        np.add.at(mass[t], ids, np.abs(w * scale[row])[:, None] * np.abs(upstream[f][row]))
    return mass


def _on(device, fn):
    with tf.device(device):
        return fn()


def _lookup_and_grad(device, tables_np, feature_table, ragged, weights, combiners, upstream):
    with tf.device(device):
        tables = [sok.Variable(t, name=f"t{i}") for i, t in enumerate(tables_np)]
        with tf.GradientTape() as tape:
            outs = sok.lookup_sparse([tables[t] for t in feature_table], ragged, weights, combiners=combiners)
            loss = sum(tf.reduce_sum(o * u) for o, u in zip(outs, upstream))
        grads = tape.gradient(loss, tables)
    return [o.numpy() for o in outs], grads


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_len", [6, 16])  # 16: multi-hot rows (the forward's unrolled kernel)
def test_lookup_and_gradient_gpu_equals_cpu(rng, id_dtype, weighted, max_len):
    tables_np = [rng.standard_normal(s).astype(np.float32) for s in ((1000, 16), (300, 7), (5000, 128))]
    feature_table = [0, 1, 2, 0, 2]
    combiners = ["sum", "mean", "sqrtn", "mean", "sum"]
    batch = 4099
    ragged, weights, upstream = [], [], []
    for t in feature_table:
        lens, ids = random_ragged(rng, batch, tables_np[t].shape[0], max_len, id_dtype, zipf=1.2)
        lens[:2] = 0
        ids = ids[:int(lens.sum())]
        ragged.append(to_ragged(lens, ids))
        weights.append(to_ragged(lens, rng.uniform(0.1, 2, len(ids)).astype(np.float32)) if weighted else None)
        upstream.append(rng.standard_normal((batch, tables_np[t].shape[1])).astype(np.float32))
    w = weights if weighted else None
    cpu_out, cpu_g = _lookup_and_grad("/CPU:0", tables_np, feature_table, ragged, w, combiners, upstream)
    gpu_out, gpu_g = _lookup_and_grad("/GPU:0", tables_np, feature_table, ragged, w, combiners, upstream)
    for c, g in zip(cpu_out, gpu_out):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-5)
    mass = _abs_mass(tables_np, feature_table, ragged, w, combiners, upstream)
    for t, (c, g) in enumerate(zip(cpu_g, gpu_g)):
        assert "GPU" in g.values.device
        np.testing.assert_array_equal(g.indices.numpy(), c.indices.numpy())  # distinct ascending, then padding
        distinct_rows(g.indices.numpy(), g.values.numpy())
        rows = tables_np[t].shape[0]
        diff = np.abs(dense_grad(g, rows) - dense_grad(c, rows))
        assert (diff <= 1e-5 * mass[t] + 1e-6).all(), f"table {t}: max diff {diff.max()}"


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
@pytest.mark.parametrize("hotness", ["one", "multi"])  # the one-id-rows kernel; the unrolled multi-hot one
def test_half_precision_lookup_and_gradient_gpu_equals_cpu(rng, dtype, hotness):
    """The GPU writes float16 / bfloat16 outputs and reads their gradients itself: the CPU's
    values (float32 sums in another order, so outputs within one rounding step), and gradients
    within a few float32 ulps of the summed magnitudes."""
    case = half_precision_case(rng, hotness)
    cpu_out, cpu_g = _on("/CPU:0", lambda: lookup_in(dtype, case))
    gpu_out, gpu_g = _on("/GPU:0", lambda: lookup_in(dtype, case))
    step = 2.0 ** -7 if dtype == tf.bfloat16 else 2.0 ** -10
    for c, g in zip(cpu_out, gpu_out):
        c, g = c.astype(np.float32), g.astype(np.float32)
        assert (np.abs(g - c) <= step * np.abs(c) + 1e-4).all(), np.abs(g - c).max()
    tables_np, feature_table, combiners, ragged, weights, upstream = case
    mass = _abs_mass(tables_np, feature_table, ragged, weights, combiners, upstream)
    for t, (c, g) in enumerate(zip(cpu_g, gpu_g)):
        assert (np.abs(g - c) <= 1e-5 * mass[t] + 1e-6).all(), f"table {t}: max diff {np.abs(g - c).max()}"


@pytest.mark.parametrize("dims", [(16, 128, 32), (7, 30)])  # 16-byte loads; scalar loads
@pytest.mark.parametrize("weighted", [False, True])
def test_rows_of_about_one_id_gpu_equals_cpu(rng, dims, weighted):
    """Rows of 0-2 ids, mostly one: the forward kernel that loads several rows' ids and
    table rows together, with its fallback for empty and two-id rows."""
    tables_np = [rng.standard_normal((int(rng.integers(50, 5000)), d)).astype(np.float32) for d in dims]
    feature_table = [t for t in range(len(dims)) for _ in range(2)]
    combiners = [["sum", "mean", "sqrtn"][f % 3] for f in range(len(feature_table))]
    batch = int(rng.integers(1000, 5000))
    ragged, weights, upstream = [], [], []
    for t in feature_table:
        lens = rng.choice([0, 1, 1, 1, 1, 1, 2], batch)
        ids = zipf_ranks(rng, tables_np[t].shape[0], int(lens.sum()), 1.1)
        ragged.append(to_ragged(lens, ids))
        weights.append(to_ragged(lens, rng.uniform(0.1, 2, len(ids)).astype(np.float32)) if weighted else None)
        upstream.append(rng.standard_normal((batch, dims[t])).astype(np.float32))
    w = weights if weighted else None
    cpu_out, cpu_g = _lookup_and_grad("/CPU:0", tables_np, feature_table, ragged, w, combiners, upstream)
    gpu_out, gpu_g = _lookup_and_grad("/GPU:0", tables_np, feature_table, ragged, w, combiners, upstream)
    for f, (c, g) in enumerate(zip(cpu_out, gpu_out)):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, np_lookup(tables_np[feature_table[f]], ragged[f].row_lengths().numpy(),
                                                ragged[f].values.numpy(),
                                                None if w is None else w[f].values.numpy(), combiners[f]),
                                   rtol=1e-5, atol=1e-5)
    mass = _abs_mass(tables_np, feature_table, ragged, w, combiners, upstream)  # float32 sums in other orders
    for t in range(len(dims)):
        rows = tables_np[t].shape[0]
        diff = np.abs(dense_grad(gpu_g[t], rows) - dense_grad(cpu_g[t], rows))
        assert (diff <= 1e-5 * mass[t] + 1e-6).all(), f"table {t}: max diff {diff.max()}"


def test_large_batch_and_table(rng):
    rows, dim, batch = 10_000_000, 16, 65_536
    table_np = rng.standard_normal((rows, dim), dtype=np.float32)
    lens, ids = random_ragged(rng, batch, rows, 8, np.int64, zipf=1.05)
    rt = to_ragged(lens, ids)
    cpu = _on("/CPU:0", lambda: sok.lookup_sparse(sok.Variable(table_np, name="big"), rt, combiners="mean"))
    gpu = _on("/GPU:0", lambda: sok.lookup_sparse(sok.Variable(table_np, name="big"), rt, combiners="mean"))
    np.testing.assert_allclose(gpu.numpy(), cpu.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_gpu_equals_cpu(rng, case):
    cls, hp, _ = CASES[case]
    rows, dim = 20_000, 36
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    steps = []
    for _ in range(4):
        n = 30_000
        idx = zipf_ranks(rng, rows // 2 + 1, n, 1.1)  # heavy duplicates; upper rows untouched
        steps.append((idx, rng.standard_normal((n, dim)).astype(np.float32)))
    results = {}
    for device in ("/CPU:0", "/GPU:0"):
        with tf.device(device):
            var = sok.Variable(table, name="t")
            opt = cls(learning_rate=0.05, **hp)
            for idx, g in steps:
                opt.apply_gradients([(tf.IndexedSlices(tf.constant(g), tf.constant(idx), [rows, dim]), var)])
            results[device] = (var.numpy(), [s.numpy() for s in opt.slots(var)])
    (cw, cs), (gw, gs) = results["/CPU:0"], results["/GPU:0"]
    np.testing.assert_allclose(gw, cw, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(gw[rows // 2 + 1:], table[rows // 2 + 1:])
    for a, b in zip(gs, cs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_update_reads_a_learning_rate_computed_on_the_gpu_when_it_runs(rng):
    """The rate is an input in device memory (no copy to the host, which would wait for the device):
    a rate computed on the GPU from a variable changed between steps of one tf.function drives each
    update with its own value, as plain SGD in NumPy computes it."""
    rows, dim = 5_000, 24
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    rates = rng.uniform(0.01, 0.5, 3).astype(np.float32)
    steps = [(rng.choice(rows, 700, replace=False), rng.standard_normal((700, dim)).astype(np.float32))
             for _ in rates]
    with tf.device("/GPU:0"):
        var = sok.Variable(table, name="t")
        base = tf.Variable(1.0)
        scale = tf.Variable(0.0)
        opt = sok.optimizers.SGD(learning_rate=1.0)

        @tf.function
        def train(idx, g, rate):
            scale.assign(rate)                      # the rate of this step, written on the device
            opt.apply_gradients([(tf.IndexedSlices(g, idx, [rows, dim]), var)], lr_scale=base * scale)

        want = table.astype(np.float64)
        for r, (idx, g) in zip(rates, steps):
            train(tf.constant(idx), tf.constant(g), tf.constant(r))
            want[idx] -= np.float64(r) * g
        assert "GPU" in var.device
    np.testing.assert_allclose(var.numpy(), want, rtol=1e-5, atol=1e-5)


def test_bad_ids_on_gpu_raise_clear_errors_and_leave_tables(rng):
    table_np = rng.standard_normal((100, 8)).astype(np.float32)
    with tf.device("/GPU:0"):
        table = sok.Variable(table_np, name="users")
        ids = tf.ragged.constant([[1, 2], [100]], dtype=tf.int64)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature 'clicks' has id 100 .*table 'users'"):
            sok.lookup_sparse([table], [ids], feature_names=["clicks"])
        opt = sok.optimizers.Adam(0.1)
        g = tf.IndexedSlices(tf.ones([3, 8]), tf.constant([1, -1, 2], tf.int64), [100, 8])
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"table 'users': row index -1"):
            opt.apply_gradients([(g, table)])
        np.testing.assert_array_equal(table.numpy(), table_np)
        for slot in opt.slots(table):
            assert not slot.numpy().any()
        # the device is still healthy afterwards
        out = sok.lookup_sparse([table], [tf.ragged.constant([[3, 4]], dtype=tf.int64)], combiners="sum")[0]
    np.testing.assert_allclose(out.numpy()[0], table_np[3] + table_np[4], rtol=1e-6)


def test_bad_ids_in_a_gpu_training_step_fail_it_before_any_write(rng):
    """In a tf.function the GPU lookup does not wait for its verdict; its check fails
    the step and the gradient waits for the check, so no table or slot changes; the
    gradient op's own error (an id past 2^40) is an error too, not a crash."""
    from tf_sok.python.ops.loader import ops

    table_np = rng.standard_normal((64, 16)).astype(np.float32)
    with tf.device("/GPU:0"):
        table = sok.Variable(table_np, name="users")
        opt = sok.optimizers.Adam(0.1)
        step = clicks_training_step(table, opt)
        lens, ids = random_ragged(rng, 256, 64, 12, np.int64)  # multi-hot rows: the unrolled forward kernel
        step(to_ragged(lens, ids))
        bad = ids.copy()
        at = int(rng.integers(0, len(bad)))
        bad[at] = 64 + int(rng.integers(0, 10**6))
        assert_failing_step_writes_nothing(
            step, to_ragged(lens, bad), table, opt,
            rf"feature 'clicks' has id {bad[at]} \(at position {at}\) outside table 'users' of 64")
        # the gradient op alone (its lookup's check did not run): a GPU drops an id past 2^40, never waiting
        idx, val = ops().tf_sok_fused_lookup_grad(
            ids=[tf.constant([1, 2**41], tf.int64)], row_splits=[tf.constant([0, 2], tf.int64)],
            weights=[tf.zeros([0])], output_grads=[tf.ones([1, 16])], num_tables=1, feature_table=[0],
            combiners=["sum"], weighted=[False], dims=[16])
        assert idx[0].numpy().tolist() == [1, 1]
        np.testing.assert_array_equal(val[0].numpy(), np.stack([np.ones(16), np.zeros(16)]))
        assert np.isfinite(step(to_ragged(lens, ids)).numpy())  # the device is still healthy


@pytest.mark.parametrize("dims", [(16, 7, 128, 4, 32), (128,) * 5, (16,) * 5, (64,) * 5, (7,) * 5])
@pytest.mark.parametrize("zipf", [1.1, None])
def test_lookup_gradient_with_known_rows_gpu_equals_cpu(rng, dims, zipf):
    """Known rows make the GPU gradient's sort key (table << shift) | id shorter
    (shift from the largest table, here 2^17 rows; 40 bits without rows): the same
    indices and sums as the CPU and NumPy either way, and an id past its table an
    error naming it and the bound. Tables of mixed widths and of one width (groups
    of 32, 4 and 16 lanes with 16-byte loads, 8 with scalar ones); hot ids make
    distinct ids whose sums span several chunks of the segment sum. Outputs padded alike:
    distinct ids, then the last one again with zero rows."""
    rows = [5000, 70, 100_000, 3, 1]
    data = [random_ragged(rng, 3000, r, 4, zipf=zipf) for r in rows]
    grads = [rng.standard_normal((3000, d)).astype(np.float32) for d in dims]
    args = ([ids for _, ids in data], [lens for lens, _ in data], grads)
    cpu = _on("/CPU:0", lambda: lookup_grad_op(*args, rows=rows))
    for given in (rows, ()):
        gpu = _on("/GPU:0", lambda: lookup_grad_op(*args, rows=given))
        for t in range(len(rows)):
            # padded to the ids' count, at most the rows where given
            assert len(gpu[t][0]) == min(len(data[t][1]), rows[t] if given else len(data[t][1]))
            idx, val = distinct_rows(*gpu[t])
            np.testing.assert_array_equal(idx, distinct_rows(*cpu[t])[0])
            # float32 sums in another order: within a few ulps of the summed magnitudes
            mass = np_sum_lookup_grad(*data[t], np.abs(grads[t]), rows[t])[idx]
            assert (np.abs(val - distinct_rows(*cpu[t])[1]) <= 1e-5 * mass + 1e-6).all()
            ref = np_sum_lookup_grad(*data[t], grads[t], rows[t])[idx]
            assert (np.abs(val - ref) <= 1e-5 * mass + 1e-6).all()
    bad = [ids.copy() for _, ids in data]
    at = int(rng.integers(0, len(bad[2])))
    bad[2][at] = rows[2] + int(rng.integers(0, 1000))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"lookup gradient: id {bad[2][at]} is outside \[0, {rows[2]}\)"):
        _on("/CPU:0", lambda: lookup_grad_op(bad, args[1], grads, rows=rows))
    # a GPU never waits to learn of it: the id is dropped (lookup_sparse's check has failed the step first)
    gpu = _on("/GPU:0", lambda: lookup_grad_op(bad, args[1], grads, rows=rows))
    lens = data[2][0]
    keep = np.ones(len(bad[2]), bool)
    keep[at] = False
    idx, val = distinct_rows(*gpu[2])
    ref = np.zeros((rows[2], dims[2]))
    np.add.at(ref, bad[2][keep], np.repeat(grads[2], lens, axis=0)[keep])
    np.testing.assert_array_equal(idx, np.unique(bad[2][keep]))
    np.testing.assert_allclose(val, ref[idx], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["adam", "ftrl", "momentum", "rmsprop_centered_momentum"])
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("specs", [[(5000, 16), (70, 7), (100_000, 128), (3, 4)],  # a width of 7: scalar accesses
                                   [(5000, 16), (70, 12), (100_000, 128), (3, 4)]])  # all by 4: 16-byte accesses
def test_one_update_of_many_tables_gpu_equals_cpu(rng, case, id_dtype, specs):
    cls, hp, _ = CASES[case]
    tables_np = [rng.standard_normal(s).astype(np.float32) for s in specs]
    steps = multi_table_steps(rng, specs, steps=3, n=(2000, 20_000))
    cw, cs = run_multi_table("/CPU:0", cls, hp, tables_np, steps, id_dtype)
    gw, gs = run_multi_table("/GPU:0", cls, hp, tables_np, steps, id_dtype)
    for t in range(len(specs)):
        np.testing.assert_allclose(gw[t], cw[t], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(gw[t][-1], tables_np[t][-1])
        for a, b in zip(gs[t], cs[t]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _train_steps(device, tables_np, ragged, upstream, steps=3):
    """tf.function steps: fused lookup over all tables, gradient, Adam (unique path)."""
    with tf.device(device):
        tables = [sok.Variable(t, name=f"t{i}") for i, t in enumerate(tables_np)]
        # epsilon 1e-3: Adam's step is then a smooth function of the gradient, so the
        # float32 sums' order (GPU vs CPU) cannot flip the step of a near-zero gradient
        opt = sok.optimizers.Adam(0.05, epsilon=1e-3)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                outs = sok.lookup_sparse(tables, ragged, combiners="sqrtn")
                loss = sum(tf.reduce_sum(o * u) for o, u in zip(outs, upstream))
            opt.apply_gradients(zip(tape.gradient(loss, tables), tables))

        for _ in range(steps):
            step()
        return [t.numpy() for t in tables], [[s.numpy() for s in opt.slots(t)] for t in tables]


@pytest.mark.parametrize("widths", [(4, 7, 16, 64), (4, 16, 64)])  # the update's scalar and 16-byte accesses
def test_training_step_over_more_tables_than_one_launch_gpu_equals_cpu(rng, widths):
    """37 tables of mixed widths: more than one group of 32 in the gradient's
    sort and the update's launch; lookup gradients take the unique path."""
    tables_np, ragged, upstream = [], [], []
    for t in range(37):
        rows, dim = int(rng.integers(2, 3000)), int(rng.choice(widths))
        tables_np.append(rng.standard_normal((rows, dim)).astype(np.float32))
        lens, ids = random_ragged(rng, 512, rows, 4, np.int64, zipf=1.1)
        ragged.append(to_ragged(lens, ids))
        upstream.append(rng.standard_normal((512, dim)).astype(np.float32))
    cw, cs = _train_steps("/CPU:0", tables_np, ragged, upstream)
    gw, gs = _train_steps("/GPU:0", tables_np, ragged, upstream)
    for t in range(len(tables_np)):
        np.testing.assert_allclose(gw[t], cw[t], rtol=1e-4, atol=1e-4)
        for a, b in zip(gs[t], cs[t]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_bad_index_of_any_table_on_gpu_changes_no_table(rng):
    from tf_sok.python.ops import optimizer_ops

    a_np, b_np = rng.standard_normal((10, 4)).astype(np.float32), rng.standard_normal((6, 8)).astype(np.float32)
    with tf.device("/GPU:0"):
        a, b = sok.Variable(a_np, name="users"), sok.Variable(b_np, name="items")
        opt = sok.optimizers.Adam(0.1)
        good = tf.IndexedSlices(tf.ones([2, 4]), tf.constant([1, 3], tf.int64), [10, 4])
        bad = tf.IndexedSlices(tf.ones([3, 8]), tf.constant([0, 5, 6], tf.int64), [6, 8])
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"table 'items': row index 6 \(at position 2\)"):
            opt.apply_gradients([(good, a), (bad, b)])
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"table 'items': indices_unique was set"):
            optimizer_ops.sparse_apply([a.handle, b.handle], [], [], 0.1,
                                       [tf.constant([1, 2], tf.int64), tf.constant([0, 3, 2], tf.int64)],
                                       [tf.ones([2, 4]), tf.ones([3, 8])], algorithm="sgd",
                                       table_names=["users", "items"], indices_unique=True)
        # checked: the GPU does not wait for the verdict, and the bad index still stops every write
        optimizer_ops.sparse_apply([a.handle, b.handle], [], [], 0.1,
                                   [tf.constant([1, 2], tf.int64), tf.constant([0, 9, 3], tf.int64)],
                                   [tf.ones([2, 4]), tf.ones([3, 8])], algorithm="sgd",
                                   table_names=["users", "items"], indices_unique=True, checked=True)
    np.testing.assert_array_equal(a.numpy(), a_np)
    np.testing.assert_array_equal(b.numpy(), b_np)
    for v in (a, b):
        for slot in opt.slots(v):
            assert not slot.numpy().any()


@pytest.mark.parametrize("by_table", [False, True])
def test_route_gpu_equals_cpu(by_table):
    from tests.helpers import random_route_keys
    from tf_sok.python.ops.route_ops import route

    rng = np.random.default_rng(11)
    for n in (0, 1, 7, 300_000):
        keys = tf.constant(random_route_keys(rng, n, 6, 1 << 30))
        kwargs = dict(num_buckets=6, table_owner=[0] * 6, by_table=True) if by_table else \
            dict(num_buckets=3, table_owner=[-1, 2, -1, 0, -1, -1])
        cpu = _on("CPU:0", lambda: route(keys, **kwargs))
        gpu = _on("GPU:0", lambda: route(keys, **kwargs))
        for c, g in zip(cpu, gpu):
            np.testing.assert_array_equal(g.numpy(), c.numpy())
    # more tables than the kernel takes as a parameter: the owners go through device memory
    owners = [int(o) for o in rng.integers(-1, 3, 600)]
    keys = tf.constant(random_route_keys(rng, 50_000, 600, 1 << 20))
    cpu = _on("CPU:0", lambda: route(keys, num_buckets=3, table_owner=owners))
    gpu = _on("GPU:0", lambda: route(keys, num_buckets=3, table_owner=owners))
    for c, g in zip(cpu, gpu):
        np.testing.assert_array_equal(g.numpy(), c.numpy())
    with tf.device("GPU:0"), pytest.raises(tf.errors.InvalidArgumentError, match="names table 9"):
        route(tf.constant([1, 9 << 40], tf.int64), num_buckets=3, table_owner=[-1] * 6)


def _combine_and_grad(device, params_np, feature_table, ragged, weights, combiners, upstream, checked):
    from tf_sok.python.ops import lookup_ops

    with tf.device(device):
        params = [tf.constant(p) for p in params_np]
        with tf.GradientTape() as tape:
            tape.watch(params)
            outs = lookup_ops.fused_combine(
                params, [r.values for r in ragged], [r.row_splits for r in ragged],
                [w.values if w is not None else tf.zeros([0]) for w in weights], feature_table=feature_table,
                combiners=combiners, weighted=[w is not None for w in weights],
                feature_names=[f"f{f}" for f in range(len(ragged))], table_names=["p0", "p1"], checked=checked)
            loss = sum(tf.reduce_sum(o * u) for o, u in zip(outs, upstream))
        grads = tape.gradient(loss, params)
    return [o.numpy() for o in outs], grads


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("checked", [False, True])
def test_combine_and_its_dense_gradient_gpu_equals_cpu(rng, id_dtype, checked):
    params_np = [rng.standard_normal(s).astype(np.float32) for s in ((3000, 128), (500, 7))]  # 16-byte and scalar paths
    feature_table, combiners = [0, 1, 0], ["mean", "sqrtn", "sum"]
    ragged, weights, upstream = [], [], []
    for f, t in enumerate(feature_table):
        lens, ids = random_ragged(rng, 8193, params_np[t].shape[0], 5, id_dtype, zipf=1.2)   # hot rows: contention
        ragged.append(to_ragged(lens, ids))
        weights.append(to_ragged(lens, rng.uniform(0.1, 2, len(ids)).astype(np.float32)) if f == 1 else None)
        upstream.append(rng.standard_normal((8193, params_np[t].shape[1])).astype(np.float32))
    cpu_out, cpu_g = _combine_and_grad("/CPU:0", params_np, feature_table, ragged, weights, combiners, upstream, checked)
    gpu_out, gpu_g = _combine_and_grad("/GPU:0", params_np, feature_table, ragged, weights, combiners, upstream, checked)
    for c, g in zip(cpu_out, gpu_out):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-5)
    mass = _abs_mass(params_np, feature_table, ragged, [w if w is not None else to_ragged(r.row_lengths().numpy(),
                     np.ones(len(r.values), np.float32)) for w, r in zip(weights, ragged)], combiners, upstream)
    for t, (c, g) in enumerate(zip(cpu_g, gpu_g)):
        assert isinstance(g, tf.Tensor) and "GPU" in g.device
        diff = np.abs(g.numpy() - c.numpy())
        assert (diff <= 1e-5 * mass[t] + 1e-6).all(), f"params {t}: max diff {diff.max()}"


def test_exchange_path_on_gpu_equals_cpu(rng):
    """The multi-rank lookup's own ops (routing, checked owner-side lookup with its direct
    gradient, combine with its dense gradient), run with one rank on GPU:0 and on the CPU."""
    from tensorflow.python.eager import tape as tape_lib

    from tf_sok.python import exchange
    from tf_sok.python.comm import SingleProcess

    shapes = [(20000, 128), (700, 16), (90000, 128)]
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    feature_table, combiners = [0, 1, 2, 0], ["sum", "mean", "sqrtn", "mean"]
    feats = [random_ragged(rng, 4096, shapes[t][0], 4, zipf=1.1) for t in feature_table]
    upstream = [rng.standard_normal((4096, shapes[t][1])).astype(np.float32) for t in feature_table]

    def run(device, comm=None):
        sok.init()
        with tf.device(device):
            tables = [sok.Variable(v, name=f"x{i}") for i, v in enumerate(values)]

            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    for t in tables:
                        tape_lib.variable_accessed(t)
                    outs = exchange.exchanged_lookup(
                        comm or SingleProcess(), [t.handle for t in tables], [sok.table_meta(t) for t in tables],
                        feature_table, [tf.constant(ids) for _, ids in feats],
                        [tf.constant(np.concatenate([[0], np.cumsum(lens)]), tf.int64) for lens, _ in feats],
                        [None] * 4, combiners, ["a", "b", "c", "d"], "sum", 1)
                    loss = tf.add_n([tf.reduce_sum(o * u) for o, u in zip(outs, upstream)])
                return outs, tape.gradient(loss, tables)
            outs, grads = step()
        return [o.numpy() for o in outs], [dense_grad(g, s[0]) for g, s in zip(grads, shapes)]

    cpu_out, cpu_g = run("/CPU:0")
    # float32 sums in other orders differ by a few ulps of the summed magnitudes (hot Zipf rows)
    mass = _abs_mass(values, feature_table, [to_ragged(lens, ids) for lens, ids in feats], None, combiners, upstream)
    # the NCCL backend with one rank: the exchange planned by one op (TfSokNcclRouteKeys)
    for comm in (None, _one_rank_nccl()):
        gpu_out, gpu_g = run("/GPU:0", comm)
        for c, g in zip(cpu_out, gpu_out):
            np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-5)
        for t, (c, g) in enumerate(zip(cpu_g, gpu_g)):
            diff = np.abs(g - c)
            assert (diff <= 1e-5 * mass[t] + 1e-5).all(), f"table {t}: max diff {diff.max()}"


def _one_rank_nccl():
    from tf_sok.python.comm import NcclCommunicator, SingleProcess
    return NcclCommunicator(SingleProcess(), "/GPU:0")

