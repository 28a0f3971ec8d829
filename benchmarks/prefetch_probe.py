"""Where a prefetching hybrid step's time goes, its parts timed one by one on the same tables.

    python benchmarks/prefetch_probe.py [--dist zipf:1.05] [--steps 5]      (tier_bench's tables)
    python benchmarks/prefetch_probe.py --quick                             (small, any device)

Hybrid tables as `tier_bench.py` makes them (8 x 2M keys x dim 128 + Adagrad, a 10 % cache), then,
in ms per call: the step without prefetch; the same step after its batch was prefetched (what the
lookup costs when every row is cached); `sok.prefetch` of the next batch alone; the step with the
prefetch of the next batch in it. With TF_SOK_FIND_STAGES=1 the finds and the prefetches print
their stages' host times every 20 calls (a last run of 40 prefetching steps makes them print).
"""
import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tf_sok as sok

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tier_bench import batches, make_step, make_tables  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dist", default="zipf:1.05")
    p.add_argument("--steps", type=int, default=5, help="timed calls of each part")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    a = argparse.Namespace(tables=8, keys=2_000_000, dim=128, batch=65536, cache_share=0.1, static=False)
    if args.quick:
        a.tables, a.keys, a.dim, a.batch = 2, 20_000, 16, 2048
    device = "/GPU:0" if tf.config.list_physical_devices("GPU") else "/CPU:0"
    data = batches(a, args.dist, 4 * args.steps + 60)
    tables = make_tables(a, device, "lru", "probe_")
    opt = sok.optimizers.Adagrad(0.01)
    plain, prefetching = make_step(tables, opt), make_step(tables, opt, prefetch=True)
    prefetch_only = tf.function(lambda next_batch: sok.prefetch(tables, list(next_batch)))
    i = 0

    def ms(f):
        t0 = time.perf_counter()
        f()
        return (time.perf_counter() - t0) * 1e3

    def show(what, times):
        print(f"  {what:44s} median {np.median(times):7.2f} ms  ({' '.join(f'{t:.2f}' for t in times)})", flush=True)

    print(f"prefetch_probe on {device}: {a.tables} hybrid tables x {a.keys:,} keys x dim {a.dim}, cache "
          f"{a.cache_share:.0%}, batch {a.batch:,}, {args.dist}")
    with tf.device(device):
        for _ in range(4):   # warm-up (traces)
            float(plain(data[i], data[i]))
            i += 1
        prefetch_only(data[i]).numpy()
        float(prefetching(data[i], data[i + 1]))
        i += 1
        times = []
        for _ in range(args.steps):
            times.append(ms(lambda: float(plain(data[i], data[i]))))
            i += 1
        show("step without prefetch", times)
        after, alone = [], []
        for _ in range(args.steps):
            alone.append(ms(lambda: prefetch_only(data[i]).numpy()))
            after.append(ms(lambda: float(plain(data[i], data[i]))))
            i += 1
        show("step whose batch was prefetched before", after)
        show("sok.prefetch of a batch alone", alone)
        times = []
        for _ in range(args.steps):
            times.append(ms(lambda: float(prefetching(data[i], data[i + 1]))))
            i += 1
        show("step with the prefetch of the next batch", times)
        if os.environ.get("TF_SOK_FIND_STAGES") == "1":
            for _ in range(40):
                float(prefetching(data[i], data[i + 1]))
                i += 1


if __name__ == "__main__":
    main()
