"""Static tables with a host tier (`sok.Variable(..., max_hbm_for_vectors=...)`, `TableConfig` /
`sok.layers.Embedding` likewise): every row in host memory, the rows a step uses cached on the
device within the budget. Against the same table without a tier (itself tested against NumPy and
Keras): lookups and K steps of every optimizer at budgets of a few rows, 0, 1 and the whole table;
rows the table never used come from its per-row initializer and dumps hold every row; ids outside
[0, rows) are errors naming the feature, the table and the id, leaving the table unchanged; Keras fit,
checkpoints, dumps both ways and serving."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tf_sok.data import zipf_ranks
from tests.helpers import np_lookup, to_ragged
from tests.python.test_hybrid import OPTIMIZERS
from tf_sok.python.dump import DumpError
from tf_sok.python.variable import MOST_STATE_ARRAYS

ROWS, DIM = 120, 4


def _gib(rows, opt=None):
    widths = [DIM] + ([DIM if not s.per_row else 1 for s in opt.slot_specs()] if opt is not None else [])
    return rows * 4 * sum(widths) / 2**30


def _held(table, opt=None):
    """[ROWS, ...] arrays (values, then the optimizer's state) of a tiered table holding every row."""
    arrays = [table] + (list(opt.slots(table)) if opt is not None else [])
    keys, parts = table.export_state(arrays)
    order = np.argsort(keys.numpy())
    np.testing.assert_array_equal(keys.numpy()[order], np.arange(ROWS))
    return [p.numpy()[order] for p in parts]


def _plain(table, opt=None):
    return [table.numpy()] + ([s.numpy() for s in opt.slots(table)] if opt is not None else [])


def _batches(rng, steps, batch=16):
    """(row lengths, ids) per step, ids Zipf-distributed over a random order of the rows."""
    order = rng.permutation(ROWS)
    return [(lens, order[zipf_ranks(rng, ROWS, int(lens.sum()), 1.1)])
            for lens in (rng.integers(0, 4, batch) for _ in range(steps))]


@pytest.mark.parametrize("case,budget_rows", [(c, 4) for c in sorted(OPTIMIZERS)] + [("adam", ROWS)] +
                         [(c, b) for c in ("sgd", "adam") for b in (0, 1)])
def test_training_equals_the_table_without_a_host_tier(rng, case, budget_rows):
    cls, hp = OPTIMIZERS[case]
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    opt_p, opt_t = cls(learning_rate=0.05, **hp), cls(learning_rate=0.05, **hp)
    plain = sok.Variable(init, name=f"p_{case}_{budget_rows}")
    tiered = sok.Variable(init, name=f"t_{case}_{budget_rows}", max_hbm_for_vectors=_gib(budget_rows, opt_t))
    assert tiered.table.rows == ROWS and tiered.hybrid

    def step(table, opt, ids, target):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, ids, combiners="mean")
            loss = tf.reduce_sum(out * target)
        opt.apply_gradients([(tape.gradient(loss, table), table)])
        return out

    step_p = tf.function(lambda ids, target: step(plain, opt_p, ids, target))
    step_t = tf.function(lambda ids_, target_: step(tiered, opt_t, ids_, target_))
    for s, (lens, ids) in enumerate(_batches(rng, 6)):
        target = tf.constant(rng.standard_normal((len(lens), DIM)).astype(np.float32))
        got = step_t(to_ragged(lens, tf.constant(ids, tf.int64)), target).numpy()
        if s == 0:   # before any update: NumPy's lookup of the initial table
            np.testing.assert_allclose(got, np_lookup(init, lens, np.asarray(ids), None, "mean"), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got, step_p(to_ragged(lens, tf.constant(ids, tf.int64)), target).numpy(),
                                   rtol=1e-5, atol=1e-7)
    for a, b in zip(_held(tiered, opt_t), _plain(plain, opt_p)):
        np.testing.assert_allclose(a, b.reshape(a.shape), rtol=1e-5, atol=1e-7)
    stats = sok.cache_stats(tiered)
    assert stats["keys"] == ROWS
    if budget_rows < ROWS:
        assert stats["evicted"] > 0 and stats["bytes_to_host"] > 0 and stats["cached"] < ROWS


def _whole(rows=ROWS, dim=DIM):
    """The least budget (GiB) that holds a table whole: its values and the most optimizer state."""
    return rows * dim * 4 * (1 + MOST_STATE_ARRAYS) / 2**30


