"""Lookups that do not train (`lookup_sparse(..., training=False)`, Keras' evaluate / predict):
dynamic and hybrid tables are read and never changed. Held keys read their values (a hybrid
table's keys in host memory read there, not moved into the cache), other keys their initial value
(zeros under min_frequency > 1); checked against NumPy pooling of the tables' exports and against
the training lookup of a twin table."""
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.helpers import np_lookup, to_ragged
from tests.python.test_dynamic import random_keys
from tf_sok.python.ops.loader import ops

DIM = 4


def _table(name, budget_rows, min_frequency=1, dim=DIM):
    """A dynamic table; budget_rows: a hybrid one whose cache holds that many rows of values and
    Adagrad's accumulator (None: no host tier)."""
    tier = {} if budget_rows is None else dict(var_type="hybrid", max_hbm_for_vectors=budget_rows * 8 * dim / 2**30)
    return sok.DynamicVariable(dim, initializer="normal", seed=11, name=name, min_frequency=min_frequency, **tier)


def _train(rng, tables, pool, steps=5):
    """Adagrad steps on each table, the same random batches of keys of `pool` for all."""
    opts = [sok.optimizers.Adagrad(learning_rate=0.1) for _ in tables]
    batches = []
    for _ in range(steps):
        lens = rng.integers(0, 4, 16)
        batches.append((lens, pool[rng.integers(0, len(pool), int(lens.sum()))],
                        rng.standard_normal((16, tables[0].dimension)).astype(np.float32)))
    for table, opt in zip(tables, opts):
        for lens, keys, target in batches:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(sok.lookup_sparse(table, to_ragged(lens, keys), combiners="sum") * target)
            opt.apply_gradients([(tape.gradient(loss, table), table)])


def _contents(table):
    keys, values = sok.export(table)
    return dict(zip(keys.numpy().tolist(), values.numpy()))


def _cached_keys(table):
    with tf.device(table._index_device):
        return set(ops().tf_sok_dynamic_export(table._index.resource_handle)[0].numpy().tolist())


def _features(rng, held, batch=20):
    """Three features' (lens, ids): ids of held keys and of keys never seen, mixed."""
    out = []
    for _ in range(3):
        lens = rng.integers(0, 5, batch)
        n = int(lens.sum())
        new = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64, endpoint=True)   # (not held: 60 of 2^64)
        ids = np.where(rng.random(n) < 0.6, held[rng.integers(0, len(held), n)], new)
        out.append((lens, ids.astype(np.int64)))
    return out


def _initial_values(keys, dim=DIM):
    """The value a table of _table's initializer gives new keys: read from a new table that inserts them."""
    fresh = sok.DynamicVariable(dim, initializer="normal", seed=11, name="initial_values")
    return fresh.sparse_read(tf.constant(keys, tf.int64)).numpy()


@pytest.mark.parametrize("budget_rows", [None, 0, 3, 10**6])
def test_a_read_gives_values_and_initial_values_and_changes_nothing(rng, budget_rows):
    check_read(rng, budget_rows, "/CPU:0")


