"""Fused lookup vs tf.nn.embedding_lookup_sparse and NumPy; its gradient vs a dense reference."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import tape as tape_lib

import tf_sok as sok
from tests.helpers import (assert_failing_step_writes_nothing, clicks_training_step, dense_grad, distinct_rows,
                           half_precision_case, lookup_grad_op, lookup_in, np_lookup, np_sum_lookup_grad, random_ragged, to_ragged)


def _tables(rng, specs):
    return [rng.standard_normal((rows, dim)).astype(np.float32) for rows, dim in specs]


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_lookup_matches_tf_and_numpy(rng, id_dtype, weighted):
    tables_np = _tables(rng, [(50, 8), (30, 5), (200, 16)])
    tables = [sok.Variable(t, name=f"t{i}") for i, t in enumerate(tables_np)]
    feature_table = [0, 2, 0, 1, 2]
    combiners = ["sum", "mean", "sqrtn", "mean", "sum"]
    batch = 37
    feats, weights, ragged_ids, ragged_w = [], [], [], []
    for f, t in enumerate(feature_table):
        lens, ids = random_ragged(rng, batch, tables_np[t].shape[0], 5, id_dtype)
        lens[:3] = [0, 4, 0]  # empty rows, and a row long enough for duplicates
        ids = rng.integers(0, tables_np[t].shape[0], int(lens.sum())).astype(id_dtype)
        ids[lens[0]:lens[0] + 2] = ids[lens[0]]  # a duplicate id inside one row
        w = rng.uniform(0.1, 2.0, len(ids)).astype(np.float32) if weighted else None
        feats.append((lens, ids))
        weights.append(w)
        ragged_ids.append(to_ragged(lens, ids))
        ragged_w.append(to_ragged(lens, w) if weighted else None)
    outs = sok.lookup_sparse([tables[t] for t in feature_table], ragged_ids,
                             ragged_w if weighted else None, combiners=combiners)
    for f, t in enumerate(feature_table):
        lens, ids = feats[f]
        ref = np_lookup(tables_np[t], lens, ids, weights[f], combiners[f])
        np.testing.assert_allclose(outs[f].numpy(), ref, rtol=1e-5, atol=1e-5)
        tf_ref = tf.nn.embedding_lookup_sparse(
            tf.constant(tables_np[t]), ragged_ids[f].to_sparse(),
            ragged_w[f].to_sparse() if weighted else None, combiner=combiners[f])
        # tf drops trailing empty rows from its output; compare on the rows it returns
        np.testing.assert_allclose(outs[f].numpy()[:tf_ref.shape[0]], tf_ref.numpy(), rtol=1e-5, atol=1e-5)
        assert not np.isnan(outs[f].numpy()).any()


def test_sparse_and_dense_inputs_equal_ragged(rng):
    table_np = _tables(rng, [(40, 6)])[0]
    table = sok.Variable(table_np, name="t")
    lens, ids = random_ragged(rng, 20, 40, 4)
    rt = to_ragged(lens, ids)
    from_ragged = sok.lookup_sparse(table, rt, combiners="sqrtn")
    from_sparse = sok.lookup_sparse(table, rt.to_sparse(), combiners="sqrtn")
    np.testing.assert_array_equal(from_ragged.numpy(), from_sparse.numpy())
    dense_ids = rng.integers(0, 40, (20, 3))
    ref = np_lookup(table_np, np.full(20, 3), dense_ids.reshape(-1), None, "sum")
    np.testing.assert_allclose(sok.lookup_sparse(table, tf.constant(dense_ids), combiners="sum").numpy(),
                               ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_gradient_is_row_sparse_and_matches_dense_reference(rng, combiner):
    t0, t1 = _tables(rng, [(60, 8), (25, 3)])
    v0, v1 = sok.Variable(t0, name="a"), sok.Variable(t1, name="b")
    ref0, ref1 = tf.Variable(t0), tf.Variable(t1)
    feats = [(0, random_ragged(rng, 33, 60, 6)), (0, random_ragged(rng, 33, 60, 3)), (1, random_ragged(rng, 33, 25, 4))]
    w = [rng.uniform(0.5, 1.5, len(ids)).astype(np.float32) for _, (lens, ids) in feats]
    up = [rng.standard_normal((33, 8 if t == 0 else 3)).astype(np.float32) for t, _ in feats]
    with tf.GradientTape(persistent=True) as tape:
        outs = sok.lookup_sparse([v0 if t == 0 else v1 for t, _ in feats],
                                 [to_ragged(*x) for _, x in feats],
                                 [to_ragged(x[0], wi) for (_, x), wi in zip(feats, w)], combiners=combiner)
        loss = sum(tf.reduce_sum(o * u) for o, u in zip(outs, up))
        ref_outs = [tf.nn.embedding_lookup_sparse(ref0 if t == 0 else ref1, to_ragged(*x).to_sparse(),
                                                  to_ragged(x[0], wi).to_sparse(), combiner=combiner)
                    for (t, x), wi in zip(feats, w)]
        ref_loss = sum(tf.reduce_sum(o * u[:o.shape[0]]) for o, u in zip(ref_outs, up))
    g0, g1 = tape.gradient(loss, [v0, v1])
    r0, r1 = tape.gradient(ref_loss, [ref0, ref1])
    for table, g, r, rows in ((0, g0, r0, 60), (1, g1, r1, 25)):
        assert isinstance(g, tf.IndexedSlices)
        distinct_rows(g.indices.numpy(), g.values.numpy())   # padded to the table's ids, at most its rows
        assert len(g.indices) == min(rows, sum(len(ids) for t, (_, ids) in feats if t == table))
        np.testing.assert_allclose(dense_grad(g, rows), dense_grad(r, rows), rtol=1e-4, atol=1e-5)


def test_works_in_tf_function_with_unknown_batch(rng):
    table_np = _tables(rng, [(30, 4)])[0]
    table = sok.Variable(table_np, name="t")

    @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64, row_splits_dtype=tf.int64)])
    def step(ids):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse([table], [ids], combiners=["mean"])[0]
            loss = tf.reduce_sum(out)
        return out, tape.gradient(loss, table)

    for batch in (5, 11):
        lens, ids = random_ragged(rng, batch, 30, 3)
        out, g = step(to_ragged(lens, ids))
        np.testing.assert_allclose(out.numpy(), np_lookup(table_np, lens, ids, None, "mean"), rtol=1e-5, atol=1e-6)
        assert isinstance(g, tf.IndexedSlices)


class TestBadInput:
    def test_id_out_of_range_names_feature_table_and_id(self, rng):
        table_np = _tables(rng, [(10, 4)])[0]
        table = sok.Variable(table_np, name="users")
        ids = tf.ragged.constant([[1, 2], [10]], dtype=tf.int64)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature 'clicks' has id 10 .*table 'users'"):
            sok.lookup_sparse([table], [ids], feature_names=["clicks"])
        with pytest.raises(tf.errors.InvalidArgumentError, match="has id -3"):
            sok.lookup_sparse([table], [tf.ragged.constant([[-3]], dtype=tf.int64)])
        np.testing.assert_array_equal(table.numpy(), table_np)

    def test_check_op_turns_a_status_record_into_the_named_error(self, rng):
        """TfSokLookupCheck reads a lookup's status as a GPU lookup leaves it (the
        first error, recorded on the device) and raises the same error as the CPU."""
        from tf_sok.python.ops.loader import ops

        names, tables, feature_table = ["age", "clicks", "ads"], ["users", "items"], [0, 1, 1]
        kw = dict(feature_names=names, table_names=tables, feature_table=feature_table)
        f, pos = int(rng.integers(0, 3)), int(rng.integers(0, 10**6))
        bad, rows = int(rng.integers(10**6, 10**12)), int(rng.integers(1, 10**6))
        word0 = lambda kind, group: kind | (group << 32)  # int32 kind, int32 feature (little-endian)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"feature '{names[f]}' has id {bad} \(at position {pos}\) outside table "
                                 rf"'{tables[feature_table[f]]}' of {rows} rows; ids must be in \[0, {rows}\)"):
            ops().tf_sok_lookup_check(tf.constant([word0(1, f), pos, bad, rows], tf.int64), **kw)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"row_splits of feature '{names[f]}' are invalid at index {pos} \(value {bad}\)"):
            ops().tf_sok_lookup_check(tf.constant([word0(2, f), pos, bad, 0], tf.int64), **kw)
        with pytest.raises(tf.errors.InternalError, match="names feature 7, which the op does not have"):
            ops().tf_sok_lookup_check(tf.constant([word0(1, 7), pos, bad, rows], tf.int64), **kw)
        with pytest.raises(tf.errors.InvalidArgumentError, match="status must be a lookup's int64 status output"):
            ops().tf_sok_lookup_check(tf.zeros([3], tf.int64), **kw)
        ops().tf_sok_lookup_check(tf.zeros([4], tf.int64), **kw)  # all zeros: no error

    def test_bad_id_fails_a_traced_training_step_and_its_gradient_waits_for_the_check(self, rng):
        """In a tf.function the lookup's check is queued after it, off tf.function's
        chain of resource-less stateful ops, and the lookup gradient depends on it,
        so no gradient or update of a step with a bad id runs (on a GPU the lookup
        itself does not wait for the verdict)."""
        table_np = _tables(rng, [(50, 8)])[0]
        table = sok.Variable(table_np, name="users")
        opt = sok.optimizers.Adam(0.05)
        # tf.print: a stateful op touching no resource, before the lookup
        step = clicks_training_step(table, opt, before=lambda: tf.print("step", output_stream="file:///dev/null"))
        lens, ids = random_ragged(rng, 16, 50, 3)
        good = to_ragged(lens, ids)
        loss = step(good)
        np.testing.assert_allclose(loss.numpy(), np.sum(np_lookup(table_np, lens, ids, None, "sum") ** 2),
                                   rtol=1e-5)
        assert not np.array_equal(table.numpy(), table_np)
        bad_ids = ids.copy()
        bad_ids[-1] = 50 + int(rng.integers(0, 1000))
        assert_failing_step_writes_nothing(step, to_ragged(lens, bad_ids), table, opt,
                                           rf"feature 'clicks' has id {bad_ids[-1]} .*table 'users' of 50 rows")
        graph = step.get_concrete_function(good).graph
        checks = [op for op in graph.get_operations() if op.type == "TfSokLookupCheck"]
        grads = [op for op in graph.get_operations() if op.type == "TfSokFusedLookupGrad"]
        assert len(checks) == 1 and len(grads) == 1
        assert checks[0] in grads[0].control_inputs
        assert not any(op.type == "PrintV2" for op in checks[0].control_inputs)

    def test_bad_row_splits(self, rng):
        from tf_sok.python.ops import lookup_ops

        table = sok.Variable(_tables(rng, [(10, 4)])[0], name="t")
        kwargs = dict(feature_table=[0], combiners=["sum"], weighted=[False], dims=[4],
                      feature_names=["f"], table_names=["t"])
        ids = tf.constant([1, 2, 3], tf.int64)
        for splits in ([0, 2, 1, 3], [1, 2, 3], [0, 1, 2]):
            with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits of feature 'f' are invalid"):
                lookup_ops.fused_lookup([table.handle], [ids], [tf.constant(splits, tf.int64)],
                                        [tf.zeros([0])], **kwargs)

    def test_weights_shape_and_types(self, rng):
        table = sok.Variable(_tables(rng, [(10, 4)])[0], name="t")
        ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
        bad_w = tf.ragged.constant([[1.0], [1.0]])
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="weights"):
            sok.lookup_sparse([table], [ids], [bad_w])
        with pytest.raises(TypeError, match="int32 or int64"):
            sok.lookup_sparse([table], [tf.ragged.constant([[1.0]])])
        with pytest.raises(TypeError, match="not a tf_sok variable"):
            sok.lookup_sparse([tf.Variable(tf.zeros([4, 4]))], [ids])
        with pytest.raises(ValueError, match="combiner"):
            sok.lookup_sparse([table], [ids], combiners=["max"])


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_fused_combine_over_tensors_matches_numpy_and_its_dense_gradient(rng, id_dtype):
    from tf_sok.python.ops import lookup_ops

    params_np = [rng.standard_normal((30, 4)).astype(np.float32), rng.standard_normal((12, 6)).astype(np.float32)]
    params = [tf.constant(p) for p in params_np]
    feats = [(0, random_ragged(rng, 9, 30, 4, id_dtype), "mean"), (1, random_ragged(rng, 9, 12, 3, id_dtype), "sqrtn"),
             (0, random_ragged(rng, 9, 30, 2, id_dtype), "sum")]
    weights = [None, rng.uniform(0.5, 2, len(feats[1][1][1])).astype(np.float32), None]
    up = [rng.standard_normal((9, params_np[t].shape[1])).astype(np.float32) for t, _, _ in feats]
    with tf.GradientTape() as tape:
        tape.watch(params)
        outs = lookup_ops.fused_combine(
            params, [tf.constant(ids) for _, (_, ids), _ in feats],
            [to_ragged(lens, ids).row_splits for _, (lens, ids), _ in feats],
            [tf.zeros([0]) if w is None else tf.constant(w) for w in weights],
            feature_table=[t for t, _, _ in feats], combiners=[c for _, _, c in feats],
            weighted=[w is not None for w in weights], feature_names=["a", "b", "c"], table_names=["p0", "p1"])
        loss = sum(tf.reduce_sum(o * u) for o, u in zip(outs, up))
    grads = tape.gradient(loss, params)
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(params)
        ref = [tf.nn.embedding_lookup_sparse(
            params[t], to_ragged(*x).to_sparse(),
            None if w is None else tf.RaggedTensor.from_row_lengths(w, x[0]).to_sparse(), combiner=c)
            for (t, x, c), w in zip(feats, weights)]
        ref_loss = sum(tf.reduce_sum(o * u[:o.shape[0]]) for o, u in zip(ref, up))
    ref_grads = ref_tape.gradient(ref_loss, params)
    for (t, (lens, ids), c), w, o in zip(feats, weights, outs):
        np.testing.assert_allclose(o.numpy(), np_lookup(params_np[t], lens, ids, w, c), rtol=1e-5, atol=1e-6)
    for t, (g, r) in enumerate(zip(grads, ref_grads)):
        assert isinstance(g, tf.Tensor) and g.shape == params_np[t].shape   # dense: no IndexedSlices
        np.testing.assert_allclose(g.numpy(), dense_grad(r, params_np[t].shape[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
@pytest.mark.parametrize("hotness", ["one", "multi"])
def test_half_precision_outputs_are_the_float32_outputs_rounded_and_their_gradient_is_exact(rng, dtype, hotness):
    """float16 / bfloat16 outputs: the float32 pooling rounded once to nearest even (TensorFlow's
    own cast as the reference); the gradient of upstream gradients in that type equals the float32
    gradient of the same (exactly representable) upstream values."""
    case = half_precision_case(rng, hotness)
    half_out, half_grads = lookup_in(dtype, case)
    f32_out, f32_grads = lookup_in(tf.float32, case)
    for h, f in zip(half_out, f32_out):
        assert h.dtype == dtype.as_numpy_dtype
        np.testing.assert_array_equal(h, tf.cast(f, dtype).numpy())
    for h, f in zip(half_grads, f32_grads):
        np.testing.assert_allclose(h, f, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16, got float64"):
        sok.lookup_sparse(sok.Variable(case[0][0], name="x"), case[3][0], dtype=tf.float64)


def test_lookup_gradient_bounds_ids_by_the_tables_rows_when_known(rng):
    """Given the tables' rows, the gradient op rejects an id past its table (and sorts
    shorter keys); without them, ids up to 2^40 pass. Both give NumPy's sums, with
    strictly ascending indices, padded to the ids' count (at most the rows); a variable's
    gradient passes its rows."""
    rows = [int(rng.integers(2, 40)), int(rng.integers(1000, 10**6)), 3]
    data = [random_ragged(rng, 64, r, 5) for r in rows]
    grads = [rng.standard_normal((64, d)).astype(np.float32) for d in (4, 8, 3)]
    args = ([ids for _, ids in data], [lens for lens, _ in data], grads)
    for given in (rows, ()):
        for t, out in enumerate(lookup_grad_op(*args, rows=given)):
            assert len(out[0]) == min(len(data[t][1]), given[t] if given else len(data[t][1]))
            idx, val = distinct_rows(*out)
            dense = np.zeros((rows[t], grads[t].shape[1]))
            dense[idx] = val
            np.testing.assert_allclose(dense, np_sum_lookup_grad(data[t][0], data[t][1], grads[t], rows[t]),
                                       rtol=1e-5, atol=1e-5)
    bad = [ids.copy() for _, ids in data]
    at = int(rng.integers(0, len(bad[1])))
    bad[1][at] = rows[1] + int(rng.integers(0, 100))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"lookup gradient: id {bad[1][at]} is outside \[0, {rows[1]}\)"):
        lookup_grad_op(bad, args[1], grads, rows=rows)
    lookup_grad_op(bad, args[1], grads)  # rows not given: in [0, 2^40), accepted
    bad[1][at] = 2**40
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"id 1099511627776 is outside \[0, 2\^40\)"):
        lookup_grad_op(bad, args[1], grads)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rows has 2 entries for 3 tables"):
        lookup_grad_op(*args, rows=rows[:2])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"table 2 has 0 rows"):
        lookup_grad_op(*args, rows=rows[:2] + [0])

    table = sok.Variable(rng.standard_normal((rows[0], 4)).astype(np.float32), name="t")

    @tf.function
    def grad(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(sok.lookup_sparse([table], [ids], combiners="sum")[0])
        return tape.gradient(loss, table)

    graph = grad.get_concrete_function(tf.RaggedTensorSpec([None, None], tf.int64, 1, tf.int64)).graph
    assert [op.get_attr("rows") for op in graph.get_operations() if op.type == "TfSokFusedLookupGrad"] == \
        [[rows[0]]]


def test_combine_gradient_names_a_bad_id_and_checks_shapes():
    from tf_sok.python.ops.loader import ops

    args = dict(params=[tf.zeros([5, 4])], row_splits=[tf.constant([0, 2], tf.int64)], weights=[tf.zeros([0])],
                output_grads=[tf.ones([1, 4])], feature_table=[0], combiners=["sum"], weighted=[False], dims=[4])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature '#0' has id 5 \(at position 1\) outside table"):
        ops().tf_sok_fused_combine_grad(ids=[tf.constant([1, 5], tf.int64)], **args)
    args["output_grads"] = [tf.ones([2, 4])]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"output gradient of feature 0 has shape \[2,4\], expected \[1, 4\]"):
        ops().tf_sok_fused_combine_grad(ids=[tf.constant([1, 2], tf.int64)], **args)


@pytest.mark.parametrize("mode", ["distinct_ids", "one_id_per_row"])
def test_owner_side_lookup_gradient_is_the_output_gradient_and_says_what_its_rows_are(rng, mode):
    """The exchange's owner-side lookups: each output row is one id's row and its
    gradient is that output gradient as it is. distinct_ids (ascending ids) promises
    ascending rows (the update skips grouping); one_id_per_row (ids repeat, any order)
    promises rows in range only: the update sums the repeats itself (SGD vs NumPy)."""
    from tf_sok.python.ops import lookup_ops

    values = [rng.standard_normal((40, 8)).astype(np.float32), rng.standard_normal((25, 4)).astype(np.float32)]
    tables = [sok.Variable(v, name=f"d{i}") for i, v in enumerate(values)]
    if mode == "distinct_ids":
        ids = [np.sort(rng.choice(40, 11, replace=False)), np.sort(rng.choice(25, 6, replace=False))]
    else:
        ids = [rng.integers(0, 40, 30), rng.integers(0, 25, 17)]
    up = [rng.standard_normal((len(i), v.shape[1])).astype(np.float32) for i, v in zip(ids, values)]
    opt = sok.optimizers.SGD(0.5)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            for t in tables:
                tape_lib.variable_accessed(t)   # as lookup_sparse does
            outs = lookup_ops.fused_lookup(
                [t.handle for t in tables], [tf.constant(i) for i in ids],
                [tf.range(len(i) + 1, dtype=tf.int64) for i in ids], [tf.zeros([0])] * 2, feature_table=[0, 1],
                combiners=["sum"] * 2, weighted=[False] * 2, dims=[8, 4], feature_names=["a", "b"],
                table_names=["d0", "d1"], checked=True, **{mode: True})
            loss = sum(tf.reduce_sum(o * u) for o, u in zip(outs, up))
        grads = tape.gradient(loss, tables)
        want = "ascending" if mode == "distinct_ids" else "checked"
        assert all(lookup_ops.rows_promise(g.indices) == want for g in grads)   # traced: the promise is kept
        assert lookup_ops.rows_promise(tf.identity(grads[0].indices)) == ""   # rows made otherwise: none
        opt.apply_gradients(zip(grads, tables))
        return outs, grads

    outs, grads = step()
    for t in range(2):
        np.testing.assert_array_equal(outs[t].numpy(), values[t][ids[t]])
        np.testing.assert_array_equal(grads[t].indices.numpy(), ids[t])
        np.testing.assert_array_equal(grads[t].values.numpy(), up[t])
        expect = values[t].copy()
        np.add.at(expect, ids[t], -0.5 * up[t])
        np.testing.assert_allclose(tables[t].numpy(), expect, rtol=1e-5, atol=1e-6)
    assert lookup_ops.rows_promise(grads[0].indices) == ""   # eager tensors keep no promise
    with pytest.raises(ValueError, match=r"promise_rows: the promise is one of \('ascending', 'checked'\), got 'sorted'"):
        lookup_ops.promise_rows(tf.constant(ids[0]), "sorted")
    with pytest.raises(ValueError, match="distinct_ids and one_id_per_row need feature t to read table t"):
        lookup_ops.fused_lookup([tables[0].handle], [tf.constant(ids[0])], [tf.range(12, dtype=tf.int64)],
                                [tf.zeros([0])], feature_table=[0], combiners=["mean"], weighted=[False], dims=[8],
                                feature_names=["a"], table_names=["d0"], **{mode: True})
