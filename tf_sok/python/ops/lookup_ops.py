"""The fused lookup ops and their registered gradients: row-sparse per table
for variables, dense for plain tensors (the exchange path's received vectors)."""
import weakref
from typing import List, Sequence

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.ops import resource_variable_ops

from tf_sok.python.ops.loader import ops

CHECK_OP = "TfSokLookupCheck"


@auto_control_deps.register_acd_resource_resolver
def _check_runs_unchained(op, reads, writes):
    """tf.function chains the stateful ops that touch no resource in program order.
    A lookup's check reads its lookup's status and nothing else: it stands for a
    resource of its own here, so no earlier stateful op (a collective, say) delays
    it, and it delays none (the lookup's gradient waits for it, see below)."""
    if op.type != CHECK_OP or not op.inputs or op.inputs[0] in reads:
        return False
    reads.add(op.inputs[0])
    return True


def _checked(result, checked: bool, feature_table: Sequence[int], feature_names: Sequence[str],
             table_names: Sequence[str]) -> List[tf.Tensor]:
    """The lookup's outputs, after queueing the check of its status (unless tf_sok
    produced and checked the ids itself). Eagerly the check raises here; in a
    tf.function it fails the call, and the lookup's gradient waits for it, so no
    gradient or update of a step with a bad id ever runs. On a GPU the ops after
    the lookup are queued while it runs (the check completes from the stream)."""
    if not checked:
        ops().tf_sok_lookup_check(result.status, feature_names=list(feature_names),
                                  table_names=list(table_names), feature_table=list(feature_table))
    return list(result.outputs)


def _checks_of(op) -> List:
    """The check ops that read a lookup op's status (graph mode; eagerly they have run)."""
    if tf.executing_eagerly() or not hasattr(op.outputs[-1], "consumers"):
        return []
    return [c for c in op.outputs[-1].consumers() if c.type == CHECK_OP]


def fused_lookup(handles: Sequence[tf.Tensor], ids: Sequence[tf.Tensor], row_splits: Sequence[tf.Tensor],
                 weights: Sequence[tf.Tensor], *, feature_table: Sequence[int], combiners: Sequence[str],
                 weighted: Sequence[bool], dims: Sequence[int], feature_names: Sequence[str],
                 table_names: Sequence[str], checked: bool = False, distinct_ids: bool = False,
                 one_id_per_row: bool = False, dtype=tf.float32) -> List[tf.Tensor]:
    """One [batch_f, dim] output per feature, of `dtype` (float32, float16 or bfloat16: pooled in
    float32, rounded once); see TfSokFusedLookup. `checked`, `distinct_ids` and `one_id_per_row`
    are for ids tf_sok produced itself (the exchange path's owner side)."""
    if (distinct_ids or one_id_per_row) and (list(feature_table) != list(range(len(handles)))
                                             or set(combiners) != {"sum"} or any(weighted)):
        raise ValueError("fused_lookup: distinct_ids and one_id_per_row need feature t to read table t, summed "
                         "and unweighted")
    result = ops().tf_sok_fused_lookup(
        tables=list(handles), ids=list(ids), row_splits=list(row_splits), weights=list(weights),
        feature_table=list(feature_table), combiners=list(combiners), weighted=list(weighted),
        dims=list(dims), feature_names=list(feature_names), table_names=list(table_names), checked=checked,
        distinct_ids=distinct_ids, one_id_per_row=one_id_per_row, T=tf.as_dtype(dtype))
    return _checked(result, checked, feature_table, feature_names, table_names)


def fused_combine(params: Sequence[tf.Tensor], ids: Sequence[tf.Tensor], row_splits: Sequence[tf.Tensor],
                  weights: Sequence[tf.Tensor], *, feature_table: Sequence[int], combiners: Sequence[str],
                  weighted: Sequence[bool], feature_names: Sequence[str],
                  table_names: Sequence[str], checked: bool = False) -> List[tf.Tensor]:
    """fused_lookup over plain [rows, dim] tensors (e.g. vectors received from other
    ranks). Its gradient with respect to `params` is dense (TfSokFusedCombineGrad)."""
    result = ops().tf_sok_fused_combine(
        params=list(params), ids=list(ids), row_splits=list(row_splits), weights=list(weights),
        feature_table=list(feature_table), combiners=list(combiners), weighted=list(weighted),
        dims=[int(p.shape[1]) for p in params], feature_names=list(feature_names), table_names=list(table_names),
        checked=checked)
    return _checked(result, checked, feature_table, feature_names, table_names)


# What a lookup gradient's rows are by construction, declared by the gradient that makes them
# (promise_rows) and read by the optimizer's update (rows_promise): per graph, by tensor name.
ROW_PROMISES = ("ascending", "checked")
_row_promises = weakref.WeakKeyDictionary()   # graph -> {tensor name: promise}


