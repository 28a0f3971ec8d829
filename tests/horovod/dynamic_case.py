"""A model with dynamic tables (and a static one) trained on a global batch, shared by the Horovod
workers (each rank on its slice) and the single-process reference (the whole batch)."""
import numpy as np
import tensorflow as tf

import tf_sok as sok
from tests.horovod import cases

GLOBAL_BATCH = 24
STEPS = 4
# name -> (dim, mode or None for the static table)
TABLES = {"users": (4, "distributed"), "pairs": (3, "localized:0"), "small": (4, None)}
FEATURES = [("u", "users", "mean"), ("u2", "users", "sum"), ("p", "pairs", "sum"), ("s", "small", "mean")]
STATIC_ROWS = 20
HYBRID_POOL = 60   # keys the hybrid scenario draws from: more than a step uses, so keys leave and come back
FILTER = dict(use_low_frequency_filter=True, filter_ratio=0.5)   # the filtered scenario's lookups


def key_pool(seed):
    rng = np.random.default_rng(seed)
    pool = rng.integers(-2**63, 2**63 - 1, 60, dtype=np.int64, endpoint=True)
    pool[:3] = [2**63 - 1, -2**63, -1]
    return pool


def make_tables(seed, modes=None, hybrid=False):
    """The tables; `modes`: other placements of the dynamic ones ({name: mode}); hybrid: every table
    with a host tier whose cache holds 3 rows (of values and Adam's two moments and step)."""
    tables = {}
    for name, (dim, mode) in TABLES.items():
        mode = (modes or {}).get(name, mode)
        if mode is None:
            init = np.random.default_rng(seed + 7).standard_normal((STATIC_ROWS, dim)).astype(np.float32)
            tier = dict(max_hbm_for_vectors=3 * 4 * (3 * dim + 1) / 2**30) if hybrid else {}
            tables[name] = sok.Variable(init, name=name, **tier)
        else:
            tier = dict(var_type="hybrid", max_hbm_for_vectors=3 * 4 * (3 * dim + 1) / 2**30) if hybrid else {}
            tables[name] = sok.DynamicVariable(dim, initializer="normal", mode=mode, seed=seed % 1000, name=name,
                                               init_capacity=8, **tier)
    return tables


def static_window(step):
    """The static table's rows a hybrid step uses: 8 from row 5 * step on (wrapping), so that each
    rank's cache of 3 rows must make room from the second step on (row r lives on rank r % n, n <= 3)
    and rows leave and come back."""
    return (5 * step + np.arange(8)) % STATIC_ROWS


def global_batch(seed, step, pool_size=30, hybrid=False):
    """Per feature (lens, ids) over GLOBAL_BATCH rows (dynamic tables' ids from the first `pool_size`
    keys of the pool; hybrid: the static table's ids from `static_window(step)`, each of its rows
    at least once), and the target [GLOBAL_BATCH, 15]."""
    rng = np.random.default_rng(seed * 100 + step)
    pool = key_pool(seed)
    feats = {}
    for name, table, _ in FEATURES:
        lens = rng.integers(0, 4, GLOBAL_BATCH)
        n = int(lens.sum())
        if TABLES[table][1] is not None:
            ids = pool[rng.integers(0, pool_size, n)]
        elif hybrid:
            window = static_window(step)
            ids = window[rng.integers(0, len(window), n)]
            ids[:len(window)] = window[:n]
        else:
            ids = rng.integers(0, STATIC_ROWS, n)
        feats[name] = (lens, ids.astype(np.int64))
    return feats, rng.standard_normal((GLOBAL_BATCH, 15)).astype(np.float32)


def rank_slice(feats, target, rank, n):
    b = GLOBAL_BATCH // n
    out = {}
    for name, (lens, ids) in feats.items():
        starts = np.concatenate([[0], np.cumsum(lens)])
        out[name] = (lens[rank * b:(rank + 1) * b], ids[starts[rank * b]:starts[(rank + 1) * b]])
    return out, target[rank * b:(rank + 1) * b]


