"""Zipf-distributed ids over a vocabulary (NumPy only: no TensorFlow, so the benchmarks' PyTorch peer
loads this file too)."""
import numpy as np

_HEAD = 1 << 16            # ranks drawn exactly; those above from the continuous power law
_tables = {}


def _parts(vocab: int, alpha: float):
    """(cumulative weights r ** -alpha of ranks 1..min(vocab, _HEAD), the weight of the ranks above)."""
    key = (vocab, alpha)
    if key not in _tables:
        k = min(vocab, _HEAD)
        head = np.cumsum(np.arange(1, k + 1, dtype=np.float64) ** -alpha)
        lo, hi = k + 0.5, vocab + 0.5
        if vocab == k:
            tail = 0.0
        elif alpha == 1:
            tail = float(np.log(hi / lo))
        else:
            tail = (hi ** (1 - alpha) - lo ** (1 - alpha)) / (1 - alpha)
        _tables[key] = (head, tail)
    return _tables[key]


def zipf_ranks(rng: np.random.Generator, vocab: int, n: int, alpha: float) -> np.ndarray:
    """n int64 ranks in [0, vocab), rank r with probability proportional to (r + 1) ** -alpha: Zipf's
    law over the vocabulary. (numpy's `rng.zipf` draws from all positive integers; clipped to a
    vocabulary, its tail would fall on one id: 47% of the draws at alpha 1.05 over 2M ids.) Exact
    over the first 65,536 ranks; above them the continuous power law between 65,536.5 and
    vocab + 0.5, rounded to the nearest rank.

    Example:
        >>> zipf_ranks(np.random.default_rng(0), 1_000_000, 4096, 1.05)
    """
    if vocab < 1 or n < 0 or alpha <= 0:
        raise ValueError(f"zipf_ranks: vocab must be positive, n non-negative and alpha positive, got "
                         f"{vocab}, {n}, {alpha}")
    head, tail = _parts(int(vocab), float(alpha))
    u = rng.random(n) * (head[-1] + tail)
    out = np.searchsorted(head, u, side="right").astype(np.int64)
    above = u >= head[-1]
    if above.any():
        v, k = u[above] - head[-1], len(head)
        lo = k + 0.5
        x = lo * np.exp(v) if alpha == 1 else (lo ** (1 - alpha) + v * (1 - alpha)) ** (1 / (1 - alpha))
        out[above] = np.clip(np.floor(x + 0.5).astype(np.int64), k + 1, vocab) - 1
    return out
