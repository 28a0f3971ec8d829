"""End to end, in one run: the input pipeline, the embedding step and model.fit.

    python benchmarks/e2e_bench.py                       # this machine's defaults (GPU: batch 65,536)
    python benchmarks/e2e_bench.py --batch 4096 --dim 16 --max-vocab 100000 --steps 12   # a small CPU run

1. Readers: rows/s of each Criteo reader (TSV parse, Parquet, TFRecord, synthetic one-hot
   and DCNv2 multi-hot) and of the TSV -> Parquet converter, consumed in a graph loop as
   model.fit consumes them, with the cores used.
2. The embedding-only step of the small DLRM's 26 tables (lookup + gradient + lazy Adam).
3. model.fit samples/s of the small DLRM (examples/dlrm.py) and DCNv2 (examples/dcnv2.py)
   on cached batches (`take(4).cache().repeat()`) and on the live pipeline (synthetic pool,
   Parquet files), at steps_per_execution 1 and the recommended value, with the ratio
   live / cached (1.0: the pipeline never limits the step). The first execution (tracing)
   is left out of every rate.
"""
import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time

import tensorflow as tf
import keras

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import tf_sok as sok  # noqa: E402
import tf_sok.data as sd  # noqa: E402
from tf_sok.python.data.convert import convert  # noqa: E402


def puller(count: int, part: int):
    """A tf.function pulling `count` batches from an iterator, as fit's loop does; it returns their
    rows (the leading dimension of each batch's element `part`)."""
    @tf.function
    def pull(it):
        n = tf.constant(0, tf.int64)
        for _ in tf.range(count):
            n += tf.shape(next(it)[part], out_type=tf.int64)[0]
        return n
    return pull


def graph_rows_per_second(ds, steps: int, on_timed=None) -> float:
    """Rows/s of `steps` batches pulled inside one tf.function (after one warm-up call);
    on_timed(): called as the timed call starts."""
    it = iter(ds.repeat())
    pull = puller(steps, 2)
    pull(it)
    if on_timed:
        on_timed()
    t0 = time.perf_counter()
    n = int(pull(it))
    return n / (time.perf_counter() - t0)


