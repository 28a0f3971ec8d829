"""Hybrid tables (a host tier with a device cache of hot rows) against the same tables all in device
memory, in one run.

    python benchmarks/tier_bench.py [--tables 8] [--keys 2000000] [--dim 128] [--batch 65536]
                                    [--cache-share 0.1] [--dists zipf:1.05 zipf:1.2 uniform]
                                    [--evict lru lfu] [--warmup 100] [--iters 10] [--rounds 5]
                                    [--write-back copies|both] [--prefetch-grids 2 4]
    python benchmarks/tier_bench.py --quick         (small sizes, any device)
    python benchmarks/tier_bench.py --find [--find-keys 67108864] [--find-dim 64] [--find-batch 1048576]
                                    [--find-shares 0.5 0.1] [--find-dist uniform]

--find measures the hybrid table's lookup alone against HierarchicalKV's hybrid find (the issue's
anchor: dim 64, 128M keys, half the values in HBM, 1M random held keys per call, A100: find
0.118-0.148 G-KV/s, find_or_insert 0.079-0.122): one dynamic table of --find-keys keys (every key
inserted first), forward lookups (`sok.lookup_sparse`, no gradient) of --find-batch held keys per
call (uniform, or --find-dist), as G keys/s, with a cache of each --find-shares of the values and all in device
memory; each two ways: training lookups (a miss takes the key's row into the cache and writes back
an evicted one; on a GPU, in turns call by call, the rows taken in as the library does for lookups
this large (the host's threads gather a share of them and copy it over while the kernel reads the
rest in place), all read in place by the kernel, and all gathered: the three rates printed),
then lookups that do not train (`training=False`: nothing changes; on a GPU the
keys not cached have their rows gathered from host memory by the host's threads and copied over
in one piece, the default for reads this large, and then, on the same calls, read where they are
by the kernel, as HierarchicalKV's find does: both rates printed, and their ratio).

The DLRM-like step: `--tables` dynamic tables of `--keys` keys each (every key inserted before the
timed steps, so the tables hold their full size; `--static`: `sok.Variable`s of `--keys` rows, with a
host tier against without, every row used once before the timed steps), one id per sample and table drawn from the
distribution (ids hashed to 64-bit keys), lookup + gradient + Adagrad (one state array per table).
The hybrid tables get `max_hbm_for_vectors` = cache-share x their bytes (values and state): the
rest lives in pinned host memory; one kind of hybrid tables per cache policy of `--evict` (LRU and
LFU). Printed per distribution: ms per step of each, the ratio (aim <= 2x at Zipf 1.05), the cache's
hit rate over the timed steps, bytes moved over the host link per step and the rate that makes,
against the link's bandwidth measured in the same run
(`sok.host_link_bandwidth`: pinned memory copied each way, and read / written in place by a
kernel, as the hybrid tables move rows). Another kind (unless `--no-prefetch`): hybrid tables (the
first policy's) trained with `sok.prefetch` of the next batch's ids in each step, its ratio printed
beside; on a GPU, one more such kind for each of `--prefetch-grids`, the prefetch's moves on that many
blocks per SM (TF_SOK_PREFETCH_BLOCKS_PER_SM). Every kind's tables are made and warmed up first
(`--warmup` steps: the caches, and LFU's counts, reach their steady state) (all held at once: the device needs the all-in-memory
tables and both caches, the host both tiers); the timed steps then run in `--rounds` rounds in
which the kinds take turns, each kind on the same batches in the same order, so that the machine's
drifts over the run fall on all of them.

`--write-back both` (GPU): another kind of hybrid tables (the first policy's) whose evicted rows are
written in place by the kernel that reads the new ones in (TF_SOK_WRITE_BACK_COPIES=0), taking turns
with the rest, against the default (copied back, written by the host's threads).

`--store-keys` (default on a GPU: both): where the hybrid tables look up the store rows of the keys a
find takes in and of the keys a read does not find cached: `gpu` (the tier's keys also mapped on the
device, the library's default), `host` (the host tier's key map alone, after a round trip through
the host: TF_SOK_STORE_KEYS_ON_GPU=0 when the tables are made), or `both` (a kind of tables each,
printed side by side; with --find, each cache share both ways).
"""
import argparse
import gc
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tf_sok as sok

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import ids_for  # noqa: E402

