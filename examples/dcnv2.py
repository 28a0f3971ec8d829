"""DLRM-DCNv2 as MLPerf Training defines it, trained with model.fit.

13 dense features -> bottom MLP 512-256-128; 26 categorical features with MLPerf's
multi-hot sizes -> 26 tables of dim 128 in ONE fused lookup (sum pooling); three
low-rank (rank 512) DCNv2 cross layers over the concatenation [bottom, 26 x emb]
(27 x 128 = 3456 wide); top MLP 1024-1024-512-256-1. Adagrad trains embeddings and
dense layers (MLPerf's reference optimizer; here lr 0.005 without MLPerf's warm-up
and decay, initial accumulator 0, epsilon 1e-8).

Table rows: MLPerf uses Criteo 1TB's cardinalities (up to 40M rows per table);
`--max-vocab` caps each table (default 1,000,000 for synthetic data; with files,
the converter's schema) so the tables fit the machine.

    python examples/dcnv2.py --steps 300                                          # synthetic multi-hot data
    python examples/dcnv2.py --batch-size 65536 --steps 2000 --mixed-precision bf16 --max-vocab 10000000  # one GPU
    python examples/dcnv2.py --data criteo_parquet/                              # the converter's output
"""
import argparse
import functools
import sys

import keras
import tensorflow as tf

import tf_sok as sok
import tf_sok.data as sd
from criteo_common import jit_dense, parse_args, run, side_by_side


class LowRankCross(keras.layers.Layer):
    """DCNv2's cross layer with a rank-r weight: x_{l+1} = x0 * (U (V^T x_l) + b) + x_l."""

    def __init__(self, rank: int, **kwargs):
        super().__init__(**kwargs)
        self.rank = rank

    def build(self, input_shape):
        width = int(input_shape[-1])
        init = keras.initializers.GlorotUniform()
        self.v = self.add_weight(shape=(width, self.rank), initializer=init, name="v")
        self.u = self.add_weight(shape=(self.rank, width), initializer=init, name="u")
        self.b = self.add_weight(shape=(width,), initializer="zeros", name="b")

    def call(self, x0, x):
        return x0 * (tf.matmul(tf.matmul(x, self.v), self.u) + self.b) + x


def mlp(widths, last_activation="relu"):
    return keras.Sequential([keras.layers.Dense(w, activation="relu" if i < len(widths) - 1 else last_activation)
                             for i, w in enumerate(widths)])


class DCNv2(keras.Model):
    """`jit_dense`: the dense part (bottom MLP, cross layers, top MLP) compiled by XLA into a few
    fused kernels; the fused lookup stays outside it (tf_sok's ops have no XLA kernels)."""

    def __init__(self, schema, dim, cross_layers=3, cross_rank=512, jit_dense=False, max_hbm_for_vectors=None,
                 **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.names = list(schema.categorical_names)
        self.embeddings = sok.layers.EmbeddingCollection(
            tables=[sok.TableConfig(n, v, dim, combiner="sum",
                                    initializer=keras.initializers.RandomUniform(-0.05, 0.05),
                                    max_hbm_for_vectors=max_hbm_for_vectors)
                    for n, v in zip(self.names, schema.vocab_sizes)],
            feature_to_table={n: n for n in self.names})
        self.bottom = mlp((512, 256, dim))
        self.cross = [LowRankCross(cross_rank, name=f"cross_{i}") for i in range(cross_layers)]
        self.top = mlp((1024, 1024, 512, 256, 1), last_activation="sigmoid")
        self.dense_part = tf.function(self._dense_part, jit_compile=True) if jit_dense else self._dense_part

    def build(self, input_shape):
        # the dense layers get their weights here, outside any compiled function
        width = self.dim * (len(self.names) + 1)
        self.bottom.build((None, input_shape["dense"][-1]))
        for layer in self.cross:
            layer.build((None, width))
        self.top.build((None, width))

    def _dense_part(self, dense, embs):
        x0 = side_by_side([self.bottom(dense)] + [tf.cast(e, self.compute_dtype) for e in embs])
        h = x0
        for layer in self.cross:
            h = layer(x0, h)
        return tf.cast(self.top(h), tf.float32)

    def call(self, x):
        emb = self.embeddings({k: x[k] for k in self.names})
        return self.dense_part(x["dense"], [emb[k] for k in self.names])


def optimizer(lr):
    return lambda: sok.keras.Optimizer(
        dense=keras.optimizers.Adagrad(lr, initial_accumulator_value=0.0, epsilon=1e-8),
        sparse=sok.optimizers.Adagrad(lr, initial_accumulator_value=0.0, epsilon=1e-8))


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--lr", type=float, default=0.005)
    pre.add_argument("--mixed-precision", choices=["off", "bf16", "fp16"], default="off",
                     help="Keras mixed policy for the dense part (tables and their state stay float32)")
    extra, rest = pre.parse_known_args(argv)
    a = parse_args(__doc__.splitlines()[0], rest, dim=128, batch_size=8192)
    if extra.mixed_precision != "off":
        keras.mixed_precision.set_global_policy(
            {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}[extra.mixed_precision])
    opt = optimizer(extra.lr)
    if extra.mixed_precision == "fp16":  # float16 needs loss scaling; bfloat16 does not
        base = opt
        opt = lambda: keras.optimizers.LossScaleOptimizer(base())  # noqa: E731
    return run("dcnv2", functools.partial(DCNv2, jit_dense=jit_dense(a)), a, optimizer=opt,
               synthetic_config=sd.SyntheticConfig.dcnv2)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
