"""`lookup_sparse`: one fused lookup for many features over many tables."""
from typing import Optional, Sequence, Union

import tensorflow as tf
from tensorflow.python.eager import tape as tape_lib

from tf_sok.python import context as context_lib
from tf_sok.python import exchange
from tf_sok.python.config import check_combiner
from tf_sok.python.context_errors import REPLICA_CONTEXT_MESSAGE, replica_context_required
from tf_sok.python.ops import lookup_ops
from tf_sok.python.ops.loader import ops
from tf_sok.python.variable import backing_variable, table_meta


def _sparse_rows(sp: tf.SparseTensor, what: str):
    """A [batch, max_ids] SparseTensor as (row ids, order): every entry checked (row in
    [0, dense_shape[0]), column in [0, dense_shape[1]), no index twice), and the order that puts
    entries in row-major order (TensorFlow allows any order; columns may have gaps).
    InvalidArgumentError naming the feature and the entry, eagerly and when a graph runs."""
    if sp.shape.rank is not None and sp.shape.rank != 2:
        raise ValueError(f"{what}: a SparseTensor of ids must be [batch, max_ids], got rank {sp.shape.rank}")
    idx = tf.cast(sp.indices, tf.int64)
    shape = tf.cast(sp.dense_shape, tf.int64)
    rows, cols = idx[:, 0], idx[:, 1]
    n = tf.shape(idx, out_type=tf.int64)[0]
    padded = tf.concat([idx, tf.zeros([1, 2], tf.int64)], 0)   # the messages' gathers work without entries
    outside = tf.where(tf.logical_or(tf.logical_or(rows < 0, rows >= shape[0]),
                                     tf.logical_or(cols < 0, cols >= shape[1])))[:, 0]
    first = tf.concat([outside, [n]], 0)[0]
    checks = [tf.debugging.Assert(tf.equal(tf.size(outside), 0), [
        f"{what}: SparseTensor entry", first, "has index", tf.gather(padded, first),
        "outside dense_shape", shape])]
    key = rows * tf.maximum(shape[1], 1) + cols          # row-major position
    order = tf.argsort(key, stable=True)
    with tf.control_dependencies(checks):
        sorted_key = tf.gather(key, order)
    repeated = tf.where(sorted_key[1:] <= sorted_key[:-1])[:, 0]
    checks.append(tf.debugging.Assert(tf.equal(tf.size(repeated), 0), [
        f"{what}: SparseTensor index", tf.gather(padded, tf.concat([tf.gather(order, repeated[:1]), [n]], 0)[0]),
        "appears more than once"]))
    with tf.control_dependencies(checks):
        return tf.gather(rows, order), tf.identity(order), shape[0]


def _sparse_to_ragged(sp: tf.SparseTensor, what: str):
    """(ragged [batch, (ids)], the order of sp's entries in it)."""
    rows, order, nrows = _sparse_rows(sp, what)
    return tf.RaggedTensor.from_value_rowids(tf.gather(sp.values, order), rows, nrows=nrows, validate=False), order


def is_ragged_pair(x) -> bool:
    """Whether `x` is a feature given as the (values, row_splits) pair of its ragged ids: two 1-D
    tensors, as the readers' and `sd.for_keras`'s `ragged_pairs=True` yield them."""
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, tf.Tensor) and t.shape.rank == 1 for t in x)


def ragged_pair(x):
    """A (values, row_splits) pair (`is_ragged_pair`) as a RaggedTensor (its row splits are checked
    by the lookup); any other input as it is."""
    return tf.RaggedTensor.from_row_splits(x[0], x[1], validate=False) if is_ragged_pair(x) else x


def _as_ragged(x, what: str) -> tf.RaggedTensor:
    if isinstance(x, tf.RaggedTensor):
        rt = x
    elif isinstance(x, tf.SparseTensor):
        rt = _sparse_to_ragged(x, what)[0]
    else:
        t = tf.convert_to_tensor(x)
        if t.shape.rank == 1:
            t = t[:, None]
        if t.shape.rank != 2:
            raise ValueError(f"{what}: dense ids must be [batch] or [batch, hotness], got shape {t.shape}")
        rt = tf.RaggedTensor.from_tensor(t)
    if rt.ragged_rank != 1 or rt.flat_values.shape.rank != 1:
        raise ValueError(f"{what}: ids must be a 2-D ragged tensor [batch, (ids)], got {rt.shape}")
    return rt


