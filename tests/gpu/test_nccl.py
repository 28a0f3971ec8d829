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


@pytest.mark.parametrize("bad", [-1, 700, 10 ** 12])
def test_fused_key_exchange_routes_like_the_separate_ops_and_names_bad_ids(comm, rng, bad):
    """TfSokNcclRouteKeys (one rank) vs TfSokRoute on the CPU: the same distinct keys,
    splits and positions; a bad id fails naming the feature, id, rank and table, and the
    op runs again afterwards."""
    from tf_sok.python.comm import KeyRouting
    from tf_sok.python.ops import route_ops

    rows, feature_table = [5000, 700, 90000], [0, 1, 2, 0]
    ids = [rng.integers(0, rows[t], int(rng.integers(1, 3000))).astype(np.int64) for t in feature_table]
    ids[2] = ids[2][:0]                                        # an empty feature
    routing = KeyRouting(step=3, signature=77, feature_table=tuple(feature_table),
                         feature_rows=tuple(rows[t] for t in feature_table), table_owner=(-1, 0, -1),
                         feature_names=("a", "b", "c", "d"), table_names=tuple(f"t{t}" for t in feature_table))
    flat = np.concatenate(ids)
    feature_of = np.repeat(np.arange(4), [len(v) for v in ids]).astype(np.int64)
    with tf.device("/GPU:0"):
        got = comm.route_keys(tf.constant(flat), tf.constant(feature_of), routing)
    keys = (np.array(feature_table, np.int64)[feature_of] << 40) | flat
    with tf.device("/CPU:0"):
        want = route_ops.route(tf.constant(keys), num_buckets=1, table_owner=[-1, 0, -1])
    send_keys, send_splits, position, recv_keys, recv_splits = [t.numpy() for t in got]
    np.testing.assert_array_equal(send_keys, want[0].numpy())
    np.testing.assert_array_equal(send_splits, want[1].numpy())
    np.testing.assert_array_equal(position, want[2].numpy())
    np.testing.assert_array_equal(recv_keys, send_keys)       # one rank: it sends itself everything
    np.testing.assert_array_equal(recv_splits, send_splits)

    spoiled = flat.copy()
    where = int(np.flatnonzero(feature_of == 1)[len(ids[1]) // 2])
    spoiled[where] = bad
    with tf.device("/GPU:0"):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"feature 'b' has id {bad} on rank 0, outside table 't1' of 700 rows"):
            comm.route_keys(tf.constant(spoiled), tf.constant(feature_of), routing)
        again = comm.route_keys(tf.constant(flat), tf.constant(feature_of), routing)
    np.testing.assert_array_equal(again[0].numpy(), send_keys)
