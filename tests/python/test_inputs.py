"""Inputs users bring: padded dense ids (negative padding pruned, as tf.nn.safe_embedding_lookup_sparse
does), SparseTensors that are not right-ragged, and sequence (non-pooled) features — against
TensorFlow's own lookups and NumPy."""
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.helpers import np_lookup, to_ragged


def padded(rng, batch, hotness, rows):
    ids = rng.integers(0, rows, (batch, hotness))
    ids[rng.random((batch, hotness)) < 0.4] = -1            # padding anywhere, whole rows included
    ids[0] = -1
    return ids.astype(np.int64)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_padded_dense_ids_equal_tensorflows_safe_lookup(rng, combiner):
    rows, dim = 30, 4
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    t = sok.Variable(table, name="padded")
    ids = padded(rng, 17, 5, rows)
    weights = rng.uniform(0.5, 2, ids.shape).astype(np.float32)
    got = tf.function(lambda i, w: sok.lookup_sparse(t, i, w, combiners=combiner))(tf.constant(ids),
                                                                                   tf.constant(weights))
    sp = tf.sparse.from_dense(tf.constant(ids) + 1)            # every position, padding included
    sp = tf.SparseTensor(sp.indices, sp.values - 1, sp.dense_shape)
    w_sp = tf.SparseTensor(sp.indices, tf.gather_nd(weights, sp.indices), sp.dense_shape)
    want = tf.nn.safe_embedding_lookup_sparse(tf.constant(table), sp, w_sp, combiner=combiner)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_pruning_is_for_dense_static_inputs_unless_asked(rng):
    t = sok.Variable(rng.standard_normal((10, 3)).astype(np.float32), name="static")
    ragged = tf.ragged.constant([[1, -1], [2]], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="has id -1"):
        sok.lookup_sparse(t, ragged, combiners="sum")          # ragged ids: a negative id is an error
    got = sok.lookup_sparse(t, ragged, combiners="sum", prune_negative_ids=True)
    want = np.stack([t.numpy()[1], t.numpy()[2]])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    dyn = sok.DynamicVariable(3, initializer="normal", name="dyn")
    dense = tf.constant([[-1, 4], [-7, -1]], tf.int64)           # negative keys are keys of a dynamic table
    out = sok.lookup_sparse(dyn, dense, combiners="sum").numpy()
    rows = tf.gather(dyn, tf.constant([-1, 4, -7], tf.int64)).numpy()
    np.testing.assert_allclose(out, [rows[0] + rows[1], rows[2] + rows[0]], rtol=1e-6)
    with pytest.raises(TypeError, match="prune_negative_ids must be None or a bool"):
        sok.lookup_sparse(t, ragged, prune_negative_ids="yes")


def test_sparse_tensors_that_are_not_right_ragged_equal_tensorflows_lookup(rng):
    rows, dim = 25, 3
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    t = sok.Variable(table, name="t")
    dense = rng.integers(1, rows, (9, 6))
    dense[rng.random(dense.shape) < 0.5] = 0                     # holes anywhere in a row
    sp = tf.sparse.from_dense(tf.constant(dense, tf.int64))
    for combiner in ("sum", "mean", "sqrtn"):
        got = sok.lookup_sparse(t, sp, combiners=combiner).numpy()
        tf_rows = tf.nn.embedding_lookup_sparse(tf.constant(table), sp, None, combiner=combiner).numpy()
        want = np.zeros((dense.shape[0], dim), np.float32)       # TensorFlow's stops at the last row with ids
        want[:len(tf_rows)] = tf_rows
        assert got.shape == want.shape
        nonempty = dense.any(1)
        np.testing.assert_allclose(got[nonempty], want[nonempty], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[~nonempty], 0)


