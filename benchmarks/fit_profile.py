"""Where a model.fit step of the DLRM (or DCNv2) example spends its time: TensorFlow's profiler over a few
executions, read back from its trace (no TensorBoard needed).

Prints, per step: wall time, the time the GPU is busy (union of its kernels and copies; the copies
alone), and so the time it waits for the host; the kernels taking most GPU time, grouped as tf_sok's
or TensorFlow's/Keras'; the host threads kept busiest; and the same model's dense part alone (its
embeddings replaced by a cached input of the same shape), which is what Keras and TensorFlow cost
without tf_sok. The batches are fed as `e2e_bench.py` feeds fit (int32 ids, prefetched to the GPU):
`--source cached` (4 batches repeated), `synthetic` (the live pool) or `parquet` (files written
first, read by `--reader-workers` processes).

    python benchmarks/fit_profile.py [--model dlrm|dcnv2] [--mixed bf16] [--jit-dense] [--batch 65536] [--spe 10]
        [--executions 3] [--tier-share 0.1] [--source cached|synthetic|parquet] [--files 16] [--reader-workers 8] [--no-twin]
        [--keep-trace FILE.xplane.pb.gz] [--warmup-steps 200]
    python benchmarks/fit_profile.py --from-trace FILE.xplane.pb.gz --executions 2 [--spe 10]
"""
import argparse
import collections
import glob
import os
import sys
import tempfile
import time

import keras
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import tf_sok as sok  # noqa: E402
import tf_sok.data as sd  # noqa: E402
from e2e_bench import fit_sources, tier_budget  # noqa: E402

OURS = ("TfSok", "tf_sok", "impl::gpu")   # kernel / op names of tf_sok


def short(name: str, width: int = 110) -> str:
    """An event's name cut to `width`, keeping its end (a nested op's own name) where it is longer."""
    return name if len(name) <= width else name[:30] + " ... " + name[-(width - 35):]


def merge(spans):
    """[start, end] intervals merged where they overlap."""
    merged = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def busy_intervals(plane, lines=None):
    """[(start_ps, end_ps)] of every event on a plane's lines (or the given ones), merged."""
    return merge((line.timestamp_ns * 1000 + ev.offset_ps, line.timestamp_ns * 1000 + ev.offset_ps + ev.duration_ps)
                 for line in (plane.lines if lines is None else lines) for ev in line.events)


def host_threads(space, steps, top: int = 8):
    """The host threads kept busiest (union of their events), ms per step."""
    host = [p for p in space.planes if p.name.startswith("/host:CPU")]
    if not host:
        return
    rows = sorted(((sum(e - s for s, e in busy_intervals(None, [line])) / 1e9 / steps, line.name)
                   for line in host[0].lines if line.events), reverse=True)
    print("  host threads busiest (ms per step): " +
          ", ".join(f"{name[:40]} {ms:.1f}" for ms, name in rows[:top]))
    names = {k: v.name for k, v in host[0].event_metadata.items()}
    ops, counts = collections.Counter(), collections.Counter()
    for line in host[0].lines:
        if line.name.startswith("tf_Compute") or line.name.startswith("tf_data"):
            for ev in line.events:
                ops[names.get(ev.metadata_id, "?")] += ev.duration_ps
                counts[names.get(ev.metadata_id, "?")] += 1
    print("  host events on TensorFlow's threads (ms per step, count per step; nested events overlap):")
    for name, ps in ops.most_common(2 * top):
        print(f"    {ps / 1e9 / steps:7.3f} ms {counts[name] / steps:6.1f}x  {short(name)}")


def op_namer(plane):
    """A function naming a GPU event by its TensorFlow op where the trace says (stat "tf_op"),
    else by its kernel's or copy's name."""
    names = {k: v.name for k, v in plane.event_metadata.items()}
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}

    def op_of(ev):
        for st in ev.stats:
            if stat_names.get(st.metadata_id) == "tf_op":
                return st.str_value or stat_names.get(st.ref_value, "") or names.get(ev.metadata_id, "?")
        return names.get(ev.metadata_id, "?")
    return op_of


