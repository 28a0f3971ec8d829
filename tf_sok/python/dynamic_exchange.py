"""The lookup of dynamic tables across ranks.

Key k of a "distributed" dynamic table lives on rank floormod(k, N) (SOK's rule,
with negative keys taken to [0, N)); a "localized:r" table lives on rank r. Every
rank sends each of its ids, tagged with its table, to the owner in one all-to-all
of [n, 2] int64 (key, table); owners insert or find the distinct keys of each
table in their shard, read the rows, and return one vector per id received, by
one all-to-all per embedding width; the requester pools them per feature (the
fused combine).

Backward is autodiff of the same graph: pooled gradients flow back through the
combine and the return all-to-all to the owners, where each table's rows get
their gradient as a `tf.IndexedSlices` over the rows read (the sparse optimizers
sum repeats). With sparse_grad_reduction="mean" they are divided by N.
"""
import zlib
from typing import List, Sequence

import tensorflow as tf

from tf_sok.python.comm import Communicator
from tf_sok.python.dynamic_variable import read_tables, rows_for_tables
from tf_sok.python.exchange import _gather_rows, _scale_gradient
from tf_sok.python.lookup import checked_splits_and_rows
from tf_sok.python.ops import lookup_ops
from tf_sok.python.variable import TableMeta, backing_variable


def _positions(mask):
    return tf.reshape(tf.where(mask), [-1])


def _check(comm: Communicator, step: int, metas, feature_table, combiners, names, ids, splits):
    """Fails on every rank alike, before any key moves, when ranks run different dynamic lookups at
    this step (an exchange between them would mix tables or never complete) or a rank's feature
    has malformed row_splits (the owners would insert keys of a batch that then fails)."""
    text = repr(([(m.name, m.dim, str(m.sharding)) for m in metas], list(feature_table), list(combiners), list(names)))
    sig = zlib.crc32(text.encode())
    valid, in_range, bad, bounds = checked_splits_and_rows(metas, feature_table, ids, splits)
    first_bad = tf.argmin(tf.concat([tf.cast(valid, tf.int64), [0]], 0))     # = len(ids) when all valid
    # ids of static tables with a host tier must be rows: the first feature out of range and its id
    ranged = max(bounds) >= 0
    out_feature = tf.argmin(tf.cast(tf.concat([in_range, [False]], 0), tf.int64))   # the last: none out of range
    out_id = tf.gather(tf.concat([bad, [0]], 0), out_feature)
    every = comm.allgather(tf.stack([tf.constant(sig, tf.int64), first_bad, out_feature, out_id])[None, :],
                           name=f"tf_sok.dyncheck.{step}")                    # [N, 4]
    same = tf.debugging.Assert(
        tf.reduce_all(tf.equal(every[:, 0], sig)),
        [tf.strings.format("tf_sok lookup: ranks disagree on the dynamic tables' lookup at step {} (different "
                           "tables, features, combiners or order); signatures per rank: {}", (step, every[:, 0]))],
        name="same_dynamic_lookup_on_all_ranks")
    rank = tf.argmin(every[:, 1])
    feature = tf.gather(tf.constant(list(names) + [""]), tf.minimum(every[rank, 1], len(names)))
    ok = tf.debugging.Assert(
        tf.reduce_all(tf.equal(every[:, 1], len(names))),
        [tf.strings.join(["tf_sok lookup: feature '", feature, "' on rank ", tf.strings.as_string(rank),
                          " has malformed row_splits (they must start at 0, never decrease and end at the "
                          "number of ids)"])], name="valid_row_splits_on_all_ranks")
    if not ranged:
        return [same, ok]
    rank = tf.argmin(every[:, 2])
    f = tf.minimum(every[rank, 2], len(names))
    rows = tf.gather(tf.constant([metas[feature_table[g]].rows for g in range(len(names))] + [0], tf.int64), f)
    table = tf.gather(tf.constant([metas[feature_table[g]].name for g in range(len(names))] + [""]), f)
    within = tf.debugging.Assert(
        tf.reduce_all(tf.equal(every[:, 2], len(names))),
        [tf.strings.join(["tf_sok lookup: feature ", tf.gather(tf.constant(list(names) + [""]), f), " on rank ",
                          tf.strings.as_string(rank), ": id ", tf.strings.as_string(every[rank, 3]),
                          " is outside [0, ", tf.strings.as_string(rows), ") of table ", table])],
        name="ids_within_rows_on_all_ranks")
    return [same, ok, within]


