"""Dynamic (hash-keyed) tables, measured in one run.

    python benchmarks/dynamic_bench.py [--quick]            (GPU when one is visible, else CPU)

(a) the key index alone (on the GPU: HBM hash table, CUDA kernels; on the CPU: the host index):
    find (held keys, rows read: the values' bytes at dim 64 / 128 come along; nothing inserted,
    as HierarchicalKV's find), find-or-insert of held keys (the training path: it also reads back
    the count of missing keys) and insert (new keys, rows written with their initial values)
    throughput in keys/s, batches of --keys distinct random 64-bit keys, at a load factor (keys
    held / max_capacity) of 0.5 and 0.75.
    Anchor: HierarchicalKV reports find 1.98 G-KV/s and insert 0.83 G-KV/s (dim 64, load factor
    0.5, A100 80 GB). Beside it, TensorFlow's find of the same keys: a DenseHashTable key -> row and
    a gather of the rows (the ratio printed).
(b) the DLRM-like training step of gpu_bench.py (26 tables, Criteo Kaggle cardinalities capped,
    Zipf(1.05) ids, lazy Adam, loss = sum of squared pooled outputs) with every table dynamic
    (the same ids hashed to 64-bit keys) against every table static: time per step and ratio.
(c) against TensorFlow's own dynamic path: a tf.lookup.experimental.DenseHashTable mapping
    keys to rows of a preallocated tf.Variable (missing keys inserted each step),
    the faster of tf.nn.embedding_lookup_sparse over the RaggedTensor of rows and a gather of the
    rows as a [batch, hotness] matrix, and the hand-written sparse Adam of gpu_common (Keras' Adam
    densifies IndexedSlices gradients), the same tables and ids.
(d) eviction: finds whose keys are 10% new into a table full at max_capacity (LRU, LFU), against
    the same finds into an unbounded table.
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
from gpu_common import CARDINALITIES, TF_LOOKUP_FORMS, TFSparseOptimizer, fixed_hot_batch, tf_sum_lookup  # noqa: E402

HASH = np.int64(-7046029254386353131)   # odd: ids -> distinct 64-bit keys
BATCHES = 4                               # key batches per timed call of the index section


def timed(fn, iters, warmup=2):
    for _ in range(warmup):
        fn()
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def sync(x):
    return float(tf.reduce_sum(tf.cast(x[:1], tf.float32)))   # waits for the device


def index_section(a, device):
    print(f"\n(a) key index alone on {device}: batches of {a.keys:,} distinct random int64 keys, "
          f"{BATCHES} batches per timed graph call (TensorFlow's dispatch shared out, as kernel timings "
          "leave it out)")
    rng = np.random.default_rng(0)
    res = {}
    for dim in (64, 128):
        for load in (0.5, 0.75):
            # the inserts (one warm-up call and two timed ones of BATCHES batches, as the finds') raise
            # the load by at most 0.12
            capacity = int(3 * BATCHES * a.keys / 0.12)
            held = int(capacity * load)
            with tf.device(device):
                table = sok.DynamicVariable(dim, initializer="uniform", init_capacity=capacity,
                                            max_capacity=capacity, name=f"bench{dim}")
            keys = rng.integers(-2**63, 2**63 - 1, held + a.keys * (3 * BATCHES + 1), dtype=np.int64,
                                endpoint=True)
            keys = np.unique(keys)
            keys = keys[keys > -2**63 + 1]   # DenseHashTable's empty and deleted keys
            rng.shuffle(keys)
            filled = 0
            with tf.device(device):
                while filled < held:
                    sync(table.rows_for(tf.constant(keys[filled:min(held, filled + a.keys)])))
                    filled += a.keys
                drawn = rng.permutation(held)[:3 * BATCHES * a.keys].reshape(3, BATCHES, a.keys)
                present = [[tf.constant(keys[d]) for d in call] for call in drawn]
                new = keys[held:held + 3 * BATCHES * a.keys].reshape(3, BATCHES, a.keys)
                fresh = iter([[tf.constant(k) for k in call] for call in new])
                # find as HierarchicalKV's: held keys' values read, nothing inserted
                find = tf.function(lambda ks: [table.sparse_read_rows(table.rows_for(k, insert=False)) for k in ks])
                # the training path: find-or-insert (waits for the missing-key count), then the values
                upsert = tf.function(lambda ks: [table.sparse_read_rows(table.rows_for(k)) for k in ks])
                insert = tf.function(lambda ks: [table.rows_for(k) for k in ks])
                it = iter(present * (a.iters + 4))
                t_find = timed(lambda: sync(find(next(it))[-1]), a.iters) / BATCHES
                t_upsert = timed(lambda: sync(upsert(next(it))[-1]), a.iters) / BATCHES
                t_insert = timed(lambda: sync(insert(next(fresh))[-1]), 2, warmup=1) / BATCHES
            del table, find, upsert, insert
            gc.collect()
            t_tf = tf_find_time(a, device, dim, keys[:held], present)
            row = {"find_keys_per_s": a.keys / t_find, "find_or_insert_keys_per_s": a.keys / t_upsert,
                   "insert_keys_per_s": a.keys / t_insert, "tf_find_keys_per_s": a.keys / t_tf,
                   "find_vs_tf": t_tf / t_find}
            res[f"dim{dim}/load{load}"] = row
            print(f"  dim {dim:3d}, load factor {load:.2f}: find {row['find_keys_per_s'] / 1e9:6.3f} G-keys/s "
                  f"({t_find * 1e3:6.3f} ms); find-or-insert of held keys "
                  f"{row['find_or_insert_keys_per_s'] / 1e9:6.3f} G-keys/s ({t_upsert * 1e3:6.3f} ms); "
                  f"insert {row['insert_keys_per_s'] / 1e9:6.3f} G-keys/s ({t_insert * 1e3:6.3f} ms); "
                  f"TensorFlow's DenseHashTable find {row['tf_find_keys_per_s'] / 1e9:6.3f} G-keys/s "
                  f"({t_tf * 1e3:6.3f} ms): tf_sok's find {row['find_vs_tf']:.1f}x")
    return res


def tf_find_time(a, device, dim, held, batches):
    """TensorFlow's find of the same batches, as a user writes it: a DenseHashTable key -> row of a
    tf.Variable holding the `held` keys' values (a CPU table: TensorFlow has no GPU hash table), the
    rows gathered; per batch, as index_section's."""
    table = tf.lookup.experimental.DenseHashTable(tf.int64, tf.int64, default_value=-1, empty_key=np.int64(-2**63),
                                                  deleted_key=np.int64(-2**63 + 1))
    for i in range(0, len(held), 1 << 20):
        table.insert(tf.constant(held[i:i + (1 << 20)]), tf.range(i, min(len(held), i + (1 << 20)), dtype=tf.int64))
    with tf.device(device):
        values = tf.Variable(tf.zeros([len(held), dim]))
        find = tf.function(lambda ks: [tf.gather(values, table.lookup(k)) for k in ks])
        it = iter(batches * (a.iters + 4))
        t = timed(lambda: sync(find(next(it))[-1]), a.iters) / BATCHES
    del table, values, find
    gc.collect()   # the memory back before the next table's (tf.functions hold cycles)
    return t