def test_a_sparse_tensor_without_entries_gives_zero_rows(rng):
    """A batch (or one replica's share of it) may hold no ids of a SparseTensor feature: zeros, eagerly
    and in a graph, next to a feature that has ids (as TensorFlow's lookup of that feature)."""
    rows, dim, batch = 25, 3, int(rng.integers(1, 9))
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    t = sok.Variable(table, name="t")
    empty = tf.SparseTensor(tf.zeros([0, 2], tf.int64), tf.zeros([0], tf.int64), [batch, 4])
    full = tf.sparse.from_dense(tf.constant(rng.integers(1, rows, (batch, 2)), tf.int64))
    want = tf.nn.embedding_lookup_sparse(tf.constant(table), full, None, combiner="sum").numpy()
    for call in (lambda: sok.lookup_sparse([t, t], [empty, full], combiners="sum"),
                 tf.function(lambda: sok.lookup_sparse([t, t], [empty, full], combiners="sum"))):
        got = call()
        np.testing.assert_array_equal(got[0].numpy(), np.zeros((batch, dim), np.float32))
        np.testing.assert_allclose(got[1].numpy(), want, rtol=1e-5, atol=1e-6)


def test_sequence_features_give_one_vector_per_id_and_row_sparse_gradients(rng):
    rows, dim = 40, 5
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    t = sok.Variable(table, name="seq")
    dyn = sok.DynamicVariable(dim, initializer="zeros", name="seq_dyn")
    keys = rng.integers(-2**62, 2**62, 12)
    dyn_values = rng.standard_normal((12, dim)).astype(np.float32)
    sok.assign(dyn, keys, dyn_values)
    lens = rng.integers(0, 5, 11)
    ids = rng.integers(0, rows, int(lens.sum()))
    w = rng.uniform(0.5, 2, len(ids)).astype(np.float32)
    pooled_lens = rng.integers(0, 4, 11)
    pooled_ids = rng.integers(0, rows, int(pooled_lens.sum()))
    dyn_lens = rng.integers(0, 4, 11)
    dyn_pick = rng.integers(0, 12, int(dyn_lens.sum()))
    upstream = rng.standard_normal((len(ids), dim)).astype(np.float32)

    @tf.function
    def run(a, aw, b, c):
        with tf.GradientTape() as tape:
            seq, pooled, dseq = sok.lookup_sparse([t, t, dyn], [a, b, c], [aw, None, None],
                                                  combiners=[None, "mean", None])
            loss = tf.reduce_sum(seq.values * upstream)
        return seq, pooled, dseq, tape.gradient(loss, t)

    seq, pooled, dseq, grad = run(to_ragged(lens, ids), to_ragged(lens, w), to_ragged(pooled_lens, pooled_ids),
                                  to_ragged(dyn_lens, keys[dyn_pick]))
    assert isinstance(seq, tf.RaggedTensor) and seq.shape.as_list()[0] == 11
    np.testing.assert_array_equal(seq.row_lengths().numpy(), lens)
    np.testing.assert_allclose(seq.values.numpy(), w[:, None] * table[ids], rtol=1e-6)
    np.testing.assert_allclose(pooled.numpy(), np_lookup(table, pooled_lens, pooled_ids, None, "mean"), rtol=1e-5)
    np.testing.assert_allclose(dseq.values.numpy(), dyn_values[dyn_pick], rtol=1e-6)
    assert isinstance(grad, tf.IndexedSlices)
    want = np.zeros_like(table, dtype=np.float64)
    np.add.at(want, ids, w[:, None] * upstream)
    got = tf.math.unsorted_segment_sum(grad.values, grad.indices, rows).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_keras_sequence_embedding(rng):
    emb = sok.layers.Embedding(20, 3, combiner=None, name="history")
    ids = tf.ragged.constant([[1, 5, 5], [], [7]], tf.int64)
    out = emb(ids)
    assert isinstance(out, tf.RaggedTensor)
    table = emb.table.numpy()
    np.testing.assert_allclose(out.values.numpy(), table[[1, 5, 5, 7]], rtol=1e-6)
    coll = sok.layers.EmbeddingCollection(tables=[sok.TableConfig("items", 20, 3)],
                                          feature_to_table={"hist": "items", "last": "items"},
                                          combiners={"hist": None})
    out = coll({"hist": ids, "last": ids})
    assert isinstance(out["hist"], tf.RaggedTensor) and not isinstance(out["last"], tf.RaggedTensor)