def dynamic_exchanged_lookup(comm: Communicator, tables: Sequence, metas: Sequence[TableMeta],
                             feature_table: Sequence[int], ids: Sequence[tf.Tensor], splits: Sequence[tf.Tensor],
                             weights: Sequence, combiners, names: Sequence[str], reduction: str, step: int,
                             insert_ratio: float = 1.0, training: bool = True) -> List[tf.Tensor]:
    """Pooled [batch, dim] outputs of features whose tables are all dynamic (see the module doc);
    training=False: the owners read their keys without inserting or moving any (read_tables)."""
    N, F, T = comm.size, len(ids), len(metas)
    ids = [tf.cast(v, tf.int64) for v in ids]
    keys = tf.concat(ids, 0)
    counts = [tf.size(v, out_type=tf.int64) for v in ids]
    table_of = tf.concat([tf.fill([c], tf.constant(feature_table[f], tf.int64)) for f, c in enumerate(counts)], 0)
    fixed_owner = tf.constant([-1 if m.sharding.kind == "distributed" else m.sharding.owner for m in metas], tf.int64)
    fixed = tf.gather(fixed_owner, table_of)
    owner = tf.where(fixed >= 0, fixed, tf.math.floormod(keys, N))
    order = tf.argsort(owner, stable=True)
    send = tf.gather(tf.stack([keys, table_of], 1), order)
    send_splits = tf.math.bincount(tf.cast(owner, tf.int32), minlength=N, maxlength=N)
    with tf.control_dependencies(_check(comm, step, metas, feature_table, combiners, names, ids, splits)):
        send = tf.identity(send)
    recv, recv_splits = comm.alltoall(send, send_splits, name=f"tf_sok.dynkeys.{step}")
    r_keys, r_table = recv[:, 0], recv[:, 1]
    src_rank = tf.searchsorted(tf.cumsum(tf.cast(recv_splits, tf.int64)),
                               tf.range(tf.shape(recv, out_type=tf.int64)[0]), side="right")
    s_table = send[:, 1]
    sent_owner = tf.gather(owner, order)

    # owner side: each table's received keys, distinct, found (one find op for all tables)
    received = []
    for t in range(T):
        pos = _positions(tf.equal(r_table, t))
        uniq, back = tf.unique(tf.gather(r_keys, pos), out_idx=tf.int64)
        received.append((pos, uniq, back))
    variables = [backing_variable(tables[t]) for t in range(T)]
    if training:
        found = rows_for_tables(variables, [u for _, u, _ in received], insert_ratio)
    else:
        read = read_tables(variables, [u for _, u, _ in received])
    dims = sorted({m.dim for m in metas})
    returned_by_dim, in_group_position = [], [None] * T
    for dim in dims:
        group = [t for t in range(T) if metas[t].dim == dim]
        member = tf.constant([metas[t].dim == dim for t in range(T)])
        # owner side: the group's received ids in arrival order, one vector each
        in_group = tf.gather(member, r_table)
        place = tf.cumsum(tf.cast(in_group, tf.int64)) - 1
        parts_pos, parts_vec = [], []
        for t in group:
            pos, _, back = received[t]
            parts_pos.append(tf.cast(tf.gather(place, pos), tf.int32))   # dynamic_stitch: int32
            parts_vec.append(_gather_rows(variables[t].sparse_read_rows(found[t]), back) if training
                             else tf.gather(read[t], back))
        vectors = tf.dynamic_stitch(parts_pos, parts_vec) if len(group) > 1 else parts_vec[0]
        vectors = tf.reshape(vectors, [-1, dim])
        if reduction == "mean":
            vectors = _scale_gradient(vectors, 1.0 / N)
        back_splits = tf.math.unsorted_segment_sum(tf.cast(in_group, tf.int32), src_rank, N)
        sent_in_group = tf.gather(member, s_table)
        coming = tf.math.unsorted_segment_sum(tf.cast(sent_in_group, tf.int32), sent_owner, N)
        got, _ = comm.alltoall(vectors, back_splits, name=f"tf_sok.dynvectors{dim}.{step}", recv_splits=coming)
        # requester side: got[i] is the i-th id of the group in send order; lay them out in the order
        # of the group's ids in `keys` (features one after another)
        key_in_group = tf.gather(member, table_of)
        key_place = tf.cumsum(tf.cast(key_in_group, tf.int64)) - 1
        sent_positions = tf.boolean_mask(order, sent_in_group)
        laid = tf.dynamic_stitch([tf.cast(tf.gather(key_place, sent_positions), tf.int32)], [got])
        returned_by_dim.append(tf.reshape(laid, [-1, dim]))
        for t in group:
            in_group_position[t] = key_place
    starts = tf.cumsum(tf.stack(counts), exclusive=True)
    rows_of_feature = []
    for f in range(F):
        place = in_group_position[feature_table[f]]
        rows_of_feature.append(tf.gather(place, tf.range(starts[f], starts[f] + counts[f])))
    weighted = [w is not None for w in weights]
    return lookup_ops.fused_combine(
        returned_by_dim, rows_of_feature, list(splits), [w if w is not None else tf.zeros([0], tf.float32)
                                                         for w in weights],
        feature_table=[dims.index(metas[feature_table[f]].dim) for f in range(F)], combiners=list(combiners),
        weighted=weighted, feature_names=list(names), table_names=[f"vectors of width {d}" for d in dims],
        checked=True)
