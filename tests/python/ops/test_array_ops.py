"""array_ops.split against NumPy: 64-bit integers keep every bit (they travel as float64)."""
import numpy as np
import tensorflow as tf

from tf_sok.python.ops import array_ops


def test_split_keeps_every_bit_of_64_bit_integers_and_matches_numpy(rng):
    # small values are subnormal as float64, large ones NaN or infinity patterns: all must survive
    values = np.concatenate([rng.integers(-2**63, 2**63 - 1, 500, dtype=np.int64),
                             rng.integers(0, 1 << 20, 500).astype(np.int64),
                             np.array([0, 1, -1, 2**63 - 1, -2**63, 0x7FF0000000000001, 0x7FF8000000000000,
                                       -0x000FFFFFFFFFFFFF], np.int64)])
    rng.shuffle(values)
    sizes = [int(s) for s in np.diff(np.sort(np.concatenate([[0, len(values)],
                                                             rng.integers(0, len(values), 6)])))]
    for dtype in (tf.int64, tf.uint64, tf.int32, tf.float32):
        x = tf.cast(tf.constant(values), dtype) if dtype != tf.uint64 else \
            tf.constant(values.view(np.uint64))
        parts = array_ops.split(x, sizes, num=len(sizes))
        want = np.split(x.numpy(), np.cumsum(sizes)[:-1])
        assert [p.dtype for p in parts] == [dtype] * len(sizes)
        for p, w in zip(parts, want):
            np.testing.assert_array_equal(p.numpy(), w)
    # inside tf.function, with sizes known only when it runs
    f = tf.function(lambda v, s: array_ops.split(v, s, num=3))
    got = f(tf.constant(values[:10]), tf.constant([3, 0, 7]))
    for p, w in zip(got, np.split(values[:10], [3, 3])):
        np.testing.assert_array_equal(p.numpy(), w)
