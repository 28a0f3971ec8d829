"""The fused lookup op and its registered gradient (row-sparse per table)."""
from typing import List, Sequence

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from tf_sok.python.ops.loader import ops


def fused_lookup(handles: Sequence[tf.Tensor], ids: Sequence[tf.Tensor], row_splits: Sequence[tf.Tensor],
                 weights: Sequence[tf.Tensor], *, feature_table: Sequence[int], combiners: Sequence[str],
                 weighted: Sequence[bool], dims: Sequence[int], feature_names: Sequence[str],
                 table_names: Sequence[str]) -> List[tf.Tensor]:
    """One [batch_f, dim] output per feature; see TfSokFusedLookup."""
    return ops().tf_sok_fused_lookup(
        tables=list(handles), ids=list(ids), row_splits=list(row_splits), weights=list(weights),
        feature_table=list(feature_table), combiners=list(combiners), weighted=list(weighted),
        dims=list(dims), feature_names=list(feature_names), table_names=list(table_names))


def fused_combine(params: Sequence[tf.Tensor], ids: Sequence[tf.Tensor], row_splits: Sequence[tf.Tensor],
                  weights: Sequence[tf.Tensor], *, feature_table: Sequence[int], combiners: Sequence[str],
                  weighted: Sequence[bool], feature_names: Sequence[str],
                  table_names: Sequence[str]) -> List[tf.Tensor]:
    """fused_lookup over plain [rows, dim] tensors (e.g. vectors received from other ranks)."""
    return ops().tf_sok_fused_combine(
        params=list(params), ids=list(ids), row_splits=list(row_splits), weights=list(weights),
        feature_table=list(feature_table), combiners=list(combiners), weighted=list(weighted),
        dims=[int(p.shape[1]) for p in params], feature_names=list(feature_names), table_names=list(table_names))


def _pooled_grad(op, out_grads, table_shape):
    """Per table an IndexedSlices of the unique rows read, for both pooled ops."""
    T = op.get_attr("num_tables")
    F = op.get_attr("num_features")
    dims = op.get_attr("dims")
    feature_table = op.get_attr("feature_table")
    ids = op.inputs[T:T + F]
    splits = op.inputs[T + F:T + 2 * F]
    weights = op.inputs[T + 2 * F:T + 3 * F]
    grads = []
    for f, g in enumerate(out_grads):
        if g is None:
            g = tf.zeros(tf.stack([tf.shape(splits[f], out_type=tf.int64)[0] - 1,
                                   tf.constant(dims[feature_table[f]], tf.int64)]), tf.float32)
        grads.append(g)
    indices, values = ops().tf_sok_fused_lookup_grad(
        ids=list(ids), row_splits=list(splits), weights=list(weights), output_grads=grads,
        feature_table=feature_table, combiners=op.get_attr("combiners"),
        weighted=op.get_attr("weighted"), dims=dims, num_tables=T)
    table_grads = [tf.IndexedSlices(values[t], indices[t], dense_shape=table_shape(op.inputs[t]))
                   for t in range(T)]
    return table_grads + [None] * (3 * F)


@tf.RegisterGradient("TfSokFusedLookup")
def _fused_lookup_grad(op, *out_grads):
    return _pooled_grad(op, out_grads, lambda h: resource_variable_ops.variable_shape(h, out_type=tf.int64))


@tf.RegisterGradient("TfSokFusedCombine")
def _fused_combine_grad(op, *out_grads):
    # int32 shape: made dense (received vectors' gradient), dense_shape[0] then stays in host memory on a GPU
    return _pooled_grad(op, out_grads, lambda p: tf.shape(p))