HASH = np.int64(-7046029254386353131)   # odd: ids -> distinct 64-bit keys
PROFILED = 5                            # steps profiled with --profile


def batches(a, dist, count):
    rng = np.random.default_rng(7)
    out = []
    scale = np.int64(1) if a.static else HASH      # static tables: the ids are the rows
    for _ in range(count):
        out.append([tf.RaggedTensor.from_row_splits(tf.constant(ids_for(rng, a.keys, a.batch, dist) * scale),
                                                    tf.range(a.batch + 1, dtype=tf.int64))
                    for _ in range(a.tables)])
    return out


class EnvVar:
    """Within it, the environment variable `name` is `value` (None: unset); restored after."""

    def __init__(self, name, value):
        self.name, self.value = name, value

    def __enter__(self):
        self.before = os.environ.get(self.name)
        if self.value is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.value

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.before


def StoreKeys(on_gpu: bool):
    """Hybrid tables made inside look up their host tier's keys on the GPU (on_gpu) or on the host."""
    return EnvVar("TF_SOK_STORE_KEYS_ON_GPU", "1" if on_gpu else "0")


def GatherRows(on: bool):
    """Within it, a GPU read of many keys not cached, or a training lookup taking many records of at
    most 640 bytes into the cache, gathers their host rows on the host's threads (the library's
    default) or, with False, reads them all in place (TF_SOK_READ_GATHER_MIN_ROWS=-1)."""
    return EnvVar("TF_SOK_READ_GATHER_MIN_ROWS", None if on else "-1")


def GatherShare(share):
    """Within it, the share of the records a GPU training lookup gathers that the host's threads take
    (the rest read in place by the kernel meanwhile): the library's default (None) or `share`
    (TF_SOK_GATHER_SHARE)."""
    return EnvVar("TF_SOK_GATHER_SHARE", None if share is None else str(share))


# the training lookups' ways of taking records in, taking turns: the default (the host's threads gather
# a share of them while the kernel reads the rest in place), all read in place, all gathered
FIND_MODES = {"find": lambda: GatherRows(True), "find_in_place": lambda: GatherRows(False),
              "find_gathered_all": lambda: GatherShare(1)}


def WriteBack(copies: bool):
    """Within it, a GPU find's evicted rows go back by copies (the library's default) or, with False,
    are written in place by the kernel (TF_SOK_WRITE_BACK_COPIES=0)."""
    return EnvVar("TF_SOK_WRITE_BACK_COPIES", None if copies else "0")


def PrefetchGrid(blocks_per_sm):
    """Within it, a prefetch's moves run on a grid of blocks_per_sm blocks per SM (None: the library's
    default; TF_SOK_PREFETCH_BLOCKS_PER_SM)."""
    return EnvVar("TF_SOK_PREFETCH_BLOCKS_PER_SM", None if blocks_per_sm is None else str(blocks_per_sm))


def store_key_places(a):
    """[(label suffix, keys on the GPU)] of --store-keys."""
    return {"host": [("", False)], "gpu": [("", True)],
            "both": [("", False), (", keys on GPU", True)]}[a.store_keys]


def make_tables(a, device, policy, tag: str, keys_on_gpu: bool = False):
    """The tables of one kind: all in device memory (policy None), or hybrid with that cache policy."""
    with StoreKeys(keys_on_gpu):
        return _make_tables(a, device, policy, tag)


def _make_tables(a, device, policy, tag: str):
    hybrid = policy is not None
    state_widths = 2 * a.dim                              # values + Adagrad's accumulator
    budget = a.cache_share * a.keys * state_widths * 4 / 2**30
    with tf.device(device):
        if a.static:   # sok.Variable with a host tier against the plain static table
            kw = dict(max_hbm_for_vectors=budget) if hybrid else {}
            tables = [sok.Variable(shape=[a.keys, a.dim], initializer="uniform", name=f"{tag}{i}", **kw)
                      for i in range(a.tables)]
            if not hybrid:
                return tables
        else:
            kw = dict(var_type="hybrid", max_hbm_for_vectors=budget, evict_strategy=policy) if hybrid else \
                dict(init_capacity=a.keys + 1)
            tables = [sok.DynamicVariable(a.dim, initializer="uniform", name=f"{tag}{i}", **kw)
                      for i in range(a.tables)]
        every = np.arange(a.keys, dtype=np.int64) * (np.int64(1) if a.static else HASH)
        for t in tables:   # every key in the table before the timed steps
            for lo in range(0, a.keys, 1 << 20):
                t.rows_for(tf.constant(every[lo:lo + (1 << 20)]))
    return tables