def copies_to_host(plane, steps):
    """The copies from the GPU to the host by the op they feed: each makes the host wait for the
    work queued before it."""
    names = {k: v.name for k, v in plane.event_metadata.items()}
    op_of = op_namer(plane)
    count = collections.Counter(op_of(ev) for line in plane.lines for ev in line.events
                                if "d2h" in names.get(ev.metadata_id, "").lower())
    print(f"  copies to the host: {sum(count.values()) / steps:.1f} per step")
    for name, n in count.most_common(8):
        print(f"    {n / steps:5.1f}x  {name[-110:]}")


def idle_gaps(plane, steps, top: int = 10, least_us: float = 100.0):
    """The GPU's idle gaps (no stream busy) of at least `least_us`, grouped by the work that ended
    each one: its TensorFlow op where the trace names it (stat "tf_op"), else its kernel's name."""
    op_of = op_namer(plane)
    events = sorted((line.timestamp_ns * 1000 + ev.offset_ps, ev.duration_ps, i, ev)
                    for line in plane.lines for i, ev in enumerate(line.events))
    gap_ps, count, end = collections.Counter(), collections.Counter(), None
    for start, dur, _, ev in events:
        if end is not None and start - end >= least_us * 1e6:
            gap_ps[op_of(ev)] += start - end
            count[op_of(ev)] += 1
        end = start + dur if end is None else max(end, start + dur)
    print(f"  GPU idle in gaps of {least_us:.0f} us or more: {sum(gap_ps.values()) / 1e9 / steps:.2f} ms per step; "
          f"the work that ended them (ms per step, gaps per step):")
    for name, ps in gap_ps.most_common(top):
        print(f"    {ps / 1e9 / steps:7.3f} ms {count[name] / steps:5.1f}x  {short(name)}")
    return gap_ps


def read_kept_trace(path):
    """A trace written by --keep-trace, and its wall time: the span of the GPU's events."""
    import gzip

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with gzip.open(path, "rb") as f:
        space.ParseFromString(f.read())
    spans = [(line.timestamp_ns * 1000 + ev.offset_ps, line.timestamp_ns * 1000 + ev.offset_ps + ev.duration_ps)
             for p in space.planes if p.name.startswith("/device:GPU") for line in p.lines for ev in line.events]
    return space, (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e12 if spans else 0.0


def read_trace(logdir, keep=None):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1]
    if keep:   # the raw trace, gzipped, for reading elsewhere
        import gzip
        import shutil
        with open(path, "rb") as src, gzip.open(keep, "wb") as dst:
            shutil.copyfileobj(src, dst)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def summarize(space, steps, wall_s):
    gpu = [p for p in space.planes if p.name.startswith("/device:GPU")]
    print(f"  wall {wall_s / steps * 1e3:8.2f} ms per step profiled")
    if not gpu:
        print("  (no GPU plane in the trace: CPU only)")
        host_threads(space, steps)
        return
    plane = gpu[0]
    merged = busy_intervals(plane)
    busy = sum(e - s for s, e in merged) / 1e9 / steps
    print(f"  GPU busy {busy:8.2f} ms per step ({busy / (wall_s / steps * 1e3):.0%} of wall); "
          f"waiting for the host {wall_s / steps * 1e3 - busy:.2f} ms")
    names = {k: v.name for k, v in plane.event_metadata.items()}
    copies = [(line.timestamp_ns * 1000 + ev.offset_ps, ev.duration_ps) for line in plane.lines for ev in line.events
              if "memcpy" in names.get(ev.metadata_id, "").lower()]
    copy_busy = sum(e - s for s, e in merge((s, s + d) for s, d in copies)) / 1e9 / steps
    print(f"  of which copies {copy_busy:.2f} ms per step ({len(copies) / steps:.0f} copy events)")
    copies_to_host(plane, steps)
    idle_gaps(plane, steps)
    total = collections.Counter()
    for line in plane.lines:
        for ev in line.events:
            total[names.get(ev.metadata_id, "?")] += ev.duration_ps
    ours = sum(v for k, v in total.items() if any(o in k for o in OURS))
    print(f"  kernel time per step: tf_sok {ours / 1e9 / steps:.2f} ms, "
          f"others {(sum(total.values()) - ours) / 1e9 / steps:.2f} ms; the largest:")
    for name, ps in total.most_common(12):
        print(f"    {ps / 1e9 / steps:7.3f} ms  {short(name)}")
    host_threads(space, steps)