@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_a_budget_that_holds_the_table_makes_a_plain_table_that_trains_as_the_tier(rng, case):
    """A budget holding every row with the most state of any optimizer gives a plain sok.Variable
    (no key index in its step: the same ops as a table made without a budget), started at the rows
    the host tier draws; a byte less gives the tier. Both train alike with every optimizer."""
    cls, hp = OPTIMIZERS[case]
    widths = DIM + sum(DIM if not s.per_row else 1 for s in cls(**hp).slot_specs())
    assert widths <= DIM * (1 + MOST_STATE_ARRAYS)   # the rule covers this optimizer
    whole = sok.Variable(shape=[ROWS, DIM], initializer="normal", name=f"w_{case}", max_hbm_for_vectors=_whole())
    tiered = sok.Variable(shape=[ROWS, DIM], initializer="normal", name=f"w_{case}",
                          max_hbm_for_vectors=_whole() - 2.0**-30)
    assert isinstance(whole, sok.Variable) and not isinstance(whole, sok.DynamicVariable)
    assert whole.table.budget_bytes == round(_whole() * 2**30) and tiered.hybrid
    every = tf.range(ROWS, dtype=tf.int64)
    # the Python draw of the plain table against the index kernel's of the tier
    np.testing.assert_array_equal(whole.numpy(), tf.nn.embedding_lookup(tiered, every).numpy())
    plain = sok.Variable(whole.numpy(), name=f"p_{case}")
    opts = [cls(learning_rate=0.05, **hp) for _ in range(3)]

    def step(table, opt, ids, target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(sok.lookup_sparse(table, ids, combiners="sum") * target)
        opt.apply_gradients([(tape.gradient(loss, table), table)])
        return loss

    steps = [tf.function(lambda ids, target, t=t, o=o: step(t, o, ids, target))
             for t, o in zip((whole, tiered, plain), opts)]
    for lens, ids in _batches(rng, 4):
        ragged = to_ragged(lens, tf.constant(ids, tf.int64))
        target = tf.constant(rng.standard_normal((len(lens), DIM)).astype(np.float32))
        losses = [f(ragged, target).numpy() for f in steps]
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(losses[0], losses[2], rtol=1e-5, atol=1e-6)
    held = _held(tiered, opts[1])
    for a, b, c in zip(held, _plain(whole, opts[0]), _plain(plain, opts[2])):
        np.testing.assert_allclose(b.reshape(a.shape), a, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(b, c)

    def op_types(f):
        graph = f.get_concrete_function(ragged, target).graph
        return sorted(op.type for op in graph.get_operations())
    assert op_types(steps[0]) == op_types(steps[2])
    assert not any(t.startswith("TfSokDynamic") for t in op_types(steps[0]))
    with pytest.raises(ValueError, match=f"table 'w_{case}' has no cache: its max_hbm_for_vectors .* holds all"):
        sok.cache_stats(whole)


def test_the_budget_rule_takes_the_largest_shard_and_checks_as_the_tier():
    """An initial value is kept as given; the tier's argument errors stand for a table held whole."""
    init = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    whole = sok.Variable(init, name="given", max_hbm_for_vectors=_whole())
    np.testing.assert_array_equal(whole.numpy(), init)
    assert sok.Variable(init, name="given", max_hbm_for_vectors=_whole(ROWS - 1)).hybrid
    with pytest.raises(TypeError, match="initializer .* is not supported: a key's initial value is drawn per key"):
        sok.Variable(shape=[10, DIM], name="glorot_whole", initializer="glorot_uniform", max_hbm_for_vectors=1)
    with pytest.raises(ValueError, match="max_hbm_for_vectors must be a number of GiB >= 0, got 'big'"):
        sok.Variable(shape=[10, DIM], name="word", max_hbm_for_vectors="big")
    # a per-row initializer's names ("0.5": the constant) in a Keras layer whose budget holds its table
    emb = sok.layers.Embedding(ROWS, DIM, initializer="0.5", name="halves", max_hbm_for_vectors=_whole())
    np.testing.assert_array_equal(emb.table.numpy(), np.full((ROWS, DIM), 0.5, np.float32))


def test_rows_start_at_the_per_row_initializer_and_dumps_hold_every_row(rng, tmp_path):
    tiered = sok.Variable(shape=[ROWS, DIM], initializer="normal", name="drawn", max_hbm_for_vectors=_gib(3))
    used = rng.choice(ROWS, 10, replace=False)
    first = tf.nn.embedding_lookup(tiered, tf.constant(used)).numpy()
    # the same table made again (another rank, a restart) draws the same rows; another table others
    again = tf.nn.embedding_lookup(sok.Variable(shape=[ROWS, DIM], initializer="normal", name="drawn",
                                                max_hbm_for_vectors=_gib(3)), tf.constant(used)).numpy()
    other = tf.nn.embedding_lookup(sok.Variable(shape=[ROWS, DIM], initializer="normal", name="drawn_too",
                                                max_hbm_for_vectors=_gib(3)), tf.constant(used)).numpy()
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)
    opt = sok.optimizers.Adagrad(0.1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.nn.embedding_lookup(tiered, tf.constant(used[:5])) ** 2)
    opt.apply_gradients([(tape.gradient(loss, tiered), tiered)])
    assert sok.cache_stats(tiered)["keys"] == 10      # rows come to host memory as they are used
    # the dump holds every row (used or not): a table without a tier loaded from it reads alike
    sok.dump(str(tmp_path / "d"), [tiered], optimizer=opt)
    plain, opt_p = sok.Variable(shape=[ROWS, DIM], name="drawn"), sok.optimizers.Adagrad(0.1)
    sok.load(str(tmp_path / "d"), [plain], optimizer=opt_p)
    every = tf.range(ROWS, dtype=tf.int64)
    np.testing.assert_array_equal(tf.nn.embedding_lookup(tiered, every).numpy(), plain.numpy())
    values = plain.numpy()
    assert abs(values.mean()) < 0.01 and 0.04 < values.std() < 0.06   # "normal": stddev 0.05
    accum = opt_p.slots(plain)[0].numpy()
    untouched = np.setdiff1d(np.arange(ROWS), used[:5])
    np.testing.assert_array_equal(accum[untouched], np.full_like(accum[untouched], 0.1))  # Adagrad's fill
    assert (accum[used[:5]] > 0.1).all()
    # and the other way: a plain table's dump into a tiered one
    plain.assign(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    sok.dump(str(tmp_path / "p"), [plain])
    sok.load(str(tmp_path / "p"), [tiered])
    np.testing.assert_array_equal(tf.nn.embedding_lookup(tiered, every).numpy(), plain.numpy())
    with pytest.raises(DumpError, match=f"holds {ROWS} rows, the model's table has {ROWS + 1}"):
        sok.load(str(tmp_path / "p"), [sok.Variable(shape=[ROWS + 1, DIM], name="drawn",
                                                    max_hbm_for_vectors=_gib(3))])


def test_ids_outside_the_rows_are_errors_that_change_nothing(rng):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    tiered = sok.Variable(init, name="ranged", max_hbm_for_vectors=_gib(2))
    plain = sok.Variable(init, name="ranged_plain")
    before = sok.cache_stats(tiered)
    lookup = tf.function(lambda ids: sok.lookup_sparse([tiered, tiered], [ids, ids[:, :1]],
                                                       feature_names=["clicks", "first"]))
    for bad in (ROWS, ROWS + 7, -2):
        ids = tf.ragged.constant([[1, 2], [bad, 3]], tf.int64)
        # InvalidArgumentError naming the feature, the offending id and the table
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"feature clicks: id {bad} is outside \[0, {ROWS}\) of table ranged"):
            sok.lookup_sparse(tiered, ids, feature_names=["clicks"])
        with pytest.raises(tf.errors.InvalidArgumentError, match=rf"id {bad} is outside \[0, {ROWS}\)"):
            lookup(ids)
    # malformed row_splits: the same one check before any find
    broken = tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3], tf.int64), tf.constant([0, 2, 1, 3], tf.int64),
                                             validate=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits must start at 0, never decrease"):
        lookup(broken)
    after = sok.cache_stats(tiered)
    assert after["finds"] == before["finds"] and after["keys"] == ROWS
    np.testing.assert_array_equal(_held(tiered)[0], init)
    # a feature without ids is in range (its outputs are zeros)
    empty = tf.RaggedTensor.from_row_lengths(tf.zeros([0], tf.int64), tf.constant([0, 0], tf.int64))
    out = lookup(empty)
    assert out[0].shape == (2, DIM) and not np.any(out[0].numpy())
    # dense ids: -1 pads, as for any static table
    dense = tf.constant([[3, -1, 5], [-1, -1, 7]], tf.int64)
    np.testing.assert_allclose(sok.lookup_sparse(tiered, dense, combiners="sum").numpy(),
                               sok.lookup_sparse(plain, dense, combiners="sum").numpy(), rtol=1e-6)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="max_hbm_for_vectors must be a number of GiB >= 0, got -1"):
        sok.Variable(shape=[10, DIM], name="neg", max_hbm_for_vectors=-1)
    with pytest.raises(TypeError, match="initializer .* is not supported: a key's initial value is drawn per key"):
        sok.Variable(shape=[10, DIM], name="glorot", initializer="glorot_uniform", max_hbm_for_vectors=1)
    with pytest.raises(ValueError, match="max_capacity, evict_strategy and min_frequency are for dynamic tables"):
        sok.TableConfig("s", 10, DIM, max_capacity=5, max_hbm_for_vectors=1)
    with pytest.raises(ValueError, match="give initial_value or a 2-D shape"):
        sok.Variable(name="shapeless", max_hbm_for_vectors=1)