def make_step(tables, opt, prefetch=False):
    """The step: lookup + gradient + the optimizer's update; prefetch: it prefetches the next batch's
    ids after its lookup (`sok.prefetch`), as a training loop fed by a pipeline that holds them."""
    @tf.function
    def step(batch, next_batch):
        with tf.GradientTape() as tape:
            outs = sok.lookup_sparse(tables, list(batch), combiners="sum")
            loss = tf.add_n([tf.reduce_sum(o * o) for o in outs])
        if prefetch:
            sok.prefetch(tables, list(next_batch))
        opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
        return loss
    return step


class Runner:
    """One kind of tables (all in device memory, hybrid, hybrid with prefetch) stepping through the
    batches in order, its timed steps' times and cache counters kept across rounds."""

    COUNTERS = ("lookups", "misses", "bytes_to_device", "bytes_to_host", "loaded", "evicted", "prefetched",
                "bytes_in_gathered")

    def __init__(self, device, tables, data, prefetch=False, copies_back=True, prefetch_grid=None):
        self.device, self.tables, self.data, self.prefetch = device, tables, data, prefetch
        self.copies_back = copies_back   # (False: evicted rows written in place, WriteBack)
        self.prefetch_grid = prefetch_grid   # (blocks per SM of the prefetch's moves, PrefetchGrid)
        self.hybrid = getattr(tables[0], "hybrid", False)
        self.step = make_step(tables, sok.optimizers.Adagrad(0.01), prefetch)
        self.at, self.times, self.counts, self.cached = 0, [], dict.fromkeys(self.COUNTERS, 0), 0

    def call(self, i):
        return float(self.step(self.data[i], self.data[min(i + 1, len(self.data) - 1)]))

    def steps(self, n, timed=True):
        """The next n batches' steps (timed: their times and counters kept)."""
        with tf.device(self.device), WriteBack(self.copies_back), PrefetchGrid(self.prefetch_grid):
            before = [sok.cache_stats(t) for t in self.tables] if self.hybrid and timed else None
            for _ in range(n):
                t0 = time.perf_counter()
                self.call(self.at)
                if timed:
                    self.times.append(time.perf_counter() - t0)
                self.at += 1
            if before:
                after = [sok.cache_stats(t) for t in self.tables]
                for k in self.COUNTERS:
                    self.counts[k] += sum(x[k] - y[k] for x, y in zip(after, before))
                self.cached = sum(x["cached"] for x in after)

    def profile(self):
        """Where the step's time goes, per op and kernel (TensorFlow's profiler), over new batches."""
        from profile_step import profile as profile_steps

        print(f"  -- {'hybrid' if self.hybrid else 'all-HBM'} step{' with prefetch' if self.prefetch else ''}, "
              f"profiled:")
        start = self.at
        with tf.device(self.device), WriteBack(self.copies_back), PrefetchGrid(self.prefetch_grid):
            profile_steps(lambda i: self.call(start + i), steps=PROFILED, top=40)

    def result(self):
        """Median ms per timed step and, for hybrid tables, the cache's counters per step."""
        res = {"ms": float(np.median(self.times)) * 1e3}
        if self.hybrid:
            d, steps = self.counts, len(self.times)
            res.update(hit_rate=1 - d["misses"] / d["lookups"],
                       mb_per_step=(d["bytes_to_device"] + d["bytes_to_host"]) / steps / 1e6,
                       loaded_per_step=d["loaded"] / steps, evicted_per_step=d["evicted"] / steps,
                       prefetched_per_step=d["prefetched"] / steps, cached=self.cached,
                       gathered_in_share=gathered_in_share(d))
        return res


