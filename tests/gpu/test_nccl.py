"""tf_sok's NCCL collective ops on one GPU (a communicator of one rank): results,
gradients and the errors bad sizes raise. Several ranks: tests/horovod
(test_nccl_alltoall_allgather_and_gradient_match_numpy, and every equivalence
test with exchange='nccl'). Skipped, with a reason, where no GPU is visible."""
import numpy as np
import pytest
import tensorflow as tf

from tf_sok.python.comm import SingleProcess
from tf_sok.python.comm.nccl import NcclCommunicator
from tf_sok.python.ops import collective_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                                   reason="no GPU visible to TensorFlow")]


@pytest.fixture(scope="module")
def comm():
    return NcclCommunicator(SingleProcess())


def test_one_rank_alltoall_allgather_and_gradient(comm, rng):
    x = tf.constant(rng.standard_normal((int(rng.integers(1, 500)), 5)).astype(np.float32))
    keys = tf.constant(rng.integers(-2**62, 2**62, int(rng.integers(0, 50))))
    w = tf.constant(rng.standard_normal(x.shape).astype(np.float32))

    def run():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, recv = comm.alltoall(x, [x.shape[0]])
            loss = tf.reduce_sum(y * y * w)
        k, _ = comm.alltoall(keys, [keys.shape[0]], recv_splits=[keys.shape[0]])
        return y, recv, k, comm.allgather(keys), tape.gradient(loss, x)

    for fn in (run, tf.function(run)):
        y, recv, k, every, g = fn()
        assert y.device.endswith("GPU:0")
        np.testing.assert_array_equal(y.numpy(), x.numpy())
        np.testing.assert_array_equal(recv.numpy(), [x.shape[0]])
        np.testing.assert_array_equal(k.numpy(), keys.numpy())
        np.testing.assert_array_equal(every.numpy(), keys.numpy())
        np.testing.assert_allclose(g.numpy(), 2 * x.numpy() * w.numpy(), rtol=1e-6)
    assert comm.version.count(".") == 2


def test_bad_sizes_raise_clear_errors(comm):
    x = tf.zeros([4, 2])
    with tf.device("/GPU:0"):
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"send_splits add up to 5 rows but the input has 4"):
            collective_ops.alltoall(x, [5], [5], key=comm._key)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"recv_splits\[0\] = -1 is negative"):
            collective_ops.alltoall(x, [4], [-1], key=comm._key)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"send_splits must have one entry per rank \(1\)"):
            collective_ops.alltoall(x, [2, 2], [4], key=comm._key)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"rank 0 sends itself 2 rows \(send_splits\) but expects 3"):
            collective_ops.alltoall(x[:2], [2], [3], key=comm._key)
        with pytest.raises(tf.errors.FailedPreconditionError, match=r"communicator 987654 does not exist"):
            collective_ops.alltoall(x, [4], [4], key=987654)