class ProfileWindow(keras.callbacks.Callback):
    """Starts TensorFlow's profiler at step `first` of a fit call and stops it `steps` steps later
    (at execution boundaries): a live source keeps its iterator, so the profile sees its steady
    state and not a reader starting again."""

    def __init__(self, logdir, first, steps):
        super().__init__()
        self.logdir, self.first, self.last = logdir, first, first + steps
        self.t0 = self.wall = None

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.first:
            tf.profiler.experimental.start(self.logdir)
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.t0 is not None and self.wall is None and batch + 1 >= self.last:
            self.wall = time.perf_counter() - self.t0
            tf.profiler.experimental.stop()


def profiled_fit(model, ds, spe, executions, keep=None, warmup_steps=None):
    """(trace, steps, wall): `executions` executions of spe steps profiled, after a warm-up fit
    call and an unprofiled one (each call a new iterator over `ds`); or, with `warmup_steps`
    (a multiple of spe), in one fit call after that many steps of it."""
    steps = executions * spe
    logdir = tempfile.mkdtemp(prefix="fit_profile_")
    if warmup_steps is not None:
        window = ProfileWindow(logdir, warmup_steps, steps)
        t0 = time.perf_counter()
        model.fit(ds, epochs=1, steps_per_epoch=warmup_steps + steps, verbose=0, callbacks=[window])
        print(f"  one fit call of {warmup_steps + steps} steps, {(time.perf_counter() - t0):.1f} s; "
              f"the last {steps} profiled")
        return read_trace(logdir, keep), steps, window.wall
    model.fit(ds, epochs=1, steps_per_epoch=2 * spe, verbose=0)          # trace + warm up
    t0 = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    print(f"  wall {(time.perf_counter() - t0) / steps * 1e3:8.2f} ms per step without the profiler")
    tf.profiler.experimental.start(logdir)
    t0 = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    wall = time.perf_counter() - t0
    tf.profiler.experimental.stop()
    return read_trace(logdir, keep), steps, wall


class DenseTwin(keras.Model):
    """The model's dense part with fixed embeddings held on the device (no lookup, no copy): what
    Keras and TensorFlow cost."""

    def __init__(self, model, emb):
        super().__init__()
        self.model = model
        self.emb = tf.Variable(emb, trainable=False)

    def call(self, x):
        return self.model.dense_part(x["dense"], tf.unstack(self.emb, axis=1))


