"""DeepFM on Criteo-format data (synthetic or real files), trained with model.fit.

    python examples/deepfm.py --data synthetic --steps 300
    python examples/deepfm.py --data examples/data/criteo_sample.tsv --format tsv --steps 100 --batch-size 256
"""
import keras
import tensorflow as tf

import tf_sok as sok
from criteo_common import parse_args, run


class DeepFM(keras.Model):
    """First-order weights (dim-1 tables) + FM second-order term over dim-k
    embeddings + an MLP over the same embeddings; every table of both orders
    is looked up in ONE fused call."""

    def __init__(self, schema, dim, max_hbm_for_vectors=None, **kwargs):
        super().__init__(**kwargs)
        self.names = list(schema.categorical_names)
        init = keras.initializers.RandomUniform(-0.05, 0.05)
        tier = dict(max_hbm_for_vectors=max_hbm_for_vectors)
        tables = [sok.TableConfig(f"{n}_w", v, 1, combiner="sum", initializer="zeros", **tier)
                  for n, v in zip(self.names, schema.vocab_sizes)]
        tables += [sok.TableConfig(f"{n}_v", v, dim, combiner="mean", initializer=init, **tier)
                   for n, v in zip(self.names, schema.vocab_sizes)]
        mapping = {f"{n}/1": f"{n}_w" for n in self.names}
        mapping.update({f"{n}/k": f"{n}_v" for n in self.names})
        self.embeddings = sok.layers.EmbeddingCollection(tables=tables, feature_to_table=mapping)
        self.dense_linear = keras.layers.Dense(1)
        self.deep = keras.Sequential([keras.layers.Dense(128, activation="relu"), keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(1)])

    def feature_ids(self, x):
        """The embedding features' ids: each categorical feature feeds its first-order and its factor table."""
        return {f"{n}/{o}": x[n] for n in self.names for o in ("1", "k")}

    def call(self, x):
        e = self.embeddings(self.feature_ids(x))
        first = tf.add_n([e[f"{n}/1"] for n in self.names]) + self.dense_linear(x["dense"])
        v = tf.stack([e[f"{n}/k"] for n in self.names], axis=1)           # [batch, fields, dim]
        second = 0.5 * tf.reduce_sum(tf.square(tf.reduce_sum(v, 1)) - tf.reduce_sum(tf.square(v), 1), 1, keepdims=True)
        deep = self.deep(tf.concat([tf.reshape(v, [-1, v.shape[1] * v.shape[2]]), x["dense"]], axis=1))
        return tf.sigmoid(first + second + deep)


if __name__ == "__main__":
    run("deepfm", DeepFM, parse_args(__doc__.splitlines()[0]))
