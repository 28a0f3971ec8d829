"""Throughput of a tf_sok training step at N = 1, 2, ... ranks (horovodrun, Gloo
controller; on GPUs one per rank), and the bytes each rank exchanges per step by
all-to-all against the all-gather alternative, measured side by side in one run.

    python benchmarks/scaling_bench.py [--ranks 1 2] [--batch 4096] [--exchange nccl framework]

"vs N=1" is the job's samples/s (all ranks) over the one-rank job's: N for
perfect weak scaling. Two timings of the same step: "ms/step", the median of
steps each waited for (the host's share of a step is exposed), and "pipelined",
a run of steps issued back to back with one wait at the end, as a training loop
runs them (the host prepares a step while the device works on the previous one). With --exchange nccl framework the lookup's data moves by
tf_sok's NCCL ops, then by Horovod's collectives (before/after in one run).

The step: fused lookup of 8 features over 8 distributed tables, backward, lazy
Adam on the shards. The per-rank batch is fixed, so ideal scaling keeps
samples/s per rank constant. Bytes are counted from the step's actual ids:
  all-to-all (tf_sok): each distinct (table, id) of the step to its owner
    (8 B), its vector back (4*dim B) and, in backward, its gradient to the
    owner (4*dim B), counting only what leaves the rank;
  all-gather alternative: every rank receives every other rank's ids, and the
    pooled outputs are reduce-scattered forward and all-gathered backward.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

from bench_args import add_shape_args

HERE = os.path.dirname(os.path.abspath(__file__))


def exchange_bytes(batch, n, rank, dim, batch_size):
    """Bytes one rank sends per step for a batch of ragged ids (one per distributed table):
    tf_sok's all-to-all (each distinct remote (table, id) once: its 8-byte key out, its vector
    back, its gradient out in backward) and the all-gather alternative (every rank's ids to
    every rank, pooled outputs reduce-scattered forward and all-gathered backward)."""
    ids = np.concatenate([x.values.numpy() for x in batch])
    remote = sum(len(np.unique(x.values.numpy()[x.values.numpy() % n != rank])) for x in batch)
    alltoall = remote * (8 + 2 * 4 * dim)
    allgather = (n - 1) * len(ids) * 8 + 2 * (n - 1) * batch_size * len(batch) * dim * 4
    return alltoall, allgather


def worker(a):
    import horovod.tensorflow as hvd

    hvd.init()
    import tensorflow as tf
    import keras

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # one GPU per rank
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")

    import tf_sok as sok
    from lookup_bench import make_batch, pipelined_time, sok_path, time_step

    ctx = sok.init(sparse_grad_reduction="mean", exchange=a.exchange[0])
    n, rank = ctx.num_ranks, ctx.rank
    rng = np.random.default_rng(100 + rank)
    batches = [make_batch(rng, a.tables, a.batch, a.rows, 4, 1.1) for _ in range(4)]
    init = keras.initializers.RandomUniform(-0.05, 0.05)
    tables = [sok.Variable(shape=[a.rows, a.dim], initializer=init, name=f"t{i}") for i in range(a.tables)]
    opt = sok.optimizers.Adam(1e-3)

    step = sok_path(tables, opt, "mean")
    seconds = time_step(step, batches, a.warmup, a.iters)
    pipelined = pipelined_time(step, batches, a.iters)
    alltoall, allgather = exchange_bytes(batches[0], n, rank, a.dim, a.batch)
    prof = []
    if a.profile:  # every rank runs the steps; rank 0 profiles its own
        def run(i):
            return float(step(batches[i % len(batches)]))
        if rank == 0:
            from profile_step import profile
            prof = profile(run, top=a.profile)
        else:
            for i in range(10):
                run(i)
    if rank == 0:
        device = f"one GPU per rank ({len(gpus)} visible)" if gpus else f"{os.cpu_count()} CPU cores shared by all ranks"
        print(json.dumps({"ranks": n, "device": device, "ms": 1e3 * seconds, "pipelined_ms": 1e3 * pipelined, "batch": a.batch,
                          "communicator": type(ctx.communicator).__name__,
                          "profile": prof,
                          "alltoall_bytes": alltoall, "allgather_bytes": allgather}), flush=True)


def add_step_args(p):
    """The step's shape, shared with mirrored_bench.py."""
    add_shape_args(p)


def step_args(a):
    return ["--batch", str(a.batch), "--rows", str(a.rows), "--dim", str(a.dim), "--tables", str(a.tables),
            "--iters", str(a.iters), "--warmup", str(a.warmup)]


def run_worker(cmd, what):
    """Runs one measuring process; returns the JSON line it printed last."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH")])))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [ln.split("<stdout>:")[-1] for ln in p.stdout.splitlines() if ln.split("<stdout>:")[-1].startswith("{")]
    if p.returncode != 0 or not line:
        sys.exit(f"{what} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[-1])


def driver(a):
    rows = []
    for exchange in a.exchange:
        for n in a.ranks:
            launch = [sys.executable, "-m", "horovod.runner.launch", "-np", str(n), "-H", f"localhost:{n}", "--gloo"]
            rows.append(run_worker(launch + [sys.executable, __file__, "--worker", "--exchange", exchange,
                                             "--profile", str(a.profile), *step_args(a)], f"N={n} exchange={exchange}"))
            rows[-1]["exchange"] = exchange
    print(f"{a.tables} distributed tables x {a.rows:,} rows, dim {a.dim}, per-rank batch {a.batch}, sok Adam; "
          f"{rows[-1]['device']}")
    print(f"{'exchange':>9s} {'ranks':>5s} {'communicator':>20s} {'ms/step':>9s} {'samples/s':>12s} "
          f"{'vs N=1':>7s} {'pipelined':>9s} {'samples/s':>12s} {'vs N=1':>7s} {'all-to-all B/rank':>18s} "
          f"{'all-gather B/rank':>18s} {'ratio':>6s}")
    for r in rows:
        one = next(x for x in rows if x["ranks"] == a.ranks[0] and x["exchange"] == r["exchange"])
        sps = r["ranks"] * r["batch"] / r["ms"] * 1e3          # the job's samples/s, all ranks together
        base = one["ranks"] * one["batch"] / one["ms"] * 1e3
        pps = r["ranks"] * r["batch"] / r["pipelined_ms"] * 1e3
        pbase = one["ranks"] * one["batch"] / one["pipelined_ms"] * 1e3
        ratio = r["allgather_bytes"] / r["alltoall_bytes"] if r["alltoall_bytes"] else float("nan")
        print(f"{r['exchange']:>9s} {r['ranks']:5d} {r['communicator']:>20s} {r['ms']:9.2f} {sps:12,.0f} "
              f"{sps / base:7.2f} {r['pipelined_ms']:9.2f} {pps:12,.0f} {pps / pbase:7.2f} "
              f"{r['alltoall_bytes']:18,d} {r['allgather_bytes']:18,d} {ratio:6.2f}")
    for r in rows:
        if r["profile"]:
            print(f"\nprofile of rank 0, exchange {r['exchange']}, N={r['ranks']} (TensorFlow profiler, per step):\n"
                  + "\n".join(r["profile"]))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--exchange", nargs="+", default=["auto"], choices=["auto", "nccl", "framework"],
                   help="how the lookup's data travels (sok.init(exchange=...)); several: each measured in turn")
    add_step_args(p)
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="also profile 10 steps on rank 0 of each run and print its TOP ops and kernels")
    args = p.parse_args()
    worker(args) if args.worker else driver(args)