def gathered_in_share(d):
    """Of the bytes a hybrid table's finds took in (cache_stats deltas d), the share the host's threads
    gathered (the rest read in place by the kernel)."""
    return d["bytes_in_gathered"] / d["bytes_to_device"] if d["bytes_to_device"] else 0.0


def _timed_calls(a, t, look, calls, hybrid):
    """G keys/s (median call) of `look` over `calls`, with the hybrid table's hit rate of training
    lookups and bytes its reads brought from host memory (in place or gathered)."""
    before = sok.cache_stats(t) if hybrid else None
    times = []
    for ids in calls:
        t0 = time.perf_counter()
        look(ids).numpy()
        times.append(time.perf_counter() - t0)
    res = {"gkeys_s": a.find_batch / float(np.median(times)) / 1e9, "host_bytes": 0}
    if before:
        after = sok.cache_stats(t)
        d = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
        res["hit_rate"] = 1 - d["misses"] / d["lookups"] if d["lookups"] else 0.0
        res["host_bytes"] = d["bytes_read_in_place"] + d["bytes_read_gathered"]
        res["gathered_in_share"] = gathered_in_share(d)
    return res


def _taking_turns(a, t, look, calls, hybrid, modes):
    """{mode: _timed_calls' result} of lookups in each mode (modes: name -> its settings' context), the
    modes taking turns call by call on calls of their own."""
    names = list(modes)
    per = {m: [] for m in names}
    for i, ids in enumerate(calls):
        m = names[i % len(names)]
        with modes[m]():
            per[m].append(_timed_calls(a, t, look, [ids], hybrid))
    return {m: {"gkeys_s": float(np.median([r["gkeys_s"] for r in rs])),
                "hit_rate": float(np.mean([r.get("hit_rate", 0.0) for r in rs])),
                "gathered_in_share": float(np.mean([r.get("gathered_in_share", 0.0) for r in rs]))}
            for m, rs in per.items()}


def find_rate(a, device, share, keys_on_gpu=False):
    with StoreKeys(keys_on_gpu):
        return _find_rate(a, device, share)


def _find_rate(a, device, share):
    """For one table of random held keys (share None: all in device memory): G keys/s of lookups that
    do not train (`training=False`: the keys not cached read from host memory, their rows gathered
    by the host's threads and copied over, and read in place by the kernel: both on the same calls) and of
    training lookups without their gradient (a miss moves the key's row into the cache), the
    training lookups' hit rate, and the reads' bytes from host memory per call."""
    with tf.device(device):
        kw = dict(init_capacity=a.find_keys + 1) if share is None else \
            dict(var_type="hybrid", max_hbm_for_vectors=share * a.find_keys * a.find_dim * 4 / 2**30)
        t = sok.DynamicVariable(a.find_dim, initializer="uniform", name=f"find_{share}", **kw)
        every = np.arange(a.find_keys, dtype=np.int64) * HASH
        for lo in range(0, a.find_keys, 1 << 20):
            t.rows_for(tf.constant(every[lo:lo + (1 << 20)]))
        del every
        rng = np.random.default_rng(11)
        splits = tf.range(a.find_batch + 1, dtype=tf.int64)
        out = {}
        for training in (True, False):   # (the training lookups first: they fill the cache with hot keys)
            # (each kind its own calls: the reads' keys are not those the training lookups just cached)
            timed = len(FIND_MODES) * a.iters if training else a.iters
            calls = [tf.RaggedTensor.from_row_splits(
                tf.constant(ids_for(rng, a.find_keys, a.find_batch, a.find_dist) * HASH), splits)
                for _ in range(timed + 3 + (PROFILED if a.profile else 0))]
            look = tf.function(lambda ids: tf.reduce_sum(
                sok.lookup_sparse(t, ids, combiners="sum", training=training)[0:1]))
            for ids in calls[:3]:
                look(ids).numpy()
            if training:
                # the rows taken into the cache in each of FIND_MODES' ways, call by call in turns (a
                # training lookup changes the cache: each its own calls)
                out.update(_taking_turns(a, t, look, calls[3:3 + timed], share is not None, FIND_MODES))
                continue
            # reads both ways on the same calls: the rows not cached gathered by the host's threads and
            # copied (the default for reads this large), then read in place by the kernel
            for mode in ("read", "read_in_place"):
                with GatherRows(mode == "read"):
                    res = _timed_calls(a, t, look, calls[3:3 + timed], share is not None)
                res["host_bytes_per_call"] = res.pop("host_bytes") / a.iters
                res["host_gb_s"] = res["host_bytes_per_call"] / (a.find_batch / res["gkeys_s"] / 1e9) / 1e9
                out[mode] = res
            if a.profile and share is not None:
                from profile_step import profile as profile_calls
                print(f"  -- {'training lookups' if training else 'reads'}, cache {share:.0%}, profiled "
                      f"(per call):", flush=True)
                profile_calls(lambda i: look(calls[3 + timed + i]).numpy(), steps=PROFILED, top=30)
    return out