def dlrm_batch(batch, hotness, cardinalities):
    rng = np.random.default_rng(1)
    raw = [fixed_hot_batch(rng, rows, batch, hotness, "zipf:1.05") for rows in cardinalities]
    static = [tf.RaggedTensor.from_row_splits(tf.constant(i), tf.constant(s)) for i, s in raw]
    hashed = [tf.RaggedTensor.from_row_splits(tf.constant(i * HASH), tf.constant(s)) for i, s in raw]
    return static, hashed


def make_step(tables, opt):
    @tf.function
    def step(batch):
        with tf.GradientTape() as tape:
            outs = sok.lookup_sparse(tables, list(batch), combiners="sum")
            loss = tf.add_n([2.0 * tf.nn.l2_loss(o) for o in outs])
        opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
        return loss
    return step


def step_section(a, device, cardinalities):
    print(f"\n(b) DLRM-like step on {device}: {len(cardinalities)} tables, dim {a.dim}, batch {a.batch}, "
          f"{a.hotness} Zipf(1.05) id(s) per feature, lazy Adam: every table dynamic vs every table static")
    static_ids, hashed_ids = dlrm_batch(a.batch, a.hotness, cardinalities)
    res = {}
    with tf.device(device):
        static = [sok.Variable(shape=[r, a.dim], initializer="uniform", name=f"s{i}")
                  for i, r in enumerate(cardinalities)]
        dynamic = [sok.DynamicVariable(a.dim, initializer="uniform", init_capacity=min(r, 4 * a.batch * a.hotness),
                                       name=f"d{i}") for i, r in enumerate(cardinalities)]
        for name, tables, ids in (("static", static, static_ids), ("dynamic", dynamic, hashed_ids)):
            step = make_step(tables, sok.optimizers.Adam(1e-3))
            res[name] = timed(lambda: float(step(ids)), a.iters)
            if a.profile:   # where the step's time goes, per op and kernel (TensorFlow's profiler)
                from profile_step import profile

                print(f"  -- {name} step, profiled:")
                profile(lambda i: float(step(ids)), steps=10, top=30)
            del step
    print(f"  static  {res['static'] * 1e3:8.2f} ms per step ({a.batch / res['static']:12,.0f} samples/s)")
    print(f"  dynamic {res['dynamic'] * 1e3:8.2f} ms per step ({a.batch / res['dynamic']:12,.0f} samples/s): "
          f"{res['dynamic'] / res['static']:.2f}x the static step (aim <= 1.5x)")
    return {f"{k}_ms": v * 1e3 for k, v in res.items()} | {"ratio": res["dynamic"] / res["static"]}


