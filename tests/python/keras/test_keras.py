"""Keras facade: model.fit trains tables and dense layers; checkpoints round-trip."""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
import tf_sok.data as sd
from examples import dlrm_synthetic as demo
from tests.helpers import embedding_then_dense, np_lookup, random_ragged


def _data(steps, batch, seed):
    return demo.make_dataset(*demo.make_data(steps * batch, seed=seed), batch)


def test_fit_trains_demo_model_and_checkpoint_round_trips(tmp_path):
    model = demo.build_model()
    hist = demo.History()
    model.fit(_data(120, 512, seed=1), epochs=1, callbacks=[hist], verbose=0)
    first, last = np.mean(hist.loss[:10]), np.mean(hist.loss[-10:])
    assert last < first - 0.05, (first, last)
    test = _data(10, 1000, seed=2)
    _, auc = model.evaluate(test, verbose=0)
    assert auc > 0.75
    sparse_vars, dense_vars = sok.filter_variables(model.trainable_variables)
    assert len(sparse_vars) == len(demo.FEATURES) and dense_vars

    x, _ = next(iter(test))
    before = model.predict_on_batch(x)
    path = str(tmp_path / "dlrm.weights.h5")
    model.save_weights(path)
    restored = demo.build_model()
    restored(x)
    restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(path)
    np.testing.assert_array_equal(restored.predict_on_batch(x), before)
    for a, b in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    ckpt_dir = str(tmp_path / "ckpt")
    saved = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(ckpt_dir)
    again = demo.build_model()
    again(x)
    again.optimizer.build(again.trainable_variables)
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).restore(saved).assert_existing_objects_matched()
    np.testing.assert_array_equal(again.predict_on_batch(x), before)
    sparse_state = [v for v in again.optimizer.variables if "user" in v.name]
    assert sparse_state and any(np.asarray(v).any() for v in sparse_state)