def find_section(a, device):
    print(f"hybrid find: one table of {a.find_keys:,} keys x dim {a.find_dim} "
          f"({a.find_keys * a.find_dim * 4 / 1e9:.1f} GB of values), {a.find_batch:,} held keys per lookup "
          f"({a.find_dist}); "
          f"HierarchicalKV's hybrid find (A100, half the values in HBM): 0.118-0.148 G-KV/s", flush=True)
    out = {}
    runs = [(None, "", False)] + [(share, label, on_gpu) for share in a.find_shares
                                  for label, on_gpu in store_key_places(a)]
    for share, label, on_gpu in runs:
        res = find_rate(a, device, share, on_gpu)
        gc.collect()   # the lookup's tf.function holds its table in a reference cycle
        what = "all in device memory" if share is None else f"cache {share:.0%} of the values{label}"
        read, in_place, find = res["read"], res["read_in_place"], res["find"]
        line = f"  {what:42s} read (training=False) {read['gkeys_s']:6.3f} G keys/s"
        if share is not None:
            line += (f" ({read['host_bytes_per_call'] / 1e6:.1f} MB from host memory per call, "
                     f"{read['host_gb_s']:.1f} GB/s")
            # (a GPU's reads gather the rows on the host first; the CPU reads them in place either way)
            line += (f"; read in place {in_place['gkeys_s']:.3f} G keys/s, {in_place['host_gb_s']:.1f} GB/s: "
                     f"gathered {read['gkeys_s'] / in_place['gkeys_s']:.2f}x)" if "GPU" in device.upper() else ")")
        line += f" | training lookup {find['gkeys_s']:6.4f} G keys/s"
        if share is not None:
            line += f", hit rate {find['hit_rate']:.3f}, records in gathered {find['gathered_in_share']:.0%}"
            if "GPU" in device.upper():   # (the CPU takes rows in place either way)
                f, g = res["find_in_place"], res["find_gathered_all"]
                line += (f" (rows taken in read in place {f['gkeys_s']:.3f} G keys/s: gathered "
                         f"{find['gkeys_s'] / f['gkeys_s']:.2f}x; all gathered {g['gkeys_s']:.3f}: the share "
                         f"{find['gkeys_s'] / g['gkeys_s']:.2f}x)")
        print(line, flush=True)
        out["hbm" if share is None else f"share_{share}{'_keys_gpu' if on_gpu else ''}"] = res
    return out