def check_read(rng, budget_rows, device, keys=60, dims=(DIM, 2 * DIM), batch=20, gather_min=-1, gather_share=1.0):
    """Two tables on `device` (budget_rows: hybrid ones caching that many rows) trained a few steps,
    then read by one lookup of three features (held and new keys, sum / mean / weighted sqrtn):
    the outputs are NumPy's pooling of the tables' exports and of new keys' initial values; the
    tables keep their keys, values and cache, and count the ids read from host memory and their
    bytes: gathered on the host and copied where a table's read has at least `gather_min` ids and
    as many of them in host memory (TF_SOK_READ_GATHER_MIN_ROWS on a GPU; -1: never), read in place
    otherwise; with a gather_share below 1 (TF_SOK_GATHER_SHARE), the ids after that share of a
    table's read in place beside the gather (gather_min then counts the rows of the share)."""
    pool = random_keys(rng, keys)
    with tf.device(device):
        a = _table(f"read_a_{budget_rows}_{device[1:4]}", budget_rows, dim=dims[0])
        b = _table(f"read_b_{budget_rows}_{device[1:4]}", budget_rows, dim=dims[1])
        _train(rng, [a], pool)
        _train(rng, [b], pool[:keys // 2])
    assert device[1:4] in a.device
    feats = _features(rng, pool, batch)
    weights = rng.random(len(feats[2][1])).astype(np.float32) + 0.5
    before = [_contents(t) for t in (a, b)]
    stats_before = [sok.cache_stats(t) for t in (a, b)] if budget_rows is not None else None
    cached_before = [_cached_keys(t) for t in (a, b)] if budget_rows is not None else None

    with tf.device(device):
        outs = sok.lookup_sparse([a, a, b], [to_ragged(*f) for f in feats],
                                 [None, None, to_ragged(feats[2][0], weights)], combiners=["sum", "mean", "sqrtn"],
                                 training=False)

    for f, (table, contents, comb) in enumerate(zip([a, a, b], [before[0], before[0], before[1]],
                                                    ["sum", "mean", "sqrtn"])):
        lens, ids = feats[f]
        vocab = sorted(set(ids.tolist()))
        unheld = [k for k in vocab if k not in contents]
        initial = dict(zip(unheld, _initial_values(unheld, table.dimension))) if unheld else {}
        matrix = np.stack([contents[k] if k in contents else initial[k] for k in vocab]) if vocab else \
            np.zeros((0, table.dimension), np.float32)
        at = np.searchsorted(vocab, ids)
        want = np_lookup(matrix, lens, at, weights if f == 2 else None, comb)
        np.testing.assert_allclose(outs[f].numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"feature {f}")
    for table, old in zip((a, b), before):   # nothing inserted, nothing changed
        now = _contents(table)
        assert set(now) == set(old)
        for k in old:
            np.testing.assert_array_equal(now[k], old[k])
    if budget_rows is None:
        return a, b
    for t, table in enumerate((a, b)):   # nothing moved; the ids not cached were read from host memory
        stats = sok.cache_stats(table)
        for name in ("finds", "lookups", "misses", "loaded", "evicted", "bytes_to_device", "bytes_to_host"):
            assert stats[name] == stats_before[t][name], name
        assert _cached_keys(table) == cached_before[t]
        ids = np.concatenate([feats[f][1] for f in ((0, 1) if t == 0 else (2,))])
        from_host = sum(1 for k in ids.tolist() if k in before[t] and k not in cached_before[t])
        assert stats["reads"] - stats_before[t]["reads"] == len(ids)
        assert stats["reads_from_host"] - stats_before[t]["reads_from_host"] == from_host
        gathered = 0 <= gather_min <= from_host and len(ids) >= gather_min and from_host > 0
        nbytes = from_host * 4 * table.dimension
        in_place = stats["bytes_read_in_place"] - stats_before[t]["bytes_read_in_place"]
        by_host = stats["bytes_read_gathered"] - stats_before[t]["bytes_read_gathered"]
        if gathered and gather_share < 1:   # (the share's rows gathered, the rest's read in place)
            assert in_place + by_host == nbytes
        else:
            assert (in_place, by_host) == ((0, nbytes) if gathered else (nbytes, 0))
    if budget_rows in (0, 3):   # most held keys live in host memory only
        assert sok.cache_stats(a)["reads_from_host"] > 0
    return a, b


@pytest.mark.parametrize("min_frequency", [1, 2])
@pytest.mark.parametrize("budget_rows", [None, 2])
def test_a_read_equals_the_training_lookup_of_a_twin_table(rng, budget_rows, min_frequency):
    """Two tables trained alike: the read of one and the training lookup of the other give the same
    outputs (new keys: the initial value, or zeros before min_frequency sightings); only the
    training lookup inserts."""
    pool = random_keys(rng, 40)
    a = _table(f"twin_a_{budget_rows}_{min_frequency}", budget_rows, min_frequency)
    b = _table(f"twin_b_{budget_rows}_{min_frequency}", budget_rows, min_frequency)
    _train(rng, [a, b], pool)
    # held keys and new ones (under min_frequency 2 a key seen once is neither: the training lookup's
    # second sighting would admit it)
    feats = [to_ragged(*f) for f in _features(rng, np.array(sorted(_contents(a)), np.int64))]
    size = int(a.size.numpy()[0])
    assert int(b.size.numpy()[0]) == size
    read = sok.lookup_sparse([a, a, a], feats, combiners="sum", training=False)
    trained = sok.lookup_sparse([b, b, b], feats, combiners="sum")
    for x, y in zip(read, trained):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    assert int(a.size.numpy()[0]) == size
    if min_frequency == 1:
        assert int(b.size.numpy()[0]) > size


def test_keras_evaluate_and_predict_leave_dynamic_tables_unchanged(rng, caplog):
    """fit inserts and trains; its validation, evaluate and predict read (training=False): the table
    keeps its keys and values, predict gives what the model's training call then gives, and
    sok.keras.CacheStats logs the validation's reads."""
    pool = random_keys(rng, 50)
    ids_in = keras.Input(shape=(None,), dtype="int64", ragged=True, name="ids")
    layer = sok.layers.Embedding(8, DIM, combiner="sum", dynamic=True, name="emb", initializer="normal",
                                 max_hbm_for_vectors=2 * 8 * DIM / 2**30)
    out = keras.layers.Dense(1)(layer(ids_in))
    model = keras.Model(ids_in, out)
    model.compile(optimizer=sok.keras.Optimizer(keras.optimizers.SGD(0.1), sok.optimizers.Adagrad(0.1)), loss="mse")

    def batch(keys_from):
        lens = rng.integers(1, 4, 32)
        return to_ragged(lens, keys_from[rng.integers(0, len(keys_from), int(lens.sum()))])

    x = batch(pool[:30])
    fresh = batch(np.concatenate([pool, rng.integers(-2**63, 2**63 - 1, 20, dtype=np.int64, endpoint=True)]))
    with caplog.at_level(logging.INFO, logger="tf_sok"):
        model.fit(tf.data.Dataset.from_tensors((x, tf.ones([32, 1]))).repeat(3), verbose=0,
                  validation_data=tf.data.Dataset.from_tensors((fresh, tf.ones([32, 1]))),
                  callbacks=[sok.keras.CacheStats()])
    table = layer.table
    before = _contents(table)
    assert set(before) == set(x.flat_values.numpy().tolist())   # the validation inserted nothing
    n_read = int(tf.size(fresh.flat_values))
    assert any(f"{n_read} ids read without training" in r.getMessage() for r in caplog.records)
    model.evaluate(tf.data.Dataset.from_tensors((fresh, tf.ones([32, 1]))), verbose=0)
    predicted = model.predict(tf.data.Dataset.from_tensors(fresh), verbose=0)
    after = _contents(table)
    assert set(after) == set(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    np.testing.assert_allclose(predicted, model(fresh, training=True).numpy(), rtol=1e-5, atol=1e-6)
    assert len(_contents(table)) > len(before)   # the training call inserted the keys the reads did not


def test_bad_reads_raise(rng):
    table = _table("bad_reads", 2)
    with pytest.raises(TypeError, match="training must be a bool"):
        sok.lookup_sparse(table, to_ragged(np.array([1]), np.array([5])), training="no")
    # malformed row splits (the last does not end at the id count) fail naming the feature, nothing read
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"malformed in feature\(s\)(.|\n)*clicks"):
        bad = tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3], tf.int64), tf.constant([0, 1, 2], tf.int64),
                                              validate=False)
        sok.lookup_sparse([table], [bad], feature_names=["clicks"], training=False)
    assert sok.cache_stats(table)["reads"] == 0