def _same_rows(id_splits, weight_splits, feature: str):
    """An assertion that a feature's weights have its ids' rows (row_splits), not only their count:
    weights are matched to ids row by row, as the structure says (TensorFlow's own lookup only
    checks counts). InvalidArgumentError eagerly and when a graph runs."""
    if weight_splits is id_splits:  # weights made from the ids' own splits (ids.with_values(w)): nothing to check
        return tf.no_op()
    a, b = tf.cast(id_splits, tf.int64), tf.cast(weight_splits, tf.int64)
    m = tf.minimum(tf.size(a), tf.size(b))
    same = tf.logical_and(tf.equal(tf.size(a), tf.size(b)), tf.reduce_all(tf.equal(a[:m], b[:m])))
    return tf.debugging.Assert(same, [f"lookup_sparse feature {feature}: the rows (row_splits) of the weights differ "
                                      f"from those of the ids; give each row of ids its own row of weights"])


def _sparse_weights(ids: tf.SparseTensor, w: tf.SparseTensor, order: tf.Tensor, feature: str):
    """SparseTensor weights of SparseTensor ids: the same indices, entry by entry (as TensorFlow's
    lookup assumes; here an InvalidArgumentError otherwise), put in the ids' row-major order."""
    same = tf.cond(tf.reduce_all(tf.equal(tf.shape(w.indices), tf.shape(ids.indices))),   # same [n, rank]
                   lambda: tf.reduce_all(tf.equal(tf.cast(w.indices, tf.int64), tf.cast(ids.indices, tf.int64))),
                   lambda: False)
    check = tf.debugging.Assert(same, [f"lookup_sparse feature {feature}: the weights SparseTensor indices differ "
                                       f"from those of the ids; give each id its weight at the same index"])
    with tf.control_dependencies([check]):
        return tf.cast(tf.gather(w.values, order), tf.float32)


def _listify(x):
    return (list(x), True) if isinstance(x, (list, tuple)) else ([x], False)