class TFDynamicTable:
    """TensorFlow's dynamic path as a user builds it: a DenseHashTable key -> row of a
    preallocated tf.Variable; each step inserts its missing keys at the next free rows."""

    def __init__(self, capacity, dim):
        self.keys = tf.lookup.experimental.DenseHashTable(tf.int64, tf.int64, default_value=-1,
                                                          empty_key=np.int64(-2**63), deleted_key=np.int64(-2**63 + 1))
        self.var = tf.Variable(tf.random.uniform([capacity, dim], -0.05, 0.05))
        self.used = tf.Variable(0, dtype=tf.int64)

    def rows(self, keys):
        found = tf.reshape(self.keys.lookup(keys), [-1])
        missing, _ = tf.unique(tf.boolean_mask(keys, found < 0))
        new_rows = self.used + tf.range(tf.size(missing, out_type=tf.int64))
        with tf.control_dependencies([self.keys.insert(missing, new_rows)]):
            self.used.assign_add(tf.size(missing, out_type=tf.int64))
            return tf.reshape(self.keys.lookup(keys), [-1])


def tf_section(a, device, cardinalities):
    print(f"\n(c) against TensorFlow's dynamic path on {device} (DenseHashTable + tf.Variable rows + "
          f"the faster of two lookups + sparse Adam), the (b) tables and ids")
    _, hashed_ids = dlrm_batch(a.batch, a.hotness, cardinalities)
    with tf.device(device):
        tables = [TFDynamicTable(min(r, 4 * a.batch * a.hotness) + a.batch * a.hotness * (a.iters + 4), a.dim)
                  for r in cardinalities]
        opt = TFSparseOptimizer("adam", 1e-3)

        def tf_step(form):   # one of gpu_common's TF_LOOKUP_FORMS over the rows the keys map to
            @tf.function
            def step(batch):
                rows = [t.rows(x.values) for t, x in zip(tables, batch)]
                with tf.GradientTape() as tape:
                    outs = [tf_sum_lookup(form, t.var, x.with_values(r)) for t, x, r in zip(tables, batch, rows)]
                    loss = tf.add_n([2.0 * tf.nn.l2_loss(o) for o in outs])
                opt.apply_gradients(zip(tape.gradient(loss, [t.var for t in tables]), [t.var for t in tables]))
                return loss
            return step

        forms = {}
        for form in TF_LOOKUP_FORMS:
            step_fn = tf_step(form)
            forms[form] = timed(lambda: float(step_fn(hashed_ids)), a.iters)
        t_tf = min(forms.values())
        dynamic = [sok.DynamicVariable(a.dim, initializer="uniform", init_capacity=min(r, 4 * a.batch * a.hotness),
                                       name=f"d{i}") for i, r in enumerate(cardinalities)]
        step = make_step(dynamic, sok.optimizers.Adam(1e-3))
        t_sok = timed(lambda: float(step(hashed_ids)), a.iters)
    print(f"  TensorFlow {t_tf * 1e3:8.2f} ms per step (ragged lookup {forms['ragged'] * 1e3:.2f}, gather "
          f"{forms['gather'] * 1e3:.2f}) | tf_sok dynamic {t_sok * 1e3:8.2f} ms | {t_tf / t_sok:.1f}x")
    return {"tf_ms": t_tf * 1e3, "tf_ragged_ms": forms["ragged"] * 1e3, "tf_gather_ms": forms["gather"] * 1e3,
            "sok_ms": t_sok * 1e3, "speedup": t_tf / t_sok}


