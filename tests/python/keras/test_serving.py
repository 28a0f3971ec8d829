"""sok.export_saved_model: the SavedModel holds no tf_sok op and, loaded in a process where tf_sok
cannot be imported, predicts what the Keras model predicts (static and dynamic tables, every
combiner, weights, a sequence feature, keys the tables never saw). The initial values of unseen keys
are checked against the op library's own."""
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.python.test_dynamic import random_keys


class Model(keras.Model):
    def __init__(self, init):
        super().__init__()
        self.coll = sok.layers.EmbeddingCollection(
            tables=[sok.TableConfig("item", 50, 4, combiner="mean"),
                    sok.TableConfig("user", 1, 4, dynamic=True, initializer=init, seed=11)],
            feature_to_table={"item": "item", "item2": "item", "user": "user", "hist": "user"},
            combiners={"item2": "sqrtn", "hist": None})
        self.tag = sok.layers.Embedding(30, 3, combiner="sum", name="tag")
        self.top = keras.layers.Dense(1, activation="sigmoid")

    def call(self, x):
        e = self.coll({k: x[k] for k in ("item", "item2", "user", "hist")})
        hist = tf.reduce_sum(e["hist"], axis=1)
        return self.top(tf.concat([x["dense"], e["item"], e["item2"], e["user"], hist, self.tag(x["tag"])], 1))


def batch(rng, keys, n=16):
    def ragged(pool, most):
        lens = rng.integers(0, most, n)
        return tf.RaggedTensor.from_row_lengths(tf.constant(rng.choice(pool, int(lens.sum())), tf.int64),
                                                tf.constant(lens, tf.int64))
    return {"dense": tf.constant(rng.standard_normal((n, 2)), tf.float32),
            "item": ragged(np.arange(50), 4), "item2": ragged(np.arange(50), 3),
            "user": ragged(keys, 3), "hist": ragged(keys, 5), "tag": ragged(np.arange(30), 3)}


_LOAD = r"""
import sys
sys.modules["tf_sok"] = None          # importing tf_sok here fails
import json, numpy as np, tensorflow as tf
path, data, out = sys.argv[1:]
m = tf.saved_model.load(path)
b = dict(np.load(data, allow_pickle=True))
flat = {k: tf.constant(v) for k, v in b.items()}
served = m.signatures["serving_default"](**flat)["output"].numpy()
ragged = {k: (tf.RaggedTensor.from_row_splits(flat[k], flat[k + "_row_splits"]) if k + "_row_splits" in flat else flat[k])
          for k in flat if not k.endswith("_row_splits")}
np.savez(out, serving_default=served, serve=m.serve(ragged).numpy())
"""


@pytest.mark.parametrize("init, pairs", [("uniform", False), ("normal", False), ("truncated_normal", False),
                                         ("0.25", False), ("uniform", True)])
def test_exported_model_predicts_alike_without_tf_sok(rng, tmp_path, init, pairs):
    """pairs: the model trained on, and exported from, batches whose ragged ids are (values,
    row_splits) pairs (the readers' ragged_pairs=True); the SavedModel serves them as ragged."""
    keys = random_keys(rng, 40)
    model = Model(init)
    model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(0.01), sparse=sok.optimizers.Adam(0.05)),
                  loss="binary_crossentropy")
    def fed(b):
        return {k: (v.values, v.row_splits) if pairs and isinstance(v, tf.RaggedTensor) else v for k, v in b.items()}
    for _ in range(3):
        model.train_on_batch(fed(batch(rng, keys[:30])), tf.constant(rng.integers(0, 2, (16, 1)), tf.float32))
    test = batch(rng, keys)             # keys[30:] never seen in training
    path = str(tmp_path / "served")
    sok.export_saved_model(model, path, fed(test))
    want = model.predict_on_batch(test)  # the training lookup (inserts the unseen keys at their initial value)
    pb = open(os.path.join(path, "saved_model.pb"), "rb").read()
    assert b"TfSok" not in pb
    flat = {}
    for k, v in test.items():
        if isinstance(v, tf.RaggedTensor):
            flat[k], flat[k + "_row_splits"] = v.values.numpy(), v.row_splits.numpy()
        else:
            flat[k] = v.numpy()
    np.savez(tmp_path / "batch.npz", **flat)
    script = tmp_path / "load.py"
    script.write_text(_LOAD)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("PYTHONPATH", None)
    p = subprocess.run([sys.executable, str(script), path, str(tmp_path / "batch.npz"), str(tmp_path / "out.npz")],
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(got["serving_default"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["serve"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, init", [(0, "uniform"), (1, "normal"), (2, "truncated_normal"), (3, "0.5")])
def test_initial_values_in_stock_ops_equal_the_op_librarys(rng, kind, init):
    from tf_sok.python.serving import initial_values

    keys = random_keys(rng, 500)
    seed = int(rng.integers(0, 2**31))
    table = sok.DynamicVariable(7, initializer=init, seed=seed, name="t")
    assert table.initial_spec[0] == kind
    want = tf.gather(table, keys).numpy()
    got = initial_values(tf.constant(keys), 7, *table.initial_spec).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_import_registers_the_ops_for_a_saved_model_with_tf_sok_ops(tmp_path):
    """A SavedModel that keeps tf_sok ops (tf.saved_model.save of a module doing a lookup) loads in a
    fresh process right after `import tf_sok`, before any op call."""
    table = sok.Variable(np.arange(12, dtype=np.float32).reshape(6, 2), name="t")
    m = tf.Module()
    m.table = table

    @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64, 1, tf.int64)])
    def f(ids):
        return sok.lookup_sparse(table, ids, combiners="sum")

    m.f = f
    tf.saved_model.save(m, str(tmp_path / "m"))
    code = ("import sys, tensorflow as tf, tf_sok\n"
            "m = tf.saved_model.load(sys.argv[1])\n"
            "print(m.f(tf.ragged.constant([[1, 2], [5]], dtype=tf.int64)).numpy().tolist())")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [[2.0 + 4.0, 3.0 + 5.0], [10.0, 11.0]]
