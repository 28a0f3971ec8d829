"""The exchange path (what every multi-rank lookup runs) with one rank, whose
collectives are identities: outputs and table gradients against NumPy, and
the pre-exchange check. Multi-rank runs: tests/horovod, tests/distribute."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import tape as tape_lib

import tf_sok as sok
from tests.helpers import dense_grad, np_lookup, random_ragged
from tf_sok.python import exchange
from tf_sok.python.comm import SingleProcess
from tests.seeds import fresh_seed


def _metas(tables):
    return [sok.table_meta(t) for t in tables]


def test_exchange_path_matches_numpy_outputs_and_gradients():
    seed = fresh_seed("exchange")
    rng = np.random.default_rng(seed)
    sok.init()
    shapes = [(50, 8), (7, 4), (300, 8)]  # two widths: one all-to-all per width
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    tables = [sok.Variable(v, name=f"t{i}") for i, v in enumerate(values)]
    feature_table, combiners = [0, 1, 2, 0], ["sum", "mean", "sqrtn", "mean"]
    feats = [random_ragged(rng, 9, shapes[t][0], 4, zipf=1.3) for t in feature_table]
    weights = [rng.uniform(0.5, 2, len(ids)).astype(np.float32) if f == 2 else None
               for f, (_, ids) in enumerate(feats)]
    upstream = [rng.standard_normal((9, shapes[t][1])).astype(np.float32) for t in feature_table]
    with tf.GradientTape() as tape:
        for t in tables:
            tape_lib.variable_accessed(t)  # as lookup_sparse does
        outs = exchange.exchanged_lookup(
            SingleProcess(), [t.handle for t in tables], _metas(tables), feature_table,
            [tf.constant(ids) for _, ids in feats],
            [tf.constant(np.concatenate([[0], np.cumsum(lens)]), tf.int64) for lens, _ in feats],
            [None if w is None else tf.constant(w) for w in weights], combiners, ["a", "b", "c", "d"], "sum", 1)
        loss = tf.add_n([tf.reduce_sum(o * u) for o, u in zip(outs, upstream)])
    grads = tape.gradient(loss, tables)
    want_grad = [np.zeros(s, np.float64) for s in shapes]
    for f, t in enumerate(feature_table):
        lens, ids = feats[f]
        np.testing.assert_allclose(outs[f].numpy(), np_lookup(values[t], lens, ids, weights[f], combiners[f]),
                                   rtol=1e-5, atol=1e-6)
        # the gradient of the pooled output is linear in the rows: d out / d row = pooling coefficient
        w = np.ones(len(ids)) if weights[f] is None else weights[f].astype(np.float64)
        row = np.repeat(np.arange(len(lens)), lens)
        denom = {"sum": np.ones(len(lens)), "mean": np.bincount(row, w, len(lens)),
                 "sqrtn": np.sqrt(np.bincount(row, w * w, len(lens)))}[combiners[f]]
        np.add.at(want_grad[t], ids, (w / denom[row])[:, None] * upstream[f][row])
    for t, g in enumerate(grads):
        assert isinstance(g, tf.IndexedSlices)
        np.testing.assert_allclose(dense_grad(g, shapes[t][0]), want_grad[t], rtol=1e-4, atol=1e-5)


def test_check_names_the_first_bad_id_and_passes_good_ids():
    sok.init()
    tables = [sok.Variable(np.zeros((10, 4), np.float32), name="ta")]
    good = [tf.constant([1, 9, 0], tf.int64), tf.constant([], tf.int64)]
    assert [bool(x) for x in exchange._check(SingleProcess(), 0, 7, _metas(tables), [0, 0], good, ["a", "b"])] == \
        [True]
    bad = [tf.constant([1, 9], tf.int64), tf.constant([], tf.int64), tf.constant([3, 12, -3, 11], tf.int64)]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"feature 'c' has id 12 on rank 0, outside table 'ta' of 10 rows"):
        exchange._check(SingleProcess(), 0, 7, _metas(tables), [0, 0, 0], bad, ["a", "b", "c"])
    negative = [tf.constant([-3, 12], tf.int64)]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature .{1,2}a.{1,2} has id -3 on rank 0"):
        tf.function(lambda: exchange._check(SingleProcess(), 0, 7, _metas(tables), [0], negative, ["a"]))()


def test_exchange_option_is_checked_and_nccl_needs_a_gpu():
    with pytest.raises(ValueError, match=r"exchange must be one of \('auto', 'nccl', 'framework'\), got 'mpi'"):
        sok.init(exchange="mpi")
    assert isinstance(sok.init(exchange="auto").communicator, SingleProcess)   # one process: nothing to exchange
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("a GPU is visible: tests/gpu/test_nccl.py covers exchange='nccl'")
    with pytest.raises(RuntimeError, match=r"exchange='nccl' is unavailable on 1 of 1 rank\(s\); on this rank: "
                                           r"(this process sees no GPU|the tf_sok op library was built without CUDA)"):
        sok.init(exchange="nccl")
