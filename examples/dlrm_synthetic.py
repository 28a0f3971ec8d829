"""DLRM-style click model on learnable synthetic data, trained with model.fit.

Dense features -> bottom MLP; 8 categorical features of different
cardinalities and hotness (Zipf ids) -> ONE fused sok.layers.EmbeddingCollection;
pairwise dot interaction; top MLP. Sparse tables train with tf_sok's lazy
Adam, dense layers with Keras Adam, through sok.keras.Optimizer.

    python examples/dlrm_synthetic.py [--steps 300] [--batch-size 1024] [--out out/dlrm_synthetic]

Prints Keras progress, final loss, held-out AUC, and writes a PNG of the
training curve.
"""
import argparse
import dataclasses
import os
import time
from typing import Dict, List

import numpy as np
import tensorflow as tf
import keras

import tf_sok as sok
from tf_sok.data import zipf_ranks


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    vocab: int
    hotness: int      # ids per row: uniform in [1, hotness]
    zipf: float


FEATURES = [
    Feature("user", 100_000, 1, 1.1), Feature("item", 50_000, 1, 1.15), Feature("history", 50_000, 8, 1.15),
    Feature("category", 1_000, 3, 1.3), Feature("brand", 5_000, 1, 1.2), Feature("city", 500, 1, 1.3),
    Feature("device", 20, 1, 1.5), Feature("tags", 10_000, 5, 1.2),
]
NUM_DENSE = 13


def make_data(num_rows: int, seed: int = 0, features: List[Feature] = FEATURES):
    """Synthetic rows whose click probability depends on dense values and on
    hidden per-id scores, so embeddings have something to learn.

    Returns (dense [n, 13] float32, {feature: (row_lengths, ids)}, labels [n, 1]).
    """
    truth = np.random.default_rng(12345)  # the hidden model is the same for every split
    w_dense = truth.normal(0, 0.5, NUM_DENSE)
    scores = {f.name: truth.normal(0, 1.0, f.vocab) for f in features}
    rng = np.random.default_rng(seed)
    dense = rng.normal(0, 1, (num_rows, NUM_DENSE)).astype(np.float32)
    logit = dense @ w_dense - 0.5
    cats = {}
    for f in features:
        lens = rng.integers(1, f.hotness + 1, num_rows)
        ids = zipf_ranks(rng, f.vocab, int(lens.sum()), f.zipf)
        ids = (ids * 2654435761 % f.vocab).astype(np.int64)  # scatter hot ids over the table
        row_of = np.repeat(np.arange(num_rows), lens)
        logit += np.bincount(row_of, scores[f.name][ids], num_rows) / lens
        cats[f.name] = (lens, ids)
    labels = (rng.random(num_rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)[:, None]
    return dense, cats, labels


def make_dataset(dense, cats, labels, batch_size: int) -> tf.data.Dataset:
    """Batches of ({"dense": [b, 13], feature: ragged [b, (ids)]}, label)."""
    n = len(labels) // batch_size * batch_size
    ragged = {k: tf.RaggedTensor.from_row_lengths(ids, lens) for k, (lens, ids) in cats.items()}

    def take(i):
        s = tf.cast(i, tf.int64) * batch_size
        x = {k: r[s:s + batch_size] for k, r in ragged.items()}
        x["dense"] = tf.constant(dense)[s:s + batch_size]
        return x, tf.constant(labels)[s:s + batch_size]

    return tf.data.Dataset.range(n // batch_size).map(take, num_parallel_calls=tf.data.AUTOTUNE)\
        .prefetch(tf.data.AUTOTUNE)


class DLRM(keras.Model):
    """Bottom MLP + fused embeddings + dot interaction + top MLP."""

    def __init__(self, features: List[Feature] = FEATURES, dim: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.feature_names = [f.name for f in features]
        self.embeddings = sok.layers.EmbeddingCollection(
            tables=[sok.TableConfig(f.name, f.vocab, dim, combiner="mean",
                                    initializer=keras.initializers.RandomUniform(-0.05, 0.05)) for f in features],
            feature_to_table={f.name: f.name for f in features})
        self.bottom = keras.Sequential([keras.layers.Dense(64, activation="relu"),
                                        keras.layers.Dense(dim, activation="relu")])
        self.top = keras.Sequential([keras.layers.Dense(64, activation="relu"),
                                     keras.layers.Dense(32, activation="relu"),
                                     keras.layers.Dense(1, activation="sigmoid")])
        self.interaction = sok.layers.DotInteraction()

    def call(self, x: Dict):
        b = self.bottom(x["dense"])
        emb = self.embeddings({k: x[k] for k in self.feature_names})
        stack = tf.stack([b] + [emb[k] for k in self.feature_names], axis=1)   # [batch, n, dim]
        return self.top(tf.concat([b, self.interaction(stack)], axis=1))


def build_model(dense_lr: float = 1e-3, sparse_lr: float = 0.01) -> DLRM:
    model = DLRM()
    model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(dense_lr),
                                                sparse=sok.optimizers.Adam(sparse_lr)),
                  loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")])
    return model


class History(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.loss, self.auc, self.t0 = [], [], time.time()

    def on_train_batch_end(self, batch, logs=None):
        self.loss.append(logs["loss"])
        self.auc.append(logs["auc"])


def plot(history: History, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(history.loss)
    ax[0].set(xlabel="step", ylabel="training loss (running mean)", title=title)
    ax[1].plot(history.auc, color="tab:orange")
    ax[1].set(xlabel="step", ylabel="training AUC (running)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--eval-rows", type=int, default=50_000)
    p.add_argument("--out", default="out/dlrm_synthetic")
    p.add_argument("--verbose", type=int, default=1)
    args = p.parse_args(argv)
    sok.init()
    os.makedirs(args.out, exist_ok=True)
    train = make_dataset(*make_data(args.steps * args.batch_size, seed=1), args.batch_size)
    test = make_dataset(*make_data(args.eval_rows, seed=2), args.batch_size)
    model = build_model()
    hist = History()
    t0 = time.time()
    model.fit(train, epochs=1, callbacks=[hist], verbose=args.verbose, shuffle=False)   # (tf.data: nothing to shuffle)
    secs = time.time() - t0
    loss, auc = model.evaluate(test, verbose=0)
    png = os.path.join(args.out, "training_curve.png")
    plot(hist, png, f"DLRM synthetic, batch {args.batch_size}")
    print(f"trained {args.steps} steps in {secs:.1f}s ({args.steps * args.batch_size / secs:,.0f} samples/s); "
          f"final training loss {hist.loss[-1]:.4f}; held-out loss {loss:.4f}, AUC {auc:.4f}; plot: {png}")
    return {"loss": hist.loss, "eval_loss": loss, "eval_auc": auc}


if __name__ == "__main__":
    main()