@tf.autograph.experimental.do_not_convert   # library code: no tensor-dependent Python control flow
def lookup_sparse(params, sp_ids, sp_weights=None, combiners: Union[str, Sequence[Optional[str]], None] = None,
                  name: Optional[str] = None, feature_names: Optional[Sequence[str]] = None, dtype=tf.float32,
                  prune_negative_ids: Optional[bool] = None, use_low_frequency_filter: bool = False,
                  filter_ratio: float = 0.0, training: bool = True):
    """Looks up and combines many features in ONE fused op.

    Args:
      params: a table variable, or a list with one table per feature (the same
        table may serve several features).
      sp_ids: per feature a `tf.RaggedTensor` [batch, (ids)], its `(values, row_splits)` pair of
        1-D tensors, a `tf.SparseTensor` or dense [batch, hotness] int32/int64 ids.
      sp_weights: None, or per feature weights of the same structure as its ids.
      combiners: "sum" | "mean" | "sqrtn", one per feature or one for all
        (default "mean", as `tf.nn.embedding_lookup_sparse`); in a list, None makes
        a feature a sequence: its output is [batch, (ids), dim] ragged, one vector
        per id (times its weight), not pooled (TorchRec's EmbeddingCollection; the
        pooled features are its EmbeddingBagCollection).
      feature_names: used in error messages (default feature0, feature1, ...).
      dtype: the outputs' type: float32, or float16 / bfloat16 (for Keras mixed
        policies: rows are summed in float32 and rounded once, by the kernel;
        tables, their gradients and optimizer state stay float32).
      prune_negative_ids: drop ids < 0 (padding) before the lookup, as
        `tf.nn.safe_embedding_lookup_sparse` does; their weights go with them and
        a row left empty gives zeros. Default (None): for dense [batch, hotness]
        ids of static tables only (a dynamic table's negative keys are keys).
      use_low_frequency_filter: SOK's: keys new to a dynamic table are inserted
        only with probability `filter_ratio` (default 0: none), drawn per key and
        lookup; the others read zeros and their gradients are dropped. Keys
        already held are looked up as always.
      training: False for a lookup that only reads (evaluation, inference;
        Keras passes it in `evaluate` / `predict`): dynamic tables are left as
        they are — no key inserted, no eviction score touched, no row moved into
        a hybrid table's cache (its keys in host memory are read there in place,
        over the host link) — and a key a table does not hold reads what a
        served model gives it: its initial value (zeros when the table admits
        keys after min_frequency > 1 sightings). No gradient reaches the tables.
        Static tables read as always.
    Returns:
      A [batch, dim] tensor per feature (a list when sp_ids is a list); a
      sequence feature's is a [batch, (ids), dim] tf.RaggedTensor.
      Gradients reach each table as one `tf.IndexedSlices`: its distinct rows read,
      ascending, then repeats of the last one with zero values, so that its size
      (the table's id count in the batch, at most its rows) is known before the
      step runs. Summing repeated rows (what every consumer of IndexedSlices does)
      gives the exact gradient; tf_sok's optimizers update each row once.

    Example:
        >>> ids = tf.ragged.constant([[1, 2], [], [3]], dtype=tf.int64)
        >>> out = sok.lookup_sparse([table], [ids], combiners=["sum"])
    """
    ids_list, as_list = _listify(sp_ids)
    ids_list = [ragged_pair(x) for x in ids_list]
    F = len(ids_list)
    if F == 0:
        return []
    params_list, comb, names, weights_list = _per_feature(params, combiners, feature_names, sp_weights, F)
    dtype = tf.as_dtype(dtype)
    if dtype not in (tf.float32, tf.float16, tf.bfloat16):
        raise TypeError(f"lookup_sparse: dtype must be float32, float16 or bfloat16, got {dtype.name}")
    ctx = context_lib.context()
    if ctx.communicator.outside_replicas():
        return _outside_replicas(params_list, ids_list, names, as_list, dtype)
    tables, feature_table = _tables_of(params_list, comb, isinstance(combiners, str), names)
    if not isinstance(use_low_frequency_filter, bool):
        raise TypeError(f"lookup_sparse: use_low_frequency_filter must be a bool, got {use_low_frequency_filter!r}")
    if isinstance(filter_ratio, bool) or not isinstance(filter_ratio, (int, float)) or not 0 <= filter_ratio <= 1:
        raise ValueError(f"lookup_sparse: filter_ratio must be a number in [0, 1], got {filter_ratio!r}")
    insert_ratio = float(filter_ratio) if use_low_frequency_filter else 1.0
    if prune_negative_ids not in (None, True, False):
        raise TypeError(f"lookup_sparse: prune_negative_ids must be None or a bool, got {prune_negative_ids!r}")
    if not isinstance(training, bool):
        raise TypeError(f"lookup_sparse: training must be a bool, got {training!r}")

    with tf.name_scope(name or "sok_lookup_sparse"):
        metas = [table_meta(t) for t in tables]
        ids, splits, weights, weighted = _fused_inputs(ids_list, weights_list, names, prune_negative_ids,
                                                       [metas[t].keyed for t in feature_table])
        sequence = {f: splits[f] for f in range(F) if comb[f] is None}
        for f in sequence:   # one output row per id: unit row splits, summed
            splits[f] = tf.range(tf.size(ids[f], out_type=tf.int64) + 1)
        comb = ["sum" if c is None else c for c in comb]
        outs = _lookup(ctx, tables, metas, feature_table, ids, splits, weights, weighted, comb, names, dtype,
                       insert_ratio, training)
        for f, row_splits in sequence.items():
            outs[f] = tf.RaggedTensor.from_row_splits(outs[f], row_splits, validate=False)
    return outs if as_list else outs[0]


