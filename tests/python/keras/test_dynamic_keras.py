"""Keras layers over dynamic tables: model.fit equals the same model over a static table (keys
mapped to rows, same initial values); weights files and checkpoints keep the keys."""
import keras
import numpy as np
import tensorflow as tf

import tf_sok as sok
from tests.python.test_dynamic import held, random_keys

DIM = 4


class Model(keras.Model):
    def __init__(self, table: sok.TableConfig):
        super().__init__()
        self.coll = sok.layers.EmbeddingCollection(tables=[table], feature_to_table={"f": table.name})
        self.dense = keras.layers.Dense(1, kernel_initializer="ones")

    def call(self, x):
        return self.dense(self.coll({"f": x})["f"])


def _compile(model):
    model.compile(optimizer=sok.keras.Optimizer(keras.optimizers.SGD(0.05), sok.optimizers.Adam(0.02)), loss="mse",
                  run_eagerly=False)
    return model


def _data(rng, values, n=96):
    picks = [rng.integers(0, len(values), rng.integers(1, 4)) for _ in range(n)]
    y = rng.standard_normal((n, 1)).astype(np.float32)
    return picks, y


def _dataset(ids, y, batch=16):
    return tf.data.Dataset.from_tensor_slices((tf.ragged.constant(ids, tf.int64), y)).batch(batch)


def test_fit_with_a_dynamic_table_equals_the_static_table_of_its_keys(rng):
    keys = random_keys(rng, 40)
    dynamic = _compile(Model(sok.TableConfig("h", 8, DIM, combiner="sum", dynamic=True, initializer="normal",
                                             seed=5)))
    static = _compile(Model(sok.TableConfig("s", len(keys), DIM, combiner="sum")))
    first = tf.gather(sok.DynamicVariable(DIM, initializer="normal", seed=5, name="probe"), keys).numpy()
    picks, y = _data(rng, keys)
    static(tf.ragged.constant([[0]], tf.int64))
    static.coll.tables["s"].assign(first)
    dynamic.fit(_dataset([keys[p].tolist() for p in picks], y), epochs=2, verbose=0, shuffle=False)
    static.fit(_dataset([p.tolist() for p in picks], y), epochs=2, verbose=0, shuffle=False)
    got = held(dynamic.coll.tables["h"].value)
    want = static.coll.tables["s"].numpy()
    used = sorted({int(i) for p in picks for i in p})
    assert set(got) == {int(keys[i]) for i in used}
    for i in used:
        np.testing.assert_allclose(got[keys[i]], want[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dynamic.dense.kernel.numpy(), static.dense.kernel.numpy(), rtol=1e-5, atol=1e-6)
    assert [v.name for v in sok.filter_variables(dynamic.trainable_variables)[0]] == ["h"]


def _restored(cfg, source):
    model = _compile(Model(cfg))
    model(tf.ragged.constant([[1]], tf.int64))
    model.optimizer.build(model.trainable_variables)
    if source.endswith(".h5"):
        model.load_weights(source)
    else:
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(source)
    return model


def test_weights_file_and_checkpoint_keep_keys_values_and_state(rng, tmp_path):
    keys = random_keys(rng, 30)
    cfg = sok.TableConfig("h", 4, DIM, combiner="mean", dynamic=True, max_capacity=25, evict_strategy="lru")
    model = _compile(Model(cfg))
    picks, y = _data(rng, keys)
    # batches of 8 samples of at most 3 ids: 24 distinct keys at most, which max_capacity holds (of the
    # 30 keys in all, so that training evicts)
    data = _dataset([keys[p].tolist() for p in picks], y, batch=8)
    model.fit(data, epochs=1, verbose=0)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    ck = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ck"))
    kept = held(model.coll.tables["h"].value)
    model.fit(data, epochs=1, verbose=0)          # train on; a resumed copy must reach the same state
    after = held(model.coll.tables["h"].value)

    from_file, from_checkpoint = _restored(cfg, path), _restored(cfg, ck)
    for m in (from_file, from_checkpoint):
        got = held(m.coll.tables["h"].value)
        assert set(got) == set(kept)
        for k in kept:
            np.testing.assert_array_equal(got[k], kept[k])
    # lookups insert keys evicted in training (as SOK's do): both copies alike
    x = tf.ragged.constant([keys[p].tolist() for p in picks[:8]], tf.int64)
    np.testing.assert_array_equal(from_file.predict_on_batch(x), from_checkpoint.predict_on_batch(x))

    for source in (ck, path):      # both keep the optimizer state of the dynamic table too
        resumed = _restored(cfg, source)
        resumed.fit(data, epochs=1, verbose=0)
        again = held(resumed.coll.tables["h"].value)
        assert set(again) == set(after)
        for k in after:
            np.testing.assert_allclose(again[k], after[k], rtol=1e-6, atol=1e-7, err_msg=source)