def main():
    import dcnv2
    import dlrm
    from criteo_common import default_optimizer

    gpu = bool(tf.config.list_physical_devices("GPU"))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["dlrm", "dcnv2"], default="dlrm")
    p.add_argument("--mixed", choices=["off", "bf16"], default="off", help="Keras mixed policy (mixed_bfloat16)")
    p.add_argument("--batch", type=int, default=65536 if gpu else 4096)
    p.add_argument("--dim", type=int, default=128 if gpu else 16)
    p.add_argument("--max-vocab", type=int, default=10_000_000 if gpu else 100_000)
    p.add_argument("--spe", type=int, default=10)
    p.add_argument("--executions", type=int, default=3)
    p.add_argument("--tier-share", type=float, default=None,
                   help="every table given a device budget, this share of the largest table's rows and state "
                        "(as e2e_bench.py's -tier runs): a host tier for the tables it does not hold whole")
    p.add_argument("--jit-dense", action="store_true", help="the dense part compiled by XLA")
    p.add_argument("--source", choices=["cached", "synthetic", "parquet"], default="cached")
    p.add_argument("--files", type=int, default=16, help="--source parquet: files of 2 batches written first")
    p.add_argument("--reader-workers", type=int, default=None, help="--source parquet: read_parquet(workers=)")
    p.add_argument("--keras-loop", action="store_true", help="Keras' own multi-step loop, not sok.keras.loop_on_host")
    p.add_argument("--ragged-tensors", action="store_true",
                   help="the batches' ragged ids copied to the GPU as RaggedTensors (default: as the examples, "
                        "(values, row_splits) pairs from the source on: ragged_pairs=True)")
    p.add_argument("--no-twin", action="store_true", help="leave out the dense part alone")
    p.add_argument("--keep-trace", metavar="FILE.xplane.pb.gz", help="also write the whole model's trace here")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="profile inside one fit call after this many of its steps (a live source in its steady "
                        "state; a multiple of --spe); default: fresh fit calls")
    p.add_argument("--from-trace", metavar="FILE.xplane.pb.gz",
                   help="only summarize a trace written by --keep-trace (its steps: --executions x --spe; wall: "
                        "the span of its GPU events)")
    a = p.parse_args()
    a.ragged_pairs = not a.ragged_tensors
    if a.from_trace:
        space, wall = read_kept_trace(a.from_trace)
        print(f"fit_profile: {a.from_trace}, {a.executions * a.spe} steps")
        summarize(space, a.executions * a.spe, wall)
        return
    if a.mixed == "bf16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    sok.init()
    schema = sd.CriteoSchema.capped(a.max_vocab)
    opt = default_optimizer() if a.model == "dlrm" else dcnv2.optimizer(0.005)()
    tier = tier_budget(a.tier_share, schema, a.dim, opt) if a.tier_share else {}
    if a.model == "dlrm":
        model, cfg = dlrm.DLRM(schema, a.dim, jit_dense=a.jit_dense, **tier), sd.SyntheticConfig
    else:
        model, cfg = dcnv2.DCNv2(schema, a.dim, jit_dense=a.jit_dense, **tier), sd.SyntheticConfig.dcnv2
    model.compile(optimizer=opt, loss="binary_crossentropy", steps_per_execution=a.spe)
    if not a.keras_loop:   # as the examples run fit
        sok.keras.loop_on_host(model)
    files = tempfile.mkdtemp(prefix="fit_profile_data_")
    if a.source == "parquet":
        for k in range(a.files):
            sd.write_parquet(sd.raw_batches(2 * a.batch, a.batch, cfg(schema=schema), seed=10 + k),
                             os.path.join(files, f"part-{k}.parquet"), schema)
    ds = fit_sources(a, schema, cfg(schema=schema), files, (2 + 2 * a.executions) * a.spe + (a.warmup_steps or 0))[
        {"cached": "cached", "synthetic": "synthetic", "parquet": "Parquet"}[a.source]]
    print(f"fit_profile: {a.model}, 26 tables of dim {a.dim} (at most {a.max_vocab:,} rows), batch {a.batch}, "
          f"steps_per_execution {a.spe}, {a.executions} executions profiled, policy {a.mixed}"
          f"{', dense part compiled by XLA' if a.jit_dense else ''}, {a.source} batches"
          + (f", host tiers with caches of {tier['max_hbm_for_vectors']:.3f} GiB" if tier else ""))
    print("1. the whole model")
    if a.warmup_steps is not None and (a.warmup_steps <= 0 or a.warmup_steps % a.spe):
        raise SystemExit(f"--warmup-steps: a positive multiple of --spe {a.spe}, got {a.warmup_steps}")
    summarize(*profiled_fit(model, ds, a.spe, a.executions, a.keep_trace, a.warmup_steps))
    if a.no_twin:
        return

    twin = DenseTwin(model, tf.random.uniform([a.batch, len(schema.categorical_names), a.dim], -0.05, 0.05))
    twin.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", steps_per_execution=a.spe,
                 jit_compile=False)   # as the whole model runs (its tf_sok ops have no XLA kernels)
    x, y = next(iter(ds))
    dense_ds = tf.data.Dataset.from_tensors(({"dense": x["dense"]}, y)).repeat().prefetch(2)
    print("2. its dense part alone (embeddings fixed on the device): Keras' and TensorFlow's own cost")
    summarize(*profiled_fit(twin, dense_ds, a.spe, a.executions))


if __name__ == "__main__":
    main()