def test_embedding_layer_fit_updates_only_touched_rows(rng):
    vocab, dim, n = 500, 4, 256
    lens, ids = random_ragged(rng, n, vocab // 2, 3)  # upper half never looked up
    lens = np.maximum(lens, 1)
    ids = rng.integers(0, vocab // 2, int(lens.sum()))
    y = rng.standard_normal((n, 1)).astype(np.float32)
    emb = sok.layers.Embedding(vocab, dim, combiner="sum", name="emb")
    inp = tf.RaggedTensor.from_row_lengths(ids, lens)
    out_layer = keras.layers.Dense(1)

    model = embedding_then_dense(emb, out_layer)
    model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.SGD(0.05),
                                                sparse=sok.optimizers.Adagrad(0.1)), loss="mse")
    model(inp[:2])
    init = emb.table.numpy().copy()
    np.testing.assert_allclose(model(inp[:5]).numpy(),
                               np_lookup(init, lens[:5], ids[:int(lens[:5].sum())], None, "sum")
                               @ out_layer.kernel.numpy() + out_layer.bias.numpy(), rtol=1e-5, atol=1e-5)
    ds = tf.data.Dataset.from_tensor_slices((inp, y)).batch(32)
    h = model.fit(ds, epochs=3, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0]
    after = emb.table.numpy()
    np.testing.assert_array_equal(after[vocab // 2:], init[vocab // 2:])
    assert not np.array_equal(after[:vocab // 2], init[:vocab // 2])


def test_keras_optimizer_rejects_bad_arguments():
    with pytest.raises(TypeError, match="sparse must be a sok.optimizers"):
        sok.keras.Optimizer(dense=keras.optimizers.Adam(), sparse=keras.optimizers.Adam())
    with pytest.raises(ValueError, match="unsupported options"):
        sok.keras.Optimizer(dense=keras.optimizers.Adam(), sparse=sok.optimizers.SGD(), clipnorm=1.0)
    with pytest.raises(ValueError, match="defined twice"):
        sok.layers.EmbeddingCollection(tables=[sok.TableConfig("a", 5, 2), sok.TableConfig("a", 5, 2)],
                                       feature_to_table={"f": "a"})
    with pytest.raises(ValueError, match="unknown tables"):
        sok.layers.EmbeddingCollection(tables=[sok.TableConfig("a", 5, 2)], feature_to_table={"f": "b"})


def _lr_model(rng, vocab=200, dim=4):
    emb = sok.layers.Embedding(vocab, dim, combiner="sum", name="lr_emb")
    dense = keras.layers.Dense(1)

    lens = np.ones(256, np.int64)
    ids = rng.integers(0, vocab, 256)
    x = tf.RaggedTensor.from_row_lengths(ids, lens)
    y = rng.standard_normal((256, 1)).astype(np.float32)
    return embedding_then_dense(emb, dense), tf.data.Dataset.from_tensor_slices((x, y)).batch(64), x


@pytest.mark.parametrize("callback", ["scheduler", "plateau"])
def test_lr_callbacks_drive_the_sparse_rate_too(rng, callback):
    model, ds, _ = _lr_model(rng)
    opt = sok.keras.Optimizer(dense=keras.optimizers.SGD(0.1), sparse=sok.optimizers.SGD(0.4))
    model.compile(optimizer=opt, loss="mse")
    cb = (keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5 ** epoch) if callback == "scheduler"
          else keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9, min_lr=0))
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(
        (float(opt.learning_rate), opt.sparse_learning_rate)))
    model.fit(ds, epochs=3, verbose=0, callbacks=[cb, record])
    dense = [d for d, _ in seen]
    want = [0.1 * 0.5 ** e for e in range(3)]   # the plateau callback reduces from the 2nd epoch on (the 1st sets a best)
    np.testing.assert_allclose(dense, want, rtol=1e-6)
    np.testing.assert_allclose([s for _, s in seen], [4 * d for d in dense], rtol=1e-6)   # same ratio, 0.4 / 0.1


@pytest.mark.parametrize("follows", [True, False])
def test_sparse_update_uses_the_followed_rate(rng, follows):
    """One SGD step after the dense rate was halved: the table row moves by the NumPy-computed amount."""
    model, _, x = _lr_model(rng)
    opt = sok.keras.Optimizer(dense=keras.optimizers.SGD(0.1), sparse=sok.optimizers.SGD(0.4),
                              sparse_lr_follows_dense=follows)
    model(x[:2])
    table = model.emb.table
    opt.build(model.trainable_variables)
    opt.learning_rate = 0.05
    before = table.numpy().copy()
    grad = rng.standard_normal((3, 4)).astype(np.float32)
    rows = np.array([5, 17, 42])
    others = [v for v in model.trainable_variables if v is not table]
    opt.apply([tf.IndexedSlices(tf.constant(grad), tf.constant(rows, tf.int64), tf.constant([200, 4], tf.int64))] +
              [tf.zeros_like(v) for v in others], [table] + others)
    lr = 0.4 * (0.5 if follows else 1.0)
    want = before.copy()
    want[rows] -= lr * grad
    np.testing.assert_allclose(table.numpy(), want, rtol=1e-6, atol=1e-7)
    assert opt.sparse_learning_rate == pytest.approx(lr)
    with pytest.raises(TypeError, match="sparse_lr_follows_dense must be a bool"):
        sok.keras.Optimizer(dense=keras.optimizers.SGD(0.1), sparse=sok.optimizers.SGD(0.4), sparse_lr_follows_dense=1)


@pytest.mark.parametrize("policy,rtol", [("mixed_bfloat16", 2e-2), ("mixed_float16", 2e-3)])
def test_mixed_precision_fit_trains_and_first_outputs_match_float32(rng, policy, rtol):
    vocab, dim, n = 300, 8, 512
    lens = rng.integers(1, 4, n)
    x = tf.RaggedTensor.from_row_lengths(rng.integers(0, vocab, int(lens.sum())), lens)
    y = (rng.random((n, 1)) < 0.5).astype(np.float32)
    init = rng.uniform(-0.5, 0.5, (vocab, dim)).astype(np.float32)

    def build():
        emb = sok.layers.Embedding(vocab, dim, combiner="mean", initializer=keras.initializers.Constant(init),
                                   name="mp_emb")
        return emb

    reference = build()(x).numpy()                       # float32 policy
    np.testing.assert_allclose(reference, np_lookup(init, lens, x.values.numpy(), None, "mean"), rtol=1e-5,
                               atol=1e-6)
    keras.mixed_precision.set_global_policy(policy)
    try:
        emb = build()
        out = emb(x)
        assert out.dtype == policy.split("_")[1]          # emitted in the compute dtype
        assert emb.table.dtype == "float32"                # the table stays float32
        np.testing.assert_allclose(out.numpy().astype(np.float32), reference, rtol=rtol, atol=rtol)

        class M(keras.Model):
            def __init__(self):
                super().__init__()
                self.emb, self.top = emb, keras.layers.Dense(1, activation="sigmoid")

            def call(self, ids):
                return tf.cast(self.top(self.emb(ids)), tf.float32)

        model = M()
        opt = sok.keras.Optimizer(dense=keras.optimizers.Adam(1e-2), sparse=sok.optimizers.Adam(0.05))
        if policy == "mixed_float16":
            opt = keras.optimizers.LossScaleOptimizer(opt)
        model.compile(optimizer=opt, loss="binary_crossentropy")
        before = emb.table.numpy().copy()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*Converting sparse IndexedSlices.*")
            h = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=4, verbose=0)
        assert h.history["loss"][-1] < h.history["loss"][0], h.history
        assert emb.table.dtype == "float32" and not np.array_equal(emb.table.numpy(), before)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_matches_numpy_and_tensorflows_gather_gradient(rng, self_interaction):
    n, dim = int(rng.integers(2, 9)), int(rng.integers(1, 17))
    x = tf.constant(rng.standard_normal((33, n, dim)).astype(np.float32))
    pairs = [(i, j) for i in range(n) for j in range(i if self_interaction else i + 1, n)]
    layer = sok.layers.DotInteraction(self_interaction=self_interaction)
    up = tf.constant(rng.standard_normal((33, len(pairs))).astype(np.float32))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        got = layer(x)
        dots = tf.matmul(x, x, transpose_b=True)
        ref = tf.transpose(tf.gather_nd(tf.transpose(dots, [1, 2, 0]), pairs))   # TensorFlow's own pick
        loss, ref_loss = tf.reduce_sum(got * up), tf.reduce_sum(ref * up)
    xn = x.numpy().astype(np.float64)
    want = np.stack([(xn[:, i] * xn[:, j]).sum(-1) for i, j in pairs], axis=1)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), tape.gradient(ref_loss, x).numpy(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"expects \[batch, n, dim\]"):
        layer(tf.zeros([3, 4]))