def _per_feature(params, combiners, feature_names, sp_weights, F: int):
    """lookup_sparse's per-feature arguments checked and spread to one entry per feature: (tables,
    combiners, names, weights)."""
    params_list = list(params) if isinstance(params, (list, tuple)) else [params] * F
    if len(params_list) != F:
        raise ValueError(f"lookup_sparse: {len(params_list)} tables for {F} features; give one per feature")
    if combiners is None:
        combiners = "mean"
    if not isinstance(combiners, (str, list, tuple)):
        raise TypeError(f"lookup_sparse: combiners must be a string or a list of strings, got {combiners!r}")
    comb = [combiners] * F if isinstance(combiners, str) else list(combiners)
    if len(comb) != F:
        raise ValueError(f"lookup_sparse: {len(comb)} combiners for {F} features")
    if feature_names is not None and (isinstance(feature_names, str) or not isinstance(feature_names, (list, tuple))):
        raise TypeError(f"lookup_sparse: feature_names must be a list of strings, got {feature_names!r}")
    names = list(feature_names) if feature_names is not None else [f"feature{i}" for i in range(F)]
    if len(names) != F or not all(isinstance(n, str) for n in names):
        raise ValueError(f"lookup_sparse: {len(names)} feature_names for {F} features; give one string per feature")
    weights_list = [None] * F if sp_weights is None else [ragged_pair(w) for w in _listify(sp_weights)[0]]
    if len(weights_list) != F:
        raise ValueError(f"lookup_sparse: {len(weights_list)} weights for {F} features")
    return params_list, comb, names, weights_list


def _tables_of(params_list, comb, one_combiner: bool, names):
    """The distinct tables of the features (in order of first use) and each feature's table; every
    pooled feature's combiner checked (a sequence feature has None)."""
    tables, table_index, feature_table = [], {}, []
    for f, p in enumerate(params_list):
        meta = table_meta(p)
        if meta is None:
            raise TypeError(f"lookup_sparse: the table of feature {names[f]!r} is not a tf_sok variable "
                            f"(create it with sok.Variable or a sok.layers layer), got {type(p).__name__}")
        key = id(backing_variable(p))
        if key not in table_index:
            table_index[key] = len(tables)
            tables.append(p)
        feature_table.append(table_index[key])
        if comb[f] is not None or one_combiner:
            check_combiner(comb[f], f"lookup_sparse feature {names[f]!r}")
    return tables, feature_table


def _fused_inputs(ids_list, weights_list, names, prune_negative_ids, keyed):
    """The fused lookup's inputs per feature: ids (one integer type for all), row splits, weights
    (float32; empty when unweighted) and whether weighted; negative ids pruned where asked (by default
    dense ids of static tables: keyed[f] False)."""
    ragged, sparse_order = [], {}   # SparseTensor ids: the order their entries take
    for f, x in enumerate(ids_list):
        if isinstance(x, tf.SparseTensor):
            rt, sparse_order[f] = _sparse_to_ragged(x, f"lookup_sparse feature {names[f]}")  # no quotes: graph
            # assertions print their strings with quotes escaped
            ragged.append(rt)
        else:
            ragged.append(_as_ragged(x, f"lookup_sparse feature {names[f]!r}"))
    id_dtype = tf.int64 if any(r.dtype == tf.int64 for r in ragged) else tf.int32
    for f, r in enumerate(ragged):
        if r.dtype not in (tf.int32, tf.int64):
            raise TypeError(f"lookup_sparse feature {names[f]!r}: ids must be int32 or int64, got {r.dtype.name}")
    ids = [tf.cast(r.values, id_dtype) for r in ragged]
    splits = [tf.cast(r.row_splits, tf.int64) for r in ragged]
    weights, weighted = [], []
    for f, w in enumerate(weights_list):
        if w is None:
            weights.append(tf.zeros([0], tf.float32))
            weighted.append(False)
        elif isinstance(w, tf.SparseTensor) and isinstance(ids_list[f], tf.SparseTensor):
            weights.append(_sparse_weights(ids_list[f], w, sparse_order[f], names[f]))
            weighted.append(True)
        else:
            wr = _as_ragged(w, f"lookup_sparse weights of feature {names[f]!r}")
            with tf.control_dependencies([_same_rows(ragged[f].row_splits, wr.row_splits, names[f])]):
                weights.append(tf.cast(tf.identity(wr.values), tf.float32))
            weighted.append(True)
    for f, x in enumerate(ids_list):
        dense = not isinstance(x, (tf.RaggedTensor, tf.SparseTensor))
        if prune_negative_ids or (prune_negative_ids is None and dense and not keyed[f]):
            ids[f], splits[f], weights[f] = _pruned(ids[f], splits[f], weights[f] if weighted[f] else None)
            if not weighted[f]:
                weights[f] = tf.zeros([0], tf.float32)
    return ids, splits, weights, weighted


