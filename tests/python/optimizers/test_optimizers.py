"""Each sparse optimizer vs a NumPy reference (lazy, per row) and vs Keras's
own optimizer when every row is touched; untouched rows stay bit-identical."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tf_sok.data import zipf_ranks
from tests.helpers import to_ragged
from tests.python.optimizers.reference import NumpyOptimizer

CASES = {
    "sgd": (sok.optimizers.SGD, {}, lambda lr: keras.optimizers.SGD(lr)),
    "momentum": (sok.optimizers.Momentum, {"momentum": 0.8}, lambda lr: keras.optimizers.SGD(lr, momentum=0.8)),
    "nesterov": (sok.optimizers.Momentum, {"momentum": 0.7, "nesterov": True},
                 lambda lr: keras.optimizers.SGD(lr, momentum=0.7, nesterov=True)),
    "adagrad": (sok.optimizers.Adagrad, {"initial_accumulator_value": 0.1, "epsilon": 1e-7},
                lambda lr: keras.optimizers.Adagrad(lr)),
    "adam": (sok.optimizers.Adam, {"beta_1": 0.9, "beta_2": 0.99, "epsilon": 1e-7},
             lambda lr: keras.optimizers.Adam(lr, beta_2=0.99)),
    "ftrl": (sok.optimizers.Ftrl, {"learning_rate_power": -0.5, "initial_accumulator_value": 0.1,
                                   "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02,
                                   "l2_shrinkage_regularization_strength": 0.0},
             lambda lr: keras.optimizers.Ftrl(lr, l1_regularization_strength=0.01, l2_regularization_strength=0.02)),
    "rmsprop": (sok.optimizers.RMSprop, {"rho": 0.9, "epsilon": 1e-7}, lambda lr: keras.optimizers.RMSprop(lr)),
    "rmsprop_centered_momentum": (sok.optimizers.RMSprop, {"rho": 0.8, "momentum": 0.5, "centered": True,
                                                            "epsilon": 1e-7},
                                  lambda lr: keras.optimizers.RMSprop(lr, rho=0.8, momentum=0.5, centered=True)),
}


def _np_name(case):
    return {"nesterov": "momentum", "rmsprop_centered_momentum": "rmsprop"}.get(case, case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference_and_leaves_untouched_rows(rng, case):
    cls, hp, _ = CASES[case]
    rows, dim, lr = 40, 6, 0.05
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    var = sok.Variable(table, name="t")
    opt = cls(learning_rate=lr, **hp)
    ref = NumpyOptimizer(_np_name(case), table, lr, **hp)
    touched = set()
    for _ in range(5):
        n = int(rng.integers(5, 30))
        idx = rng.integers(0, rows // 2, n)  # rows >= rows//2 are never touched
        idx[:3] = idx[0]  # duplicates within the batch
        g = rng.standard_normal((n, dim)).astype(np.float32)
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(g), tf.constant(idx), [rows, dim]), var)])
        ref.apply(idx, g)
        touched |= set(idx.tolist())
    np.testing.assert_allclose(var.numpy(), ref.w, rtol=2e-4, atol=2e-5)
    untouched = np.array(sorted(set(range(rows)) - touched))
    np.testing.assert_array_equal(var.numpy()[untouched], table[untouched])  # bit-identical
    for slot, spec in zip(opt.slots(var), opt.slot_specs()):
        np.testing.assert_array_equal(slot.numpy()[untouched], np.full_like(slot.numpy()[untouched],
                                                                           spec.initial_value))


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_keras_optimizer_when_every_row_is_touched(rng, case):
    cls, hp, keras_opt = CASES[case]
    rows, dim, lr = 12, 5, 0.03
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    var = sok.Variable(table, name="t")
    kvar = tf.Variable(table)
    opt, kopt = cls(learning_rate=lr, **hp), keras_opt(lr)
    for _ in range(4):
        idx = rng.permutation(rows)
        g = rng.standard_normal((rows, dim)).astype(np.float32)
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(g), tf.constant(idx), [rows, dim]), var)])
        dense = np.zeros_like(g)
        dense[idx] = g
        kopt.apply_gradients([(tf.constant(dense), kvar)])
    np.testing.assert_allclose(var.numpy(), kvar.numpy(), rtol=1e-4, atol=1e-5)


def test_wrapper_maps_keras_hyper_parameters(rng):
    sparse = sok.OptimizerWrapper(keras.optimizers.Adam(0.02, beta_1=0.8, beta_2=0.95, epsilon=1e-6))
    assert isinstance(sparse, sok.optimizers.Adam)
    assert (sparse.beta_1, sparse.beta_2) == (pytest.approx(0.8), pytest.approx(0.95))
    assert float(sparse.current_learning_rate()) == pytest.approx(0.02)
    assert isinstance(sok.OptimizerWrapper(keras.optimizers.SGD(0.1, momentum=0.9)), sok.optimizers.Momentum)
    with pytest.raises(ValueError, match="clipnorm"):
        sok.OptimizerWrapper(keras.optimizers.Adam(0.1, clipnorm=1.0))
    with pytest.raises(ValueError, match="no sparse equivalent of Lion"):
        sok.OptimizerWrapper(keras.optimizers.Lion(0.1))


def test_bad_index_raises_and_changes_nothing(rng):
    table = rng.standard_normal((10, 4)).astype(np.float32)
    var = sok.Variable(table, name="items")
    opt = sok.optimizers.Adam(0.1)
    g = tf.IndexedSlices(tf.ones([3, 4]), tf.constant([1, 10, 2], tf.int64), [10, 4])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"adam update of table 'items': row index 10"):
        opt.apply_gradients([(g, var)])
    np.testing.assert_array_equal(var.numpy(), table)
    for slot in opt.slots(var):
        assert not slot.numpy().any()
    with pytest.raises(tf.errors.InvalidArgumentError, match="do not match"):
        opt.apply_gradients([(tf.IndexedSlices(tf.ones([2, 3]), tf.constant([1, 2]), [10, 4]), var)])
    np.testing.assert_array_equal(var.numpy(), table)


def test_native_keras_optimizer_trains_a_sok_table_like_a_tf_variable(rng):
    """As in SOK, Keras 3 optimizers accept the tables' IndexedSlices gradients (not lazily)."""
    table = rng.standard_normal((20, 3)).astype(np.float32)
    var, ref = sok.Variable(table, name="t"), tf.Variable(table)
    ids = tf.ragged.constant([[1, 2, 2], [5]], dtype=tf.int64)
    for v, opt in ((var, keras.optimizers.Adam(0.1)), (ref, keras.optimizers.Adam(0.1))):
        for _ in range(3):
            with tf.GradientTape() as tape:
                if v is var:
                    out = sok.lookup_sparse(v, ids, combiners="sum")
                else:
                    out = tf.nn.embedding_lookup_sparse(v, ids.to_sparse(), None, combiner="sum")
                loss = tf.reduce_sum(out * out)
            g = tape.gradient(loss, v)
            assert isinstance(g, tf.IndexedSlices)
            opt.apply_gradients([(g, v)])
    np.testing.assert_allclose(var.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


def test_learning_rate_schedule_follows_the_step(rng):
    table = rng.standard_normal((6, 2)).astype(np.float32)
    var = sok.Variable(table, name="t")
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    opt = sok.OptimizerWrapper(keras.optimizers.SGD(schedule))
    g = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([3]), [6, 2])
    for _ in range(3):
        opt.apply_gradients([(g, var)])
    np.testing.assert_allclose(var.numpy()[3], table[3] - (0.5 + 0.25 + 0.125), rtol=1e-6)
    np.testing.assert_array_equal(np.delete(var.numpy(), 3, 0), np.delete(table, 3, 0))


