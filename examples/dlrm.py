"""DLRM on Criteo-format data (synthetic or real files), trained with model.fit.

    python examples/dlrm.py --data synthetic --steps 300
    python examples/dlrm.py --data examples/data/criteo_sample.tsv --format tsv --steps 100 --batch-size 256
    python examples/dlrm.py --data criteo_parquet/ --format parquet
"""
import keras
import tensorflow as tf

import tf_sok as sok
from criteo_common import parse_args, run


class DLRM(keras.Model):
    """Bottom MLP on the 13 integer features, 26 embeddings in one fused lookup,
    pairwise dot interaction, top MLP."""

    def __init__(self, schema, dim, **kwargs):
        super().__init__(**kwargs)
        self.names = list(schema.categorical_names)
        self.embeddings = sok.layers.EmbeddingCollection(
            tables=[sok.TableConfig(n, v, dim, combiner="mean", initializer=keras.initializers.RandomUniform(-0.05, 0.05))
                    for n, v in zip(self.names, schema.vocab_sizes)],
            feature_to_table={n: n for n in self.names})
        self.bottom = keras.Sequential([keras.layers.Dense(64, activation="relu"),
                                        keras.layers.Dense(dim, activation="relu")])
        self.top = keras.Sequential([keras.layers.Dense(128, activation="relu"), keras.layers.Dense(64, activation="relu"),
                                     keras.layers.Dense(1, activation="sigmoid")])
        self.interaction = sok.layers.DotInteraction()

    def interact(self, b, embs):
        """Bottom output b [batch, dim] and embeddings [batch, features, dim] -> the top MLP's input."""
        return tf.concat([b, self.interaction(tf.concat([b[:, None, :], embs], axis=1))], axis=1)

    def call(self, x):
        b = self.bottom(x["dense"])
        emb = self.embeddings({k: x[k] for k in self.names})
        return self.top(self.interact(b, tf.stack([emb[k] for k in self.names], axis=1)))


if __name__ == "__main__":
    run("dlrm", DLRM, parse_args(__doc__.splitlines()[0]))