def make_files(d: str, a, schema, tfrecord: bool = True, one_hot: bool = True):
    """A Criteo TSV file, its Parquet and TFRecord conversions (one_hot), and DCNv2 multi-hot Parquet
    files."""
    rows = a.file_rows
    tsv = os.path.join(d, "day.tsv")
    conv = None
    if not one_hot:
        os.makedirs(os.path.join(d, "dcnv2"))
        write_dcnv2(d, a, schema, rows)
        return tsv, conv
    sd.write_criteo_tsv(tsv, rows, sd.SyntheticConfig(schema=schema), seed=1)
    t0 = time.perf_counter()
    per_file = -(-rows // a.files)
    convert([tsv], os.path.join(d, "parquet"), "parquet", schema, rows_per_file=per_file)
    conv = rows / (time.perf_counter() - t0)
    if tfrecord:
        convert([tsv], os.path.join(d, "tfrecord"), "tfrecord", schema, rows_per_file=per_file)
    os.makedirs(os.path.join(d, "dcnv2"))
    write_dcnv2(d, a, schema, rows)
    return tsv, conv


def write_dcnv2(d: str, a, schema, rows: int):
    cfg = sd.SyntheticConfig.dcnv2(schema)
    for k in range(a.files):
        sd.write_parquet(sd.raw_batches(rows // a.files, a.batch, cfg, seed=10 + k),
                         os.path.join(d, "dcnv2", f"part-{k}.parquet"), schema)


def readers_section(a, d, schema, tsv, conv_rate):
    cores = len(os.sched_getaffinity(0))
    print(f"\n1. readers ({cores} cores, batch {a.batch}, {a.file_rows:,} rows in {a.files} files; "
          f"rows/s pulled in a graph loop)")
    print(f"  {'converter TSV -> Parquet':32s} {conv_rate:12,.0f} rows/s")
    out = {"cores": cores, "convert": conv_rate}
    steps = max(2, a.file_rows // a.batch)
    for name, ds in (("TSV (pyarrow parser)", sd.read_tsv(tsv, a.batch, schema)),
                     ("Parquet one-hot", sd.read_parquet(os.path.join(d, "parquet"), a.batch)),
                     ("TFRecord one-hot", sd.read_tfrecord(os.path.join(d, "tfrecord"), a.batch)),
                     ("Parquet DCNv2 multi-hot", sd.read_parquet(os.path.join(d, "dcnv2"), a.batch)),
                     ("synthetic one-hot (pool)", sd.synthetic(10**9, a.batch, sd.SyntheticConfig(schema=schema))),
                     ("synthetic DCNv2 (pool)", sd.synthetic(10**9, a.batch, sd.SyntheticConfig.dcnv2(schema)))):
        rate = graph_rows_per_second(ds, steps)
        out[name] = rate
        print(f"  {name:32s} {rate:12,.0f} rows/s")
    # how the multi-hot reader scales with the pieces read at once (int32 ids, as the examples read)
    for par in sorted({1, max(1, cores // 4), max(1, cores // 2), cores}):
        rate = graph_rows_per_second(sd.read_parquet(os.path.join(d, "dcnv2"), a.batch, parallel_files=par,
                                                     id_dtype=tf.int32), steps)
        out[f"Parquet DCNv2 int32, {par} at once"] = rate
        print(f"  {'Parquet DCNv2 int32, ' + str(par) + ' at once':32s} {rate:12,.0f} rows/s")
    out.update(feed_section(a, schema, d))
    return out


def feed_section(a, schema, d: str, steps: int = 60) -> dict:
    """Batches as fit takes them (for_keras, int32 ids, copied to the device by to_device; pulled
    inside a tf.function as fit's loop does), the ids as RaggedTensors and as (values, row_splits)
    pairs from the source on (the readers' and synthetic's ragged_pairs): rows/s and this process's
    CPU time per batch (tf.data's threads, which the training step's launches share; a reader's
    worker processes not counted): synthetic DCNv2 data, the one-hot and the DCNv2 Parquet files.
    The CPU time is the measure; the rows/s may count batches the readers built ahead."""
    device = "/gpu:0" if tf.config.list_physical_devices("GPU") else "/cpu:0"
    k = 10   # batches per graph call
    pull = puller(k, 1)   # (features, label): the label's rows

    def source(name, pairs):
        if name == "synthetic DCNv2":
            return sd.synthetic(10**9 // a.batch * a.batch, a.batch, sd.SyntheticConfig.dcnv2(schema),
                                id_dtype=tf.int32, ragged_pairs=pairs)
        files = sorted(glob.glob(os.path.join(d, "parquet" if "one-hot" in name else "dcnv2", "*.parquet")))
        return sd.read_parquet(files * 1000, a.batch, drop_remainder=True, id_dtype=tf.int32,
                               workers=a.reader_workers, ragged_pairs=pairs)

    out = {}
    for name in ("synthetic DCNv2", "Parquet one-hot", "Parquet DCNv2"):
        ragged_cpu = None
        for pairs in (False, True):
            it = iter(sd.to_device(sd.for_keras(source(name, pairs), id_dtype=tf.int32), device, ragged_pairs=True))
            for _ in range(2):
                pull(it)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(max(1, steps // k)):
                pull(it)
            batches = max(1, steps // k) * k
            rate, cpu = batches * a.batch / (time.perf_counter() - t0), (time.process_time() - c0) / batches * 1e3
            label = f"{name} to {device}, ids as {'pairs' if pairs else 'RaggedTensors'}"
            out[label] = {"rows_per_s": rate, "cpu_ms_per_batch": cpu}
            print(f"  {label:60s} {rate:12,.0f} rows/s, {cpu:6.1f} ms of CPU per batch"
                  + (f" ({ragged_cpu / cpu:.2f}x less than RaggedTensors)" if pairs else ""), flush=True)
            ragged_cpu = cpu
            del it
    return out


def embedding_section(a, schema):
    """The small DLRM's 26 tables alone: lookup + gradient + lazy Adam, steps in a graph loop."""
    tables = [sok.Variable(shape=[v, a.dim], initializer="uniform", name=f"e2e_emb{i}")
              for i, v in enumerate(schema.vocab_sizes)]
    opt = sok.optimizers.Adam(1e-3)
    _, cats, _ = next(iter(sd.synthetic(a.batch, a.batch, sd.SyntheticConfig(schema=schema))))
    batch = [cats[n] for n in schema.categorical_names]

    @tf.function
    def steps(batch):
        for _ in tf.range(a.loop):
            with tf.GradientTape() as tape:
                outs = sok.lookup_sparse(tables, batch, combiners="mean")
                loss = tf.add_n([tf.reduce_sum(o * o) for o in outs])
            opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
        return loss
    steps(batch).numpy()
    t0 = time.perf_counter()
    steps(batch).numpy()
    ms = (time.perf_counter() - t0) / a.loop * 1e3
    print(f"\n2. embedding step alone (26 tables, dim {a.dim}, lookup + gradient + Adam, {a.loop} steps per call): "
          f"{ms:.2f} ms ({a.batch / ms * 1e3:,.0f} samples/s)")
    return ms


class Rate(keras.callbacks.Callback):
    """Samples/s over the executions after the first (which traces)."""

    def __init__(self, batch, on_first=None):
        super().__init__()
        self.batch, self.marks, self.on_first = batch, [], on_first

    def on_train_batch_end(self, step, logs=None):
        self.marks.append((time.perf_counter(), step + 1))
        if len(self.marks) == 1 and self.on_first:
            self.on_first()

    def rate(self):
        (t0, s0), (t1, s1) = self.marks[0], self.marks[-1]
        return (s1 - s0) * self.batch / (t1 - t0)


def fit_steps(a, spe: int) -> int:
    steps = max(a.steps, 3 * spe)
    return steps - steps % spe


def fit_rate(model, ds, a, spe: int, busy=None) -> float:
    """samples/s of `fit` over the executions after the first; busy (a CpuUse): started with them."""
    rate = Rate(a.batch, on_first=busy.start if busy else None)
    model.fit(ds, epochs=1, steps_per_epoch=fit_steps(a, spe), callbacks=[rate], verbose=0)
    return rate.rate()


def tier_budget(share, schema, dim, opt):
    """The -tier runs' table arguments: every table's device budget (max_hbm_for_vectors, GiB) is this
    share of the largest table's rows and their optimizer state."""
    widths = dim + sum(dim if not s.per_row else 1 for s in opt.sparse.slot_specs())
    return dict(max_hbm_for_vectors=share * max(schema.vocab_sizes) * widths * 4 / 2**30)


def fit_sources(a, schema, cfg, files: str, steps: int) -> dict:
    """The fit's batches as the examples feed them (int32 ids as the tables are capped, prefetched to
    the GPU): "cached" (4 synthetic batches repeated), live "synthetic" (the pool) and live "Parquet"
    (the files in `files`, if any, listed as often as `steps` batches need: the steps read in the steady
    state of one long epoch, as over a day of data, not across epoch restarts)."""
    import pyarrow.parquet as pq
    from criteo_common import id_dtype

    ids = id_dtype(schema)
    gpu = "/gpu:0" if tf.config.list_physical_devices("GPU") else None

    def fed(ds, pinned=True):   # as the examples feed fit (the ids as (values, row_splits) unless --ragged-tensors)
        return sd.to_device(ds, gpu, pinned=pinned, ragged_pairs=a.ragged_pairs) if gpu else ds

    pairs = a.ragged_pairs   # from the source on: no RaggedTensor in the pipeline
    synthetic = sd.for_keras(sd.synthetic(10**9 // a.batch * a.batch, a.batch, cfg, id_dtype=ids, ragged_pairs=pairs),
                             id_dtype=ids)
    names = sorted(glob.glob(os.path.join(files, "*.parquet")))
    rows = sum(pq.ParquetFile(n).metadata.num_rows for n in names)
    passes = -(-steps * a.batch // max(1, rows)) + 1
    out = {"cached": fed(synthetic.take(4).cache().repeat())}
    if getattr(a, "pageable", False):   # the copy to the GPU from pageable memory, as before pinned_copy
        out["cached, pageable"] = fed(synthetic.take(4).cache().repeat(), pinned=False)
    out["synthetic"] = fed(synthetic)
    if names:
        out["Parquet"] = fed(sd.for_keras(sd.read_parquet(names * passes, a.batch, drop_remainder=True, id_dtype=ids,
                                                          workers=a.reader_workers, ragged_pairs=pairs).repeat(),
                                          id_dtype=ids))
    return out


def tier_tables(model) -> list:
    """The model's tables (hybrid or not) as tf_sok sees them (Keras wraps them)."""
    return [getattr(t, "_dynamic", t) for t in model.embeddings.tables.values()]


def tier_counters(model) -> dict:
    """The host tiers' counters summed over the model's hybrid tables: lookups, misses, bytes moved
    over the host link, finds (a table's finds: the steps)."""
    stats = [sok.cache_stats(t) for t in tier_tables(model) if getattr(t, "hybrid", False)]
    return {"lookups": sum(s["lookups"] for s in stats), "misses": sum(s["misses"] for s in stats),
            "moved": sum(s["bytes_to_device"] + s["bytes_to_host"] for s in stats),
            "finds": stats[0]["finds"] if stats else 0}


def fit_one(a, d, schema, name: str, spe: int) -> dict:
    """One model compiled once, fit on the cached batches then on each live pipeline (a
    process per model and setting: TensorFlow keeps a model's memory until it exits)."""
    import dcnv2
    import dlrm
    from criteo_common import default_optimizer
    from reader_scaling import CpuUse

    # e.g. DCNv2-bf16-xla (-kerasloop: Keras' own multi-step loop; -pinnedslabs: the Parquet readers'
    # slabs registered with the GPU, TF_SOK_PIN_SLABS=1; -tier: the tables with a host tier, -prefetch:
    # and each step prefetching the next batch's ids into their caches; DLRM-tf: the baseline, benchmarks/tf_dlrm.py)
    base, *options = name.split("-")
    if "pinnedslabs" in options:
        from tf_sok.python.data import block_workers

        block_workers.PIN_SLABS = True
    if "bf16" in options:  # Keras' mixed policy for the dense part
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    jit = "xla" in options  # the dense part compiled by XLA
    opt = default_optimizer() if base == "DLRM" else dcnv2.optimizer(0.005)()
    dim = a.dim if base == "DLRM" else a.dcnv2_dim
    tier = tier_budget(a.tier_share, schema, dim, opt) if "tier" in options else {}
    if base == "DLRM":
        if "tf" in options:   # the same model without tf_sok: TensorFlow's own tables
            import tf_dlrm

            model, opt = tf_dlrm.TFDLRM(schema, a.dim, jit_dense=jit), tf_dlrm.optimizer()
        else:
            model = dlrm.DLRM(schema, a.dim, jit_dense=jit, **tier)
        cfg, files = sd.SyntheticConfig(schema=schema), os.path.join(d, "parquet")
    else:
        model = dcnv2.DCNv2(schema, a.dcnv2_dim, jit_dense=jit, **tier)
        cfg, files = sd.SyntheticConfig.dcnv2(schema), os.path.join(d, "dcnv2")
    model.compile(optimizer=opt, loss="binary_crossentropy", steps_per_execution=spe)
    if "prefetch" in options and not tier:
        raise SystemExit(f"{name}: -prefetch goes with -tier (only tables with a host tier prefetch)")
    if "kerasloop" not in options:   # as the examples run fit (--prefetch: the examples' prefetch of each next batch)
        from criteo_common import next_batch_prefetch

        sok.keras.loop_on_host(model, prefetch=next_batch_prefetch(model) if "prefetch" in options else None)
    sources = fit_sources(a, schema, cfg, files, fit_steps(a, spe))
    row, text = {}, f"  {name:18s} spe {spe:2d}:"
    for src, ds in sources.items():
        # cores kept busy while the Parquet run is timed: the training process, the reader's workers
        busy = CpuUse(a.reader_workers) if src == "Parquet" and a.reader_workers else None
        before = tier_counters(model) if tier else None
        try:
            row[src] = r = fit_rate(model, ds, a, spe, busy)
        except Exception as e:  # noqa: BLE001 (report and go on: one variant must not stop the run)
            text += f" | {src}: failed ({type(e).__name__}: {str(e)[:200]})"
            continue
        text += f" | {src} {r:11,.0f}" + (f" ({r / row['cached']:.2f} of cached" if src != "cached" else "")
        if before is not None:   # the caches over this source's run (its warm-up included)
            after = tier_counters(model)
            d = {k: after[k] - before[k] for k in after}
            row[f"{src}_tier"] = src_tier = {"hit_rate": 1 - d["misses"] / max(d["lookups"], 1),
                                             "mb_per_step": d["moved"] / max(d["finds"], 1) / 1e6}
            text += (f"{'; ' if src != 'cached' else ' ('}hit rate {src_tier['hit_rate']:.4f}, "
                     f"{src_tier['mb_per_step']:.1f} MB per step" + (")" if src == "cached" else ""))
        if busy:
            main, workers = busy.cores()
            row["Parquet_cores_busy"] = {"training_process": main, "reader_workers": workers}
            text += f"; cores busy: training process {main:.1f}, reader processes {workers:.1f}"
        text += ")" if src != "cached" else ""
    if tier:   # the host tiers' caches over every run above
        tables = tier_tables(model)
        tiered = sum(1 for t in tables if getattr(t, "hybrid", False))
        c = tier_counters(model)
        row["tier"] = {"budget_gib": tier["max_hbm_for_vectors"], "hit_rate": 1 - c["misses"] / max(c["lookups"], 1),
                       "mb_per_step": c["moved"] / max(c["finds"], 1) / 1e6,
                       "tables_tiered": tiered, "tables_held_whole": len(tables) - tiered}
        budget = tier["max_hbm_for_vectors"]
        text += (f" | host tier: {f'{budget:.2f} GiB' if budget >= 0.1 else f'{budget * 1024:.1f} MiB'} per table "
                 f"({tiered} of {len(tables)} tables tiered, the others held whole), hit rate "
                 f"{row['tier']['hit_rate']:.4f}, {row['tier']['mb_per_step']:.1f} MB over the link per step")
    print(text, flush=True)
    return row


def fit_section(a, d):
    import subprocess

    print(f"\n3. model.fit samples/s, batch {a.batch} (steps_per_execution 1 and {a.spe}; the first execution "
          f"left out; one process per model and setting)", flush=True)
    out = {}
    runs = [r.split(":") for r in a.fit_runs] if a.fit_runs else \
        [("DLRM", 1), ("DLRM", a.spe), ("DLRM-tf", a.spe), ("DLRM-tier", a.spe), ("DCNv2", 1), ("DCNv2", a.spe),
         ("DCNv2-bf16", a.spe)]
    for name, spe in runs:
        args = [sys.executable, os.path.abspath(__file__), "--fit-one", name, str(spe), "--data-dir", d]
        for k in ("batch", "dim", "dcnv2_dim", "max_vocab", "steps", "tier_share"):
            args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
        args += ["--reader-workers", str(a.reader_workers or 0)]
        if a.pageable:
            args += ["--pageable"]
        if a.ragged_tensors:
            args += ["--ragged-tensors"]
        began = time.time()
        try:
            p = subprocess.run(args, capture_output=True, text=True, timeout=a.fit_timeout or None)
        except subprocess.TimeoutExpired as e:   # (one run must not hold up the others; what it printed is kept)
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            last = " / ".join(err.strip().splitlines()[-3:])
            print(f"  {name:18s} spe {int(spe):2d}: timed out after {a.fit_timeout:.0f} s (--fit-timeout); its last "
                  f"lines: {last}", flush=True)
            out[f"{name}/spe{spe}"] = None
            continue
        lines = [l for l in p.stdout.splitlines() if l.startswith("  ") or l.startswith("{")]
        print("\n".join(l for l in lines if not l.startswith("{")) or p.stderr[-1500:], flush=True)
        print(f"    ({name} took {time.time() - began:.0f} s with its set-up and compilation)", flush=True)
        out[f"{name}/spe{spe}"] = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    for key, base in [(k, k.replace("-tf/", "/")) for k in out if "-tf/" in k]:   # tf_sok vs the baseline
        ours, theirs = out.get(base) or {}, out[key] or {}
        shared = [src for src in ("cached", "synthetic", "Parquet") if ours.get(src) and theirs.get(src)]
        if shared:
            print(f"  {base.split('/')[0]} with tf_sok vs TensorFlow's own tables ({key.split('/')[0]}, "
                  f"benchmarks/tf_dlrm.py), {key.split('/')[1]}: " +
                  ", ".join(f"{src} {ours[src] / theirs[src]:.2f}x" for src in shared), flush=True)
    for key, base in [(k, k.replace("-prefetch/", "/")) for k in out if "-tier-prefetch/" in k]:   # the prefetch's gain
        ours, plain = out[key] or {}, out.get(base) or {}
        shared = [src for src in ("cached", "synthetic", "Parquet") if ours.get(src) and plain.get(src)]
        if shared:
            print(f"  {key.split('/')[0]} (each step prefetching the next batch's ids) vs {base.split('/')[0]}, "
                  f"{key.split('/')[1]}: " + ", ".join(f"{src} {ours[src] / plain[src]:.2f}x the samples/s" for src in shared),
                  flush=True)
    for key, base in [(k, re.sub(r"-tier(-prefetch)?/", "/", k)) for k in out if "-tier" in k]:   # the host tier's cost
        ours, full = out[key] or {}, out.get(base) or {}
        shared = [src for src in ("cached", "synthetic", "Parquet") if ours.get(src) and full.get(src)]
        if shared:
            print(f"  {key.split('/')[0]} (tables beyond a budget of {a.tier_share:.0%} of the largest in host "
                  f"memory, cached on the device) vs all in device memory, {key.split('/')[1]}: " +
                  ", ".join(f"{src} {ours[src] / full[src]:.2f}x the samples/s" for src in shared), flush=True)
    return out


def main():
    gpu = bool(tf.config.list_physical_devices("GPU"))
    for g in tf.config.list_physical_devices("GPU"):   # the fit runs are child processes: leave them the memory
        tf.config.experimental.set_memory_growth(g, True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=65536 if gpu else 4096)
    p.add_argument("--dim", type=int, default=128 if gpu else 16, help="the small DLRM's table width")
    p.add_argument("--dcnv2-dim", type=int, default=128 if gpu else 16)
    p.add_argument("--max-vocab", type=int, default=10_000_000 if gpu else 100_000)
    p.add_argument("--file-rows", type=int, default=None,
                   help="rows of the test TSV file (default: 8 batches, at least 262,144 and 2 batches per file)")
    p.add_argument("--files", type=int, default=4, help="Parquet/TFRecord files the test rows are split into "
                                                        "(the readers read one file per core at once)")
    p.add_argument("--steps", type=int, default=200 if gpu else 12,
                   help="fit steps per measurement (the first execution's left out; on a GPU enough that the "
                        "Parquet workers build blocks while timed, past those built during the first one)")
    p.add_argument("--spe", type=int, default=10, help="the recommended steps_per_execution")
    p.add_argument("--loop", type=int, default=10, help="embedding steps per call")
    p.add_argument("--sections", nargs="+", default=["readers", "embedding", "fit"],
                   choices=["readers", "embedding", "fit"])
    p.add_argument("--fit-runs", nargs="+", metavar="MODEL:SPE",
                   help="the fit runs (default DLRM:1 DLRM:<spe> DLRM-tf:<spe> DLRM-tier:<spe> DCNv2:1 DCNv2:<spe> DCNv2-bf16:<spe>); a model "
                        "name may end in -bf16 (Keras mixed_bfloat16), -xla (the dense part compiled by XLA), "
                        "-pinnedslabs (the Parquet readers' slabs page-locked), -kerasloop (Keras' own "
                        "multi-step loop instead of sok.keras.loop_on_host), -tier (every table given a device "
                        "budget, --tier-share: those it holds whole held plainly, the others in host memory with a "
                        "device cache), -tier-prefetch (and each step prefetching the next "
                        "batch's ids: sok.keras.loop_on_host(prefetch=...), as the examples' --prefetch); DLRM-tf: the same DLRM without "
                        "tf_sok (benchmarks/tf_dlrm.py), its samples/s compared with DLRM's at the same spe")
    p.add_argument("--fit-timeout", type=float, default=900,
                   help="seconds each fit run (a process) may take, its set-up included; 0: no limit")
    p.add_argument("--tier-share", type=float, default=0.1,
                   help="-tier runs: each table's device budget (max_hbm_for_vectors), this share of the largest "
                        "table's rows and optimizer state")
    p.add_argument("--ragged-tensors", action="store_true",
                   help="the batches' ragged ids copied to the GPU as RaggedTensors (default: as the examples, "
                        "(values, row_splits) pairs from the source on: read_parquet / synthetic(ragged_pairs=True))")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--pageable", action="store_true",
                   help="fit also on cached batches copied to the GPU from pageable memory (to_device(pinned=False))")
    p.add_argument("--reader-workers", default="auto",
                   help="the live Parquet pipeline's blocks built by this many processes (read_parquet(workers=)); "
                        "0: threads of the training process; auto: as the examples (half the cores on a GPU "
                        "machine of 8 or more)")
    p.add_argument("--fit-one", nargs=2, metavar=("MODEL", "SPE"), help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.ragged_pairs = not a.ragged_tensors
    from criteo_common import reader_workers
    a.reader_workers = reader_workers(a)   # None: threads
    if a.fit_one:
        sok.init()
        schema = sd.CriteoSchema.capped(a.max_vocab)
        print(json.dumps(fit_one(a, a.data_dir, schema, a.fit_one[0], int(a.fit_one[1]))))
        return
    a.file_rows = a.file_rows or max(8 * a.batch, 1 << 18, 2 * a.files * a.batch)
    sok.init()
    schema = sd.CriteoSchema.capped(a.max_vocab)
    print(f"e2e_bench: {'GPU ' + tf.config.experimental.get_device_details(tf.config.list_physical_devices('GPU')[0]).get('device_name', '') if gpu else 'CPU only'}, "
          f"{len(os.sched_getaffinity(0))} cores, tables capped at {a.max_vocab:,} rows")
    res = {}
    with tempfile.TemporaryDirectory() as d:
        # the one-hot files only where a section reads them (the readers, the small DLRM's fit)
        one_hot = "readers" in a.sections or not a.fit_runs or any(r.startswith("DLRM") for r in a.fit_runs)
        tsv, conv = make_files(d, a, schema, tfrecord="readers" in a.sections, one_hot=one_hot)
        if "readers" in a.sections:
            res["readers"] = readers_section(a, d, schema, tsv, conv)
        if "embedding" in a.sections:
            res["embedding_ms"] = embedding_section(a, schema)
        if "fit" in a.sections:
            res["fit"] = fit_section(a, d)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
