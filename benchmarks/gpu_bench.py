"""GPU benchmark of tf_sok on one device, everything measured in one run.

    python benchmarks/gpu_bench.py [--quick] [--torch]   (on a machine with a CUDA GPU)

(a) forward lookup throughput (bytes/s) against the device copy bandwidth measured
    here: uniform and Zipf(1.05, 1.2) ids, dim 16/64/128, hotness 1/10/64, batch 64K,
    one 1e7-row table. "physical" bytes count ids, splits, each distinct gathered row
    once and the outputs; "application" bytes count every id's row (no dedup).
(b) DLRM-like training step: 26 tables (Criteo Kaggle cardinalities capped at 1e7),
    dim 128, batch 64K, 1 and 10 Zipf(1.05) ids per feature, loss = sum of squared
    pooled outputs (2 x tf.nn.l2_loss per output): tf_sok + lazy Adam / SGD against TensorFlow's
    fastest sparse path (the faster of tf.nn.embedding_lookup_sparse over the RaggedTensor and
    tf.gather over the ids as a [batch, hot] matrix; gradients kept as IndexedSlices, a
    hand-written scatter update: gpu_common.TFSparseOptimizer; the run fails if TensorFlow
    densifies a gradient), and the step's bandwidth floor.
(c) step time with a 1e5-row vs a 5e7-row table, same ids.
parts: (b)'s tf_sok Adam step taken apart in graph loops: forward + loss, then + the
    gradient, then + the update (times by difference, no profiler needed).
(d) with --torch: the same (a) and (b) shapes with PyTorch's EmbeddingBag
    (+ SparseAdam / SGD) in a separate process (benchmarks/torch_bench.py).
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import tensorflow as tf
import keras

import tf_sok as sok
from gpu_common import CARDINALITIES, TF_LOOKUP_FORMS, TFSparseOptimizer, fixed_hot_batch, ids_for, tf_sum_lookup

# The baseline must stay on TensorFlow's sparse path: a densified gradient fails the run.
warnings.filterwarnings("error", message=".*Converting sparse IndexedSlices.*")

HERE = os.path.dirname(os.path.abspath(__file__))
REPEAT = 10


def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        float(fn())
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        float(fn())
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def copy_bandwidth(copies=8):
    """Device-to-device copy bandwidth (bytes read + written per second): `copies` chained
    copies of 1 GiB per call, so that the call's own overhead (~0.1-0.3 ms, a third of
    one copy) does not count."""
    x = tf.random.uniform([256 * 1024 * 1024], dtype=tf.float32)  # 1 GiB

    @tf.function
    def copy():
        y = x
        for _ in range(copies):
            y = tf.raw_ops.DeepCopy(x=y)  # each reads and writes 1 GiB; chained, so none is elided
        return y[0]

    return copies * 2 * 4 * x.shape[0] / timed(copy, 10)


def forward_section(a, bw):
    rows = 10_000_000
    print(f"\n(a) forward lookup, 1 table x {rows:,} rows, batch {a.batch}, sum combiner "
          f"(copy bandwidth {bw / 1e12:.2f} TB/s)")
    print(f"{'ids':>10s} {'dim':>4s} {'hot':>4s} {'ms':>8s} {'physical TB/s':>14s} {'% copy':>7s} "
          f"{'application TB/s':>17s}")
    rng = np.random.default_rng(0)
    res = []
    for dim in a.dims:
        table = sok.Variable(shape=[rows, dim], initializer=keras.initializers.RandomUniform(-1, 1), name=f"fw{dim}")
        for hot in a.hotness:
            for dist in ("uniform", "zipf:1.05", "zipf:1.2"):
                ids, splits = fixed_hot_batch(rng, rows, a.batch, hot, dist)
                # REPEAT lookups per call amortise the call's own overhead; each reads the same ids
                # rotated differently, so TensorFlow cannot merge them into one
                rts = [tf.RaggedTensor.from_row_splits(tf.constant(np.roll(ids, k * 7919)), tf.constant(splits))
                       for k in range(REPEAT)]

                @tf.function
                def fwd():
                    return tf.add_n([sok.lookup_sparse(table, rt, combiners="sum")[0, 0] for rt in rts])

                s = timed(fwd, a.iters) / REPEAT
                n, uniq = len(ids), len(np.unique(ids))
                common = n * 8 + (a.batch + 1) * 8 + a.batch * dim * 4
                phys, app = (common + uniq * dim * 4) / s, (common + n * dim * 4) / s
                res.append({"dist": dist, "dim": dim, "hot": hot, "ms": s * 1e3, "physical": phys, "app": app})
                print(f"{dist:>10s} {dim:4d} {hot:4d} {s * 1e3:8.3f} {phys / 1e12:14.2f} {100 * phys / bw:6.0f}% "
                      f"{app / 1e12:17.2f}")
        del table, fwd
        gc.collect()
    return res


def squared_sum(outs):
    """The loss: the sum of the squared pooled outputs, as 2 x tf.nn.l2_loss (one read of
    each output forward, one multiply backward), not reduce_sum(o * o) (a product, a sum
    and three passes over the outputs for its gradient): the dense work around the lookups
    is TensorFlow's in both paths and lies outside the bandwidth floor."""
    return tf.add_n([2.0 * tf.nn.l2_loss(o) for o in outs])