def _pruned(ids, splits, weights):
    """A feature's ids >= 0 only (and their weights), with its row splits recounted."""
    keep = ids >= 0
    kept_per_row = tf.reduce_sum(tf.cast(tf.RaggedTensor.from_row_splits(keep, splits, validate=False), tf.int64),
                                 axis=1)
    splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(kept_per_row)], 0)
    return tf.boolean_mask(ids, keep), splits, None if weights is None else tf.boolean_mask(weights, keep)


def _lookup(ctx, tables, metas, feature_table, ids, splits, weights, weighted, comb, names, dtype, insert_ratio,
            training=True):
    """The fused lookup of lookup_sparse's checked, flattened features (pooled outputs)."""
    if any(m.dynamic for m in metas):
        if ctx.num_ranks > 1 or not training:
            return _with_dynamic_tables(ctx, tables, metas, feature_table, ids, splits, weights, weighted, comb,
                                        names, dtype, insert_ratio, training)
        ids = _dynamic_rows(tables, metas, feature_table, ids, splits, names, insert_ratio)
    handles = []
    for t in tables:
        var = backing_variable(t)
        if var.trainable:
            tape_lib.variable_accessed(var)  # lets GradientTape / Keras see the read
        handles.append(var.handle)
    if ctx.num_ranks > 1:
        outs = exchange.exchanged_lookup(
            ctx.communicator, handles, metas, feature_table, [tf.cast(v, tf.int64) for v in ids], splits,
            [w if on else None for w, on in zip(weights, weighted)], comb, names,
            ctx.sparse_grad_reduction, ctx.collective_index())
        return [tf.cast(o, dtype) for o in outs]   # pooled from received float32 vectors
    # one fused lookup per id type: the dynamic tables' rows are int64, the static tables' ids keep
    # theirs (int32 ids are not widened; every table's features share its type)
    by_type = {}
    for f, v in enumerate(ids):
        by_type.setdefault(v.dtype, []).append(f)
    outs = [None] * len(ids)
    for fs in by_type.values():
        ts = sorted({feature_table[f] for f in fs})
        got = lookup_ops.fused_lookup(
            [handles[t] for t in ts], [ids[f] for f in fs], [splits[f] for f in fs], [weights[f] for f in fs],
            feature_table=[ts.index(feature_table[f]) for f in fs], combiners=[comb[f] for f in fs],
            weighted=[weighted[f] for f in fs], dims=[metas[t].dim for t in ts], feature_names=[names[f] for f in fs],
            table_names=[metas[t].name for t in ts], dtype=dtype)
        for f, o in zip(fs, got):
            outs[f] = o
    return outs