def test_tables_with_the_same_name_keep_separate_state(rng):
    a_np, b_np = rng.standard_normal((4, 2)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    a, b = sok.Variable(a_np, name="same"), sok.Variable(b_np, name="same")
    opt = sok.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)
    g = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), [4, 2])
    opt.apply_gradients([(g, a), (g, b)])
    for v, init in ((a, a_np), (b, b_np)):
        np.testing.assert_allclose(opt.slots(v)[0].numpy()[0], [1.1, 1.1], rtol=1e-6)
        np.testing.assert_allclose(v.numpy()[0], init[0] - 0.1 / np.sqrt(1.1 + 1e-7), rtol=1e-5)
    assert opt.slots(a)[0] is not opt.slots(b)[0]


def multi_table_steps(rng, specs, steps=3, n=(20, 60)):
    """Random row-sparse gradients for several tables: per step, per table
    (indices with duplicates, values); the last table gets two entries per step."""
    out = []
    for _ in range(steps):
        step = []
        for t, (rows, dim) in enumerate(specs):
            parts = 2 if t == len(specs) - 1 else 1
            for _ in range(parts):
                k = int(rng.integers(*n))
                idx = rng.integers(0, rows - 1, k)  # the last row is never touched
                idx[:2] = idx[0]
                step.append((t, idx, rng.standard_normal((k, dim)).astype(np.float32)))
        out.append(step)
    return out


