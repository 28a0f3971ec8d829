"""Inputs shared by the multi-process workers and the single-process references:
both sides rebuild them from the same seed."""
import numpy as np

TABLES = {  # name: (rows, dim, mode) -- uneven row counts on purpose
    "a": (23, 8, "distributed"),
    "b": (10, 4, "localized:last"),
    "c": (7, 8, "distributed"),
}
FEATURES = [("f0", "a", "mean", True), ("f1", "b", "sum", False), ("f2", "a", "sqrtn", True),
            ("f3", "c", "sum", False)]  # name, table, combiner, weighted


def mode(name, num_ranks):
    m = TABLES[name][2]
    return f"localized:{num_ranks - 1}" if m == "localized:last" else m


def global_tables(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((rows, dim)).astype(np.float32) for k, (rows, dim, _) in TABLES.items()}


def batch_size(step, rank):
    """Lookup checks (step 0) use uneven local batches; training steps use equal
    ones, since a mean of per-rank mean losses is the global mean only then."""
    return 5 + rank if step == 0 else 6


def rank_batch(seed, step, rank):
    """One rank's batch: per feature (row_lengths, ids, weights or None), an
    upstream gradient per feature and a regression target."""
    rng = np.random.default_rng([seed, step, rank])
    batch = batch_size(step, rank)
    feats = {}
    for name, table, _, weighted in FEATURES:
        rows = TABLES[table][0]
        lens = rng.integers(0, 4, batch)
        ids = rng.integers(0, rows, int(lens.sum())).astype(np.int64)
        w = rng.uniform(0.5, 1.5, len(ids)).astype(np.float32) if weighted else None
        feats[name] = (lens, ids, w)
    upstream = {name: rng.standard_normal((batch, TABLES[t][1])).astype(np.float32) for name, t, _, _ in FEATURES}
    target = rng.standard_normal((batch, 1)).astype(np.float32)
    return feats, upstream, target


def global_batch(seed, step, num_ranks):
    """The concatenation of every rank's batch (what one process sees)."""
    parts = [rank_batch(seed, step, r) for r in range(num_ranks)]
    feats = {}
    for name, _, _, weighted in FEATURES:
        lens = np.concatenate([p[0][name][0] for p in parts])
        ids = np.concatenate([p[0][name][1] for p in parts])
        w = np.concatenate([p[0][name][2] for p in parts]) if weighted else None
        feats[name] = (lens, ids, w)
    upstream = {n: np.concatenate([p[1][n] for p in parts]) for n, _, _, _ in FEATURES}
    target = np.concatenate([p[2] for p in parts])
    return feats, upstream, target


def local_rows(name, rank, num_ranks):
    """Global row numbers held by `rank` (SOK's layout)."""
    rows = TABLES[name][0]
    m = mode(name, num_ranks)
    if m == "distributed":
        return np.arange(rank, rows, num_ranks)
    return np.arange(rows) if rank == int(m.split(":")[1]) else np.arange(0)


# name: (sok class name, kwargs). Adam's and RMSprop's epsilon 1e-3, not 1e-7: their step g / (|g| + eps)
# turns the float32 rounding of a gradient that cancels to ~1e-7 (whose summation order differs between
# one process and N) into differences far above the comparison's tolerance.
OPTIMIZERS = {
    "sgd": ("SGD", {"learning_rate": 0.1}),
    "momentum": ("Momentum", {"learning_rate": 0.05, "momentum": 0.9}),
    "adagrad": ("Adagrad", {"learning_rate": 0.1}),
    "adam": ("Adam", {"learning_rate": 0.05, "epsilon": 1e-3}),
    "ftrl": ("Ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.001}),
    "rmsprop": ("RMSprop", {"learning_rate": 0.01, "epsilon": 1e-3}),
}
STEPS = 3


def alltoall_case(seed, num_ranks):
    """Uneven all-to-all sizes (zeros included): sizes[s, d] rows go from rank s to
    rank d; per rank its float rows [n, 3], int64 keys [n] and the upstream
    gradient of what it receives."""
    rng = np.random.default_rng([seed, 99])
    sizes = rng.integers(0, 5, (num_ranks, num_ranks)).astype(np.int32)
    sizes[rng.integers(num_ranks), :] = 0            # one rank sends nothing
    xs = [rng.standard_normal((sizes[r].sum(), 3)).astype(np.float32) for r in range(num_ranks)]
    keys = [rng.integers(-2**62, 2**62, sizes[r].sum()) for r in range(num_ranks)]
    upstream = [rng.standard_normal((sizes[:, r].sum(), 3)).astype(np.float32) for r in range(num_ranks)]
    return sizes, xs, keys, upstream