def main():
    gpu = bool(tf.config.list_physical_devices("GPU"))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--keys", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--cache-share", type=float, default=0.1)
    p.add_argument("--dists", nargs="+", default=["zipf:1.05", "zipf:1.2", "uniform"])
    p.add_argument("--evict", nargs="+", choices=["lru", "lfu"], default=["lru", "lfu"],
                   help="the hybrid dynamic tables' cache policies, a kind of tables each")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5,
                   help="the timed steps split into rounds in which the kinds of tables take turns")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--link-mib", type=int, default=1024)
    p.add_argument("--profile", action="store_true",
                   help="also profile both steps of the first distribution (with --find: the hybrid lookups)")
    p.add_argument("--static", action="store_true",
                   help="static tables (sok.Variable with max_hbm_for_vectors) against plain sok.Variables")
    p.add_argument("--no-prefetch", action="store_true", help="skip the hybrid run with sok.prefetch")
    p.add_argument("--prefetch-grids", type=int, nargs="+", default=[],
                   help="more kinds of hybrid tables with sok.prefetch (GPU), their moves on grids of these many "
                        "blocks per SM (TF_SOK_PREFETCH_BLOCKS_PER_SM), against the library's default")
    p.add_argument("--write-back", choices=["copies", "both"], default="copies",
                   help="both: another kind of hybrid tables (the first policy's, keys where the last "
                        "--store-keys puts them) whose evicted rows are written in place (TF_SOK_WRITE_BACK_COPIES=0)")
    p.add_argument("--find", action="store_true", help="the hybrid find against HierarchicalKV's (only that)")
    p.add_argument("--find-keys", type=int, default=1 << 26)
    p.add_argument("--find-dim", type=int, default=64)
    p.add_argument("--find-batch", type=int, default=1 << 20)
    p.add_argument("--find-shares", type=float, nargs="+", default=[0.5, 0.1])
    p.add_argument("--find-dist", default="uniform", help="the --find keys' distribution (uniform, zipf:A)")
    p.add_argument("--store-keys", choices=["host", "gpu", "both"], default="both" if gpu else "host",
                   help="where hybrid tables look up their host tier's keys (see above)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    if a.quick:
        a.tables, a.keys, a.dim, a.batch, a.iters, a.warmup, a.link_mib = 2, 20_000, 16, 2048, 3, 2, 64
        a.find_keys, a.find_dim, a.find_batch = 200_000, 16, 16_384
    if a.static:
        a.evict = ["lru"]   # a static table's host tier evicts the least recently used rows
    device = "/GPU:0" if gpu else "/CPU:0"
    if a.find:
        out = find_section(a, device)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    total = a.tables * a.keys * 2 * a.dim * 4
    kind = "static" if a.static else "dynamic"
    print(f"tier_bench on {device}: {a.tables} {kind} tables x {a.keys:,} keys x dim {a.dim} + Adagrad state = "
          f"{total / 1e9:.1f} GB; cache budget {a.cache_share:.0%} ({total * a.cache_share / 1e9:.2f} GB); "
          f"batch {a.batch:,}, one id per sample and table; cache policies {' / '.join(e.upper() for e in a.evict)}")
    out = {"device": device, "tables": a.tables, "keys": a.keys, "dim": a.dim, "batch": a.batch,
           "cache_share": a.cache_share, "static": a.static, "evict": a.evict}
    if gpu:
        link = sok.host_link_bandwidth(a.link_mib)
        print(f"host link ({a.link_mib} MiB of pinned memory): copies to / from the device "
              f"{link['copy_to_device']:.1f} / {link['copy_to_host']:.1f} GB/s; a kernel reading / writing "
              f"host memory in place {link['read_in_place']:.1f} / {link['write_in_place']:.1f} GB/s")
        out["link_gbs"] = link
    places = store_key_places(a)
    if a.write_back == "both" and not gpu:
        print("  (--write-back both: a CPU's tier writes rows in place either way; one kind run)")
    # kind -> (cache policy, the tier's keys on the GPU)
    policies = {"hbm": (None, False),
                **{f"hybrid_{e}{'_keys_gpu' if g else ''}": (e, g) for e in a.evict for _, g in places},
                **({} if a.no_prefetch else {"prefetch": (a.evict[0], False)}),
                **({f"prefetch_grid{n}": (a.evict[0], False) for n in a.prefetch_grids} if gpu and not a.no_prefetch
                   else {}),
                **({"in_place": (a.evict[0], places[-1][1])} if a.write_back == "both" and gpu else {})}
    kinds = tuple(policies)
    rounds = max(1, min(a.rounds, a.iters))
    for dist in a.dists:
        data = batches(a, dist, a.warmup + a.iters + PROFILED)   # the profile's batches are new to the cache too
        runners, fill = {}, {}
        for kind in kinds:   # every kind's tables at once (their steps take turns below)
            t0 = time.perf_counter()
            policy, keys_on_gpu = policies[kind]
            tables = make_tables(a, device, policy, f"{kind}_{dist.replace(':', '')}_", keys_on_gpu)
            fill[kind] = time.perf_counter() - t0
            grid = int(kind[len("prefetch_grid"):]) if kind.startswith("prefetch_grid") else None
            runners[kind] = Runner(device, tables, data, prefetch=kind.startswith("prefetch"),
                                   copies_back=kind != "in_place", prefetch_grid=grid)
            runners[kind].steps(a.warmup, timed=False)
        # the timed steps in rounds, the kinds taking turns in each: drifts of the machine fall on all
        for r in range(rounds):
            for kind in kinds:
                runners[kind].steps(a.iters * (r + 1) // rounds - a.iters * r // rounds)
        if a.profile and dist == a.dists[0]:
            for kind in kinds:
                runners[kind].profile()
        res = {kind: dict(runners[kind].result(), fill_s=fill[kind]) for kind in kinds}
        del runners
        gc.collect()   # the steps' tf.functions hold their tables in reference cycles
        h = res["hbm"]
        print(f"  {dist:10s} all in device memory {h['ms']:8.2f} ms (tables filled in {h['fill_s']:.1f} s)", flush=True)
        out[dist] = {"hbm": h}
        for e, (label, g) in [(e, p) for e in a.evict for p in places]:
            c = res[f"hybrid_{e}{'_keys_gpu' if g else ''}"]
            rate = c["mb_per_step"] / c["ms"]   # MB/ms = GB/s
            print(f"  {'':10s} hybrid, {e.upper()}{label} {c['ms']:8.2f} ms = {c['ms'] / h['ms']:.2f}x | hit rate "
                  f"{c['hit_rate']:.4f} | {c['loaded_per_step']:,.0f} keys in, {c['evicted_per_step']:,.0f} out per "
                  f"step, {c['mb_per_step']:.1f} MB over the link ({rate:.1f} GB/s while stepping; records in "
                  f"gathered by the host {c['gathered_in_share']:.0%}) | filled in {c['fill_s']:.1f} s", flush=True)
            tag = f"{e}{'_keys_gpu' if g else ''}"
            out[dist].update({f"hybrid_{tag}": c, f"ratio_{tag}": c["ms"] / h["ms"]})
        c = res[next(k for k in kinds if k.startswith(f"hybrid_{a.evict[0]}"))]
        if "prefetch" in res:
            f = res["prefetch"]
            print(f"  {'':10s} hybrid, {a.evict[0].upper()}, with sok.prefetch of the next batch {f['ms']:8.2f} ms = "
                  f"{f['ms'] / h['ms']:.2f}x all in device memory, {c['ms'] / f['ms']:.2f}x faster than without | "
                  f"hit rate at the lookups {f['hit_rate']:.4f} | {f['prefetched_per_step']:,.0f} keys prefetched "
                  f"per step, {f['mb_per_step']:.1f} MB over the link", flush=True)
            out[dist].update(prefetch=f, prefetch_ratio=f["ms"] / h["ms"])
            for n in (n for n in a.prefetch_grids if f"prefetch_grid{n}" in res):
                g = res[f"prefetch_grid{n}"]
                print(f"  {'':10s} hybrid, {a.evict[0].upper()}, with sok.prefetch, its moves on {n} blocks per SM "
                      f"{g['ms']:8.2f} ms = {g['ms'] / h['ms']:.2f}x all in device memory, {f['ms'] / g['ms']:.2f}x "
                      f"the default's speed | hit rate at the lookups {g['hit_rate']:.4f}", flush=True)
                out[dist][f"prefetch_grid{n}"] = dict(g, ratio=g["ms"] / h["ms"])
        if "in_place" in res:   # against the same policy and keys' place with copies back
            e, g = policies["in_place"]
            c, w = res[f"hybrid_{e}{'_keys_gpu' if g else ''}"], res["in_place"]
            print(f"  {'':10s} hybrid, {e.upper()}{places[-1][0]}, evicted rows written in place {w['ms']:8.2f} ms = "
                  f"{w['ms'] / h['ms']:.2f}x all in device memory; copied back {w['ms'] / c['ms']:.2f}x faster | "
                  f"hit rate {w['hit_rate']:.4f}, {w['mb_per_step']:.1f} MB over the link", flush=True)
            out[dist].update(in_place=w, in_place_ratio=w["ms"] / h["ms"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