def test_checkpoint_round_trip(rng, tmp_path):
    cls, hp = OPTIMIZERS["adam"]
    tiered = sok.Variable(rng.standard_normal((ROWS, DIM)).astype(np.float32), name="ck",
                          max_hbm_for_vectors=_gib(3, cls(**hp)))
    opt = cls(learning_rate=0.05, **hp)

    def train(batches):
        for lens, ids in batches:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(sok.lookup_sparse(tiered, to_ragged(lens, tf.constant(ids, tf.int64))) ** 2)
            opt.apply_gradients([(tape.gradient(loss, tiered), tiered)])

    train(_batches(rng, 3))
    ckpt = tf.train.Checkpoint(table=tiered, opt=opt)
    path = ckpt.write(str(tmp_path / "ck"))
    later = _batches(rng, 3)
    train(later)
    want = _held(tiered, opt)
    ckpt.read(path).assert_consumed()
    train(later)
    for a, b in zip(_held(tiered, opt), want):
        np.testing.assert_array_equal(a, b)


def test_keras_fit_equals_the_table_without_a_tier_and_serves(rng, tmp_path):
    x = tf.ragged.constant([rng.integers(0, ROWS, rng.integers(1, 4)).tolist() for _ in range(96)], tf.int64)
    y = rng.standard_normal((96, 1)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(({"ids": x}, y)).batch(16)
    models, histories = [], []
    for budget in (_gib(5, sok.optimizers.Adam()), None, _whole()):
        emb = sok.layers.Embedding(ROWS, DIM, combiner="sum", initializer="uniform", name="items",
                                   max_hbm_for_vectors=budget)
        inp = keras.Input(shape=(None,), dtype="int64", ragged=True, name="ids")
        model = keras.Model({"ids": inp}, keras.layers.Dense(1, kernel_initializer="ones")(emb(inp)))
        model.compile(optimizer=sok.keras.Optimizer(keras.optimizers.SGD(0.05), sok.optimizers.Adam(0.02)),
                      loss="mse")
        if budget is None:   # the plain table starts where the tiered one did
            sok.load(str(tmp_path / "start"), [emb.table])
        elif models:         # a budget that holds the table: a plain weight, started by the per-row draw
            assert isinstance(emb.table, keras.Variable) and not hasattr(emb.table, "_dynamic")
            assert sok.table_meta(emb.table).budget_bytes >= 0
        else:
            sok.dump(str(tmp_path / "start"), [emb.table])
        histories.append(model.fit(ds, epochs=2, verbose=0).history["loss"])
        models.append(model)
    for other in (1, 2):
        np.testing.assert_allclose(histories[0], histories[other], rtol=1e-5)
        np.testing.assert_allclose(models[0].predict_on_batch({"ids": x}), models[other].predict_on_batch({"ids": x}),
                                   rtol=1e-5, atol=1e-6)
    assert models[0].layers[1].get_config()["max_hbm_for_vectors"] is not None
    # served by stock TensorFlow: the table as a dense variable of every row
    path = str(tmp_path / "served")
    sok.export_saved_model(models[0], path, {"ids": x[:8]})
    served = tf.saved_model.load(path)
    np.testing.assert_allclose(served.serve({"ids": x[:8]}).numpy(), models[0].predict_on_batch({"ids": x[:8]}),
                               rtol=1e-5, atol=1e-6)


def test_keras_weights_files_refuse_another_kind_of_table(rng, tmp_path):
    """A weights file of a model whose table has a host tier does not load into the same model
    without one, nor the other way: a ValueError naming the table says to move rows by sok.dump /
    sok.load (the file holds a key index and cached rows, or a plain array)."""
    def model(budget):
        emb = sok.layers.Embedding(ROWS, DIM, name="kinds", max_hbm_for_vectors=budget)
        inp = keras.Input(shape=(None,), dtype="int64", ragged=True, name="ids")
        m = keras.Model({"ids": inp}, emb(inp))
        m({"ids": tf.ragged.constant([rng.integers(0, ROWS, 3).tolist()], tf.int64)})
        return m
    tiered, plain = model(_gib(2)), model(None)
    tiered.save_weights(str(tmp_path / "t.weights.h5"))
    plain.save_weights(str(tmp_path / "p.weights.h5"))
    with pytest.raises(ValueError, match="table 'kinds' is a plain static table but the weights file holds a key "
                                         "index"):
        plain.load_weights(str(tmp_path / "t.weights.h5"))
    with pytest.raises(ValueError, match="table 'kinds' has a host tier but the weights file holds a plain array"):
        tiered.load_weights(str(tmp_path / "p.weights.h5"))
    # each loads its own kind
    before = tiered.predict_on_batch({"ids": tf.ragged.constant([[1, 2]], tf.int64)})
    tiered.load_weights(str(tmp_path / "t.weights.h5"))
    np.testing.assert_array_equal(tiered.predict_on_batch({"ids": tf.ragged.constant([[1, 2]], tf.int64)}), before)


def test_int32_ids_of_tables_without_a_tier_are_not_widened(rng):
    """A lookup over a plain and a tiered static table with int32 ids runs one fused lookup per id
    type: only the tiered table's feature is widened to int64 (its find's keys). Outputs (NumPy first)
    and three SGD steps equal the same tables without a tier."""
    inits = [rng.standard_normal((ROWS, DIM)).astype(np.float32) for _ in range(2)]
    mixed = [sok.Variable(inits[0], name="i32_plain"), sok.Variable(inits[1], name="i32_tier",
                                                                    max_hbm_for_vectors=_gib(3))]
    plain = [sok.Variable(inits[0], name="i32_ref_a"), sok.Variable(inits[1], name="i32_ref_b")]
    opts = [sok.optimizers.SGD(0.1), sok.optimizers.SGD(0.1)]

    def lookup(tables, feats):
        return sok.lookup_sparse([tables[0], tables[1], tables[0]], feats, combiners="sum")

    def step(tables, opt, feats):
        with tf.GradientTape() as tape:
            outs = lookup(tables, feats)
            loss = sum(tf.reduce_sum(o * (i + 1)) for i, o in enumerate(outs))
        opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
        return outs

    steps = [tf.function(lambda f, t=t, o=o: step(t, o, f)) for t, o in zip((mixed, plain), opts)]
    for s in range(3):
        lens = [rng.integers(0, 4, 8) for _ in range(3)]
        feats = [to_ragged(n, tf.constant(rng.integers(0, ROWS, int(n.sum())), tf.int32)) for n in lens]
        got, want = ([o.numpy() for o in f(feats)] for f in steps)
        if s == 0:
            for o, n, f, init in zip(got, lens, feats, (inits[0], inits[1], inits[0])):
                np.testing.assert_allclose(o, np_lookup(init, n, f.values.numpy(), None, "sum"), rtol=1e-6, atol=1e-6)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mixed[0].numpy(), plain[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_held(mixed[1])[0], plain[1].numpy(), rtol=1e-5, atol=1e-6)
    graph = tf.function(lambda f: lookup(mixed, f)).get_concrete_function(feats).graph
    widened = [op for op in graph.get_operations() if op.type == "Cast"
               and op.get_attr("SrcT") == tf.int32 and op.get_attr("DstT") == tf.int64]
    assert len(widened) == 1, [op.name for op in widened]
    assert sum(op.type == "TfSokFusedLookup" for op in graph.get_operations()) == 2
