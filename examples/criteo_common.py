"""Shared by examples/dlrm.py and examples/deepfm.py: command line, data
(synthetic or Criteo files in TSV / Parquet / TFRecord), training with model.fit,
held-out AUC, and PNG plots of loss, AUC and samples/s."""
import argparse
import os
import time

import keras
import numpy as np

import tf_sok as sok
import tf_sok.data as sd


def parse_args(description, argv=None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", default="synthetic", help="'synthetic' or a file/directory of Criteo data")
    p.add_argument("--format", default="tsv", choices=["tsv", "parquet", "tfrecord"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--eval-batches", type=int, default=20, help="held-out batches (the first ones of --data)")
    p.add_argument("--max-vocab", type=int, default=1_000_000, help="cap on each table's rows")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--out", default=None, help="where the plots go (default out/<example>)")
    p.add_argument("--verbose", type=int, default=2)
    return p.parse_args(argv)


def datasets(a):
    """(train, held-out) tf.data pipelines of ({"dense", "C1".."C26"}, label) and the schema."""
    schema = sd.CriteoSchema.capped(a.max_vocab)
    if a.data == "synthetic":
        cfg = sd.SyntheticConfig(schema=schema)
        train = sd.synthetic(a.steps * a.batch_size, a.batch_size, cfg, seed=1)
        test = sd.synthetic(a.eval_batches * a.batch_size, a.batch_size, cfg, seed=2)
        return sd.for_keras(train), sd.for_keras(test), schema
    reader = {"tsv": sd.read_tsv, "parquet": sd.read_parquet, "tfrecord": sd.read_tfrecord}[a.format]
    ds = sd.for_keras(reader(a.data, a.batch_size, schema=schema))
    return ds.skip(a.eval_batches).repeat().take(a.steps), ds.take(a.eval_batches), schema


class Curves(keras.callbacks.Callback):
    def __init__(self, batch_size):
        super().__init__()
        self.batch_size, self.loss, self.auc, self.sps = batch_size, [], [], []
        self._t = None

    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.loss.append(logs["loss"])
        self.auc.append(logs["auc"])
        self.sps.append(self.batch_size / (time.perf_counter() - self._t))


def plot(c: Curves, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for axis, ys, label in zip(ax, (c.loss, c.auc, c.sps), ("training loss (running mean)", "training AUC",
                                                             "samples/s")):
        axis.plot(ys)
        axis.set(xlabel="step", ylabel=label)
    ax[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(name, build_model, a):
    """Trains `build_model(schema, dim)` with model.fit and reports held-out AUC."""
    sok.init()
    train, test, schema = datasets(a)
    model = build_model(schema, a.dim)
    model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(1e-3), sparse=sok.optimizers.Adam(0.01)),
                  loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")])
    curves = Curves(a.batch_size)
    t0 = time.time()
    model.fit(train, epochs=1, steps_per_epoch=a.steps, callbacks=[curves], verbose=a.verbose)
    secs = time.time() - t0
    loss, auc = model.evaluate(test, verbose=0)
    out = a.out or os.path.join("out", name)
    os.makedirs(out, exist_ok=True)
    png = os.path.join(out, "training.png")
    plot(curves, png, f"{name}, {a.data}, batch {a.batch_size}")
    print(f"{name}: {a.steps} steps in {secs:.1f}s ({np.median(curves.sps):,.0f} samples/s median); "
          f"final training loss {curves.loss[-1]:.4f}; held-out loss {loss:.4f}, AUC {auc:.4f}; plot {png}")
    return {"loss": curves.loss, "eval_auc": auc, "eval_loss": loss}