def run_multi_table(device, cls, hp, tables_np, steps, id_dtype=tf.int64):
    """Applies every step's gradients of all tables in one apply_gradients call."""
    with tf.device(device):
        tables = [sok.Variable(t, name=f"table{i}") for i, t in enumerate(tables_np)]
        opt = cls(learning_rate=0.05, **hp)
        for step in steps:
            opt.apply_gradients([
                (tf.IndexedSlices(tf.constant(g), tf.constant(idx, id_dtype), list(tables_np[t].shape)), tables[t])
                for t, idx, g in step])
        return [v.numpy() for v in tables], [[s.numpy() for s in opt.slots(v)] for v in tables]


@pytest.mark.parametrize("case", ["adam", "ftrl", "rmsprop_centered_momentum", "sgd"])
def test_one_update_of_many_tables_matches_numpy_per_table(rng, case):
    """All tables (different rows and dims; one named twice) go through ONE op."""
    cls, hp, _ = CASES[case]
    specs = [(50, 4), (9, 16), (200, 3)]
    tables_np = [rng.standard_normal(s).astype(np.float32) for s in specs]
    steps = multi_table_steps(rng, specs)
    got, _ = run_multi_table("/CPU:0", cls, hp, tables_np, steps)
    for t, table in enumerate(tables_np):
        ref = NumpyOptimizer(_np_name(case), table, 0.05, **hp)
        for step in steps:
            parts = [(idx, g) for tt, idx, g in step if tt == t]
            ref.apply(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        np.testing.assert_allclose(got[t], ref.w, rtol=2e-4, atol=2e-5)
        np.testing.assert_array_equal(got[t][-1], table[-1])


def test_bad_index_in_one_table_changes_no_table(rng):
    a_np, b_np = rng.standard_normal((10, 4)).astype(np.float32), rng.standard_normal((6, 2)).astype(np.float32)
    a, b = sok.Variable(a_np, name="users"), sok.Variable(b_np, name="items")
    opt = sok.optimizers.Adam(0.1)
    good = tf.IndexedSlices(tf.ones([2, 4]), tf.constant([1, 3], tf.int64), [10, 4])
    bad = tf.IndexedSlices(tf.ones([3, 2]), tf.constant([0, 5, 6], tf.int64), [6, 2])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"adam update of table 'items': row index 6 \(at position 2\) is outside \[0, 6\)"):
        opt.apply_gradients([(good, a), (bad, b)])
    np.testing.assert_array_equal(a.numpy(), a_np)
    np.testing.assert_array_equal(b.numpy(), b_np)
    for v in (a, b):
        for slot in opt.slots(v):
            assert not slot.numpy().any()


def test_unique_indices_promise_is_checked(rng):
    from tf_sok.python.ops import optimizer_ops

    table = rng.standard_normal((8, 3)).astype(np.float32)
    var = sok.Variable(table, name="t")
    for checked in (False, True):  # `checked` only spares a GPU its wait: the CPU reports regardless
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"sgd update of table 't': indices_unique was set but row index 2 \(at position 2\) is below"):
            optimizer_ops.sparse_apply([var.handle], [], [], 0.1, [tf.constant([1, 4, 2], tf.int64)],
                                       [tf.ones([3, 3])], algorithm="sgd", table_names=["t"], indices_unique=True,
                                       checked=checked)
        np.testing.assert_array_equal(var.numpy(), table)


