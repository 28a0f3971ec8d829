"""What the multi-rank exchange path costs before any communication: the same
training step (fused lookup of 8 features over 8 tables, backward, lazy Adam)
through the fused single-rank path and through the exchange path with one rank
(identity collectives), side by side in one run, forward only and full step.

    python benchmarks/exchange_bench.py [--batch 4096] [--device GPU:0 [--nccl]]

The difference is the routing (owner, dedup, bucketing, reassembly) that every
multi-rank step pays on top of its communication. --nccl (GPU) adds the
exchange path through the NCCL backend with one rank: its fused first exchange
(id check, routing and key all-to-all in one op) against the separate ops.
"""
import argparse
import functools

import numpy as np
import tensorflow as tf
import keras

from tensorflow.python.eager import tape as tape_lib

import tf_sok as sok
from bench_args import add_shape_args
from lookup_bench import make_batch, time_step
from tf_sok.python import exchange
from tf_sok.python.comm import SingleProcess
from tf_sok.python.lookup import lookup_sparse
from tf_sok.python.variable import table_meta


def exchanged(tables, ids, comm=None):
    for t in tables:  # as lookup_sparse does: the tape must see the reads to differentiate them
        tape_lib.variable_accessed(t)
    metas = [table_meta(t) for t in tables]
    return exchange.exchanged_lookup(
        comm or SingleProcess(), [t.handle for t in tables], metas, list(range(len(tables))),
        [x.values for x in ids], [x.row_splits for x in ids], [None] * len(ids), ["mean"] * len(ids),
        [f"f{i}" for i in range(len(ids))], "sum", 0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, iters=30)
    p.add_argument("--device", default="CPU:0")
    p.add_argument("--nccl", action="store_true", help="also the NCCL backend with one rank (GPU)")
    a = p.parse_args(argv)
    sok.init()
    paths = [("exchange path, 1 rank", exchanged)]
    if a.nccl:
        from tf_sok.python.comm import NcclCommunicator
        paths.append(("NCCL backend, 1 rank", functools.partial(
            exchanged, comm=NcclCommunicator(SingleProcess(), "/" + a.device))))
    with tf.device(a.device):
        init = keras.initializers.RandomUniform(-0.05, 0.05)
        tables = [sok.Variable(shape=[a.rows, a.dim], initializer=init, name=f"t{i}") for i in range(a.tables)]
        opt = sok.optimizers.Adam(1e-3)
        rng = np.random.default_rng(0)
        batches = [make_batch(rng, a.tables, a.batch, a.rows, 4, 1.1) for _ in range(4)]

        def fused(tables, ids):
            return lookup_sparse(tables, list(ids), combiners="mean")

        def forward(path):
            @tf.function(reduce_retracing=True)
            def f(ids):
                return tf.add_n([tf.reduce_sum(o) for o in path(tables, ids)])
            return f

        def step(path):
            @tf.function(reduce_retracing=True)
            def f(ids):
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(o * o) for o in path(tables, ids)])
                opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
                return loss
            return f

        print(f"{a.tables} tables x {a.rows:,} rows, dim {a.dim}, batch {a.batch}, Zipf ids, on {a.device}")
        for what, make in (("forward", forward), ("step", step)):
            t_fused = time_step(make(fused), batches, a.warmup, a.iters)
            for name, path in paths:
                t_exch = time_step(make(path), batches, a.warmup, a.iters)
                print(f"{what:>8s}: fused {1e3 * t_fused:7.2f} ms   {name} {1e3 * t_exch:7.2f} ms   "
                      f"routing overhead {1e3 * (t_exch - t_fused):7.2f} ms ({t_exch / t_fused:.2f}x)")


if __name__ == "__main__":
    main()
