"""The lookup across ranks: each distinct id of the step travels once, by
all-to-all, to the rank owning its row; owners gather (once per distinct row)
from their shards; vectors come back by all-to-all and are combined where the
batch lives.

Backward is TensorFlow's autodiff of the same graph: the all-to-all's gradient
is the reverse all-to-all, so each owner receives the gradients of its rows and
the fused lookup's gradient turns them into one `tf.IndexedSlices` of unique
local rows per table. With sparse_grad_reduction="mean" the gradients reaching
the owners are divided by the number of ranks.

Per-rank traffic depends on the per-rank batch (ids out, vectors back), not on
the number of ranks.
"""
import zlib
from typing import List, Sequence

import tensorflow as tf

from tf_sok.python.comm import Communicator
from tf_sok.python.ops import lookup_ops
from tf_sok.python.variable import TableMeta

_TABLE_SHIFT = 40                       # key = table << 40 | local row
_LOCAL_MASK = (1 << _TABLE_SHIFT) - 1


def signature(metas: Sequence[TableMeta], feature_table, combiners, names) -> int:
    """A number every rank computes alike for the same lookup (crc32 of its description)."""
    text = repr(([(m.name, m.rows, m.dim, str(m.sharding)) for m in metas], list(feature_table),
                 list(combiners), list(names)))
    return zlib.crc32(text.encode())


def _scale_gradient(x, factor: float):
    @tf.custom_gradient
    def f(v):
        return tf.identity(v), lambda dy: dy * factor
    return f(x)


def _check(comm: Communicator, step: int, sig: int, metas, feature_table, ids, names) -> List[tf.Operation]:
    """Gathers every rank's lookup signature and its first bad id per feature,
    and fails on every rank alike (before any exchange) if they disagree or
    any id is outside its table."""
    F = len(ids)
    local = [tf.constant(sig, tf.int64)]
    for f in range(F):
        rows = metas[feature_table[f]].rows
        v = ids[f]
        bad = tf.where((v < 0) | (v >= rows))[:, 0]
        has_bad = tf.size(bad) > 0
        first_bad = tf.concat([tf.gather(v, bad[:1]), tf.constant([-1], tf.int64)], 0)[0]
        local.append(first_bad)
        local.append(tf.cast(has_bad, tf.int64))
    row = tf.stack(local)[None, :]
    every = comm.allgather(row, name=f"tf_sok.check.{step}")            # [N, 1 + 2F]
    asserts = [tf.debugging.Assert(
        tf.reduce_all(tf.equal(every[:, 0], sig)),
        [tf.strings.format("tf_sok lookup: ranks disagree on lookup step {} (different tables, features, "
                           "combiners or order); signatures per rank: {}", (step, every[:, 0]))],
        name="same_lookup_on_all_ranks")]
    for f in range(F):
        flags = every[:, 2 + 2 * f]
        first = tf.argmax(flags)
        meta = metas[feature_table[f]]
        asserts.append(tf.debugging.Assert(
            tf.equal(tf.reduce_max(flags), 0),
            [tf.strings.format(f"tf_sok lookup: feature '{names[f]}' has id {{}} on rank {{}}, outside table "
                               f"'{meta.name}' of {meta.rows} rows; ids must be in [0, {meta.rows})",
                               (every[first, 1 + 2 * f], first))],
            name="ids_in_range"))
    return asserts


