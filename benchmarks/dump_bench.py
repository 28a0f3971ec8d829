"""sok.dump / sok.load throughput, in one run: a static table of --rows rows (default 1e7) with its
Adagrad state, and a dynamic table of --keys keys with Adam state; MB/s of the files written and read,
next to numpy's own write/read of the same bytes (np.ndarray.tofile / np.fromfile, the floor of any
format). With --ranks N, the dump is also loaded under horovodrun -np N (each rank keeps its rows):
the time of a load at another world size.

    python benchmarks/dump_bench.py [--rows 10000000] [--dim 32] [--keys 2000000] [--ranks 2]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import tf_sok as sok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tables(rows, dim, keys):
    static = sok.Variable(shape=[rows, dim], initializer="uniform", name="static")
    opt_s = sok.optimizers.Adagrad(0.1)
    opt_s.build([static])
    dyn = sok.DynamicVariable(dim, initializer="normal", init_capacity=keys + 2, name="dyn")
    opt_d = sok.optimizers.Adam(0.1)
    if keys:
        sok.assign(dyn, np.arange(keys, dtype=np.int64) * 7919, np.zeros([keys, dim], np.float32))
    opt_d.build([dyn])
    return (static, opt_s), (dyn, opt_d)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--keys", type=int, default=2_000_000)
    p.add_argument("--ranks", type=int, default=0, help="also load under horovodrun -np RANKS")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    sok.init()
    work = a.dir or tempfile.mkdtemp(prefix="dump_bench_")
    os.makedirs(work, exist_ok=True)
    print(f"dump_bench: {os.cpu_count()} cores, {work}")
    out = {}
    (static, opt_s), (dyn, opt_d) = tables(a.rows, a.dim, a.keys)
    for name, var, opt in (("static", static, opt_s), ("dynamic", dyn, opt_d)):
        path = os.path.join(work, name)
        t0 = time.perf_counter()
        sok.dump(path, [var], opt)
        t_dump = time.perf_counter() - t0
        size = dir_bytes(path)
        t0 = time.perf_counter()
        sok.load(path, [var], opt)
        t_load = time.perf_counter() - t0
        # the floor: numpy writing and reading the same bytes, one file
        raw = np.zeros(size // 4, np.float32)
        base = os.path.join(work, "raw.bin")
        t0 = time.perf_counter()
        raw.tofile(base)
        os.sync()
        t_np_w = time.perf_counter() - t0
        t0 = time.perf_counter()
        np.fromfile(base, np.float32)
        t_np_r = time.perf_counter() - t0
        os.remove(base)
        mb = size / 1e6
        out[name] = {"bytes": size, "dump_s": t_dump, "load_s": t_load, "numpy_write_s": t_np_w,
                     "numpy_read_s": t_np_r}
        print(f"  {name:8s} {mb:9,.0f} MB: dump {t_dump:6.2f} s ({mb / t_dump:7,.0f} MB/s; numpy write "
              f"{mb / t_np_w:7,.0f} MB/s), load {t_load:6.2f} s ({mb / t_load:7,.0f} MB/s, checksums read first; "
              f"numpy read {mb / t_np_r:7,.0f} MB/s)")
    if a.ranks:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                   CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""), TF_CPP_MIN_LOG_LEVEL="3")
        cmd = [sys.executable, "-m", "horovod.runner.launch", "-np", str(a.ranks), "-H", f"localhost:{a.ranks}",
               "--gloo", sys.executable, os.path.abspath(__file__), "--worker", os.path.join(work, "static"),
               str(a.rows), str(a.dim)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            print(r.stdout[-2000:], r.stderr[-2000:])
            raise SystemExit(1)
        loads = [float(line.split()[-1]) for line in r.stdout.splitlines() if "load_s " in line]   # horovodrun prefixes lines
        out["static"]["load_at_ranks"] = {"ranks": a.ranks, "load_s": max(loads), "launch_wall_s": wall}
        print(f"  static loaded under {a.ranks} ranks (dumped by 1): {max(loads):.2f} s (slowest rank; each reads "
              f"the files and keeps its rows)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)


def worker(path, rows, dim):
    import horovod.tensorflow as hvd

    hvd.init()
    sok.init()
    table = sok.Variable(shape=[rows, dim], initializer="zeros", name="static")
    opt = sok.optimizers.Adagrad(0.1)
    t0 = time.perf_counter()
    sok.load(path, [table], opt)
    print(f"load_s {time.perf_counter() - t0:.3f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