def _with_dynamic_tables(ctx, tables, metas, feature_table, ids, splits, weights, weighted, comb, names, dtype,
                         insert_ratio, training=True):
    """A lookup over dynamic tables (and static ones) across ranks, or one that does not train: the
    dynamic tables' features by their exchange (dynamic_exchange) or their read (_read_pooled), the
    static tables' by lookup_sparse's, outputs in order."""
    from tf_sok.python import dynamic_exchange

    dyn = [f for f in range(len(ids)) if metas[feature_table[f]].dynamic]
    static = [f for f in range(len(ids)) if not metas[feature_table[f]].dynamic]
    dyn_tables = sorted({feature_table[f] for f in dyn})
    outs = [None] * len(ids)
    args = ([tables[t] for t in dyn_tables], [metas[t] for t in dyn_tables],
            [dyn_tables.index(feature_table[f]) for f in dyn], [ids[f] for f in dyn], [splits[f] for f in dyn],
            [weights[f] if weighted[f] else None for f in dyn], [comb[f] for f in dyn], [names[f] for f in dyn])
    if ctx.num_ranks > 1:
        pooled = dynamic_exchange.dynamic_exchanged_lookup(ctx.communicator, *args, ctx.sparse_grad_reduction,
                                                           ctx.collective_index(), insert_ratio, training)
    else:
        pooled = _read_pooled(*args)
    for f, o in zip(dyn, pooled):
        outs[f] = tf.cast(o, dtype)
    if static:
        rest = lookup_sparse([tables[feature_table[f]] for f in static],
                             [tf.RaggedTensor.from_row_splits(ids[f], splits[f], validate=False) for f in static],
                             [tf.RaggedTensor.from_row_splits(weights[f], splits[f], validate=False)
                              if weighted[f] else None for f in static] if any(weighted[f] for f in static) else None,
                             combiners=[comb[f] for f in static], feature_names=[names[f] for f in static],
                             dtype=dtype, training=training)
        for f, o in zip(static, rest):
            outs[f] = o
    return outs


def checked_splits_and_rows(metas, feature_table, ids, splits):
    """The features' (all on dynamic tables) row splits checked, and where a static table behind a
    host tier holds the feature, its ids against [0, rows) (the finds would insert others as keys):
    (splits valid [k] bool, ids in range [k] bool, an offending id [k] int64, the bounds: rows or -1),
    by one op on the ids' device."""
    bounds = [metas[feature_table[f]].rows if metas[feature_table[f]].row_ids else -1 for f in range(len(ids))]
    valid, in_range, offending = ops().tf_sok_row_splits_valid(
        [tf.cast(s, tf.int64) for s in splits], [tf.cast(v, tf.int64) for v in ids],
        rows=bounds if max(bounds) >= 0 else [])
    return valid, in_range, offending, bounds


def range_message(feature, bad, meta):
    """The error text of feature `feature`'s id `bad` (a tensor) outside table `meta`'s rows."""
    return tf.strings.join([f"lookup_sparse feature {feature}: id ", tf.strings.as_string(bad),
                            f" is outside [0, {meta.rows}) of table {meta.name}"])


def _checked_ids(metas, feature_table, ids, splits, names):
    """(the features' ids, those of dynamic tables as int64, one op checking every dynamic feature's row
    splits and the range of the ids of static tables behind a host tier): the dynamic tables' finds
    and reads wait for it."""
    ids = [tf.cast(v, tf.int64) if metas[feature_table[f]].dynamic else v for f, v in enumerate(ids)]
    # the finds insert keys: a malformed feature must fail before them, not in the lookup after. One
    # check for all features (on a GPU, a check is a wait for the device)
    dynamic = [f for f in range(len(ids)) if metas[feature_table[f]].dynamic]
    valid, in_range, bad, bounds = checked_splits_and_rows(metas, [feature_table[f] for f in dynamic],
                                                           [ids[f] for f in dynamic], [splits[f] for f in dynamic])
    ok = tf.reduce_all(tf.logical_and(valid, in_range))

    def fail():   # built only when a check fails: the passing step reads one bool back
        asserts = [tf.debugging.Assert(tf.reduce_all(valid), [
            "lookup_sparse: row_splits must start at 0, never decrease and end at the number of ids; malformed "
            "in feature(s)", tf.boolean_mask(tf.constant([names[f] for f in dynamic]), tf.logical_not(valid))])]
        asserts += [tf.debugging.Assert(in_range[i], [range_message(names[f], bad[i], metas[feature_table[f]])],
                                        name="ids_within_rows")
                    for i, f in enumerate(dynamic) if bounds[i] >= 0]
        with tf.control_dependencies(asserts):
            return tf.constant(False)
    return ids, tf.cond(ok, lambda: tf.constant(True), fail)


