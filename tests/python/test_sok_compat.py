"""SOK scripts switch by changing the import: SOK's init arguments and names, OptimizerWrapper over
Keras 3, tf_keras and tf_keras' legacy optimizers (against the NumPy references), sparse Adamax and
Adadelta, tf_keras' legacy optimizers applied to sok.Variables directly (against the same
optimizer on a tf.Variable)."""
import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_sok as sok
from tests.helpers import to_ragged
from tests.python.optimizers.reference import NumpyOptimizer
from tests.python.test_dynamic import held, random_keys

# name: (hyper-parameters, the NumPy reference's name and hyper-parameters)
OPTIMIZERS = {
    "SGD": ({"learning_rate": 0.1}, "sgd", {}),
    "SGD-momentum": ({"learning_rate": 0.1, "momentum": 0.8, "nesterov": True}, "momentum",
                     {"momentum": 0.8, "nesterov": True}),
    "Adagrad": ({"learning_rate": 0.1, "initial_accumulator_value": 0.2, "epsilon": 1e-7}, "adagrad",
                {"initial_accumulator_value": 0.2, "epsilon": 1e-7}),
    "Adam": ({"learning_rate": 0.05, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-7}, "adam",
             {"beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-7}),
    "Adamax": ({"learning_rate": 0.05, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-7}, "adamax",
               {"beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-7}),
    "Adadelta": ({"learning_rate": 1.0, "rho": 0.9, "epsilon": 1e-6}, "adadelta", {"rho": 0.9, "epsilon": 1e-6}),
    "Ftrl": ({"learning_rate": 0.1, "learning_rate_power": -0.5, "initial_accumulator_value": 0.1,
              "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02}, "ftrl",
             {"learning_rate_power": -0.5, "initial_accumulator_value": 0.1, "l1_regularization_strength": 0.01,
              "l2_regularization_strength": 0.02, "l2_shrinkage_regularization_strength": 0.0}),
    "RMSprop": ({"learning_rate": 0.05, "rho": 0.8, "epsilon": 1e-7}, "rmsprop", {"rho": 0.8, "epsilon": 1e-7}),
}
FAMILIES = {"keras": lambda n: getattr(keras.optimizers, n), "tf_keras": lambda n: getattr(tf_keras.optimizers, n),
            "tf_keras.legacy": lambda n: getattr(tf_keras.optimizers.legacy, n)}


def make(family, name):
    hp, _, _ = OPTIMIZERS[name]
    return FAMILIES[family](name.split("-")[0])(**hp)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_wrapper_over_every_optimizer_family_matches_numpy(rng, family, name):
    _, ref_name, ref_hp = OPTIMIZERS[name]
    dim, n_keys = 4, 30
    keys = random_keys(rng, n_keys)
    init = rng.standard_normal((n_keys, dim)).astype(np.float32)
    static = sok.Variable(init, name="static")
    dynamic = sok.DynamicVariable(dim, name="dynamic", init_capacity=4)
    sok.assign(dynamic, keys, init)
    opt = sok.OptimizerWrapper(make(family, name))
    ref = NumpyOptimizer(ref_name, init, OPTIMIZERS[name][0]["learning_rate"], **ref_hp)
    for _ in range(3):
        lens = rng.integers(0, 4, 10)
        picks = rng.integers(0, n_keys // 2, int(lens.sum()))
        target = rng.standard_normal((10, dim)).astype(np.float32)
        with tf.GradientTape() as tape:
            a, b = sok.lookup_sparse([static, dynamic], [to_ragged(lens, picks), to_ragged(lens, keys[picks])],
                                     combiners="sum")
            loss = tf.reduce_sum(a * target) + tf.reduce_sum(b * target)
        opt.apply_gradients(zip(tape.gradient(loss, [static, dynamic]), [static, dynamic]))
        ref.apply(picks, np.repeat(target, lens, axis=0))
    np.testing.assert_allclose(static.numpy(), ref.w, rtol=2e-5, atol=2e-6)
    got = held(dynamic)
    for i, k in enumerate(keys):
        np.testing.assert_allclose(got[k], ref.w[i], rtol=2e-5, atol=2e-6)
    assert opt.get_slot_names() == [s.name for s in opt.slot_specs()]
    for s in opt.get_slot_names():
        assert opt.get_slot(static, s) is opt.slots(static)[opt.get_slot_names().index(s)]
    assert "get_slot_names" not in dir(opt)   # TensorFlow's checkpointing would take it for a TF1 optimizer


@pytest.mark.parametrize("name", ["Adamax", "Adadelta"])
def test_sparse_adamax_and_adadelta_equal_keras_when_every_row_is_touched(rng, name):
    hp, _, _ = OPTIMIZERS[name]
    table = rng.standard_normal((6, 3)).astype(np.float32)
    mine = sok.Variable(table, name="t")
    theirs = keras.Variable(table)
    ours = getattr(sok.optimizers, name)(**hp)
    keras_opt = getattr(keras.optimizers, name)(**hp)
    for _ in range(4):
        g = rng.standard_normal((6, 3)).astype(np.float32)
        ours.apply_gradients([(tf.IndexedSlices(tf.constant(g), tf.range(6, dtype=tf.int64)), mine)])
        keras_opt.apply_gradients([(tf.constant(g), theirs)])
    np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)


def test_sparse_tf_ops_optimizers_reject_bad_rows_and_update_nothing(rng):
    t = sok.Variable(rng.standard_normal((5, 2)).astype(np.float32), name="t")
    opt = sok.optimizers.Adamax(0.1)
    opt.build([t])
    before = t.numpy().copy()
    with pytest.raises(tf.errors.InvalidArgumentError, match="table t: a row index is outside"):
        opt.apply_gradients([(tf.IndexedSlices(tf.ones([2, 2]), tf.constant([1, 7], tf.int64)), t)])
    np.testing.assert_array_equal(t.numpy(), before)


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Adam", "RMSprop"])
def test_tf_keras_legacy_optimizers_train_sok_variables_like_tf_variables(rng, name):
    hp, _, _ = OPTIMIZERS[name]
    table = rng.standard_normal((20, 3)).astype(np.float32)
    mine, plain = sok.Variable(table, name="t"), tf.Variable(table)
    opts = [getattr(tf_keras.optimizers.legacy, name)(**hp) for _ in range(2)]
    for _ in range(3):
        ids = tf.constant(rng.integers(0, 20, (6, 2)), tf.int64)
        for var, opt in zip((mine, plain), opts):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.nn.embedding_lookup(var, ids)))
            opt.apply_gradients([(tape.gradient(loss, var), var)])
    np.testing.assert_allclose(mine.numpy(), plain.numpy(), rtol=1e-6, atol=1e-7)


def test_sok_init_arguments_names_and_version():
    assert sok.init("single").num_ranks == 1                      # SOK passes comm_tool positionally
    assert sok.init(comm_tool="single", use_legacy_optimizer=False).num_ranks == 1
    with pytest.raises(ValueError, match="comm_tool must be one of"):
        sok.init(comm_tool="mpi")
    import sys
    if "horovod.tensorflow" not in sys.modules:
        with pytest.raises(RuntimeError, match=r"hvd.init\(\) first"):
            sok.init(comm_tool="horovod")
    assert sok.tf_version[:2] == [int(x) for x in tf.__version__.split(".")[:2]]
    assert sok.SGD is sok.optimizers.SGD
    for name, instead in (("DistributedVariable", "mode="), ("Saver", "tf.train.Checkpoint"),
                          ("All2AllDenseEmbedding", "EmbeddingCollection")):
        with pytest.raises(AttributeError, match=f"tf_sok has no {name} \\(a SOK name\\); use .*{instead}"):
            getattr(sok, name)
    sok.init()
    v = sok.DynamicVariable(3, initializer="13", name="dyn")
    sok_vars, other = sok.filter_variables([tf.Variable([1.0]), sok.Variable(shape=[4, 3], name="s"), v])
    assert sok_vars[1] is v and len(other) == 1
