"""Where the Parquet reader's scaling stops: the block builder alone in T Python threads (no
TensorFlow), blocks already in memory turned into batches by tf.data at T pieces (the reader's
main-process side alone), then the tf.data reader at T pieces, then with its blocks built by W
worker processes (read_parquet(workers=W)), over DCNv2 multi-hot files; with worker processes
it also prints the cores the reader process and its workers keep busy.

    python benchmarks/reader_scaling.py [--files 8] [--rows 131072] [--parts builder,memory,threads,workers]
        [--ragged-tensors]
"""
import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tf_sok.data as sd  # noqa: E402
from tf_sok.python.data import blocks as blocks_lib, columnar  # noqa: E402
from e2e_bench import graph_rows_per_second  # noqa: E402


def threads_rate(files, schema, threads: int, pyarrow_threads: bool, batch: int) -> float:
    rows = [0] * threads

    def work(t):
        for k in range(t, len(files) * 2, threads):   # each file twice over
            for block in columnar._parquet_blocks(files[k % len(files)], 1 << 18, schema, None, batch, np.int32,
                                                  pyarrow_threads):
                rows[t] += len(block[2])
    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(rows) / (time.perf_counter() - t0)


def physical_cores() -> str:
    """What the cores are: physical cores and threads per core, from /proc/cpuinfo."""
    try:
        info = open("/proc/cpuinfo").read().split("\n\n")
        ids = {(b.split("physical id")[1].split("\n")[0], b.split("core id")[1].split("\n")[0])
               for b in info if "core id" in b}
        model = info[0].split("model name")[1].split("\n")[0].strip(" :\t")
        return f"{len(ids)} physical cores seen in /proc/cpuinfo, {model}"
    except (OSError, IndexError):
        return "physical cores unknown"


class CpuUse:
    """Cores kept busy by this process and by read_parquet's worker processes (from /proc), from
    start() to cores()."""

    def __init__(self, workers: int):
        from tf_sok.python.data import block_workers

        self.pids = list(block_workers._pool(workers)._processes)

    @staticmethod
    def _ticks(pid) -> int:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])   # utime + stime

    def start(self):
        self.t0 = time.perf_counter()
        self.c0 = time.process_time()
        self.w0 = sum(self._ticks(p) for p in self.pids)

    def cores(self):
        wall = time.perf_counter() - self.t0
        workers = (sum(self._ticks(p) for p in self.pids) - self.w0) / os.sysconf("SC_CLK_TCK")
        return (time.process_time() - self.c0) / wall, workers / wall


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--parts", default="builder,memory,threads,workers",
                   help="which measurements: the block builder in threads, blocks in memory -> tf.data, "
                        "read_parquet with threads, read_parquet with worker processes")
    p.add_argument("--ragged-tensors", action="store_true",
                   help="batches with RaggedTensor ids (default: (values, row_splits) pairs, as the examples read)")
    a = p.parse_args()
    pairs = not a.ragged_tensors
    parts = set(a.parts.split(","))
    schema = sd.CriteoSchema.capped(10_000_000)
    d = tempfile.mkdtemp()
    cfg = sd.SyntheticConfig.dcnv2(schema)
    files = []
    for k in range(a.files):
        files.append(os.path.join(d, f"part-{k}.parquet"))
        sd.write_parquet(sd.raw_batches(a.rows, min(a.rows, 65536), cfg, seed=k), files[-1], schema)
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores ({physical_cores()}), {a.files} DCNv2 files of {a.rows:,} rows, ids as "
          f"{'pairs' if pairs else 'RaggedTensors'}")
    for t in sorted({1, 2, 4, 8, cores}) if "builder" in parts else []:
        print(f"  block builder, {t:2d} Python threads: {threads_rate(files, schema, t, False, a.batch):12,.0f} rows/s "
              f"(pyarrow threads on: {threads_rate(files, schema, t, True, a.batch):12,.0f})", flush=True)
    steps = max(2, a.files * a.rows // a.batch)
    # the reader's main-process side alone: blocks already built (in memory), handed to tf.data by a
    # generator and sliced into batches there, P pieces interleaved as read_parquet does
    built = [list(columnar._parquet_blocks(f, 1 << 18, schema, None, a.batch, np.int32, False)) for f in files] \
        if "memory" in parts else []
    sig = blocks_lib.block_signature(schema, tf.int32)
    for t in sorted({1, 4, 8, cores}) if "memory" in parts else []:
        def piece(k):
            return blocks_lib.batched_blocks(tf.data.Dataset.from_generator(
                lambda i: iter(built[int(i)]), output_signature=sig, args=(k,)), a.batch, ragged_pairs=pairs)
        ds = tf.data.Dataset.range(len(built)).interleave(piece, cycle_length=t, num_parallel_calls=tf.data.AUTOTUNE,
                                                          deterministic=False).prefetch(tf.data.AUTOTUNE)
        print(f"  blocks in memory -> tf.data batches, {t:2d} pieces: {graph_rows_per_second(ds, steps):12,.0f} rows/s",
              flush=True)
    best_threads = 0.0   # the baseline: what read_parquet gives without worker processes
    for t in sorted({1, 4, 8, cores}) if "threads" in parts else []:
        for det in (True, False):
            ds = sd.read_parquet(d, a.batch, parallel_files=t, id_dtype=tf.int32, deterministic=det, ragged_pairs=pairs)
            rate = graph_rows_per_second(ds, steps)
            best_threads = max(best_threads, rate)
            print(f"  read_parquet, {t:2d} pieces, deterministic={det}: {rate:12,.0f} rows/s", flush=True)
    for w in sorted({2, max(2, cores // 2), max(2, 3 * cores // 4), cores}) if "workers" in parts else []:
        ds = sd.read_parquet(d, a.batch, parallel_files=cores, id_dtype=tf.int32, deterministic=False, workers=w,
                             ragged_pairs=pairs)
        busy = CpuUse(w)
        rate = graph_rows_per_second(ds, steps, on_timed=busy.start)
        main, workers = busy.cores()
        vs = f", {rate / best_threads:.2f}x the best with threads" if best_threads else ""
        print(f"  read_parquet, {cores} pieces built by {w:2d} worker processes: {rate:12,.0f} rows/s "
              f"(cores busy: main process {main:.1f}, workers {workers:.1f}{vs})", flush=True)


if __name__ == "__main__":
    main()
