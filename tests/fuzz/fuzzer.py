"""A seeded, bounded fuzzer over tf_sok's public calls: `lookup_sparse` (over static tables, a
third of them with a host tier), every sparse optimizer's `apply_gradients`, `sok.Variable` and
`sok.DynamicVariable` (assignments and lookups over random int64 keys, bounded or not, with
eviction, admission and the low-frequency filter, some with a host tier), eagerly and in
`tf.function`.

Each case is drawn from its seed alone. A valid case must give the independent reference's result
(NumPy); a faulty one (an id out of range, negative or at the int64 extremes, corrupt row_splits
built with validate=False, a SparseTensor index past its shape, mismatched weights, float ids or
indices, a bad shape) must raise the documented error type, and after it every table and slot is
bit-identical to before. `run_cases` runs cases in child processes, so a crash is counted (with
its seed) instead of ending the run.

    python -m tests.fuzz.fuzzer --cases 500 --first-seed 0        (one child's work; prints JSON)
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time

import numpy as np

ERRORS = ("InvalidArgumentError", "ValueError", "TypeError")   # the documented error types
OPTIMIZERS = {
    "sgd": ("SGD", {}),
    "momentum": ("Momentum", {"momentum": 0.8}),
    "adagrad": ("Adagrad", {"initial_accumulator_value": 0.1, "epsilon": 1e-7}),
    "adam": ("Adam", {"beta_1": 0.9, "beta_2": 0.99, "epsilon": 1e-7}),
    "ftrl": ("Ftrl", {"learning_rate_power": -0.5, "initial_accumulator_value": 0.1,
                      "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02,
                      "l2_shrinkage_regularization_strength": 0.0}),
    "rmsprop": ("RMSprop", {"rho": 0.9, "epsilon": 1e-7, "momentum": 0.0, "centered": False}),
}
LOOKUP_FAULTS = ("id_past_rows", "negative_id", "int64_max", "int64_min", "splits_decrease", "splits_start",
                 "splits_end", "weights_count", "float_ids", "sparse_past_shape")
APPLY_FAULTS = ("index_past_rows", "negative_index", "float_indices", "dense_wrong_shape")
DYNAMIC_FAULTS = ("float_keys", "full_table", "batch_over_capacity", "splits_decrease")


def np_lookup(table, lens, ids, weights, combiner):
    out = np.zeros((len(lens), table.shape[1]))
    pos = 0
    for b, n in enumerate(lens):
        w = np.ones(n) if weights is None else weights[pos:pos + n].astype(np.float64)
        acc = (w[:, None] * table[ids[pos:pos + n]].astype(np.float64)).sum(0) if n else 0.0
        denom = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        out[b] = acc / denom if denom != 0 else 0.0
        pos += n
    return out


class Case:
    """What one seed draws: kind, mode (eager / graph), fault (None: valid) and the arguments."""

    def __init__(self, seed):
        self.seed = seed
        self.rng = rng = np.random.default_rng(seed)
        self.kind = str(rng.choice(["lookup", "apply", "variable", "dynamic"], p=[0.4, 0.35, 0.1, 0.15]))
        self.graph = bool(rng.random() < 0.3)
        faults = {"lookup": LOOKUP_FAULTS, "apply": APPLY_FAULTS, "variable": ("bad_shape",),
                  "dynamic": DYNAMIC_FAULTS}[self.kind]
        self.fault = str(rng.choice(faults)) if rng.random() < 0.5 else None


def _state(v):
    """A table's contents: its value (a static table with a host tier: every key held and its row)."""
    if getattr(v, "hybrid", False):
        keys, values = v.export()
        order = np.argsort(keys.numpy())
        return np.hstack([keys.numpy()[order, None].astype(np.float64), values.numpy()[order]])
    return v.numpy().copy()


def _snapshot(variables):
    return [_state(v) for v in variables]


def _unchanged(before, variables):
    return all(np.array_equal(a, _state(b), equal_nan=True) for a, b in zip(before, variables))


