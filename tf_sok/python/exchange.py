"""The lookup across ranks: each distinct id of the step travels once, by
all-to-all, to the rank owning its row; owners read the rows from their shards;
vectors come back by all-to-all, one per width of embedding, and are combined
where the batch lives.

Two ways to get there, one result:
- planned (a backend that offers `route_keys`: NCCL): one op checks the ids on
  every rank, moves the keys and lays out the owner side, the return trip and
  the combine, after the step's only wait on the GPU stream. Owners read one row
  per key received (a row two ranks asked for is read twice, at most once per
  rank), so nothing after that op is sized by data the host has not seen;
- routed (Horovod's or tf.distribute's collectives, one process): a check, a
  routing op, the keys' all-to-all, and a routing op on the owner side that
  reads each distinct row once.

Backward is TensorFlow's autodiff of the same graph: the all-to-all's gradient
is the reverse all-to-all, so each owner receives the gradients of its rows and
the owner-side lookup's gradient is them as they are, one `tf.IndexedSlices`
per table (rows distinct and ascending when routed; repeated across senders
when planned, which the update sums). With sparse_grad_reduction="mean" the
gradients reaching the owners are divided by the number of ranks.

Per-rank traffic depends on the per-rank batch (ids out, vectors back), not on
the number of ranks.
"""
import zlib
from typing import List, Sequence

import tensorflow as tf

from tf_sok.python.comm import Communicator, KeyRouting
from tf_sok.python.ops import array_ops, lookup_ops, route_ops
from tf_sok.python.variable import TableMeta

_TABLE_SHIFT = route_ops.TABLE_SHIFT    # key = table << 40 | row
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


def _gather_rows(rows, index):
    """tf.gather(rows, index) with a dense gradient (a segment sum). tf.gather's own
    gradient is an IndexedSlices, and reaching the tf.concat that built `rows` it would
    be split per table by a tf.where each: on a GPU, one wait on the stream per table."""
    @tf.custom_gradient
    def gather(r):
        def grad(dy):
            return tf.math.unsorted_segment_sum(tf.convert_to_tensor(dy), index, tf.shape(r)[0])  # int32: host
        return tf.gather(r, index), grad
    return gather(rows)


def _permute_rows(rows, index, inverse):
    """tf.gather(rows, index) for an index naming every row once (a permutation, whose
    inverse the caller has): the gradient gathers by the inverse, with no zero fill
    and no atomic adds, unlike the segment sum a gather needs in general."""
    @tf.custom_gradient
    def permute(r):
        return tf.gather(r, index), lambda dy: tf.gather(tf.convert_to_tensor(dy), inverse)
    return permute(rows)


def _bucket_of_position(splits, n):
    """For positions 0..n-1 of rows laid out bucket after bucket (splits[b] rows in
    bucket b), the bucket of each: a sorted search, no device-to-host wait."""
    return tf.searchsorted(tf.cumsum(splits), tf.range(n), side="right")


def _flatten(ids):
    """Every feature's ids as one vector, and the feature of each position (by a
    sorted search over the features' ends: unlike tf.repeat, no device-to-host wait)."""
    ends = tf.cumsum(tf.stack([tf.size(v, out_type=tf.int64) for v in ids]))
    flat = tf.concat(ids, 0)
    positions = tf.range(tf.size(flat, out_type=tf.int64))
    return flat, tf.searchsorted(ends, positions, side="right", out_type=tf.int64)


def _check(comm: Communicator, step: int, sig: int, metas, feature_table, ids, names,
           flat_ids=None) -> List[tf.Tensor]:
    """Gathers every rank's lookup signature and its first bad id, and fails on
    every rank alike (before any exchange) if they disagree or any id is outside
    its table. A fixed number of ops whatever the number of features: the ids
    are checked as one concatenated vector against per-position row counts."""
    flat, feature_of = flat_ids if flat_ids is not None else _flatten(ids)
    n = tf.size(flat, out_type=tf.int64)
    rows_of_feature = tf.constant([metas[t].rows for t in feature_table], tf.int64)
    rows = tf.gather(rows_of_feature, feature_of)
    # bad positions score n - position (the first scores highest, no ties), good ones 0
    score = tf.concat([tf.where((flat < 0) | (flat >= rows), n - tf.range(n), 0), [0]], 0)
    first = tf.argmax(score, output_type=tf.int64)
    found = tf.gather(score, first) > 0       # gathers: indexing by a device scalar would wait for it
    local = tf.stack([tf.constant(sig, tf.int64), tf.cast(found, tf.int64),
                      tf.gather(tf.concat([feature_of, [-1]], 0), first), tf.gather(tf.concat([flat, [-1]], 0), first)])
    every = comm.allgather(local[None, :], name=f"tf_sok.check.{step}")            # [N, 4]
    healthy = tf.reduce_all(tf.equal(every[:, 0], sig)) & tf.reduce_all(tf.equal(every[:, 1], 0))

    def explain():  # runs only when something is wrong: the messages cost host work
        same = tf.debugging.Assert(
            tf.reduce_all(tf.equal(every[:, 0], sig)),
            [tf.strings.format("tf_sok lookup: ranks disagree on lookup step {} (different tables, features, "
                               "combiners or order); signatures per rank: {}", (step, every[:, 0]))],
            name="same_lookup_on_all_ranks")
        rank = tf.argmax(every[:, 1])                                  # the first rank with a bad id
        f = every[rank, 2]
        feature_name = tf.gather(tf.constant(list(names)), f)
        table_name = tf.gather(tf.constant([metas[t].name for t in feature_table]), f)
        table_rows = tf.gather(rows_of_feature, f)
        in_range = tf.debugging.Assert(
            tf.equal(tf.reduce_max(every[:, 1]), 0),
            [tf.strings.join(["tf_sok lookup: feature '", feature_name, "' has id ",
                              tf.strings.as_string(every[rank, 3]), " on rank ", tf.strings.as_string(rank),
                              ", outside table '", table_name, "' of ", tf.strings.as_string(table_rows),
                              " rows; ids must be in [0, ", tf.strings.as_string(table_rows), ")"])],
            name="ids_in_range")
        with tf.control_dependencies([same, in_range]):
            return tf.constant(False)

    return [tf.cond(healthy, lambda: tf.constant(True), explain)]


