"""Throughput of a tf_sok training step under tf.distribute.MirroredStrategy at
R = 1, 2, ... replicas (GPUs when present, else logical CPU devices), with a
fixed per-replica batch (weak scaling), next to the same step on one device
without a strategy; one process per R, side by side in one run.

    python benchmarks/mirrored_bench.py [--replicas 1 2] [--batch 4096] [--exchange nccl framework] [--profile 30]

The step: fused lookup of 8 features over 8 distributed tables (ids and vectors
exchanged between replicas), backward, lazy Adam on each replica's shards, and
a dense layer whose gradient the strategy all-reduces. Also the bytes replica 0 sends per step
by all-to-all against the all-gather alternative (counted from the step's ids, as in
scaling_bench.py). "ms/step" is the median of steps each waited for, "pipelined" the
mean of steps issued back to back with one wait at the end (as model.fit runs them).
--exchange (sok.init(exchange=...)): "nccl" moves the lookup's data by tf_sok's NCCL
ops (one GPU per replica), "framework" by the strategy's copies; several: each
measured at R > 1.
"""
import argparse
import json
import os
import sys

import numpy as np

from scaling_bench import add_step_args, exchange_bytes, run_worker, step_args

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(a):
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        devices = [f"/gpu:{i}" for i in range(a.worker)]
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * a.worker)
        devices = [f"/cpu:{i}" for i in range(a.worker)]
    import keras

    import tf_sok as sok
    from lookup_bench import make_batch, pipelined_time, time_step

    strategy = tf.distribute.MirroredStrategy(devices) if not a.plain else tf.distribute.get_strategy()
    R = len(devices) if not a.plain else 1
    init = keras.initializers.RandomUniform(-0.05, 0.05)
    with strategy.scope():
        comm = type(sok.init(exchange=a.exchange[0]).communicator).__name__
        tables = [sok.Variable(shape=[a.rows, a.dim], initializer=init, name=f"t{i}") for i in range(a.tables)]
        dense = tf.Variable(tf.random.normal([a.tables * a.dim, 1], stddev=0.05))
        opt = sok.optimizers.Adam(1e-3)
        opt.build(tables)
        dense_opt = keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(100)
    batches = [[make_batch(rng, a.tables, a.batch, a.rows, 4, 1.1) for _ in range(R)] for _ in range(4)]

    def one_replica(ids):
        with tf.GradientTape() as tape:
            outs = sok.lookup_sparse(tables, list(ids), combiners="mean")
            pred = tf.concat(outs, 1) @ dense
            loss = tf.nn.compute_average_loss(tf.square(pred[:, 0]), global_batch_size=a.batch * R)
        grads = tape.gradient(loss, tables + [dense])
        opt.apply_gradients(zip(grads[:-1], tables))
        dense_opt.apply_gradients([(grads[-1], dense)])
        return loss

    steps = []
    for per_replica in batches:
        if a.plain:
            steps.append(tf.function(lambda b=per_replica[0]: one_replica(b)))
        else:
            def run(b=per_replica):
                rid = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
                return one_replica(b[rid])
            steps.append(tf.function(lambda run=run: strategy.reduce("SUM", strategy.run(run), axis=None)))
    seconds = time_step(lambda i: steps[int(i)](), list(range(len(steps))), a.warmup, a.iters)
    pipelined = pipelined_time(lambda i: steps[int(i)](), list(range(len(steps))), a.iters)
    sent, gathered = exchange_bytes(batches[0][0], R, 0, a.dim, a.batch) if R > 1 else (0, 0)
    prof = []
    if a.profile:
        from profile_step import profile
        prof = profile(lambda i: float(steps[i % len(steps)]()), top=a.profile)
    print(json.dumps({"profile": prof, "replicas": R, "plain": a.plain, "ms": 1e3 * seconds, "batch": a.batch,
                      "pipelined_ms": 1e3 * pipelined, "communicator": comm,
                      "alltoall_bytes": sent, "allgather_bytes": gathered,
                      "device": f"{len(gpus)} GPU(s)" if gpus else f"{os.cpu_count()} CPU cores (logical devices)"}),
          flush=True)


def driver(a):
    rows = []
    runs = [(1, True, "auto")] + [(r, False, e) for r in a.replicas for e in (a.exchange if r > 1 else ["auto"])]
    for r, plain, exchange in runs:
        cmd = [sys.executable, __file__, "--worker", str(r), *step_args(a), "--profile", str(a.profile),
               "--exchange", exchange] + (["--plain"] if plain else [])
        rows.append(run_worker(cmd, f"R={r} exchange={exchange}"))
    print(f"{a.tables} distributed tables x {a.rows:,} rows, dim {a.dim}, per-replica batch {a.batch}, sok Adam "
          f"+ dense SGD; {rows[-1]['device']}")
    print(f"{'run':>23s} {'communicator':>20s} {'ms/step':>9s} {'samples/s':>12s} {'vs 1':>6s} {'pipelined':>9s} "
          f"{'samples/s':>12s} {'vs 1':>6s} {'all-to-all B/replica':>21s} {'all-gather B/replica':>21s}")
    one = next(r for r in rows if not r["plain"] and r["replicas"] == 1) if 1 in a.replicas else None

    def label(r):
        return "one device, no strategy" if r["plain"] else f"Mirrored, {r['replicas']} replica(s)"
    for r in rows:
        sps = r["replicas"] * r["batch"] / r["ms"] * 1e3
        pps = r["replicas"] * r["batch"] / r["pipelined_ms"] * 1e3
        if one and not r["plain"]:
            ratio = f"{sps / (one['batch'] / one['ms'] * 1e3):6.2f}"
            pratio = f"{pps / (one['batch'] / one['pipelined_ms'] * 1e3):6.2f}"
        else:
            ratio = pratio = f"{'':>6s}"
        print(f"{label(r):>23s} {r['communicator']:>20s} {r['ms']:9.2f} {sps:12,.0f} {ratio} "
              f"{r['pipelined_ms']:9.2f} {pps:12,.0f} {pratio} {r['alltoall_bytes']:21,d} {r['allgather_bytes']:21,d}")
    for r in rows:
        if r["profile"]:
            print(f"\nprofile, {label(r)}, {r['communicator']} (TensorFlow profiler, per step):\n" +
                  "\n".join(r["profile"]))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--exchange", nargs="+", default=["auto"], choices=["auto", "nccl", "framework"],
                   help="how the lookup's data travels between replicas (sok.init(exchange=...)); several: each "
                        "measured in turn")
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="also profile 10 steps of each run and print its TOP ops and kernels")
    add_step_args(p)
    args = p.parse_args()
    worker(args) if args.worker else driver(args)
