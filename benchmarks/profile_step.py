"""Profiles one training step (tf_sok or TensorFlow's path) and prints the
time per op type, from TensorFlow's profiler trace.

    python benchmarks/profile_step.py --path sok|tf [--device GPU:0] [--batch 65536]
    python benchmarks/profile_step.py --dlrm 1 --device GPU:0 --optimizer adam   (gpu_bench's (b) step)
    python benchmarks/profile_step.py --lookups 16 --device GPU:0   (gpu_bench's (a) one-id lookups,
        10 per call, next to tf.gather in the same form: where a small lookup's time goes)
"""
import argparse
import collections
import glob
import tempfile
import time

import numpy as np
import tensorflow as tf
import keras
from tensorflow.tsl.profiler.protobuf import xplane_pb2

import tf_sok as sok
from gpu_bench import make_step, steps_in_graph
from gpu_common import CARDINALITIES, TFSparseOptimizer, fixed_hot_batch
from lookup_bench import make_batch, sok_path, tf_path


def short_name(name):
    """An event's name without namespaces and arguments: 'void a::(anonymous namespace)::
    K<long, 4>(a::B, int)' -> 'K<long, 4>'; a TensorFlow op 'scope/op:Type' -> 'Type'."""
    name = name.replace("(anonymous namespace)::", "")
    if "(" not in name:
        return name.split(":")[-1][:60]
    head, depth, cut = name.split("(")[0], 0, 0
    for i, ch in enumerate(head):  # the last '::' outside template arguments
        depth += ch == "<"
        depth -= ch == ">"
        if depth == 0 and head.startswith("::", i):
            cut = i + 2
    return head[cut:].strip()[:60]


def summarize(logdir, steps, top=25):
    """Prints (and returns) the top op / kernel times per step from a profiler trace (the
    executor's threads summed together)."""
    f = sorted(glob.glob(logdir + "/**/*.xplane.pb", recursive=True))[-1]
    xs = xplane_pb2.XSpace()
    with open(f, "rb") as fh:
        xs.ParseFromString(fh.read())
    agg, busy, count = collections.Counter(), collections.Counter(), collections.Counter()
    for plane in xs.planes:
        md = plane.event_metadata
        for line in plane.lines:
            for ev in line.events:
                name = short_name(md[ev.metadata_id].name)
                thread = line.name.split("/")[0] if line.name.startswith("tf_") else line.name
                agg[(plane.name[:18], thread[:18], name)] += ev.duration_ps / 1e9 / steps
                count[(plane.name[:18], thread[:18], name)] += 1
                if plane.name.startswith("/device:GPU") and line.name.startswith("Stream"):
                    busy[(plane.name[:18], line.name[:18])] += ev.duration_ps / 1e9 / steps
    # a GPU stream's busy time (its kernels and copies) against the step time shows who waits on whom
    lines = [f"{v:9.3f} ms/step  {p:18s} {l:18s} (busy: all its kernels and copies)" for (p, l), v in busy.most_common()]
    lines += [f"{v:9.3f} ms/step  {p:18s} {l:18s} {n} (x{count[(p, l, n)] / steps:g})"
              for (p, l, n), v in agg.most_common(top)]
    print("\n".join(lines))
    return lines


def profile(run, steps=10, top=25, calls=None):
    """Profiles `calls` (default: `steps`) calls of run(i), which together run `steps`
    steps, and returns summarize's lines (times per step)."""
    logdir = tempfile.mkdtemp()
    tf.profiler.experimental.start(logdir)
    for i in range(steps if calls is None else calls):
        run(i)
    tf.profiler.experimental.stop()
    return summarize(logdir, steps, top)


