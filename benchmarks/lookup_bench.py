"""One training step (lookup forward + backward + optimizer) of tf_sok against
TensorFlow's own path, measured side by side in one run.

Baselines: `tf.nn.embedding_lookup_sparse` per feature on plain tf.Variables (the
RaggedTensors as they are), trained by TensorFlow's sparse updates of the rows touched
(gpu_common.TFSparseOptimizer: lazy Adam and SGD over IndexedSlices, which Keras 3's
optimizers densify; the run fails if a gradient is densified).
tf_sok: one fused `sok.lookup_sparse` + `sok.optimizers.Adam` / `SGD`.
Also tf_sok's step time with small vs large tables (only touched rows may cost).

    python benchmarks/lookup_bench.py [--batch 4096] [--tables 8] [--rows 100000] [--dim 32] [--device CPU:0]
"""
import argparse
import time
import warnings

import numpy as np
import tensorflow as tf
import keras

import tf_sok as sok
from bench_args import add_shape_args
from gpu_common import TFSparseOptimizer, zipf_ranks

# The baseline must stay on TensorFlow's sparse path: a densified gradient fails the run.
warnings.filterwarnings("error", message=".*Converting sparse IndexedSlices.*")


def make_batch(rng, n_feat, batch, rows, max_hot, alpha, spread_over=None):
    """Per feature a ragged batch of Zipf ids in [0, rows), hot ids scattered
    over the table. With spread_over, the same ids are mapped one-to-one into
    a table of that many rows (same unique count, spread over more memory)."""
    out = []
    for _ in range(n_feat):
        lens = rng.integers(1, max_hot + 1, batch)
        ids = zipf_ranks(rng, rows, int(lens.sum()), alpha)
        ids = ids * 2654435761 % (spread_over or rows)  # a bijection modulo 10^k
        out.append(tf.RaggedTensor.from_row_lengths(ids.astype(np.int64), lens))
    return out


def time_step(step, batches, warmup, iters):
    for i in range(warmup):
        step(batches[i % len(batches)])
    t = []
    for i in range(iters):
        t0 = time.perf_counter()
        r = step(batches[i % len(batches)])
        float(r)  # wait for the step
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def pipelined_time(step, batches, iters):
    """Seconds per step of `iters` steps issued back to back with one wait at the
    end, as a training loop runs: the host prepares step k+1 while the device
    still works on step k (time_step's wait after every step exposes the host's
    share of each step instead)."""
    float(step(batches[0]))
    t0 = time.perf_counter()
    for i in range(iters):
        r = step(batches[i % len(batches)])
    float(r)
    return (time.perf_counter() - t0) / iters


def tf_path(tables, opt, combiner):
    @tf.function(reduce_retracing=True)
    def step(ids):
        with tf.GradientTape() as tape:
            outs = [tf.nn.embedding_lookup_sparse(t, x, None, combiner=combiner)
                    for t, x in zip(tables, ids)]
            loss = tf.add_n([tf.reduce_sum(o * o) for o in outs])
        opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
        return loss
    return step


def sok_path(tables, opt, combiner):
    @tf.function(reduce_retracing=True)
    def step(ids):
        with tf.GradientTape() as tape:
            outs = sok.lookup_sparse(tables, list(ids), combiners=combiner)
            loss = tf.add_n([tf.reduce_sum(o * o) for o in outs])
        opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
        return loss
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, iters=30, warmup=5)
    p.add_argument("--large-rows", type=int, default=10_000_000)
    p.add_argument("--max-hot", type=int, default=4)
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--combiner", default="mean")
    p.add_argument("--device", default="CPU:0")
    a = p.parse_args(argv)
    sok.init()
    rng = np.random.default_rng(0)
    batches = [make_batch(rng, a.tables, a.batch, a.rows, a.max_hot, a.alpha) for _ in range(8)]
    init = keras.initializers.RandomUniform(-0.05, 0.05)
    print(f"device {a.device}; {a.tables} tables x {a.rows:,} rows, dim {a.dim}, batch {a.batch}, "
          f"1-{a.max_hot} Zipf({a.alpha}) ids per row, {a.combiner} combiner; median of {a.iters} steps")
    res = {}
    with tf.device(a.device):
        for name, make_opt, lr in (("adam", lambda: keras.optimizers.Adam(1e-3), 1e-3),
                                   ("sgd", lambda: keras.optimizers.SGD(1e-2), 1e-2)):
            tf_tables = [tf.Variable(init((a.rows, a.dim))) for _ in range(a.tables)]
            res["tf_" + name] = time_step(tf_path(tf_tables, TFSparseOptimizer(name, lr), a.combiner), batches,
                                          a.warmup, a.iters)
            del tf_tables
            sok_tables = [sok.Variable(shape=[a.rows, a.dim], initializer=init, name=f"t{i}")
                          for i in range(a.tables)]
            sok_opt = sok.OptimizerWrapper(make_opt())
            res["sok_" + name] = time_step(sok_path(sok_tables, sok_opt, a.combiner), batches, a.warmup, a.iters)
            del sok_tables, sok_opt
        # table size: one table serving every feature, small vs large, with the
        # same ids (so the same number of touched rows) in both
        size = {}
        for rows in (a.rows, a.large_rows):
            same = [make_batch(np.random.default_rng(7 + i), a.tables, a.batch, a.rows, a.max_hot, a.alpha,
                               spread_over=rows) for i in range(8)]
            table = sok.Variable(shape=[rows, a.dim], initializer=init, name=f"shared{rows}")
            size[rows] = time_step(sok_path([table] * a.tables, sok.optimizers.Adam(1e-3), a.combiner),
                                   same, a.warmup, a.iters)
            del table
    sps = lambda s: a.batch / s  # noqa: E731
    print(f"{'path':54s} {'ms/step':>9s} {'samples/s':>12s}")
    for key, label in (("tf_adam", "TensorFlow embedding_lookup_sparse + sparse lazy Adam"),
                       ("sok_adam", "tf_sok fused lookup + sok Adam (lazy)"),
                       ("tf_sgd", "TensorFlow embedding_lookup_sparse + sparse SGD"),
                       ("sok_sgd", "tf_sok fused lookup + sok SGD")):
        print(f"{label:54s} {res[key] * 1e3:9.2f} {sps(res[key]):12,.0f}")
    print(f"speed-up vs TensorFlow, Adam: {res['tf_adam'] / res['sok_adam']:.1f}x   "
          f"SGD: {res['tf_sgd'] / res['sok_sgd']:.1f}x")
    print(f"tf_sok Adam step, one shared table, same ids: {a.rows:,} rows {size[a.rows] * 1e3:.2f} ms, "
          f"{a.large_rows:,} rows {size[a.large_rows] * 1e3:.2f} ms, ratio {size[a.large_rows] / size[a.rows]:.2f}")
    return res, size


if __name__ == "__main__":
    main()