@pytest.mark.parametrize("batches", [25, 30])   # the data ends inside an execution / at its end
def test_loop_on_host_trains_as_keras_own_loop(rng, batches):
    """sok.keras.loop_on_host: the same steps as Keras' steps_per_execution loop (same tables, dense
    weights and per-epoch losses), including the last, shorter execution of an epoch."""
    vocab, dim, n, batch = 300, 4, batches * 16, 16
    lens = rng.integers(1, 4, n)
    ids = rng.integers(0, vocab, int(lens.sum()))
    y = rng.standard_normal((n, 1)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((tf.RaggedTensor.from_row_lengths(ids, lens), y)).batch(batch)

    def build():
        model = embedding_then_dense(sok.layers.Embedding(vocab, dim, combiner="mean"), keras.layers.Dense(1))
        model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(0.01),
                                                    sparse=sok.optimizers.Adagrad(0.1)),
                      loss="mse", steps_per_execution=10)
        model(tf.RaggedTensor.from_row_lengths(ids[:lens[0]], lens[:1]))
        return model

    keras_loop, host_loop = build(), build()
    host_loop.set_weights(keras_loop.get_weights())
    before = keras_loop.get_weights()
    assert sok.keras.loop_on_host(host_loop) is host_loop
    h_keras = keras_loop.fit(ds, epochs=2, verbose=0)
    h_host = host_loop.fit(ds, epochs=2, verbose=0)
    assert "_host_loop_function" in host_loop.train_function.__qualname__   # not Keras' own loop
    assert host_loop.optimizer.iterations.numpy() == keras_loop.optimizer.iterations.numpy() == 2 * batches
    np.testing.assert_allclose(h_host.history["loss"], h_keras.history["loss"], rtol=1e-5)
    for a, b, c in zip(host_loop.get_weights(), keras_loop.get_weights(), before):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(a, c)   # every weight trained


def test_ragged_pairs_look_up_and_train_as_their_ragged_tensors(rng):
    """A feature given as its (values, row_splits) pair: lookup_sparse's outputs and gradients,
    and a model.fit, equal those of the RaggedTensor; row splits that do not fit the values raise
    the lookup's error naming the feature."""
    vocab, dim, n = 200, 5, 96
    lens = rng.integers(0, 5, n)
    ids = rng.integers(0, vocab, int(lens.sum()))
    rt = tf.RaggedTensor.from_row_lengths(ids, lens)
    table = sok.Variable(rng.standard_normal((vocab, dim)).astype(np.float32))
    with tf.GradientTape(persistent=True) as tape:
        a = sok.lookup_sparse([table], [rt], combiners=["sum"])[0]
        b = sok.lookup_sparse([table], [(rt.values, rt.row_splits)], combiners=["sum"])[0]
        la, lb = tf.reduce_sum(a * a), tf.reduce_sum(b * b)
    np.testing.assert_allclose(b.numpy(), np_lookup(table.numpy(), lens, ids, None, "sum"), rtol=1e-5, atol=1e-5)
    ga, gb = tape.gradient(la, table), tape.gradient(lb, table)
    np.testing.assert_allclose(tf.convert_to_tensor(gb).numpy(), tf.convert_to_tensor(ga).numpy(), rtol=1e-6)
    bad = tf.constant(np.r_[0, lens.cumsum()[:-1], lens.sum() + 3], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits of feature 'clicks'"):
        sok.lookup_sparse([table], [(rt.values, bad)], feature_names=["clicks"])

    y = rng.standard_normal((n, 1)).astype(np.float32)

    def fit(pairs):
        model = embedding_then_dense(sok.layers.Embedding(vocab, dim, combiner="mean", name="emb"),
                                     keras.layers.Dense(1, kernel_initializer="ones"))
        model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.SGD(0.05),
                                                    sparse=sok.optimizers.Adagrad(0.1)), loss="mse")
        ds = sd.for_keras(tf.data.Dataset.from_tensor_slices((tf.zeros([n, 1]), {"C1": rt}, y)).batch(32),
                          ragged_pairs=pairs).map(lambda x, t: (x["C1"], t))
        model(next(iter(ds))[0])
        model.emb.table.assign(table)
        model.fit(ds, epochs=2, verbose=0)
        return model.get_weights()

    for p, r in zip(fit(True), fit(False)):
        np.testing.assert_allclose(p, r, rtol=1e-6, atol=1e-7)
