"""The small DLRM as a TensorFlow user builds it without tf_sok, in its fastest form: the 26 tables
as tf.Variables, each feature's ids gathered and mean-pooled by row (`tf.gather`, then
`tf.sparse.segment_mean` of the gathered rows, as `tf.nn.embedding_lookup_sparse` builds it, over
the (values, row_splits) pairs the pipeline feeds; on the project's CPU machine, 26 tables of 1e5 x 16
at batch 4,096, a step of lookups and sparse updates took 20-24 ms this way, 33 ms with
`tf.math.unsorted_segment_sum` for the mean and 50-53 ms with `tf.sparse.segment_mean` straight from
the table with `sparse_gradient=True`), gradients
kept as `tf.IndexedSlices` and applied by a lazy Adam over the touched rows
(gpu_common.TFSparseOptimizer: Keras 3's optimizers would densify them), the dense part (the same
layers as examples/dlrm.py) by Keras' Adam. e2e_bench.py's "DLRM-tf" fit runs train it next to
tf_sok's DLRM on the same batches."""
import keras
import tensorflow as tf

from dlrm import DLRM
from gpu_common import TFSparseOptimizer


class PooledTables:
    """tf.Variable tables and their mean-pooled lookups: features -> {name: [batch, dim]}."""

    def __init__(self, names, vocab_sizes, dim):
        self.names = list(names)
        self.tables = [tf.Variable(tf.random.uniform([v, dim], -0.05, 0.05), name=f"tf_{n}")
                       for n, v in zip(self.names, vocab_sizes)]

    def __call__(self, features):
        out = {}
        for name, table in zip(self.names, self.tables):
            f = features[name]
            values, splits = (f.values, f.row_splits) if isinstance(f, tf.RaggedTensor) else f
            rows = tf.ragged.row_splits_to_segment_ids(splits)   # (sorted, as the sparse segment ops need)
            n = tf.shape(splits, out_type=rows.dtype)[0] - 1
            picked = tf.gather(table, values)   # (its gradient: IndexedSlices of the ids' rows)
            out[name] = tf.sparse.segment_mean(picked, tf.range(tf.shape(values, out_type=rows.dtype)[0]),
                                               rows, num_segments=n)   # (0 for a row without ids)
        return out


class TFDLRM(DLRM):
    """examples/dlrm.py's model with TensorFlow's own tables and sparse updates (see above)."""

    def __init__(self, schema, dim, sparse_learning_rate=0.01, **kwargs):
        super().__init__(schema, dim, **kwargs)
        self.sparse_optimizer = TFSparseOptimizer("adam", sparse_learning_rate)

    def compile(self, *args, jit_compile=False, **kwargs):
        """As Keras' compile, but not the whole step under XLA by default: Keras' jit_compile="auto" picks
        XLA on a GPU for this model (all its layers support it, unlike tf_sok's), and XLA then compiles the
        step with its scatters into the 26 tables and their moments. On an H100 that step
        (steps_per_execution 10, tables capped at 1e7 rows of dim 128) filled the GPU's memory and had not
        finished its first execution 330 s after the process started; on the CPU it compiles for ~95 s and
        runs each step 1.7-2x slower. Like tf_sok's DLRM, only the dense part is compiled, and only when
        asked (jit_dense)."""
        super().compile(*args, jit_compile=jit_compile, **kwargs)

    def make_embeddings(self, schema, dim, max_hbm_for_vectors):
        if max_hbm_for_vectors is not None:
            raise ValueError("TFDLRM: TensorFlow's tables have no host tier")
        return PooledTables(schema.categorical_names, schema.vocab_sizes, dim)

    def train_step(self, data):
        x, y = data[:2]
        tables = self.embeddings.tables
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        dense = self.trainable_variables   # (after the call: it builds the dense layers)
        grads = tape.gradient(loss, tables + dense)
        self.sparse_optimizer.apply_gradients(zip(grads[:len(tables)], tables))
        self.optimizer.apply_gradients(zip(grads[len(tables):], dense))
        return {"loss": loss}


def optimizer():
    return keras.optimizers.Adam(1e-3)
