"""The benchmarks' TensorFlow baselines compute what they stand in for: the hand-written sparse
updates (gpu_common.TFSparseOptimizer) equal the NumPy references of lazy Adam and SGD, and the
DLRM without tf_sok (benchmarks/tf_dlrm.py) trains like the examples' tf_sok DLRM from the same
weights on the same batches."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
import tf_sok.data as sd
from tests.python.optimizers.reference import NumpyOptimizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")]

from gpu_common import TFSparseOptimizer  # noqa: E402


@pytest.mark.parametrize("kind, hp", [("sgd", {}), ("adam", {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7})])
def test_the_sparse_updates_equal_the_numpy_references(kind, hp):
    rng = np.random.default_rng()
    table = rng.standard_normal((50, 6)).astype(np.float32)
    var, ref = tf.Variable(table), NumpyOptimizer(kind, table, 0.05, **hp)
    opt = TFSparseOptimizer(kind, 0.05)
    for _ in range(4):
        idx = rng.integers(0, 50, 30)                       # repeats: summed per row
        grads = rng.standard_normal((30, 6)).astype(np.float32)
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(grads), tf.constant(idx)), var)])
        ref.apply(idx, grads)
    np.testing.assert_allclose(var.numpy(), ref.w, rtol=1e-5, atol=1e-5)


def test_the_sparse_updates_refuse_a_dense_gradient():
    var = tf.Variable(tf.zeros([4, 2]))
    with pytest.raises(TypeError, match="got a dense gradient"):
        TFSparseOptimizer("sgd", 0.1).apply_gradients([(tf.ones([4, 2]), var)])


def test_the_tensorflow_dlrm_trains_like_the_tf_sok_dlrm():
    """Same tables (copied), same dense weights, same 3 batches, steps_per_execution 1: the two models'
    predictions agree after training (lazy Adam on both sides; float32 tolerance)."""
    import dlrm
    import tf_dlrm
    from criteo_common import default_optimizer

    sok.init()
    schema = sd.CriteoSchema.capped(300)
    seed = int(np.random.default_rng().integers(1 << 30))      # fresh batches each run
    data = sd.for_keras(sd.synthetic(3 * 256, 256, sd.SyntheticConfig(schema=schema), seed=seed, ragged_pairs=True))
    batches = list(data)
    ours = dlrm.DLRM(schema, 8)
    theirs = tf_dlrm.TFDLRM(schema, 8)
    ours(batches[0][0]), theirs(batches[0][0])          # build both
    theirs.set_weights(ours.get_weights()[-len(theirs.get_weights()):])
    tables = {v.name.split("/")[-1].split(":")[0]: v for v in ours.embeddings.variables}
    for name, t in zip(theirs.embeddings.names, theirs.embeddings.tables):
        t.assign(tables[name].numpy() if hasattr(tables[name], "numpy") else tf.convert_to_tensor(tables[name]))
    x0 = batches[0][0]
    start = ours(x0).numpy()
    np.testing.assert_allclose(theirs(x0).numpy(), start, rtol=1e-5, atol=1e-6)
    ours.compile(optimizer=default_optimizer(), loss="binary_crossentropy")
    theirs.compile(optimizer=tf_dlrm.optimizer(), loss="binary_crossentropy")
    for x, y in batches:
        ours.train_on_batch(x, y)
        theirs.train_on_batch(x, y)
    after = ours(x0).numpy()
    assert np.abs(after - start).max() > 1e-3              # both trained
    np.testing.assert_allclose(theirs(x0).numpy(), after, rtol=1e-4, atol=1e-5)


def test_the_tensorflow_dlrm_keeps_its_step_out_of_xla_unless_asked(monkeypatch):
    """Keras' jit_compile="auto" would compile the whole step, table scatters included, with XLA on a GPU
    (made to resolve as there); the baseline compiles like tf_sok's DLRM (no XLA for the step) unless the
    caller asks."""
    import tf_dlrm

    schema = sd.CriteoSchema.capped(50)
    model = tf_dlrm.TFDLRM(schema, 4)
    monkeypatch.setattr(type(model), "_resolve_auto_jit_compile", lambda self: True, raising=True)
    model.compile(optimizer=tf_dlrm.optimizer(), loss="binary_crossentropy", jit_compile="auto")
    assert model.jit_compile is True       # ("auto" as on a GPU)
    model.compile(optimizer=tf_dlrm.optimizer(), loss="binary_crossentropy")
    assert model.jit_compile is False
    model.compile(optimizer=tf_dlrm.optimizer(), loss="binary_crossentropy", jit_compile=True)
    assert model.jit_compile is True
