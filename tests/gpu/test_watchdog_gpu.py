"""The collective watchdog's close op on the GPU: it passes the collective's outputs on where
they are (device memory; int32 in host memory, as TensorFlow keeps it) with their values."""
import numpy as np
import pytest
import tensorflow as tf

from tf_sok.python.comm.watchdog import open_watches, watched

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                                  reason="no GPU visible to TensorFlow")]


def test_watched_outputs_stay_on_the_gpu_with_their_values():
    rng = np.random.default_rng()
    a = rng.normal(size=(64, 8)).astype(np.float32)
    b = rng.integers(-1000, 1000, size=17).astype(np.int64)
    c = rng.integers(-1000, 1000, size=5).astype(np.int32)

    @tf.function
    def step(a, b, c):
        with tf.device("/gpu:0"):
            return watched("gpu test", lambda: (a * 2.0, b + 1, c - 1, tf.reduce_sum(a, 1)), [a, b, c])

    with tf.device("/gpu:0"):
        outs = step(tf.constant(a), tf.constant(b), tf.constant(c))
    for o in (outs[0], outs[1], outs[3]):
        assert "GPU" in o.device, o.device
    np.testing.assert_array_equal(outs[0].numpy(), a * 2.0)
    np.testing.assert_array_equal(outs[1].numpy(), b + 1)
    np.testing.assert_array_equal(outs[2].numpy(), c - 1)
    np.testing.assert_allclose(outs[3].numpy(), a.sum(1), rtol=1e-5, atol=1e-5)
    assert open_watches() == 0