def run_lookup(case, tf, sok):
    rng = case.rng
    rows, dim = int(rng.integers(1, 40)), int(rng.integers(1, 9))
    table_np = rng.standard_normal((rows, dim)).astype(np.float32)
    # a third of the tables with a host tier: a cache of 0-5 rows, every row in host memory
    tier = dict(max_hbm_for_vectors=int(rng.integers(0, 6)) * dim * 4 / 2**30) if rng.random() < 0.3 else {}
    table = sok.Variable(table_np, name="fuzz", **tier)
    F = int(rng.integers(1, 4))
    feats = []
    for _ in range(F):
        batch = int(rng.integers(0, 12))
        lens = rng.integers(0, 5, batch)
        ids = rng.integers(0, rows, int(lens.sum())).astype(rng.choice([np.int32, np.int64]))
        # positive weights: a row's weights summing to about zero would make float32 and float64
        # means differ by more than any tolerance, which says nothing about the kernel
        w = rng.uniform(0.1, 2, len(ids)).astype(np.float32) if rng.random() < 0.4 else None
        if w is not None and len(w) and rng.random() < 0.1:
            w[int(rng.integers(0, len(w)))] = rng.choice([np.nan, np.inf])
        feats.append([lens, ids, w, str(rng.choice(["sum", "mean", "sqrtn"]))])
    f = int(rng.integers(0, F))
    lens, ids, w, _ = feats[f]
    fault = case.fault
    if fault and not len(ids):   # faults at an id need one: a batch of one row of one id
        lens, ids = feats[f][0], feats[f][1] = np.array([1]), np.array([0], ids.dtype)
        if w is not None:
            w = feats[f][2] = np.ones(1, np.float32)
    at = int(rng.integers(0, max(len(ids), 1)))
    if fault == "id_past_rows":
        ids = ids.astype(np.int64)
        ids[at] = rows + int(rng.integers(0, 2**33))
    elif fault == "negative_id":
        ids[at] = -int(rng.integers(1, 2**30))
    elif fault == "int64_max":
        ids = ids.astype(np.int64)
        ids[at] = np.iinfo(np.int64).max
    elif fault == "int64_min":
        ids = ids.astype(np.int64)
        ids[at] = np.iinfo(np.int64).min
    feats[f][1] = ids

    def ragged(k):
        lens_k, ids_k, w_k, _ = feats[k]
        splits = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
        if k == f and fault in ("splits_decrease", "splits_start", "splits_end"):
            if fault == "splits_start" or len(splits) < 3:
                splits[0] = 1 if fault != "splits_end" else splits[0]
            if fault == "splits_decrease" and len(splits) >= 3:
                splits[1] = splits[2] + 1
            if fault == "splits_end":
                splits[-1] += 1
        vals = ids_k.astype(np.float32) if (k == f and fault == "float_ids") else ids_k
        rt = tf.RaggedTensor.from_row_splits(vals, splits, validate=False)
        if k == f and fault == "sparse_past_shape":
            sp = tf.RaggedTensor.from_row_splits(ids_k, splits).to_sparse()
            idx = sp.indices.numpy().copy()
            if len(idx):
                idx[int(rng.integers(0, len(idx))), 0] = int(sp.dense_shape[0]) + int(rng.integers(0, 5))
            return tf.SparseTensor(idx, sp.values, sp.dense_shape), w_k
        wt = None
        if w_k is not None:
            wv = w_k[:-1] if (k == f and fault == "weights_count" and len(w_k)) else w_k
            if k == f and fault == "weights_count" and not len(w_k):
                wv = np.ones(1, np.float32)
            wt = tf.RaggedTensor.from_row_lengths(wv, [len(wv)] if len(wv) != len(ids_k) else lens_k,
                                                  validate=False)
        elif k == f and fault == "weights_count":
            wt = tf.RaggedTensor.from_row_lengths(np.ones(len(ids_k) + 1, np.float32), [len(ids_k) + 1])
        return rt, wt

    inputs = [ragged(k) for k in range(F)]
    combiners = [x[3] for x in feats]

    def call(*args):
        return sok.lookup_sparse([table] * F, [a[0] for a in inputs], [a[1] for a in inputs], combiners=combiners)

    before = _snapshot([table])
    try:
        outs = (tf.function(call) if case.graph else call)()
        outs = [o.numpy() for o in outs]
    except Exception as e:  # noqa: BLE001 (every exception is a verdict to check)
        return _verdict(case, e, _unchanged(before, [table]))
    if fault:
        return "accepted_fault"
    for k, o in enumerate(outs):
        want = np_lookup(table_np, feats[k][0], feats[k][1].astype(np.int64), feats[k][2], combiners[k])
        if o.shape != want.shape or not np.allclose(o, want, rtol=1e-4, atol=1e-4, equal_nan=True):
            return "wrong_result"
    return "ok"


