"""Shapes and id generators shared by the GPU benchmark (TensorFlow side) and its
PyTorch peer, so both measure the same work."""
import importlib.util
import os

import numpy as np

# Criteo Kaggle (DLRM) cardinalities, capped at 1e7 rows.
CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
CAP = 10_000_000
CARDINALITIES = [min(c, CAP) for c in CRITEO_KAGGLE]


def _load_zipf():
    """tf_sok's Zipf sampler, loaded from its file (importing the tf_sok package would import TensorFlow,
    which the PyTorch peer does without)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tf_sok", "python", "data", "zipf.py")
    spec = importlib.util.spec_from_file_location("tf_sok_zipf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.zipf_ranks


zipf_ranks = _load_zipf()


def ids_for(rng, rows, n, dist):
    """n ids in [0, rows): uniform, or Zipf(alpha) over the rows (zipf_ranks) with hot ids scattered
    over the table."""
    if dist == "uniform":
        return rng.integers(0, rows, n, dtype=np.int64)
    z = zipf_ranks(rng, rows, n, float(dist.split(":")[1]))
    return (z * 2654435761 % rows).astype(np.int64)


def fixed_hot_batch(rng, rows, batch, hotness, dist):
    """(ids [batch*hotness], offsets/row_splits [batch+1]) with exactly `hotness` ids per row."""
    ids = ids_for(rng, rows, batch * hotness, dist)
    splits = np.arange(0, batch * hotness + 1, hotness, dtype=np.int64)
    return ids, splits


# TensorFlow's two fast sum-pooled lookups over a RaggedTensor of ids whose rows all hold as many ids
# (the benchmarks' fixed-hotness batches), both with IndexedSlices gradients: the RaggedTensor handed
# to tf.nn.embedding_lookup_sparse as is (its segment ids are the row ids; no SparseTensor, whose
# conversion runs on the host), and a gather of the ids as a [batch, hotness] matrix summed over its
# second axis. The benchmarks time both and take the faster as TensorFlow's baseline.
TF_LOOKUP_FORMS = ("ragged", "gather")


def tf_sum_lookup(form, table, ids):
    import tensorflow as tf

    if form == "ragged":
        return tf.nn.embedding_lookup_sparse(table, ids, None, combiner="sum")
    return tf.reduce_sum(tf.gather(table, tf.reshape(ids.values, [ids.nrows(), -1])), axis=1)


class TFSparseOptimizer:
    """The fastest sparse update a TensorFlow user writes by hand for a tf.Variable table and
    its `tf.IndexedSlices` gradient (Keras 3's Adam and SGD densify such gradients): SGD as
    one `scatter_sub`; lazy Adam (tf_sok's semantics, as tfa.LazyAdam) as unique + segment
    sum, then gather / update / scatter of the touched rows of the table and its moments."""

    def __init__(self, kind: str, learning_rate: float, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        import tensorflow as tf

        self._tf, self.kind, self.lr = tf, kind, learning_rate
        self.b1, self.b2, self.eps = beta_1, beta_2, epsilon
        self.slots = {}
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False)

    def _moments(self, var):
        tf = self._tf
        key = var.ref()
        if key not in self.slots:
            self.slots[key] = [tf.Variable(tf.zeros_like(var), trainable=False) for _ in range(2)] + \
                [tf.Variable(tf.zeros(var.shape[:1], tf.int64), trainable=False)]
        return self.slots[key]

    def apply_gradients(self, grads_and_vars):
        tf = self._tf
        for g, var in grads_and_vars:
            if not isinstance(g, tf.IndexedSlices):
                raise TypeError(f"TFSparseOptimizer: {var.name} got a dense gradient (the baseline fell off its "
                                f"sparse path)")
            if self.kind == "sgd":
                var.scatter_sub(tf.IndexedSlices(g.values * self.lr, g.indices))
                continue
            m, v, t = self._moments(var)
            rows, pos = tf.unique(g.indices)
            grad = tf.math.unsorted_segment_sum(g.values, pos, tf.shape(rows)[0])
            steps = tf.gather(t, rows) + 1
            t.scatter_update(tf.IndexedSlices(steps, rows))
            steps = tf.cast(steps, tf.float32)[:, None]
            m_new = self.b1 * tf.gather(m, rows) + (1 - self.b1) * grad
            v_new = self.b2 * tf.gather(v, rows) + (1 - self.b2) * grad * grad
            m.scatter_update(tf.IndexedSlices(m_new, rows))
            v.scatter_update(tf.IndexedSlices(v_new, rows))
            lr = self.lr * tf.sqrt(1 - self.b2 ** steps) / (1 - self.b1 ** steps)
            var.scatter_sub(tf.IndexedSlices(lr * m_new / (tf.sqrt(v_new) + self.eps), rows))
        self.step.assign_add(1)