def exchanged_lookup(comm: Communicator, handles, metas: Sequence[TableMeta], feature_table: Sequence[int],
                     ids: Sequence[tf.Tensor], splits: Sequence[tf.Tensor], weights: Sequence, combiners,
                     names: Sequence[str], reduction: str, step: int) -> List[tf.Tensor]:
    """The multi-rank lookup_sparse; see the module docstring."""
    N, F = comm.size, len(ids)
    sig = signature(metas, feature_table, combiners, names)
    dims = sorted({m.dim for m in metas})          # one all-to-all of vectors per embedding width
    group_of_table = [dims.index(m.dim) for m in metas]
    owners = [-1 if m.sharding.kind == "distributed" else m.sharding.owner for m in metas]
    owner_side = dict(handles=handles, metas=metas, reduction=reduction, N=N, step=step, sig=sig, dims=dims)

    # 1-3: the distinct rows (key = table << 40 | global row) to their owners, the owners' lookups, the
    # vectors back. One planning op where the backend offers it (NCCL: one wait for the whole step), else
    # a check, routing on both sides and size arithmetic around the all-to-alls
    plan = comm.route_keys(ids, KeyRouting(
        step=step, signature=sig, feature_table=tuple(feature_table),
        feature_rows=tuple(metas[t].rows for t in feature_table), table_owner=tuple(owners),
        table_group=tuple(group_of_table), num_groups=len(dims), feature_names=tuple(names),
        table_names=tuple(metas[t].name for t in feature_table)))
    if plan is not None:
        returned_by_dim, slot = _planned_exchange(comm, plan, **owner_side)
        rows_of_feature = array_ops.split(slot, [tf.size(v) for v in ids], num=F)
    else:
        returned_by_dim, rows_of_feature = _routed_exchange(comm, ids, feature_table, names, owners, **owner_side)

    # 4. combine where the batch lives: one fused op pools every feature from the received vectors
    # (positions tf_sok computed: no wait for errors; its gradient is dense, with no wait)
    weighted = [w is not None for w in weights]
    return lookup_ops.fused_combine(
        returned_by_dim, rows_of_feature, splits,
        [w if w is not None else tf.zeros([0], tf.float32) for w in weights],
        feature_table=[group_of_table[feature_table[f]] for f in range(F)], combiners=combiners,
        weighted=weighted, feature_names=names, table_names=[f"vectors of width {d}" for d in dims], checked=True)


def _owner_lookup(handles, metas, rows, unit_splits, **modes):
    """Each table's rows looked up one per output row (ids tf_sok checked: no wait)."""
    T = len(metas)
    return lookup_ops.fused_lookup(
        handles, rows, unit_splits, [tf.zeros([0], tf.float32)] * T, feature_table=list(range(T)),
        combiners=["sum"] * T, weighted=[False] * T, dims=[m.dim for m in metas],
        feature_names=[f"{m.name} (owner side)" for m in metas], table_names=[m.name for m in metas], checked=True,
        **modes)


def _return_vectors(comm, rows, index, send, recv, reduction, N, name, inverse=None):
    """The vectors rows[index] to the ranks that asked (send[p] to rank p); `inverse`:
    index is a permutation and this its inverse."""
    vectors = _gather_rows(rows, index) if inverse is None else _permute_rows(rows, index, inverse)
    if reduction == "mean":
        vectors = _scale_gradient(vectors, 1.0 / N)
    return comm.alltoall(vectors, send, name=name, recv_splits=recv)[0]