def run_apply(case, tf, sok):
    from tests.python.optimizers.reference import NumpyOptimizer

    rng = case.rng
    name = str(rng.choice(list(OPTIMIZERS)))
    cls, hp = OPTIMIZERS[name]
    rows, dim = int(rng.integers(1, 30)), int(rng.integers(1, 9))
    table_np = rng.standard_normal((rows, dim)).astype(np.float32)
    table = sok.Variable(table_np, name="fuzz")
    opt = getattr(sok.optimizers, cls)(0.05, **hp)
    n = int(rng.integers(0, 20))
    indices = rng.integers(0, rows, n)
    values = rng.standard_normal((n, dim)).astype(np.float32)
    if n and name in ("sgd", "momentum", "adagrad", "adam") and rng.random() < 0.15:
        values[int(rng.integers(0, n)), int(rng.integers(0, dim))] = rng.choice([np.nan, np.inf, -np.inf])
    fault = case.fault
    if fault in ("index_past_rows", "negative_index", "float_indices") and n == 0:
        n, indices, values = 1, np.zeros(1, np.int64), np.ones((1, dim), np.float32)
    if fault == "index_past_rows":
        indices[int(rng.integers(0, n))] = rows + int(rng.integers(0, 1000))
    elif fault == "negative_index":
        indices[int(rng.integers(0, n))] = -int(rng.integers(1, 1000))
    if fault == "float_indices":
        grad = tf.IndexedSlices(tf.constant(values), tf.constant(indices.astype(np.float32) + 0.5), [rows, dim])
    elif fault == "dense_wrong_shape":
        grad = tf.constant(rng.standard_normal((rows + 1, dim)).astype(np.float32))
    else:
        grad = tf.IndexedSlices(tf.constant(values), tf.constant(indices.astype(np.int64)), [rows, dim])
    opt.apply_gradients([(tf.IndexedSlices(tf.zeros([0, dim]), tf.zeros([0], tf.int64), [rows, dim]), table)])
    state = [table] + list(opt.slots(table))   # built by an update of no rows (it changes none)
    before = _snapshot(state)
    iterations = int(opt.iterations)
    try:
        if case.graph:
            tf.function(lambda: opt.apply_gradients([(grad, table)]))()
        else:
            opt.apply_gradients([(grad, table)])
    except Exception as e:  # noqa: BLE001
        verdict = _verdict(case, e, _unchanged(before, state))
        return verdict if int(opt.iterations) == iterations or verdict != "ok" else "counter_moved"
    if fault:
        return "accepted_fault"
    ref = NumpyOptimizer(name, table_np, 0.05, **hp)
    if n:
        ref.apply(indices, values)
    ok = np.allclose(table.numpy(), ref.w, rtol=2e-4, atol=2e-5, equal_nan=True)
    return "ok" if ok and int(opt.iterations) == iterations + 1 else "wrong_result"


def run_variable(case, tf, sok):
    rng = case.rng
    if case.fault:   # a non-positive, fractional or boolean row count or width (or both)
        rows_opts, dim_opts = [-1, 0, 2.5, True, 10], [0, -3, 4.0, False, 3]
        shape = [rows_opts[int(rng.integers(len(rows_opts)))], dim_opts[int(rng.integers(len(dim_opts)))]]
        if shape == [10, 3]:
            shape[1] = 0
    else:
        shape = [int(rng.integers(1, 50)), int(rng.integers(1, 9))]
    try:
        v = sok.Variable(shape=shape, name="fuzz")
    except Exception as e:  # noqa: BLE001
        return _verdict(case, e, True)
    if case.fault:
        return "accepted_fault"
    return "ok" if list(v.shape) == shape else "wrong_result"


_M64 = (1 << 64) - 1


