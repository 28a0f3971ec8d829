"""Shapes and id generators shared by the GPU benchmark (TensorFlow side) and its
PyTorch peer, so both measure the same work."""
import numpy as np

# Criteo Kaggle (DLRM) cardinalities, capped at 1e7 rows.
CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
CAP = 10_000_000
CARDINALITIES = [min(c, CAP) for c in CRITEO_KAGGLE]


def ids_for(rng, rows, n, dist):
    """n ids in [0, rows): uniform, or Zipf(alpha) with hot ids scattered over the table."""
    if dist == "uniform":
        return rng.integers(0, rows, n, dtype=np.int64)
    alpha = float(dist.split(":")[1])
    z = np.minimum(rng.zipf(alpha, n) - 1, rows - 1)
    return (z * 2654435761 % rows).astype(np.int64)


def fixed_hot_batch(rng, rows, batch, hotness, dist):
    """(ids [batch*hotness], offsets/row_splits [batch+1]) with exactly `hotness` ids per row."""
    ids = ids_for(rng, rows, batch * hotness, dist)
    splits = np.arange(0, batch * hotness + 1, hotness, dtype=np.int64)
    return ids, splits