def small_lookups(dim, batch):
    """gpu_bench (a)'s one-id lookups (1e7-row table, uniform ids, 10 lookups per call),
    timed and profiled next to TensorFlow's tf.gather of the same ids in the same form."""
    rng = np.random.default_rng(0)
    rows = 10_000_000
    table = sok.Variable(shape=[rows, dim], initializer=keras.initializers.RandomUniform(-1, 1), name="small")
    dense = tf.Variable(tf.random.uniform([rows, dim]))
    ids, splits = fixed_hot_batch(rng, rows, batch, 1, "uniform")
    rts = [tf.RaggedTensor.from_row_splits(tf.constant(np.roll(ids, k * 7919)), tf.constant(splits))
           for k in range(10)]

    @tf.function
    def lookups():
        return tf.add_n([sok.lookup_sparse(table, rt, combiners="sum")[0, 0] for rt in rts])

    @tf.function
    def gathers():
        return tf.add_n([tf.gather(dense, rt.values)[0, 0] for rt in rts])

    for name, fn in (("tf_sok lookup_sparse", lookups), ("tf.gather", gathers)):
        for _ in range(20):
            float(fn())
        t = []
        for _ in range(50):
            t0 = time.perf_counter()
            float(fn())
            t.append(time.perf_counter() - t0)
        print(f"== {name}: {np.median(t) / 10 * 1e3:.3f} ms per lookup (10 per call); per call:")
        profile(lambda i: float(fn()), steps=20, top=20)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--path", default="sok")
    p.add_argument("--device", default="CPU:0")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--dlrm", type=int, metavar="IDS_PER_FEATURE",
                   help="profile gpu_bench.py's DLRM-like step (26 Criteo tables, dim 128) instead")
    p.add_argument("--loop", type=int, default=1,
                   help="run this many steps per tf.function call (a graph loop, as gpu_bench.py --loop); "
                        "times are still per step")
    p.add_argument("--lookups", type=int, metavar="DIM",
                   help="profile gpu_bench's one-id forward lookups of this width instead (batch 65,536)")
    a = p.parse_args()
    sok.init()
    if a.lookups:
        with tf.device(a.device):
            small_lookups(a.lookups, 65536)
        return
    rng = np.random.default_rng(0)
    init = keras.initializers.RandomUniform(-0.05, 0.05)
    kopt = keras.optimizers.SGD(0.01) if a.optimizer == "sgd" else keras.optimizers.Adam(1e-3)
    # TensorFlow's path updates the touched rows only (Keras 3's optimizers densify IndexedSlices)
    tf_opt = TFSparseOptimizer("sgd", 0.01) if a.optimizer == "sgd" else TFSparseOptimizer("adam", 1e-3)
    if a.dlrm:
        batches = [[tf.RaggedTensor.from_row_splits(*map(tf.constant, fixed_hot_batch(rng, r, a.batch, a.dlrm,
                                                                                       "zipf:1.05")))
                    for r in CARDINALITIES]] * 4
    else:
        batches = [make_batch(rng, 8, a.batch, a.rows, 4, 1.1) for _ in range(4)]
    with tf.device(a.device):
        if a.dlrm:
            if a.path == "sok":
                tables = [sok.Variable(shape=[r, 128], initializer=init, name=f"c{i}")
                          for i, r in enumerate(CARDINALITIES)]
                kopt = sok.OptimizerWrapper(kopt)
            else:
                tables = [tf.Variable(init((r, 128))) for r in CARDINALITIES]
                kopt = tf_opt
            step = make_step(tables, list(range(26)), kopt, a.path)
        elif a.path == "sok":
            tables = [sok.Variable(shape=[a.rows, 32], initializer=init, name=f"t{i}") for i in range(8)]
            step = sok_path(tables, sok.OptimizerWrapper(kopt), "mean")
        else:
            tables = [tf.Variable(init((a.rows, 32))) for _ in range(8)]
            step = tf_path(tables, tf_opt, "mean")
        for i in range(5):
            float(step(batches[i % 4]))
        if a.loop > 1:
            looped = steps_in_graph(step, a.loop)
            float(looped(batches[0]))
            profile(lambda i: float(looped(batches[i % 4])), steps=10 * a.loop, calls=10)
        else:
            profile(lambda i: float(step(batches[i % 4])))


if __name__ == "__main__":
    main()