def _mix(x):
    """splitmix64's finaliser, as the documented draw of the low-frequency filter uses it."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def keeps_new_key(key, clock, ratio):
    """The low-frequency filter's draw: new key `key` is inserted by the call whose clock is
    `clock` when the top 53 bits of mix(key ^ mix(clock + 0x51ED27)), as a fraction of 1, are
    below `ratio` (a float32)."""
    if ratio >= 1.0:
        return True
    x = _mix((key & _M64) ^ _mix((clock + 0x51ED27) & _M64))
    return (x >> 11) * 2.0**-53 < float(np.float32(ratio))


class DynamicModel:
    """Plain-Python model of a dynamic table: per call, found keys are touched; missing keys are
    admitted on their min_frequency-th sighting (an assignment admits at once) and, under the
    low-frequency filter (ratio < 1), only when the filter's draw keeps them; admitted keys enter
    at the initializer's constant, evicting the untouched keys of lowest (score, key) when full
    (LRU score: the last call; LFU: calls); keys not admitted read zeros and count a sighting."""

    class Full(Exception):
        pass

    def __init__(self, dim, const, cap, evict, min_frequency):
        self.dim, self.const, self.cap, self.evict, self.minf = dim, const, cap, evict, min_frequency
        self.value, self.score, self.seen, self.clock = {}, {}, {}, 0

    def find(self, keys, admit_all=False, ratio=1.0):
        distinct = list(dict.fromkeys(int(k) for k in keys))
        found = [k for k in distinct if k in self.value]
        missing = [k for k in distinct if k not in self.value]
        admit = [k for k in missing if admit_all or (self.seen.get(k, 0) + 1 >= self.minf
                                                     and keeps_new_key(k, self.clock + 1, ratio))]
        evicted = []
        if self.cap and len(self.value) + len(admit) > self.cap:
            need = len(self.value) + len(admit) - self.cap
            untouched = sorted((self.score[k], k) for k in self.value if k not in set(found))
            if not self.evict or len(untouched) < need:
                raise DynamicModel.Full()
            evicted = [k for _, k in untouched[:need]]
        self.clock += 1
        for k in found:
            self.score[k] = self.score[k] + 1 if self.evict == "lfu" else self.clock
        for k in evicted:
            del self.value[k], self.score[k]
        for k in missing:
            if k in admit:
                self.value[k] = np.full(self.dim, self.const, np.float32)
                self.score[k] = 1 if self.evict == "lfu" else self.clock
                self.seen.pop(k, None)
            else:
                self.seen[k] = self.seen.get(k, 0) + 1
        return evicted

    def rows(self, keys):
        return np.stack([self.value.get(int(k), np.zeros(self.dim, np.float32)) for k in keys]) if len(keys) \
            else np.zeros((0, self.dim), np.float32)


def _held(var):
    keys, values = var.export()
    return dict(zip(keys.numpy().tolist(), [v.tobytes() for v in values.numpy()]))


def run_dynamic(case, tf, sok):
    rng = case.rng
    fault = case.fault
    dim = int(rng.integers(1, 9))
    const = float(np.float32(rng.normal()))
    evict = [None, "lru", "lfu"][int(rng.integers(0, 3))]
    cap = int(rng.integers(4, 30)) if (evict or rng.random() < 0.5) else None
    minf = int(rng.choice([1, 1, 2, 3]))
    if fault == "full_table":            # (admission off: keys not yet admitted take no room)
        evict, cap, minf = None, int(rng.integers(2, 10)), 1
    elif fault == "batch_over_capacity":
        evict, cap, minf = evict or "lru", int(rng.integers(2, 10)), 1
    # the same contents with a host tier (a cache of 0-5 rows of values): unbounded tables, and bounded
    # ones evicting by LRU (a hybrid table's bound drops the keys not cached of least recent use)
    tier = dict(var_type="hybrid", max_hbm_for_vectors=int(rng.integers(0, 6)) * dim * 4 / 2**30) \
        if (cap is None or evict == "lru") and rng.random() < 0.5 else {}
    # the low-frequency filter in half the cases: new keys inserted with this probability (not where
    # the fault is a table too full for the last call's new keys: the filter could leave them out)
    ratio = float(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])) if rng.random() < 0.5 else None
    if fault in ("full_table", "batch_over_capacity"):
        ratio = None
    # on a GPU, an unbounded tier's keys mapped on the device too in half the seeds (read when the table
    # is made; the seed's parity, so that the draws above and below stay those of the seed)
    os.environ["TF_SOK_STORE_KEYS_ON_GPU"] = str(case.seed % 2)
    table = sok.DynamicVariable(dim, initializer=repr(const), max_capacity=cap, evict_strategy=evict,
                                min_frequency=minf, init_capacity=int(rng.integers(1, 16)), name="fuzz_dynamic",
                                **tier)
    model = DynamicModel(dim, np.float32(const), cap, evict, minf)
    edge = [2**63 - 1, -2**63, -1, 0]
    pool = np.array(edge + rng.integers(-2**63, 2**63 - 1, int(rng.integers(4, 40)), dtype=np.int64,
                                        endpoint=True).tolist(), np.int64)
    assigned = rng.choice(pool, min(len(pool), int(rng.integers(0, (cap or 20) + 1))), replace=False)
    values = rng.standard_normal((len(assigned), dim)).astype(np.float32)
    if len(assigned):
        sok.assign(table, assigned, values)
        model.find(assigned, admit_all=True)
        for k, v in zip(assigned, values):
            model.value[int(k)] = v
    calls = int(rng.integers(1, 5))
    for c in range(calls):
        F = int(rng.integers(1, 4))
        last = c == calls - 1
        feats = []
        for _ in range(F):
            lens = rng.integers(0, 5, int(rng.integers(0, 8)))
            feats.append([lens, rng.choice(pool, int(lens.sum())), str(rng.choice(["sum", "mean", "sqrtn"]))])
        if last and fault in ("full_table", "batch_over_capacity"):   # more distinct keys than fit
            extra = rng.integers(-2**62, 2**62, (cap or 0) + 1 + len(model.value), dtype=np.int64)
            feats[0][0] = np.array([len(extra)])
            feats[0][1] = extra
        if last and fault == "splits_decrease" and sum(len(f[1]) for f in feats) == 0:   # needs an id
            feats[0][0], feats[0][1] = np.array([1, 1]), pool[:2]
        inputs = []
        for k, (lens, ids, _) in enumerate(feats):
            splits = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            if last and fault == "splits_decrease" and len(splits) >= 2 and len(ids):
                splits[-1] = len(ids) + 1
            vals = ids.astype(np.float32) if (last and fault == "float_keys") else ids
            inputs.append(tf.RaggedTensor.from_row_splits(vals, splits, validate=False))
        combiners = [f[2] for f in feats]

        def call():
            return sok.lookup_sparse([table] * F, inputs, combiners=combiners,
                                     **(dict(use_low_frequency_filter=True, filter_ratio=ratio) if ratio is not None
                                        else {}))

        all_keys = np.concatenate([f[1] for f in feats])
        trial = copy.deepcopy(model)
        try:
            trial.find(all_keys, ratio=1.0 if ratio is None else ratio)
            full = False
        except DynamicModel.Full:   # a valid call the table must refuse, changing nothing
            full = True
        before = _held(table)
        try:
            outs = [o.numpy() for o in ((tf.function(call) if case.graph else call)())]
        except Exception as e:  # noqa: BLE001
            if (last and fault) or full:
                verdict = _verdict(case, e, _held(table) == before) if (last and fault) else \
                    ("ok" if type(e).__name__ == "InvalidArgumentError" and _held(table) == before
                     else f"full_table_error:{type(e).__name__}:{str(e)[:160]}")
                if verdict != "ok" or (last and fault):
                    return verdict
                continue
            return f"error_on_valid:{type(e).__name__}:{str(e)[:160]}"
        if last and fault:
            return "accepted_fault"
        if full:
            return "full_table_accepted"
        model = trial
        for k, (lens, ids, comb) in enumerate(feats):
            want = np_lookup(model.rows(ids), lens, np.arange(len(ids)), None, comb)
            if outs[k].shape != want.shape or not np.allclose(outs[k], want, rtol=1e-4, atol=1e-4):
                return "wrong_result"
        if rng.random() < 0.3:   # a lookup that does not train: changes nothing, counts no sighting
            verdict = _read_lookup(case, tf, sok, table, model, pool)
            if verdict != "ok":
                return verdict
        if tier and rng.random() < 0.5:   # a prefetch of keys held or not: it changes no value, counts nothing
            ahead = tf.constant(rng.choice(pool, int(rng.integers(0, 12))))
            (tf.function(sok.prefetch) if case.graph else sok.prefetch)([table], [ahead])
    got = table.export()
    keys = got[0].numpy().tolist()
    if set(keys) != set(model.value):
        return "wrong_result"
    for k, v in zip(keys, got[1].numpy()):
        if not np.array_equal(v, model.value[k]):
            return "wrong_result"
    return "ok"


def _read_lookup(case, tf, sok, table, model, pool):
    """lookup_sparse(training=False) of keys of the pool and new ones: held keys read their values,
    others the initial value (zeros when keys are admitted late); the table stays as it was."""
    rng = case.rng
    lens = rng.integers(0, 5, int(rng.integers(0, 8)))
    n = int(lens.sum())
    new = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64, endpoint=True)
    ids = np.where(rng.random(n) < 0.7, rng.choice(pool, n), new).astype(np.int64)
    comb = str(rng.choice(["sum", "mean", "sqrtn"]))
    ragged = tf.RaggedTensor.from_row_lengths(ids, lens.astype(np.int64))

    def read():
        return sok.lookup_sparse([table], [ragged], combiners=[comb], training=False)[0]

    before = _held(table)
    out = (tf.function(read) if case.graph else read)().numpy()
    unheld = np.full(model.dim, model.const if model.minf == 1 else 0.0, np.float32)
    rows = np.stack([model.value.get(int(k), unheld) for k in ids]) if n else np.zeros((0, model.dim), np.float32)
    want = np_lookup(rows, lens, np.arange(n), None, comb)
    if out.shape != want.shape or not np.allclose(out, want, rtol=1e-4, atol=1e-4):
        return "wrong_result"
    return "ok" if _held(table) == before else "state_changed"


def _verdict(case, error, unchanged):
    if not case.fault:
        return f"error_on_valid:{type(error).__name__}:{str(error)[:160]}"
    if type(error).__name__ not in ERRORS:
        return f"undocumented_error:{type(error).__name__}:{str(error)[:160]}"
    return "ok" if unchanged else "state_changed"


def run_one(seed, tf, sok):
    case = Case(seed)
    return case, {"lookup": run_lookup, "apply": run_apply, "variable": run_variable,
                  "dynamic": run_dynamic}[case.kind](case, tf, sok)


def child(first, count, progress):
    """Runs seeds first..first+count-1, appending each seed before running it to `progress` (so a
    parent can name the case that crashed) and prints one JSON line of the verdicts."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import tf_sok as sok

    sok.init()
    counts, failures = {}, []
    with open(progress, "a") as log:
        for seed in range(first, first + count):
            log.write(f"{seed}\n")
            log.flush()
            case, verdict = run_one(seed, tf, sok)
            key = f"{case.kind}/{'graph' if case.graph else 'eager'}/{case.fault or 'valid'}"
            counts[key] = counts.get(key, 0) + 1
            if verdict != "ok":
                failures.append({"seed": seed, "case": key, "verdict": verdict})
    print(json.dumps({"counts": counts, "failures": failures}))


