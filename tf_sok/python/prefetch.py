"""Prefetch: the next batch's rows brought into hybrid tables' device caches while a step runs.

A hybrid table (a host tier with a device cache of hot rows) reads the rows its cache lacks from
host memory in the step that needs them. The input pipeline knows the next batch while this one
trains: `sok.prefetch(tables, next_ids)` in the step takes the rows of those ids that the tables'
host tiers hold into their caches — on a GPU on a CUDA stream of its own, beside the step's
compute — so that the next step's lookup finds them cached. It never changes a value: it only
moves rows, as the next lookup would have, evicting rows no lookup since the last prefetch used
(a step that ran since may still be updating its rows). Keys a table has never held are left to
the lookup (admission, the low-frequency filter and initial values stay where they were), as are
tables without a tier and tiers bounded by `max_capacity` (whose drop order follows the cache's).
"""
from typing import Sequence

import tensorflow as tf

from tf_sok.python.ops.loader import ops
from tf_sok.python.variable import backing_variable, table_meta


def _flat_ids(ids, what: str) -> tf.Tensor:
    if isinstance(ids, (tuple, list)) and len(ids) == 2:   # a (values, row_splits) pair, as lookup_sparse takes
        ids = ids[0]
    if isinstance(ids, tf.RaggedTensor):
        ids = ids.flat_values
    elif isinstance(ids, tf.SparseTensor):
        ids = ids.values
    ids = tf.convert_to_tensor(ids)
    if ids.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"sok.prefetch: the ids of {what} must be int32 or int64, got {ids.dtype.name}")
    return tf.reshape(tf.cast(ids, tf.int64), [-1])


def _local_keys(meta, keys: tf.Tensor) -> tf.Tensor:
    """The keys this process's shard holds: key k of a distributed table lives on rank floormod(k, N)."""
    if meta.num_ranks <= 1:
        return keys
    if meta.sharding.kind != "distributed":
        return keys if meta.sharding.owner == meta.rank else keys[:0]
    return tf.boolean_mask(keys, tf.equal(tf.math.floormod(keys, meta.num_ranks), meta.rank))


def prefetch(variables: Sequence, ids: Sequence) -> tf.Tensor:
    """Brings the rows of `ids` (a later batch's) into the device caches of hybrid tables.

    Call it in a training step with the next batch's ids, after the step's lookup: the moves
    overlap the rest of the step, and the next step's lookup finds the rows cached. Results do not
    change (it moves rows, never values); tables without a host tier are passed over. With several
    ranks each rank prefetches the keys of its own ids that its shard holds. In `model.fit`:
    `sok.keras.loop_on_host(model, prefetch=fn)`, fn calling this on each next batch.

    Example:
        >>> @tf.function
        ... def step(ids, next_ids):
        ...     with tf.GradientTape() as tape:
        ...         loss = tf.reduce_sum(sok.lookup_sparse(tables, ids, combiners="sum")[0])
        ...     sok.prefetch(tables, next_ids)
        ...     opt.apply_gradients(zip(tape.gradient(loss, tables), tables))

    Args:
      variables: the tables (sok.DynamicVariable, sok.Variable, their Keras weights or ReplicaTables).
      ids: per table, its ids (a Tensor, RaggedTensor, SparseTensor or (values, row_splits) pair of
        int32 / int64). A table given several times (features sharing it) prefetches all their ids.
    Returns:
      int64 [len(variables)]: per table, the keys taken into its cache (at its first place; 0 at the others).
    """
    from tf_sok.python.dynamic_variable import DynamicVariable
    variables, ids = list(variables), list(ids)
    if len(variables) != len(ids):
        raise ValueError(f"sok.prefetch: {len(variables)} tables and {len(ids)} id lists; give one per table")
    tables = {}   # id(table) -> (first place, table, its key lists): a table once per op
    for i, var in enumerate(variables):
        meta = table_meta(var)
        if meta is None:
            raise TypeError(f"sok.prefetch: {getattr(var, 'name', var)!r} is not a tf_sok table")
        v = backing_variable(var)
        keys = _flat_ids(ids[i], repr(meta.name))
        if isinstance(v, DynamicVariable) and v.hybrid:
            tables.setdefault(id(v), (i, v, []))[2].append(_local_keys(meta, keys))
    by_device = {}
    for i, v, keys in tables.values():
        by_device.setdefault(v._index_device, []).append((i, v, keys[0] if len(keys) == 1 else tf.concat(keys, 0)))
    counts = [tf.constant(0, tf.int64)] * len(variables)
    for device, members in by_device.items():
        with tf.device(device):
            taken = ops().tf_sok_dynamic_prefetch([v._index.resource_handle for _, v, _ in members],
                                                  [k for _, _, k in members])
        for j, (i, _, _) in enumerate(members):
            counts[i] = taken[j]
    return tf.stack(counts)