def make_step(tables, features, opt, path):
    if path == "sok":
        @tf.function
        def step(batch):
            with tf.GradientTape() as tape:
                outs = sok.lookup_sparse([tables[t] for t in features], list(batch), combiners="sum")
                loss = squared_sum(outs)
            opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
            return loss
    else:
        form = "ragged" if path == "tf" else path   # "tf": TensorFlow's ragged lookup, else one of TF_LOOKUP_FORMS

        @tf.function
        def step(batch):
            with tf.GradientTape() as tape:
                loss = squared_sum([tf_sum_lookup(form, tables[t], x) for t, x in zip(features, batch)])
            opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
            return loss
    return step


def steps_in_graph(step_fn, n):
    """n training steps in one tf.function call (a graph loop), as Keras runs them with
    steps_per_execution=n: without the Python call of each step (argument flattening of
    26 ragged tensors and the function's dispatch, ~2-3 ms a call on the H200 host).
    step_fn must have run once (its optimizer state exists)."""
    @tf.function
    def run(batch):
        loss = tf.constant(0.0)
        for _ in tf.range(n):
            loss = step_fn(batch)
        return loss
    return run


def floor_bytes(batches, dims, batch, adam, distinct=True):
    """Bytes one training step must move: ids + splits, the rows gathered, outputs and their
    gradients, and the rows' weights and optimizer state read and written. distinct: each
    distinct row once (a repeated id's row counted once: the strict floor); else every id's
    row (no dedup, the issue's count: ~2 ms for the 1-id Adam step at 4.27 TB/s)."""
    total = 0
    for (ids, _), dim in zip(batches, dims):
        rows = len(np.unique(ids)) if distinct else len(ids)
        total += len(ids) * 8 + (batch + 1) * 8 + rows * dim * 4 + 2 * batch * dim * 4
        total += rows * dim * 4 * 2 * (3 if adam else 1) + (rows * 4 * 2 if adam else 0)
    return total


DLRM_DIM = 128
DLRM_INIT = keras.initializers.RandomUniform(-0.05, 0.05)


def dlrm_batches(batch, hotness):
    """(b)'s inputs, per ids/feature: (hot, [(ids, splits)] per table, [RaggedTensor]);
    the same seed wherever they are used, so every section sees the same ids."""
    rng = np.random.default_rng(1)
    for hot in hotness:
        raw = [fixed_hot_batch(rng, rows, batch, hot, "zipf:1.05") for rows in CARDINALITIES]
        yield hot, raw, [tf.RaggedTensor.from_row_splits(tf.constant(i), tf.constant(s)) for i, s in raw]


def dlrm_sok_tables(prefix):
    return [sok.Variable(shape=[r, DLRM_DIM], initializer=DLRM_INIT, name=f"{prefix}{i}")
            for i, r in enumerate(CARDINALITIES)]