def promise_rows(rows: tf.Tensor, promise: str) -> tf.Tensor:
    """Declares what the row indices `rows` are by construction: "ascending" (distinct and strictly
    ascending) or "checked" (in their table's range, repeats possible). Kept for tensors of a graph
    (a tf.function's); eager tensors keep none (their update sorts and checks). Returns `rows`.

    Example:
        >>> rows = promise_rows(tf.identity(ids), "ascending")   # in a gradient function
    """
    if promise not in ROW_PROMISES:
        raise ValueError(f"promise_rows: the promise is one of {ROW_PROMISES}, got {promise!r}")
    if not tf.executing_eagerly() and hasattr(rows, "graph"):
        _row_promises.setdefault(rows.graph, {})[rows.name] = promise
    return rows


def rows_promise(rows) -> str:
    """What promise_rows declared about `rows`: "ascending", "checked", or "" (nothing: an eager
    tensor, or rows made otherwise). The update checks the ascending promise (a broken one is an
    error, never a wrong update); for checked rows it only skips a GPU's wait for the verdict.

    Example:
        >>> rows_promise(grad.indices)   # in an optimizer's update
    """
    try:
        graph, name = rows.graph, rows.name
    except (AttributeError, ValueError):
        return ""
    return _row_promises.get(graph, {}).get(name, "")


def _inputs_and_grads(op, out_grads):
    """The op's tables, ids, splits and weights, and an output gradient for every
    feature (zeros where none flows; the status output has none)."""
    T = op.get_attr("num_tables")
    F = op.get_attr("num_features")
    out_grads = out_grads[:F]
    dims = op.get_attr("dims")
    feature_table = op.get_attr("feature_table")
    ins = list(op.inputs)
    tables, ids, splits, weights = ins[:T], ins[T:T + F], ins[T + F:T + 2 * F], ins[T + 2 * F:T + 3 * F]
    dtype = op.outputs[0].dtype   # the pooled outputs' type, and so their gradients'
    grads = []
    for f, g in enumerate(out_grads):
        if g is None:
            g = tf.zeros(tf.stack([tf.shape(splits[f], out_type=tf.int64)[0] - 1,
                                   tf.constant(dims[feature_table[f]], tf.int64)]), dtype)
        grads.append(tf.cast(g, dtype))
    attrs = dict(feature_table=feature_table, combiners=op.get_attr("combiners"),
                 weighted=op.get_attr("weighted"), dims=dims)
    return tables, ids, splits, weights, grads, attrs


def _static_rows(shapes) -> List[int]:
    """The tables' row counts when every one is known (and not empty) while tracing
    (variables carry their shapes), else [] (the gradient then accepts ids up to 2^40):
    known rows let the gradient reject ids past a table and sort shorter keys."""
    rows = []
    for s in shapes:
        value = tf.get_static_value(s)
        if value is None or value[0] <= 0:
            return []
        rows.append(int(value[0]))
    return rows


@tf.RegisterGradient("TfSokFusedLookup")
def _fused_lookup_grad(op, *out_grads):
    """Per table an IndexedSlices of the distinct rows read, padded to a size known before the
    step runs (see TfSokFusedLookupGrad)."""
    tables, ids, splits, weights, grads, attrs = _inputs_and_grads(op, out_grads)
    shape = [resource_variable_ops.variable_shape(h, out_type=tf.int64) for h in tables]
    if op.get_attr("distinct_ids") or op.get_attr("one_id_per_row"):  # each output row: the gradient of its id
        promise = "ascending" if op.get_attr("distinct_ids") else "checked"
        rows = [promise_rows(tf.identity(tf.cast(i, tf.int64)), promise) for i in ids]
        return [tf.IndexedSlices(tf.cast(g, tf.float32), r, dense_shape=s)
                for g, r, s in zip(grads, rows, shape)] + [None] * (3 * len(ids))
    with tf.control_dependencies(_checks_of(op)):
        indices, values = ops().tf_sok_fused_lookup_grad(
            ids=ids, row_splits=splits, weights=weights, output_grads=grads, num_tables=len(tables),
            rows=_static_rows(shape), **attrs)
    return [tf.IndexedSlices(values[t], promise_rows(indices[t], "ascending"), dense_shape=shape[t])
            for t in range(len(tables))] + \
        [None] * (3 * len(ids))


@tf.RegisterGradient("TfSokFusedCombine")
def _fused_combine_grad(op, *out_grads):
    """Dense gradients of the pooled params (on a GPU, no wait on the stream)."""
    params, ids, splits, weights, grads, attrs = _inputs_and_grads(op, out_grads)
    with tf.control_dependencies(_checks_of(op)):
        dense = ops().tf_sok_fused_combine_grad(params=params, ids=ids, row_splits=splits, weights=weights,
                                                output_grads=grads, **attrs)
    return list(dense) + [None] * (3 * len(ids))