def evict_section(a, device):
    """(d): a find whose keys are 10% new into a table full at max_capacity (it evicts as many
    keys), against the same find into an unbounded table: what eviction adds per call."""
    capacity, batch = (8 << 20, 1 << 20) if a.keys >= 1 << 20 else (1 << 20, 65536)
    print(f"\n(d) eviction on {device}: finds of {batch:,} keys (10% new) into a table of {capacity:,} keys, "
          f"full at max_capacity (as many keys evicted) vs unbounded")
    rng = np.random.default_rng(2)
    pool = rng.integers(-2**62, 2**62, 3 * capacity, dtype=np.int64)
    res = {}
    for policy in ("none", "lru", "lfu"):
        bound = {} if policy == "none" else dict(max_capacity=capacity, evict_strategy=policy)
        with tf.device(device):
            table = sok.DynamicVariable(16, initializer="zeros", init_capacity=capacity + 16, name=f"evict_{policy}",
                                        **bound)
            for i in range(0, capacity, batch):
                sync(table.rows_for(tf.constant(pool[i:i + batch])))
            old = int(batch * 0.9)
            calls = [tf.constant(np.concatenate([rng.choice(pool[:capacity], old),
                                                 pool[capacity + i * (batch - old):capacity + (i + 1) * (batch - old)]]))
                     for i in range(a.iters + 3)]
            it = iter(calls)
            find = tf.function(lambda k: table.rows_for(k))
            res[policy] = timed(lambda: sync(find(next(it))), a.iters)
        del table, find
        gc.collect()
    for policy in ("lru", "lfu"):
        print(f"  {policy}: {res[policy] * 1e3:8.2f} ms per find | unbounded {res['none'] * 1e3:8.2f} ms | "
              f"{res[policy] / res['none']:.2f}x")
    return {k + "_ms": v * 1e3 for k, v in res.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (a CPU smoke run)")
    p.add_argument("--device", default=None, help="/GPU:0 or /CPU:0 (default: GPU when visible)")
    p.add_argument("--keys", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--hotness", type=int, default=1)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--parts", default="index,step,tf,evict")
    p.add_argument("--profile", action="store_true", help="(b): also print where each step's time goes")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    gpu = bool(tf.config.list_physical_devices("GPU"))
    device = a.device or ("/GPU:0" if gpu else "/CPU:0")
    big = gpu and not a.quick
    a.keys = a.keys or (1 << 20 if big else 1 << 14)
    a.batch = a.batch or (65536 if big else 4096)
    a.dim = a.dim or (128 if big else 16)
    cards = CARDINALITIES if big else [min(c, 100_000) for c in CARDINALITIES[:8]]
    sok.init()
    print(f"tf_sok dynamic tables, {device}, TensorFlow {tf.__version__}")
    res = {}
    parts = a.parts.split(",")
    if "index" in parts:
        res["index"] = index_section(a, device)
    if "step" in parts:
        res["step"] = step_section(a, device, cards)
    if "tf" in parts:
        res["tf"] = tf_section(a, device, cards)
    if "evict" in parts:
        res["evict"] = evict_section(a, device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