def training_section(a, bw):
    dim = DLRM_DIM
    print(f"\n(b) DLRM-like step: 26 tables (Criteo Kaggle cardinalities capped at 1e7), dim {dim}, "
          f"batch {a.batch}, Zipf(1.05), loss = sum of squared pooled outputs")
    res = {}
    for hot, raw, batch in dlrm_batches(a.batch, a.train_hotness):
        for name, lr, adam in (("adam", 1e-3, True), ("sgd", 1e-2, False)):
            row = {}
            for path in a.paths:
                if path == "sok":
                    tables = dlrm_sok_tables("c")
                    opt = sok.optimizers.Adam(lr) if adam else sok.optimizers.SGD(lr)
                    step_fn = make_step(tables, list(range(26)), opt, path)
                    row[path] = timed(lambda: step_fn(batch), a.iters)
                else:   # both of TensorFlow's forms on the same tables; the faster is the baseline
                    tables = [tf.Variable(DLRM_INIT((r, dim))) for r in CARDINALITIES]
                    opt = TFSparseOptimizer(name, lr)
                    steps = {}
                    for form in TF_LOOKUP_FORMS:
                        steps[form] = make_step(tables, list(range(26)), opt, form)
                        row[f"tf_{form}"] = timed(lambda: steps[form](batch), a.iters)
                    fastest = min(steps, key=lambda f: row[f"tf_{f}"])
                    row["tf"], step_fn = row[f"tf_{fastest}"], steps.pop(fastest)
                    del steps
                if a.loop > 1:   # the step as fit runs it with steps_per_execution (TensorFlow's fastest form)
                    looped = steps_in_graph(step_fn, a.loop)
                    row[f"{path}_loop"] = timed(lambda: looped(batch), max(3, a.iters // 2), warmup=1) / a.loop
                    del looped
                del tables, opt, step_fn
                gc.collect()  # traced functions hold the tables: free them before the next path
            floor = floor_bytes(raw, [dim] * 26, a.batch, adam) / bw
            every = floor_bytes(raw, [dim] * 26, a.batch, adam, distinct=False) / bw
            res[f"{name}/{hot}"] = {f"{k}_ms": v * 1e3 for k, v in row.items()}
            res[f"{name}/{hot}"]["floor_ms"] = floor * 1e3
            res[f"{name}/{hot}"]["floor_every_id_ms"] = every * 1e3
            tf_part = (f"TensorFlow {row['tf'] * 1e3:8.2f} ms ({a.batch / row['tf']:12,.0f} samples/s; ragged "
                       f"{row['tf_ragged'] * 1e3:.2f}, gather {row['tf_gather'] * 1e3:.2f}) | "
                       f"{row['tf'] / row['sok']:5.1f}x | ") if "tf" in row else ""
            print(f"  {hot:2d} id/feature, {name:4s}: {tf_part}tf_sok {row['sok'] * 1e3:7.2f} ms "
                  f"({a.batch / row['sok']:12,.0f} samples/s) | bandwidth floor {floor * 1e3:.2f} ms "
                  f"(distinct rows), {every * 1e3:.2f} ms (every id's row): tf_sok at {row['sok'] / floor:.1f}x / "
                  f"{row['sok'] / every:.1f}x")
            if "sok_loop" in row:
                tf_loop = (f"TensorFlow {row['tf_loop'] * 1e3:8.2f} ms | {row['tf_loop'] / row['sok_loop']:5.1f}x | "
                           if "tf_loop" in row else "")
                print(f"  {'':2s} {a.loop} steps per call (as fit with steps_per_execution={a.loop}): {tf_loop}tf_sok "
                      f"{row['sok_loop'] * 1e3:7.2f} ms per step ({a.batch / row['sok_loop']:12,.0f} samples/s), "
                      f"{row['sok_loop'] / floor:.1f}x / {row['sok_loop'] / every:.1f}x the floors")
    return res


def parts_section(a):
    """Where (b)'s tf_sok Adam step spends its time: the forward (+ loss), forward +
    gradients, and the whole step, each in a graph loop of a.loop steps."""
    print(f"\nparts of the tf_sok Adam step ((b)'s shapes), ms per step in loops of {a.loop}")
    out = {}
    for hot, _, batch in dlrm_batches(a.batch, a.train_hotness):
        tables = dlrm_sok_tables("p")
        opt = sok.OptimizerWrapper(keras.optimizers.Adam(1e-3))

        @tf.function
        def forward(b):
            return squared_sum(sok.lookup_sparse(tables, list(b), combiners="sum"))

        @tf.function
        def gradient(b):
            with tf.GradientTape() as tape:
                loss = squared_sum(sok.lookup_sparse(tables, list(b), combiners="sum"))
            grads = tape.gradient(loss, tables)  # one fused op: reading any output runs all of it
            return loss + tf.add_n([tf.reduce_sum(g.values[:1]) for g in grads])

        step = make_step(tables, list(range(26)), opt, "sok")
        row = {}
        for name, fn in (("forward", forward), ("gradient", gradient), ("step", step)):
            float(fn(batch))
            looped = steps_in_graph(fn, a.loop)
            row[name] = timed(lambda: looped(batch), max(3, a.iters // 2), warmup=1) / a.loop * 1e3
        out[hot] = row
        print(f"  {hot:2d} id/feature: forward + loss {row['forward']:6.2f} ms, gradient "
              f"{row['gradient'] - row['forward']:6.2f} ms, update {row['step'] - row['gradient']:6.2f} ms "
              f"(step {row['step']:6.2f} ms)")
        del tables, opt, step, forward, gradient
        gc.collect()
    return out


def size_section(a):
    print("\n(c) tf_sok Adam step, one table, 8 features x batch "
          f"{a.batch} x 4 ids, dim 128, the same ids in both tables")
    out = {}
    for rows in (100_000, 50_000_000):
        rng = np.random.default_rng(2)
        batch = []
        for _ in range(8):
            ids, splits = fixed_hot_batch(rng, 100_000, a.batch, 4, "zipf:1.05")
            batch.append(tf.RaggedTensor.from_row_splits(tf.constant(ids * 2654435761 % rows), tf.constant(splits)))
        table = sok.Variable(shape=[rows, 128], initializer="zeros", name=f"size{rows}")
        step = make_step([table], [0] * 8, sok.optimizers.Adam(1e-3), "sok")
        out[rows] = timed(lambda: step(batch), a.iters)
        del table, step
        gc.collect()
    print(f"  100,000 rows {out[100_000] * 1e3:.2f} ms, 50,000,000 rows {out[50_000_000] * 1e3:.2f} ms, "
          f"ratio {out[50_000_000] / out[100_000]:.2f}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--hotness", type=int, nargs="+", default=[1, 10, 64])
    p.add_argument("--train-hotness", type=int, nargs="+", default=[1, 10])
    p.add_argument("--torch", action="store_true", help="also run the PyTorch peer (benchmarks/torch_bench.py)")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--loop", type=int, default=10,
                   help="(b): also time this many tf_sok steps per tf.function call (1: off)")
    p.add_argument("--sections", nargs="+", default=["forward", "train", "size"],
                   choices=["forward", "train", "size", "parts"])
    p.add_argument("--paths", nargs="+", default=["tf", "sok"], choices=["tf", "sok"],
                   help="training step paths to time (sok only: a quick check without the baseline)")
    a = p.parse_args()
    if not tf.config.list_physical_devices("GPU"):
        sys.exit("gpu_bench: no GPU visible to TensorFlow")
    peer = None
    if a.torch:  # first: TensorFlow keeps the GPU memory it takes until the process exits
        cmd = [sys.executable, os.path.join(HERE, "torch_bench.py"), "--batch", str(a.batch), "--iters",
               str(a.iters), "--dims", *map(str, a.dims), "--hotness", *map(str, a.hotness),
               "--train-hotness", *map(str, a.train_hotness)]
        p2 = subprocess.run(cmd, capture_output=True, text=True)
        print(p2.stdout + p2.stderr[-2000:])
        peer = json.loads([l for l in p2.stdout.splitlines() if l.startswith("{")][-1])
    sok.init()
    gpu = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0]).get("device_name")
    with tf.device("/GPU:0"):
        bw = copy_bandwidth()
        print(f"{gpu}: copy bandwidth (read + write) {bw / 1e12:.2f} TB/s")
        results = {"copy_bw": bw}
        if "forward" in a.sections:
            results["forward"] = forward_section(a, bw)
        if "train" in a.sections:
            results["train"] = training_section(a, bw)
        if "size" in a.sections:
            results["size"] = size_section(a)
        if "parts" in a.sections:
            results["parts"] = parts_section(a)
    if peer:
        results["torch"] = peer
        print("\n(d) tf_sok vs PyTorch on the same shapes (ratio = PyTorch time / tf_sok time)")
        for key, r in results.get("train", {}).items():
            t = peer["train"].get(key)
            if t:
                print(f"  step {key:8s}: PyTorch {t:8.2f} ms, tf_sok {r['sok_ms']:7.2f} ms, {t / r['sok_ms']:5.2f}x")
        for f in results.get("forward", []):
            t = peer["forward"].get(f"{f['dist']}/{f['dim']}/{f['hot']}")
            if t:
                print(f"  forward {f['dist']:>9s} dim {f['dim']:3d} hot {f['hot']:2d}: PyTorch {t:7.3f} ms, "
                      f"tf_sok {f['ms']:7.3f} ms, {t / f['ms']:5.2f}x")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1, default=float)


if __name__ == "__main__":
    main()
