"""Invalid arguments fail at once with errors that name the argument and value, and leave
tables and optimizer state unchanged (red-team findings 5-9)."""
import math

import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.helpers import embedding_then_dense


@pytest.mark.parametrize("shape,error,text", [
    ([-1, 4], ValueError, "rows must be >= 1, got -1"), ([0, 4], ValueError, "rows must be >= 1, got 0"),
    ([10, 0], ValueError, "dim must be >= 1, got 0"), ([10.5, 4], TypeError, "rows must be an integer, got 10.5"),
    ([True, 4], TypeError, "rows must be an integer, got True"), ([10], ValueError, "2-D shape"),
    ([10, 4, 2], ValueError, "2-D shape"), ("ab", ValueError, "2-D shape"),
])
def test_variable_rejects_bad_shapes(shape, error, text):
    with pytest.raises(error, match=text):
        sok.Variable(shape=shape, name="bad")


def test_variable_rejects_bad_initializers_and_conflicting_shape(rng):
    with pytest.raises(ValueError, match=r"initializer returned shape \(3, 4\), expected \[10, 4\]"):
        sok.Variable(shape=[10, 4], initializer=lambda shape, dtype: tf.zeros([3, 4]), name="bad")
    with pytest.raises(ValueError, match=r"initializer returned shape \(10, 4, 1\)"):
        sok.Variable(shape=[10, 4], initializer=lambda shape, dtype: tf.zeros([10, 4, 1]), name="bad")
    value = rng.standard_normal((6, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=r"shape=\[6, 4\] conflicts with initial_value's shape \[6, 3\]"):
        sok.Variable(value, shape=[6, 4], name="bad")
    with pytest.raises(ValueError, match=r"rows >= 1, dim >= 1"):
        sok.Variable(np.zeros((0, 3), np.float32), name="bad")
    ok = sok.Variable(value, shape=[6, 3], name="good")                # a matching shape= is fine
    np.testing.assert_array_equal(ok.numpy(), value)


@pytest.mark.parametrize("make,text", [
    (lambda: sok.optimizers.Adagrad(0.1, initial_accumulator_value=-1), "initial_accumulator_value must be >= 0"),
    (lambda: sok.optimizers.Adagrad(0.1, initial_accumulator_value=math.nan), "must be finite"),
    (lambda: sok.optimizers.Adagrad(0.1, epsilon=math.inf), "epsilon must be finite"),
    (lambda: sok.optimizers.Adam(math.nan), "learning_rate must be finite"),
    (lambda: sok.optimizers.Adam(-0.1), "learning_rate must be >= 0"),
    (lambda: sok.optimizers.Adam(0.1, beta_1=1.0), r"beta_1 must be in \[0, 1\)"),
    (lambda: sok.optimizers.Adam(0.1, beta_2=math.nan), "beta_2 must be finite"),
    (lambda: sok.optimizers.Ftrl(0.1, l1_regularization_strength=math.nan), "l1_regularization_strength must be finite"),
    (lambda: sok.optimizers.Ftrl(0.1, beta=-1), "beta must be >= 0"),
    (lambda: sok.optimizers.Ftrl(0.1, learning_rate_power=0.5), "learning_rate_power must be <= 0"),
    (lambda: sok.optimizers.RMSprop(0.1, rho=-0.1), r"rho must be in \[0, 1\)"),
    (lambda: sok.optimizers.Momentum(0.1, momentum=math.inf), "momentum must be finite"),
])
def test_optimizer_hyper_parameters_validated_at_construction(make, text):
    with pytest.raises(ValueError, match=text):
        make()


def test_optimizer_type_errors():
    with pytest.raises(TypeError, match="learning_rate must be a real number, got 'fast'"):
        sok.optimizers.SGD("fast")
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        sok.optimizers.Momentum(0.1, nesterov="no")
    with pytest.raises(TypeError, match="epsilon must be a real number, got True"):
        sok.optimizers.Adam(0.1, epsilon=True)
    sok.optimizers.Adam(tf.Variable(0.1))                                  # variables and schedules are fine
    sok.optimizers.SGD(lambda: 0.1)


def test_float_indices_and_short_dense_gradients_are_errors_and_write_nothing(rng):
    table = sok.Variable(rng.standard_normal((8, 3)).astype(np.float32), name="val_table")
    opt = sok.optimizers.Adagrad(0.1)
    opt.apply_gradients([(tf.IndexedSlices(tf.ones([1, 3]), tf.constant([2], tf.int64), tf.constant([8, 3], tf.int64)),
                          table)])
    before, slots, step = table.numpy().copy(), [s.numpy().copy() for s in opt.slots(table)], int(opt.iterations)
    with pytest.raises(TypeError, match="'val_table' has float32 indices; row indices must be int32 or int64"):
        opt.apply_gradients([(tf.IndexedSlices(tf.ones([1, 3]), tf.constant([1.7]), tf.constant([8, 3], tf.int64)),
                              table)])
    with pytest.raises(ValueError, match=r"dense gradient of table 'val_table' has shape \(7, 3\), the table \(8, 3\)"):
        opt.apply_gradients([(tf.ones([7, 3]), table)])

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def apply_dense(g):
        opt.apply_gradients([(g, table)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="dense gradient of table val_table must have the shape of the table"):
        apply_dense(tf.ones([7, 3]))
    np.testing.assert_array_equal(table.numpy(), before)
    for s, b in zip(opt.slots(table), slots):
        np.testing.assert_array_equal(s.numpy(), b)
    assert int(opt.iterations) == step
    g = rng.standard_normal((8, 3)).astype(np.float32)                    # a full dense gradient is applied
    apply_dense(tf.constant(g))
    acc = slots[0] + g * g
    np.testing.assert_allclose(table.numpy(), before - 0.1 * g / np.sqrt(acc + 1e-7), rtol=1e-5, atol=1e-6)


def test_lookup_rejects_bad_feature_names_and_combiners(rng):
    table = sok.Variable(shape=[10, 2], name="names_table")
    ids = [tf.ragged.constant([[1], [2]], tf.int64)] * 2
    with pytest.raises(ValueError, match="1 feature_names for 2 features"):
        sok.lookup_sparse([table, table], ids, feature_names=["a"])
    with pytest.raises(ValueError, match="3 feature_names for 2 features"):
        sok.lookup_sparse([table, table], ids, feature_names=["a", "b", "c"])
    with pytest.raises(TypeError, match="feature_names must be a list of strings, got 'ab'"):
        sok.lookup_sparse([table, table], ids, feature_names="ab")
    with pytest.raises(TypeError, match="combiners must be a string or a list of strings, got 0"):
        sok.lookup_sparse([table, table], ids, combiners=0)


def test_a_failing_fit_step_moves_no_counter_and_no_schedule(rng):
    """A batch with an id past its table fails model.fit; the optimizer's, the sparse and the dense
    counters (and so a learning-rate schedule) stay where the last good step left them."""
    import keras

    emb = sok.layers.Embedding(50, 4, combiner="sum", name="ctr_emb")
    top = keras.layers.Dense(1)

    m = embedding_then_dense(emb, top)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)
    opt = sok.keras.Optimizer(dense=keras.optimizers.SGD(schedule), sparse=sok.optimizers.Adagrad(0.1))
    m.compile(optimizer=opt, loss="mse")
    good = tf.RaggedTensor.from_row_lengths(rng.integers(0, 50, 16), np.ones(16, np.int64))
    bad = tf.RaggedTensor.from_row_lengths(np.array([3, 77] + [1] * 14), np.ones(16, np.int64))
    y = rng.standard_normal((16, 1)).astype(np.float32)
    m.fit(tf.data.Dataset.from_tensors((good, y)), epochs=1, verbose=0)
    counters = lambda: (int(opt.iterations), int(opt.sparse.iterations), int(opt.dense.iterations))  # noqa: E731
    before, table, lr = counters(), emb.table.numpy().copy(), float(opt.learning_rate)
    assert before == (1, 1, 1)
    for _ in range(3):
        with pytest.raises(tf.errors.InvalidArgumentError, match="id 77"):
            m.fit(tf.data.Dataset.from_tensors((bad, y)), epochs=1, verbose=0)
    assert counters() == before
    assert float(opt.learning_rate) == lr
    np.testing.assert_array_equal(emb.table.numpy(), table)


@pytest.mark.parametrize("graph", [False, True])
def test_weights_must_have_the_ids_rows_not_only_their_count(rng, graph):
    init = rng.standard_normal((10, 3)).astype(np.float32)
    table = sok.Variable(init, name="w_rows")
    ids = tf.ragged.constant([[1, 2], [3]], tf.int64)
    shifted = tf.ragged.constant([[0.5], [2.0, 3.0]])            # 3 weights, other rows
    good = tf.ragged.constant([[0.5, 2.0], [3.0]])
    run = tf.function(lambda w: sok.lookup_sparse(table, ids, w, combiners="sum", feature_names=["clicks"])) \
        if graph else (lambda w: sok.lookup_sparse(table, ids, w, combiners="sum", feature_names=["clicks"]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature clicks: the rows \(row_splits\) of the weights differ"):
        run(shifted)
    np.testing.assert_allclose(run(good).numpy(), [0.5 * init[1] + 2.0 * init[2], 3.0 * init[3]], rtol=1e-6)


def _random_sparse(rng, batch, cols, vocab, gaps):
    """A random [batch, cols] SparseTensor of ids with entries in shuffled order; with gaps, a row's
    columns need not start at 0 or be consecutive."""
    mask = rng.random((batch, cols)) < 0.5
    if not gaps:
        mask = np.arange(cols)[None, :] < mask.sum(1, keepdims=True)
    idx = np.argwhere(mask)
    rng.shuffle(idx)
    return idx, rng.integers(0, vocab, len(idx)), rng.uniform(0.5, 2, len(idx)).astype(np.float32)


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_any_valid_sparse_tensor_gives_tensorflows_result(rng, gaps, graph):
    """SparseTensor ids in any entry order, with or without gaps in their columns, weighted or
    not: TensorFlow's own lookup of the reordered tensor."""
    init = rng.standard_normal((50, 4)).astype(np.float32)
    table = sok.Variable(init, name="sp")
    idx, ids, w = _random_sparse(rng, 23, 6, 50, gaps)
    sp = tf.SparseTensor(idx, ids, [23, 6])
    spw = tf.SparseTensor(idx, w, [23, 6])
    run = (tf.function if graph else (lambda f: f))(
        lambda s, sw: sok.lookup_sparse([table, table], [s, s], [None, sw], combiners=["mean", "sum"]))
    got = run(sp, spw)
    ref = tf.Variable(init)
    ordered, ordered_w = tf.sparse.reorder(sp), tf.sparse.reorder(spw)
    want = [tf.nn.embedding_lookup_sparse(ref, ordered, None, combiner="mean"),
            tf.nn.embedding_lookup_sparse(ref, ordered, ordered_w, combiner="sum")]
    for g, r in zip(got, want):
        full = np.zeros((23, 4), np.float32)
        full[:r.shape[0]] = r.numpy()        # TensorFlow leaves out trailing empty rows
        np.testing.assert_allclose(g.numpy(), full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("graph", [False, True])
def test_invalid_sparse_tensors_are_rejected_naming_the_feature(rng, graph):
    """An index past dense_shape (row or column, or negative), an index given twice, and weights
    at other indices than the ids: InvalidArgumentError naming the feature, nothing computed."""
    table = sok.Variable(rng.standard_normal((20, 3)).astype(np.float32), name="sp_bad")
    run = (tf.function if graph else (lambda f: f))(
        lambda s, w=None: sok.lookup_sparse(table, s, w, feature_names=["clicks"]))
    good = [[0, 0], [2, 1], [1, 0]]
    for bad, text in (([[0, 0], [5, 0], [1, 0]], r"entry.*1.*has index.*5,? 0.*outside dense_shape.*4,? 3"),
                      ([[0, 0], [2, 3], [1, 0]], r"has index.*2,? 3.*outside dense_shape"),
                      ([[0, 0], [2, -1], [1, 0]], r"has index.*2,? -1.*outside dense_shape"),
                      ([[0, 0], [2, 1], [0, 0]], r"SparseTensor index.*0,? 0.*appears more than once")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?s)feature clicks.*" + text):
            run(tf.SparseTensor(tf.constant(bad, tf.int64), tf.constant([1, 2, 3], tf.int64), [4, 3]))
    ids = tf.SparseTensor(tf.constant(good, tf.int64), tf.constant([1, 2, 3], tf.int64), [4, 3])
    other = tf.SparseTensor(tf.constant([[0, 0], [2, 2], [1, 0]], tf.int64), tf.constant([1.0, 2.0, 3.0]), [4, 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature clicks: the weights SparseTensor indices differ"):
        run(ids, other)
    assert run(ids).shape == (4, 3)


def _trained_model(rng, vocab, dim):
    import keras

    model = embedding_then_dense(sok.layers.Embedding(vocab, dim, name="items"), keras.layers.Dense(1))
    model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(1e-2), sparse=sok.optimizers.Adam(0.05)),
                  loss="mse")
    lens = rng.integers(1, 3, 16)
    x = tf.RaggedTensor.from_row_lengths(rng.integers(0, min(vocab, 40), int(lens.sum())), lens)
    model.fit(tf.data.Dataset.from_tensors((x, tf.ones([16, 1]))).repeat(int(rng.integers(1, 4))), verbose=0)
    return model


def _state(model):
    opt = model.optimizer
    return [v.numpy().copy() for v in model.weights] + [int(opt.iterations), int(opt.sparse.iterations)]


@pytest.mark.parametrize("other", [(60, 4), (40, 5)])
def test_restore_is_all_or_nothing(rng, tmp_path, other):
    """A checkpoint of another table size or width: sok.restore raises one ValueError naming the
    table and both shapes and changes nothing (dense weights, tables, counters); a fitting one
    restores every value."""
    saved = _trained_model(rng, 40, 4)
    path = tf.train.Checkpoint(model=saved, optimizer=saved.optimizer).save(str(tmp_path / "c"))
    target = _trained_model(rng, *other)
    before = _state(target)
    with pytest.raises(ValueError, match=rf"table 'items'\): checkpoint \[40, 4\], model \[{other[0]}, {other[1]}\].*"
                                         r"nothing was restored|nothing was restored.*table 'items'"):
        sok.restore(tf.train.Checkpoint(model=target, optimizer=target.optimizer), path)
    for a, b in zip(_state(target), before):
        np.testing.assert_array_equal(a, b)
    fitting = _trained_model(rng, 40, 4)
    sok.restore(tf.train.Checkpoint(model=fitting, optimizer=fitting.optimizer), path).assert_existing_objects_matched()
    for a, b in zip(_state(fitting), _state(saved)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="save_path is empty"):
        sok.restore(tf.train.Checkpoint(model=fitting), None)