def _planned_exchange(comm, plan, handles, metas, reduction, N, step, sig, dims):
    """The owner side and the return trip from a backend's plan: sizes all on the host
    already, nothing waits. Every key received is looked up (a row two ranks asked for
    is read twice); its gradient rows repeat alike and the update sums them. Each key
    received is returned once, so the return trip permutes the rows (its gradient:
    the inverse permutation, which the plan carries)."""
    T = len(metas)
    # int32 sizes stay in host memory (TensorFlow keeps int32 on the host): nothing is copied
    gathered = _owner_lookup(handles, metas, array_ops.split(plan.table_rows, plan.table_counts, num=T),
                             array_ops.split(plan.unit_splits, plan.table_counts + 1, num=T), one_id_per_row=True)
    returned = []
    for g, dim in enumerate(dims):
        group = [gathered[t] for t in range(T) if metas[t].dim == dim]
        rows = group[0] if len(group) == 1 else tf.concat(group, 0)
        returned.append(_return_vectors(comm, rows, plan.group_gather[g], plan.group_send[g], plan.group_recv[g],
                                        reduction, N, f"tf_sok.vectors{dim}.{step}.{sig}",
                                        inverse=plan.group_scatter[g]))
    return returned, plan.slot


def _routed_exchange(comm, ids, feature_table, names, owners, handles, metas, reduction, N, step, sig, dims):
    """The same with separate collectives: a check, routing by owner, the keys' all-to-all,
    routing by table on the owner side (one lookup per distinct row), the vectors back."""
    F, T = len(ids), len(metas)
    counts = [tf.size(v) for v in ids]
    flat, feature_of = _flatten(ids)
    with tf.control_dependencies(_check(comm, step, sig, metas, feature_table, ids, names, (flat, feature_of))):
        flat = tf.identity(flat)
    table_bits = tf.constant([t << _TABLE_SHIFT for t in feature_table], tf.int64)
    keys = tf.bitwise.bitwise_or(tf.gather(table_bits, feature_of), flat)
    send_keys, send_splits, send_position, _ = route_ops.route(keys, num_buckets=N, table_owner=owners)
    recv_keys, recv_splits = comm.alltoall(send_keys, send_splits, name=f"tf_sok.keys.{step}.{sig}")
    with tf.device("/cpu:0"):  # split sizes stay in host memory
        recv_splits = tf.cast(recv_splits, tf.int32)

    # owners: the received keys deduplicated across senders and grouped by table (one op), then one
    # fused lookup reads each requested row once; its rows are distinct and ascending per table, so
    # the tables' gradients are its output gradients as they are (no sort). Each table's row splits
    # [0, 1, ..., count] come from the route op, on the device
    uniq, table_splits, uniq_of_recv, unit_splits = route_ops.route(recv_keys, num_buckets=T, table_owner=[0] * T,
                                                                    by_table=True)
    gathered = _owner_lookup(handles, metas,
                             array_ops.split(tf.bitwise.bitwise_and(uniq, _LOCAL_MASK), table_splits, num=T),
                             array_ops.split(unit_splits, table_splits + 1, num=T), distinct_ids=True)

    # vectors back in the order the keys came, one all-to-all per embedding width
    returned_by_dim, slot_by_dim = [], []
    for dim in dims:
        group = [t for t in range(T) if metas[t].dim == dim]
        rows = tf.concat([gathered[t] for t in group], 0)      # the group's distinct keys, table by table
        if len(group) == T:
            index, back_splits, slot = uniq_of_recv, recv_splits, send_position
            coming = send_splits      # each owner returns one vector per key this rank sent it
        else:
            member = tf.constant([t in group for t in range(T)])
            in_group = tf.gather(member, tf.bitwise.right_shift(uniq, _TABLE_SHIFT))
            row_of_uniq = tf.cumsum(tf.cast(in_group, tf.int64)) - 1
            recv_in_group = tf.gather(in_group, uniq_of_recv)
            index = tf.gather(row_of_uniq, tf.boolean_mask(uniq_of_recv, recv_in_group))
            src_rank = _bucket_of_position(recv_splits, tf.size(recv_keys, out_type=tf.int32))
            back_splits = tf.math.unsorted_segment_sum(tf.cast(recv_in_group, tf.int32), src_rank, N)
            sent_in_group = tf.gather(member, tf.bitwise.right_shift(send_keys, _TABLE_SHIFT))
            slot = tf.gather(tf.cumsum(tf.cast(sent_in_group, tf.int64)) - 1, send_position)
            owner_of_sent = _bucket_of_position(send_splits, tf.size(send_keys, out_type=tf.int32))
            coming = tf.math.unsorted_segment_sum(tf.cast(sent_in_group, tf.int32), owner_of_sent, N)
        returned_by_dim.append(_return_vectors(comm, rows, index, back_splits, coming, reduction, N,
                                               f"tf_sok.vectors{dim}.{step}.{sig}"))
        slot_by_dim.append(array_ops.split(slot, counts, num=F))      # per feature: its ids' returned rows
    return returned_by_dim, [slot_by_dim[dims.index(metas[feature_table[f]].dim)][f] for f in range(F)]