def test_unique_path_updates_each_row_once_and_skips_the_gradients_padding(rng):
    """The lookup gradient's layout (distinct rows ascending, then the last row repeated with
    zero rows): each distinct row updated once, the grouped path (eager Adam, repeats summed)
    agreeing with NumPy; a decreasing index fails before anything is written. (Adam's unique
    path over padded lookup gradients: the test below.)"""
    from tf_sok.python.ops import optimizer_ops

    table = rng.standard_normal((12, 4)).astype(np.float32)
    rows = np.sort(rng.choice(12, 5, replace=False))
    pad = int(rng.integers(1, 6))
    indices = np.concatenate([rows, np.full(pad, rows[-1])])
    values = np.concatenate([rng.standard_normal((5, 4)), np.zeros((pad, 4))]).astype(np.float32)
    var = sok.Variable(table, name="t")
    want = table.copy()
    want[rows] -= 0.1 * values[:5]
    optimizer_ops.sparse_apply([var.handle], [], [], 0.1, [tf.constant(indices)], [tf.constant(values)],
                               algorithm="sgd", table_names=["t"], indices_unique=True)
    np.testing.assert_allclose(var.numpy(), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"row index \d+ \(at position 5\) is below the one before"):
        optimizer_ops.sparse_apply([var.handle], [], [], 0.1, [tf.constant(np.append(rows, rows[0]))],
                                   [tf.ones([6, 4])], algorithm="sgd", table_names=["t"], indices_unique=True)
    np.testing.assert_array_equal(var.numpy(), want)
    opt, ref = sok.optimizers.Adam(0.1), NumpyOptimizer("adam", want, 0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-7)
    opt.apply_gradients([(tf.IndexedSlices(tf.constant(values), tf.constant(indices), [12, 4]), var)])
    ref.apply(indices, values)
    np.testing.assert_allclose(var.numpy(), ref.w, rtol=1e-5, atol=1e-6)


def test_lookup_gradients_take_the_unique_path_and_match_tensorflow(rng):
    """Inside tf.function the update knows the lookup gradient's indices are
    unique (no grouping); the result equals TensorFlow's lookup + the NumPy
    optimizer, and eager (grouping) gives the same."""
    specs = [(300, 8), (40, 4)]
    tables_np = [rng.standard_normal(s).astype(np.float32) for s in specs]
    feats = []
    for rows, dim in specs:
        lens = rng.integers(1, 6, 64)  # no empty rows: TF's lookup drops trailing ones
        ids = zipf_ranks(rng, rows, int(lens.sum()), 1.3)
        feats.append((to_ragged(lens, ids), rng.standard_normal((64, dim)).astype(np.float32)))
    hp = {"beta_1": 0.9, "beta_2": 0.99, "epsilon": 1e-7}

    def train(compiled):
        tables = [sok.Variable(t, name=f"t{i}") for i, t in enumerate(tables_np)]
        opt = sok.optimizers.Adam(0.05, **hp)

        def step():
            with tf.GradientTape() as tape:
                outs = sok.lookup_sparse(tables, [f for f, _ in feats], combiners=["mean", "sum"])
                loss = sum(tf.reduce_sum(o * u) for o, (_, u) in zip(outs, feats))
            opt.apply_gradients(zip(tape.gradient(loss, tables), tables))

        fn = tf.function(step) if compiled else step
        for _ in range(3):
            fn()
        if compiled:
            graph = fn.get_concrete_function().graph
            applies = [op for op in graph.get_operations() if op.type == "TfSokSparseApply"]
            assert len(applies) == 1 and applies[0].get_attr("indices_unique")
        return [t.numpy() for t in tables]

    refs = []
    for (rt, up), table in zip(feats, tables_np):
        ref, var = NumpyOptimizer("adam", table, 0.05, **hp), tf.Variable(table)
        for _ in range(3):
            with tf.GradientTape() as tape:
                comb = "mean" if not refs else "sum"
                out = tf.nn.embedding_lookup_sparse(var, rt.to_sparse(), None, combiner=comb)
                loss = tf.reduce_sum(out * up)
            g = tape.gradient(loss, var)
            ref.apply(g.indices.numpy(), g.values.numpy())
            var.assign(ref.w.astype(np.float32))
        refs.append(ref.w)
    for compiled in (True, False):
        for got, want in zip(train(compiled), refs):
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
