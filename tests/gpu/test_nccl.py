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
def test_exchange_plan_of_one_rank_matches_numpy_and_names_bad_ids(comm, rng, bad):
    """TfSokNcclRouteKeys with one rank against NumPy: the owner side's rows table by
    table, their unit row splits, the vectors to return per width group (and the
    inverse of that permutation; at N > 1 tests/horovod's gradients depend on it) and each id's
    slot among them; a bad id fails naming the feature, id, rank and table, and the op
    runs again afterwards."""
    from tf_sok.python.comm import KeyRouting

    rows, feature_table, table_group = [5000, 700, 90000], [0, 1, 2, 0], [1, 0, 1]
    ids = [rng.integers(0, rows[t], int(rng.integers(1, 3000))).astype(np.int64) for t in feature_table]
    ids[2] = ids[2][:0]                                        # an empty feature
    routing = KeyRouting(step=3, signature=77, feature_table=tuple(feature_table),
                         feature_rows=tuple(rows[t] for t in feature_table), table_owner=(-1, 0, -1),
                         table_group=tuple(table_group), num_groups=2, feature_names=("a", "b", "c", "d"),
                         table_names=tuple(f"t{t}" for t in feature_table))
    with tf.device("/GPU:0"):
        plan = comm.route_keys([tf.constant(v) for v in ids], routing)
    uniq = [np.unique(np.concatenate([ids[f] for f in range(4) if feature_table[f] == t] + [[]])).astype(np.int64)
            for t in range(3)]
    counts = np.array([len(u) for u in uniq])
    np.testing.assert_array_equal(plan.table_counts.numpy(), counts)
    np.testing.assert_array_equal(plan.table_rows.numpy(), np.concatenate(uniq))
    np.testing.assert_array_equal(plan.unit_splits.numpy(), np.concatenate([np.arange(c + 1) for c in counts]))
    for g in range(2):
        total = sum(counts[t] for t in range(3) if table_group[t] == g)
        # one rank returns everything to itself, in its group's tables' order
        np.testing.assert_array_equal(plan.group_gather[g].numpy(), np.arange(total))
        np.testing.assert_array_equal(plan.group_scatter[g].numpy(), np.arange(total))   # its inverse
        np.testing.assert_array_equal(plan.group_send[g].numpy(), [total])
        np.testing.assert_array_equal(plan.group_recv[g].numpy(), [total])
    start = {t: sum(counts[u] for u in range(t) if table_group[u] == table_group[t]) for t in range(3)}
    want_slot = np.concatenate([start[feature_table[f]] + np.searchsorted(uniq[feature_table[f]], ids[f])
                                for f in range(4)])
    np.testing.assert_array_equal(plan.slot.numpy(), want_slot)

    spoiled = [v.copy() for v in ids]
    spoiled[1][len(ids[1]) // 2] = bad
    spoiled[3][-1] = -5                                       # a later bad id: the first one is named
    with tf.device("/GPU:0"):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"feature 'b' has id {bad} on rank 0, outside table 't1' of 700 rows"):
            comm.route_keys([tf.constant(v) for v in spoiled], routing)
        again = comm.route_keys([tf.constant(v) for v in ids], routing)
    np.testing.assert_array_equal(again.slot.numpy(), want_slot)