def run_cases(count, first_seed=0, per_child=400, device="cpu", time_limit=None):
    """Runs `count` cases in child processes of `per_child` each; a child that dies counts its
    current case as a crash and the run goes on after it. Returns {counts, failures, crashes}."""
    import tempfile

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    total = {"counts": {}, "failures": [], "crashes": []}
    seed, end, t0 = first_seed, first_seed + count, time.time()
    while seed < end and (time_limit is None or time.time() - t0 < time_limit):
        n = min(per_child, end - seed)
        with tempfile.NamedTemporaryFile("r", suffix=".progress") as progress:
            p = subprocess.run([sys.executable, "-m", "tests.fuzz.fuzzer", "--child", str(seed), str(n),
                                progress.name], env=env, cwd=root, capture_output=True, text=True)
            done = [int(x) for x in open(progress.name).read().split()]
        if p.returncode == 0:
            out = json.loads(p.stdout.strip().splitlines()[-1])
            for k, v in out["counts"].items():
                total["counts"][k] = total["counts"].get(k, 0) + v
            total["failures"] += out["failures"]
            seed += n
        else:
            crashed = done[-1] if done else seed
            total["crashes"].append({"seed": crashed, "returncode": p.returncode, "stderr": p.stderr[-800:]})
            seed = crashed + 1
    total["cases"] = sum(total["counts"].values()) + len(total["crashes"])
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=3, metavar=("FIRST", "COUNT", "PROGRESS"), help=argparse.SUPPRESS)
    a, _ = p.parse_known_args()
    if a.child:
        child(int(a.child[0]), int(a.child[1]), a.child[2])


if __name__ == "__main__":
    main()
