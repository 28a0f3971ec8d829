"""Keras saving of models with sok.layers and sok.keras.Optimizer: model.save / keras.models.load_model,
the default (full-model) ModelCheckpoint, and load_weights into a model whose optimizer is not built
(an error, not a silently dropped optimizer state)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.python.test_dynamic import random_keys


@keras.saving.register_keras_serializable("tf_sok_tests")
class Small(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.coll = sok.layers.EmbeddingCollection(
            tables=[sok.TableConfig("item", 40, 4, initializer=keras.initializers.RandomNormal(0.0, 0.2, seed=3)),
                    sok.TableConfig("user", 8, 4, dynamic=True, combiner="sum", seed=5)],
            feature_to_table={"item": "item", "user": "user"})
        self.tag = sok.layers.Embedding(20, 3, combiner="sqrtn", initializer="zeros", name="tag")
        self.top = keras.layers.Dense(1, activation="sigmoid")

    def build(self, input_shape):
        self.top.build((None, 11))

    def call(self, x):
        e = self.coll({"item": x["item"], "user": x["user"]})
        return self.top(tf.concat([e["item"], e["user"], self.tag(x["tag"])], 1))


def compiled():
    m = Small()
    m.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(0.01),
                                            sparse=sok.optimizers.Adagrad(0.05, initial_accumulator_value=0.1)),
              loss="binary_crossentropy")
    return m


def data(rng, keys, n=12):
    def ragged(pool):
        lens = rng.integers(0, 4, n)
        return tf.RaggedTensor.from_row_lengths(tf.constant(rng.choice(pool, int(lens.sum())), tf.int64),
                                                tf.constant(lens, tf.int64))
    return ({"item": ragged(np.arange(40)), "user": ragged(keys), "tag": ragged(np.arange(20))},
            tf.constant(rng.integers(0, 2, (n, 1)), tf.float32))



def test_model_save_and_load_model_round_trip_then_train_alike(rng, tmp_path):
    keys = random_keys(rng, 30)
    batches = [data(rng, keys) for _ in range(5)]
    m = compiled()
    for x, y in batches[:3]:
        m.train_on_batch(x, y)
    m.save(tmp_path / "m.keras")
    m2 = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(m2.optimizer, sok.keras.Optimizer) and isinstance(m2.optimizer.sparse, sok.optimizers.Adagrad)
    assert m2.tag.get_config()["initializer"] == "zeros"
    assert m2.coll.table_configs[0].initializer.get_config()["stddev"] == 0.2
    np.testing.assert_array_equal(m.predict_on_batch(batches[0][0]), m2.predict_on_batch(batches[0][0]))
    for a, b in zip(m.optimizer.variables, m2.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    for x, y in batches[3:]:
        np.testing.assert_allclose(m2.train_on_batch(x, y), m.train_on_batch(x, y), rtol=1e-6)
    np.testing.assert_allclose(m2.predict_on_batch(batches[0][0]), m.predict_on_batch(batches[0][0]), rtol=1e-6)


def test_default_model_checkpoint_saves_loadable_models(rng, tmp_path):
    keys = random_keys(rng, 30)
    x, y = data(rng, keys, 64)
    m = compiled()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    m.fit(ds, epochs=2, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(str(tmp_path / "e{epoch}.keras"))])
    last = keras.models.load_model(tmp_path / "e2.keras")
    np.testing.assert_array_equal(last.predict_on_batch(x), m.predict_on_batch(x))


def test_load_weights_into_an_unbuilt_optimizer_fails_loudly(rng, tmp_path):
    keys = random_keys(rng, 30)
    x, y = data(rng, keys)
    m = compiled()
    m.train_on_batch(x, y)
    m.save_weights(tmp_path / "w.weights.h5")
    fresh = compiled()
    fresh(x)
    with pytest.raises(ValueError, match="holds 1[0-9] optimizer variables, this optimizer has .* not built"):
        fresh.load_weights(tmp_path / "w.weights.h5")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_array_equal(fresh.predict_on_batch(x), m.predict_on_batch(x))
    for a, b in zip(m.optimizer.variables, fresh.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