def _keys_of_tables(metas, feature_table, ids):
    """Per dynamic table (ascending), its features and the concatenation of their ids."""
    dyn = [t for t, meta in enumerate(metas) if meta.dynamic]
    features = [[f for f, ft in enumerate(feature_table) if ft == t] for t in dyn]
    return dyn, features, [tf.concat([ids[f] for f in fs], 0) if len(fs) > 1 else ids[fs[0]] for fs in features]


def _dynamic_rows(tables, metas, feature_table, ids, splits, names, insert_ratio=1.0):
    """The ids of features on dynamic tables replaced by the rows holding them (missing keys
    inserted): one find per table over all its features' ids, so that keys of one feature never
    evict those of another in the same step. The static tables' ids are left as they are."""
    ids, check = _checked_ids(metas, feature_table, ids, splits, names)
    from tf_sok.python.dynamic_variable import rows_for_tables

    dyn, features, keys = _keys_of_tables(metas, feature_table, ids)
    with tf.control_dependencies([check]):
        rows = rows_for_tables([backing_variable(tables[t]) for t in dyn], keys, insert_ratio)
    for fs, r in zip(features, rows):
        parts = tf.split(r, [tf.size(ids[f]) for f in fs]) if len(fs) > 1 else [r]
        for f, part in zip(fs, parts):
            ids[f] = part
    return ids


def _read_pooled(tables, metas, feature_table, ids, splits, weights, combiners, names):
    """Pooled [batch, dim] float32 outputs of features whose tables are all dynamic, read without
    training (dynamic_variable.read_tables): each table's values of its features' ids in one read,
    one vector per id, pooled by the fused combine."""
    from tf_sok.python.dynamic_variable import read_tables

    ids, check = _checked_ids(metas, feature_table, ids, splits, names)
    dyn, features, keys = _keys_of_tables(metas, feature_table, ids)   # (every table here is dynamic)
    with tf.control_dependencies([check]):
        values = read_tables([backing_variable(tables[t]) for t in dyn], keys)
    positions = [None] * len(ids)   # each id's vector: its place in its table's read
    for fs in features:
        start = tf.constant(0, tf.int64)
        for f in fs:
            n = tf.size(ids[f], out_type=tf.int64)
            positions[f] = tf.range(start, start + n)
            start = start + n
    weighted = [w is not None for w in weights]
    return lookup_ops.fused_combine(
        values, positions, [tf.cast(s, tf.int64) for s in splits],
        [w if w is not None else tf.zeros([0], tf.float32) for w in weights],
        feature_table=[dyn.index(t) for t in feature_table], combiners=list(combiners), weighted=weighted,
        feature_names=list(names), table_names=[metas[t].name for t in dyn], checked=True)


def _outside_replicas(params_list, ids_list, names, as_list, dtype):
    """A lookup under tf.distribute outside strategy.run: tables are sharded over
    the replicas, so there is nothing to compute here. Eagerly that is an error;
    while Keras traces a model for its output shapes, the result has the right
    shapes and raises the same error if it is ever run."""
    if tf.executing_eagerly():
        replica_context_required()
    failing = tf.debugging.Assert(tf.constant(False), [REPLICA_CONTEXT_MESSAGE], name="replica_context")
    outs = []
    with tf.control_dependencies([failing]):
        for f, (p, x) in enumerate(zip(params_list, ids_list)):
            meta = table_meta(p)
            if meta is None:
                raise TypeError(f"lookup_sparse: the table of feature {names[f]!r} is not a tf_sok variable")
            rows = _as_ragged(x, f"lookup_sparse feature {names[f]!r}").nrows()
            outs.append(tf.zeros(tf.stack([rows, tf.constant(meta.dim, rows.dtype)]), dtype))
    return outs if as_list else outs[0]