def loss_fn(tables, dense_w, feats, target, **lookup_kw):
    ids = [tf.RaggedTensor.from_row_lengths(feats[f][1], tf.cast(feats[f][0], tf.int64)) for f, _, _ in FEATURES]
    outs = sok.lookup_sparse([tables[t] for _, t, _ in FEATURES], ids, combiners=[c for _, _, c in FEATURES],
                             feature_names=[f for f, _, _ in FEATURES], **lookup_kw)
    x = tf.concat(outs, 1)                                   # [b, 15]
    return tf.reduce_mean(tf.reduce_sum(x * target * dense_w, 1) + 0.1 * tf.reduce_sum(x * x, 1))


def read_batch(seed):
    """A global batch for a lookup that does not train: the hybrid scenario's ids, a third of the
    dynamic tables' replaced by keys no step used."""
    feats, _ = global_batch(seed, STEPS, HYBRID_POOL, hybrid=True)
    rng = np.random.default_rng(seed + 5)
    for name, table, _ in FEATURES:
        if TABLES[table][1] is not None:
            lens, ids = feats[name]
            new = rng.integers(-2**63, 2**63 - 1, len(ids), dtype=np.int64, endpoint=True)
            feats[name] = (lens, np.where(rng.random(len(ids)) < 0.3, new, ids))
    return feats


def read_outputs(tables, feats):
    """The lookup of feats with training=False (every table read, none changed), [b, 15]."""
    ids = [tf.RaggedTensor.from_row_lengths(feats[f][1], tf.cast(feats[f][0], tf.int64)) for f, _, _ in FEATURES]
    outs = sok.lookup_sparse([tables[t] for _, t, _ in FEATURES], ids, combiners=[c for _, _, c in FEATURES],
                             feature_names=[f for f, _, _ in FEATURES], training=False)
    return tf.concat(outs, 1).numpy()


def dense_init():
    return np.linspace(0.5, 1.5, 15).astype(np.float32)


def adam():
    """The sparse optimizer the cases compare: the Adam of cases.OPTIMIZERS (its epsilon is why)."""
    cls, kwargs = cases.OPTIMIZERS["adam"]
    return getattr(sok.optimizers, cls)(**kwargs)


def train(tables, dense_w, batches, dense_tape=None, sparse_opt=None, prefetch=False, **lookup_kw):
    """STEPS of Adam (or `sparse_opt`) on the tables and SGD on the dense weight (dense_tape: wraps
    the tape, e.g. hvd.DistributedGradientTape; prefetch: each step sok.prefetch'es the next batch's
    ids of every table after its lookup; lookup_kw: lookup_sparse's, e.g. the filter's)."""
    sparse_opt = sparse_opt or adam()
    names = list(tables)

    @tf.function(reduce_retracing=True)   # (each step's batch sizes differ: one trace for all but the first)
    def step(feats, next_feats, target):
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(tables, dense_w, feats, target, **lookup_kw)
        if prefetch:
            sok.prefetch([tables[n] for n in names],
                         [tf.concat([next_feats[f][1] for f, t, _ in FEATURES if t == n], 0) for n in names])
        grads = tape.gradient(loss, [tables[n] for n in names])
        dense_grad = (dense_tape(tape) if dense_tape else tape).gradient(loss, [dense_w])[0]
        sparse_opt.apply_gradients(zip(grads, [tables[n] for n in names]))
        dense_w.assign_sub(0.05 * dense_grad)

    def tensors(feats):
        return {k: (tf.constant(v[0]), tf.constant(v[1])) for k, v in feats.items()}

    for i, (feats, target) in enumerate(batches):
        step(tensors(feats), tensors(batches[(i + 1) % len(batches)][0]), tf.constant(target))


def static_rows(table):
    """A static table's rows held here, in row order (a host tier holds every row it was given)."""
    if isinstance(table, sok.DynamicVariable):
        keys, values = sok.export(table)
        return values.numpy()[np.argsort(keys.numpy())]
    return table.numpy()


def results(tables, dense_w):
    res = {"dense": dense_w.numpy()}
    for name, t in tables.items():
        if TABLES[name][1] is None:
            res[f"{name}/rows"] = static_rows(t)
        else:
            keys, values = sok.export(t)
            res[f"{name}/keys"], res[f"{name}/values"] = keys.numpy(), values.numpy()
    return res