def exchanged_lookup(comm: Communicator, handles, metas: Sequence[TableMeta], feature_table: Sequence[int],
                     ids: Sequence[tf.Tensor], splits: Sequence[tf.Tensor], weights: Sequence, combiners,
                     names: Sequence[str], reduction: str, step: int) -> List[tf.Tensor]:
    """The multi-rank lookup_sparse; see the module docstring."""
    N, F, T = comm.size, len(ids), len(metas)
    sig = signature(metas, feature_table, combiners, names)
    with tf.control_dependencies(_check(comm, step, sig, metas, feature_table, ids, names)):
        ids = [tf.identity(v) for v in ids]

    # 1. owner and (table, local row) of every id, all features concatenated
    owners, wire_keys, global_keys, counts = [], [], [], []
    for f in range(F):
        t, v = feature_table[f], ids[f]
        spec = metas[t].sharding
        if spec.kind == "distributed":
            owner, local = v % N, v // N
        else:
            owner, local = tf.fill(tf.shape(v), tf.constant(spec.owner, tf.int64)), v
        tag = tf.bitwise.left_shift(tf.constant(t, tf.int64), _TABLE_SHIFT)
        owners.append(owner)
        wire_keys.append(tf.bitwise.bitwise_or(tag, local))      # what the owner needs
        global_keys.append(tf.bitwise.bitwise_or(tag, v))        # what identifies the row
        counts.append(tf.size(v, out_type=tf.int64))
    # each distinct row travels once per step, however often the batch repeats it
    distinct, req_inv = tf.unique(tf.concat(global_keys, 0))
    first = tf.math.unsorted_segment_min(tf.range(tf.size(req_inv)), req_inv, tf.size(distinct))
    req_owner = tf.gather(tf.concat(owners, 0), first)
    order = tf.argsort(req_owner, stable=True)                   # send buffer in rank order
    send_keys = tf.gather(tf.gather(tf.concat(wire_keys, 0), first), order)
    send_splits = tf.math.bincount(tf.cast(req_owner, tf.int32), minlength=N, maxlength=N)
    recv_keys, recv_splits = comm.alltoall(send_keys, send_splits, name=f"tf_sok.keys.{step}.{sig}")
    recv_splits = tf.cast(recv_splits, tf.int32)

    # 2. owners: gather each distinct requested row once, from every table at once
    uniq, inv = tf.unique(recv_keys)
    u_table = tf.bitwise.right_shift(uniq, _TABLE_SHIFT)
    u_local = tf.bitwise.bitwise_and(uniq, _LOCAL_MASK)
    sel = [tf.where(tf.equal(u_table, t))[:, 0] for t in range(T)]
    per_table_ids = [tf.gather(u_local, s) for s in sel]
    gathered = lookup_ops.fused_lookup(
        handles, per_table_ids,
        [tf.range(tf.size(x, out_type=tf.int64) + 1) for x in per_table_ids],
        [tf.zeros([0], tf.float32)] * T, feature_table=list(range(T)), combiners=["sum"] * T,
        weighted=[False] * T, dims=[m.dim for m in metas], feature_names=[f"{m.name} (owner side)" for m in metas],
        table_names=[m.name for m in metas])
    src_rank = tf.repeat(tf.range(N), recv_splits)
    recv_table = tf.gather(u_table, inv)

    # 3. vectors back, one all-to-all per embedding width
    sorted_table = tf.bitwise.right_shift(send_keys, _TABLE_SHIFT)
    # id position -> its distinct key -> that key's place in the send buffer
    send_position = tf.gather(tf.math.invert_permutation(order), req_inv)
    starts = tf.cumsum(tf.stack(counts), exclusive=True)
    dims = sorted({m.dim for m in metas})
    returned_by_dim, slot_by_dim = [], []
    for dim in dims:
        group = [t for t in range(T) if metas[t].dim == dim]
        u_rows = tf.concat([gathered[t] for t in group], 0)
        u_index = tf.concat([sel[t] for t in group], 0)
        by_unique = tf.scatter_nd(u_index[:, None], u_rows, tf.stack([tf.size(uniq, out_type=tf.int64), dim]))
        in_group = tf.reduce_any(tf.equal(recv_table[:, None], tf.constant(group, tf.int64)[None, :]), axis=1)
        vectors = tf.gather(by_unique, tf.boolean_mask(inv, in_group))
        if reduction == "mean":
            vectors = _scale_gradient(vectors, 1.0 / N)
        back_splits = tf.math.unsorted_segment_sum(tf.cast(in_group, tf.int32), src_rank, N)
        returned, _ = comm.alltoall(vectors, back_splits, name=f"tf_sok.vectors{dim}.{step}.{sig}")
        returned_by_dim.append(returned)
        sent_in_group = tf.reduce_any(tf.equal(sorted_table[:, None], tf.constant(group, tf.int64)[None, :]), axis=1)
        slot_by_dim.append(tf.cumsum(tf.cast(sent_in_group, tf.int64)) - 1)  # send position -> returned row

    # 4. combine where the batch lives: one fused op pools every feature from the received vectors
    rows_of_feature = []
    for f in range(F):
        g = dims.index(metas[feature_table[f]].dim)
        pos = tf.gather(send_position, tf.range(starts[f], starts[f] + counts[f]))
        rows_of_feature.append(tf.gather(slot_by_dim[g], pos))
    weighted = [w is not None for w in weights]
    return lookup_ops.fused_combine(
        returned_by_dim, rows_of_feature, splits,
        [w if w is not None else tf.zeros([0], tf.float32) for w in weights],
        feature_table=[dims.index(metas[feature_table[f]].dim) for f in range(F)], combiners=combiners,
        weighted=weighted, feature_names=names, table_names=[f"vectors of width {d}" for d in dims])
