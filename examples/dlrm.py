"""DLRM on Criteo-format data (synthetic or real files), trained with model.fit.

    python examples/dlrm.py --data synthetic --steps 300
    python examples/dlrm.py --data examples/data/criteo_sample.tsv --format tsv --steps 100 --batch-size 256
    python examples/dlrm.py --data criteo_parquet/ --format parquet
"""
import functools

import keras
import tensorflow as tf

import tf_sok as sok
from criteo_common import jit_dense, parse_args, run, side_by_side


class DLRM(keras.Model):
    """Bottom MLP on the 13 integer features, 26 embeddings in one fused lookup,
    pairwise dot interaction, top MLP. `jit_dense`: the dense part (both MLPs and the
    interaction) compiled by XLA; the fused lookup stays outside it."""

    def __init__(self, schema, dim, jit_dense=False, max_hbm_for_vectors=None, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.names = list(schema.categorical_names)
        self.embeddings = self.make_embeddings(schema, dim, max_hbm_for_vectors)
        self.bottom = keras.Sequential([keras.layers.Dense(64, activation="relu"),
                                        keras.layers.Dense(dim, activation="relu")])
        self.top = keras.Sequential([keras.layers.Dense(128, activation="relu"), keras.layers.Dense(64, activation="relu"),
                                     keras.layers.Dense(1, activation="sigmoid")])
        self.interaction = sok.layers.DotInteraction()
        self.dense_part = tf.function(self._dense_part, jit_compile=True) if jit_dense else self._dense_part

    def make_embeddings(self, schema, dim, max_hbm_for_vectors):
        """The 26 tables and their mean-pooled lookups: features -> {name: [batch, dim]}."""
        return sok.layers.EmbeddingCollection(
            tables=[sok.TableConfig(n, v, dim, combiner="mean", initializer=keras.initializers.RandomUniform(-0.05, 0.05),
                                    max_hbm_for_vectors=max_hbm_for_vectors)
                    for n, v in zip(self.names, schema.vocab_sizes)],
            feature_to_table={n: n for n in self.names})

    def build(self, input_shape):
        # the dense layers get their weights here, outside any compiled function
        n = len(self.names) + 1
        self.bottom.build((None, input_shape["dense"][-1]))
        self.interaction.build((None, n, self.dim))
        self.top.build((None, self.dim + n * (n - 1) // 2))

    def _dense_part(self, dense, embs):
        """Bottom MLP over the dense features, interaction with the embeddings, top MLP."""
        b = self.bottom(dense)
        stack = tf.stack([b] + list(embs), axis=1)
        return self.top(side_by_side([b, self.interaction(stack)]))

    def call(self, x):
        emb = self.embeddings({k: x[k] for k in self.names})
        return self.dense_part(x["dense"], [emb[k] for k in self.names])


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    run("dlrm", functools.partial(DLRM, jit_dense=jit_dense(args)), args)
