"""Embedding table variables.

`sok.Variable` is a `tf.Variable` (a ResourceVariable) that also carries its
table description and sharding spec. Keras layers of tf_sok create Keras
weights and attach the same description, so both kinds are recognised by
`filter_variables`, `lookup_sparse` and the sparse optimizers.
"""
import contextlib
import dataclasses
import logging
import zlib
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from tf_sok.python import context as context_lib
from tf_sok.python.sharding import ShardingSpec

_META_ATTR = "_tf_sok_table"
_log = logging.getLogger("tf_sok")

# The most per-row state a tf_sok optimizer keeps, in arrays as wide as the table: RMSprop centered
# with momentum keeps three (Adam and Adamax two and a step count, Ftrl and Adadelta two).
MOST_STATE_ARRAYS = 3


@dataclasses.dataclass(frozen=True)
class TableMeta:
    """What tf_sok knows about a table variable."""

    name: str
    rows: int            # global rows
    dim: int
    sharding: ShardingSpec
    local_rows: int      # rows held by this rank
    rank: int = 0        # the rank holding this shard
    num_ranks: int = 1
    dynamic: bool = False  # held by a key index (sok.DynamicVariable): rows = max keys (0: unbounded)
    row_ids: bool = False  # a static table held by a key index (a host tier): ids are rows in [0, rows)
    budget_bytes: int = -1  # a static table made with a device budget that holds it whole (held plainly)

    @property
    def keyed(self) -> bool:
        """Whether ids are keys (any int64, a dynamic table) rather than rows in [0, rows)."""
        return self.dynamic and not self.row_ids


def table_meta(var) -> Optional[TableMeta]:
    """The table description of a tf_sok variable, or None for other variables."""
    if isinstance(var, ReplicaTable):
        return var.meta
    return getattr(var, _META_ATTR, None)


def attach_meta(var, meta: TableMeta) -> None:
    setattr(var, _META_ATTR, meta)


def backing_variable(var) -> tf.Variable:
    """The tf.Variable holding the data (a Keras weight wraps one); for a
    `ReplicaTable`, the current replica's shard."""
    if isinstance(var, ReplicaTable):
        var = var.local()
    return var.value if isinstance(var, keras.Variable) else var


def make_meta(name: str, rows: int, dim: int, mode: str, rank: Optional[int] = None) -> TableMeta:
    """Describes a table's shard on `rank` (default: this process's rank); with
    one rank per process, checks that every rank declares the same table at the
    same point (else ValueError on all)."""
    ctx = context_lib.context()
    context_lib.check_creation_scope(ctx, f"table {name!r}")
    spec = ShardingSpec.parse(mode)
    spec.validate(ctx.num_ranks, name)
    rank = ctx.rank if rank is None else rank
    meta = TableMeta(name, int(rows), int(dim), spec, spec.local_rows(int(rows), rank, ctx.num_ranks), rank,
                     ctx.num_ranks)
    if ctx.num_ranks > 1 and not ctx.communicator.per_replica_tables:
        _check_same_on_all_ranks(ctx, meta)
    return meta


def make_shards(name: str, rows: int, dim: int, mode: str, create: Callable[[TableMeta], Any]):
    """Creates a table's state in this process: `create(meta)` once, or under
    tf.distribute once per local replica (on its device, unmirrored), wrapped
    in a `ReplicaTable`."""
    comm = context_lib.context().communicator
    if not comm.per_replica_tables:
        return create(make_meta(name, rows, dim, mode))
    shards = []
    for rank in comm.local_ranks:
        meta = make_meta(name, rows, dim, mode, rank)
        with comm.placement(rank):
            shards.append(create(meta))
    return ReplicaTable(shards, comm.local_ranks)


def state_placement(var):
    """Where per-row optimizer state of table `var` is created: next to it."""
    comm = context_lib.context().communicator
    if comm.per_replica_tables:
        return comm.placement(table_meta(var).rank)
    return _colocated(backing_variable(var).device)


@contextlib.contextmanager
def _colocated(device):
    with tf.init_scope(), tf.device(device):
        yield


class ReplicaTable(tf.Module):
    """A table under tf.distribute: this process's shards, one per local replica.

    Inside `strategy.run` it stands for the current replica's shard: pass it to
    `sok.lookup_sparse`, `tape.gradient` and the sparse optimizers as you would
    a `sok.Variable`. Its shards (`.shards`) are the variables that
    checkpoints save and `model.trainable_variables` lists; a replica's
    gradient is None for the other replicas' shards.
    """

    def __init__(self, shards: Sequence, ranks: Sequence[int]):
        super().__init__(name=getattr(shards[0], _META_ATTR).name)
        self.shards = list(shards)
        self._ranks = list(ranks)

    def local(self):
        """The current replica's shard (replica context only)."""
        return self.shards[self._ranks.index(context_lib.context().communicator.rank)]

    @property
    def meta(self) -> TableMeta:
        if context_lib.context().communicator.outside_replicas():
            return getattr(self.shards[0], _META_ATTR)
        return getattr(self.local(), _META_ATTR)

    def _should_act_as_resource_variable(self):
        """Lets GradientTape take the table as a source (the local shard's handle)."""

    @property
    def handle(self):
        return backing_variable(self.local()).handle

    @property
    def dtype(self):
        return tf.float32

    @property
    def shape(self):
        return tf.TensorShape([self.meta.rows, self.meta.dim])


def expand_tables(variables: Iterable) -> list:
    """`variables` with each ReplicaTable replaced by its shards (all of them in
    cross-replica context, the current replica's in replica context)."""
    out = []
    for v in variables:
        if isinstance(v, ReplicaTable):
            out.extend(v.shards if context_lib.context().communicator.outside_replicas() else [v.local()])
        else:
            out.append(v)
    return out


def _check_same_on_all_ranks(ctx, meta: TableMeta) -> None:
    desc = repr((meta.name, meta.rows, meta.dim, str(meta.sharding)))
    with tf.init_scope():
        step = ctx.collective_index()
        mine = tf.constant([[zlib.crc32(desc.encode())]], tf.int64)
        every = ctx.communicator.allgather(mine, name=f"tf_sok.table.{step}").numpy()[:, 0]
    if (every != every[ctx.rank]).any():
        differ = [r for r in range(len(every)) if every[r] != every[0]]
        raise ValueError(f"table {meta.name!r}: ranks declare different tables at this point (this rank: "
                         f"{desc}); ranks {differ} differ from rank 0. Every rank must create the same tables, "
                         f"with the same shapes and modes, in the same order")


def local_shard(value, meta: TableMeta):
    """The rows of a global [rows, dim] table value held by `meta`'s shard.

    Example (set a table from a global value, e.g. under tf.distribute):
        >>> for shard in sok.filter_variables(model.variables)[0]:
        ...     shard.assign(sok.local_shard(full_table, sok.table_meta(shard)))
    """
    if meta.sharding.kind == "distributed":
        return value[meta.rank::meta.num_ranks]
    return value if meta.rank == meta.sharding.owner else value[:0]


def shard_row_ids(meta: TableMeta) -> tf.Tensor:
    """The global rows (int64) held by `meta`'s shard, in its local order."""
    if meta.sharding.kind == "distributed":
        return tf.range(meta.rank, meta.rows, meta.num_ranks, dtype=tf.int64)
    return tf.range(meta.rows if meta.rank == meta.sharding.owner else 0, dtype=tf.int64)


class PerRowInitializer:
    """A table's initial rows as a function of the global row id and a seed (as a dynamic table's
    keys, dynamic_index.h's InitialValue): a static table made with a device budget starts at the same
    values whether it has a host tier or its budget holds it whole, on any number of ranks."""

    _CHUNK = 1 << 22   # elements per piece: the draw's 64-bit temporaries stay small for large tables

    def __init__(self, kind: int, a: float, b: float, seed: int):
        self.spec = (kind, a, b, seed)

    def shard(self, meta: TableMeta) -> tf.Tensor:
        """[meta.local_rows, meta.dim] float32: the shard's rows."""
        from tf_sok.python.serving import initial_values

        ids = shard_row_ids(meta)
        step = max(1, self._CHUNK // meta.dim)
        pieces = [initial_values(ids[i:i + step], meta.dim, *self.spec) for i in range(0, meta.local_rows, step)]
        if not pieces:
            return tf.zeros([0, meta.dim], tf.float32)
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0)


def whole_table_budget(name: str, rows: int, dim: int, mode: str, max_hbm_for_vectors) -> int:
    """A static table's device budget (max_hbm_for_vectors, GiB; checked) in bytes where it holds the
    largest shard of the table's rows with the most optimizer state any tf_sok optimizer keeps: then
    the table needs no host tier. -1 where it does not."""
    from tf_sok.python.dynamic_variable import _cache_bytes

    budget = _cache_bytes(name, "hybrid", max_hbm_for_vectors, 0)
    ctx = context_lib.context()
    spec = ShardingSpec.parse(mode)
    spec.validate(ctx.num_ranks, name)
    largest = rows if spec.kind == "localized" else -(-rows // ctx.num_ranks)
    if budget < largest * 4 * dim * (1 + MOST_STATE_ARRAYS):
        return -1
    _log.info("table %r: max_hbm_for_vectors=%s GiB holds its %d x %d rows with any optimizer's state; held in "
              "device memory as a table without a host tier", name, max_hbm_for_vectors, rows, dim)
    return budget


def per_row_initializer(initializer, name: str) -> PerRowInitializer:
    """A static table's per-row initializer (what a host tier draws; checked), seeded by its name, so
    that two tables of one model start apart and every rank agrees."""
    from tf_sok.python.dynamic_variable import _initializer_spec, initializer_kind

    kind, a, b = _initializer_spec(initializer, name)
    return PerRowInitializer(initializer_kind(kind), a, b, zlib.crc32(name.encode()))


def make_initializer(initializer: Any):
    """A callable(shape, dtype) from a Keras initializer spec or a callable."""
    if callable(initializer) and not isinstance(initializer, str):
        return initializer
    return keras.initializers.get(initializer)


def _table_shape(shape, name) -> List[int]:
    """[rows, dim] of positive Python / NumPy integers (not bools or floats), else ValueError/TypeError."""
    if shape is None or isinstance(shape, str) or len(shape) != 2:
        raise ValueError(f"sok.Variable {name!r}: give initial_value or a 2-D shape [rows, dim], got {shape!r}")
    out = []
    for what, v in zip(("rows", "dim"), shape):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"sok.Variable {name!r}: {what} must be an integer, got {v!r} in shape {list(shape)}")
        if v < 1:
            raise ValueError(f"sok.Variable {name!r}: {what} must be >= 1, got {v} in shape {list(shape)}")
        out.append(int(v))
    return out


class Variable(resource_variable_ops.ResourceVariable):
    """An embedding table: a `tf.Variable` that knows its sharding.

    Example:
        >>> v = sok.Variable(shape=[1000, 16], initializer="uniform")
        >>> v.shape
        TensorShape([1000, 16])

    Args:
      initial_value: the global table ([rows, dim]); or give `shape` and `initializer`.
      shape: global [rows, dim] when no initial_value is given.
      initializer: Keras initializer (name, instance or callable(shape, dtype)).
      dtype: tf.float32 (the kernels' storage type).
      mode: "distributed" (row-wise round robin) or "localized:<rank>".
      name: the table's name, used in error messages and checkpoints.
      max_hbm_for_vectors: a host tier for a table larger than device memory (GiB of device memory
        for cached rows, values and optimizer state together, as `sok.DynamicVariable`'s): every row
        lives in host memory (pinned, on a GPU) and the rows a step uses are cached on the device.
        The call then returns a `sok.DynamicVariable` keyed by row id, ids outside [0, rows) being
        errors as for any static table; `initializer` is drawn per row (as a DynamicVariable's:
        "uniform", "normal", "truncated_normal", constants, or the Keras initializers of those), or
        `initial_value` is copied to host memory whole. Where the budget holds every row of the
        table's largest shard with the most optimizer state any tf_sok optimizer keeps (rows x dim x
        16 bytes: values and three state arrays), the table needs no tier: the call returns a plain
        `sok.Variable` in device memory, started at the same per-row values.
    In one process the variable holds the whole table; with N ranks it holds
    this rank's shard (rank r: global rows r, r+N, r+2N, ... under
    "distributed"; all rows on rank k and none elsewhere under "localized:k").
    Every rank must create the same tables in the same order (checked).
    Under tf.distribute (sok.init() inside strategy.scope()) the call returns
    a `ReplicaTable`: one such shard per local replica, each on its device.
    """

    @classmethod
    def _variable_call(cls, initial_value=None, _meta=None, **kwargs):
        """A table with a host tier (max_hbm_for_vectors); under tf.distribute: one shard per local
        replica, as a ReplicaTable."""
        if kwargs.get("max_hbm_for_vectors") is not None:
            return _host_tier_table(cls, initial_value, **kwargs)
        kwargs.pop("max_hbm_for_vectors", None)
        if _meta is not None or not context_lib.context().communicator.per_replica_tables:
            return None
        value, global_shape = cls._global_value(initial_value, kwargs.get("shape"), kwargs.get("dtype", tf.float32),
                                                kwargs.get("name"))
        name = kwargs.pop("name", None) or "sok_table"
        return make_shards(name, global_shape[0], global_shape[1], kwargs.pop("mode", "distributed"),
                           lambda meta: cls(value, name=f"{name}_replica{meta.rank}", _meta=meta, **kwargs))

    @staticmethod
    def _global_value(initial_value, shape, dtype, name):
        if tf.as_dtype(dtype) != tf.float32:
            raise ValueError(f"sok.Variable {name!r}: only float32 tables are supported, got {dtype}")
        if initial_value is None:
            return None, _table_shape(shape, name)
        if callable(initial_value):
            initial_value = initial_value()
        initial_value = tf.convert_to_tensor(initial_value, dtype=tf.float32)
        if initial_value.shape.rank != 2 or min(initial_value.shape.as_list()) < 1:
            raise ValueError(f"sok.Variable {name!r}: initial_value must be [rows >= 1, dim >= 1], "
                             f"got shape {initial_value.shape}")
        if shape is not None and _table_shape(shape, name) != initial_value.shape.as_list():
            raise ValueError(f"sok.Variable {name!r}: shape={list(shape)} conflicts with initial_value's shape "
                             f"{initial_value.shape.as_list()}")
        return initial_value, initial_value.shape.as_list()

    def __init__(self, initial_value=None, *, shape=None, initializer="uniform", dtype=tf.float32,
                 mode: str = "distributed", name: Optional[str] = None, trainable: bool = True,
                 max_hbm_for_vectors: Optional[float] = None, _meta: Optional[TableMeta] = None,
                 _budget_bytes: int = -1):
        initial_value, global_shape = self._global_value(initial_value, shape, dtype, name)
        table_name = name or "sok_table"
        meta = _meta or make_meta(table_name, global_shape[0], global_shape[1], mode)
        meta = dataclasses.replace(meta, budget_bytes=_budget_bytes)
        local_shape = [meta.local_rows, global_shape[1]]
        if isinstance(initializer, PerRowInitializer) and initial_value is None:
            value = lambda: initializer.shard(meta)   # noqa: E731
        elif initial_value is None:
            init = make_initializer(initializer)

            def value():
                v = tf.convert_to_tensor(init(local_shape, tf.float32), tf.float32)
                if v.shape.as_list() != local_shape:
                    raise ValueError(f"sok.Variable {table_name!r}: the initializer returned shape {v.shape}, "
                                     f"expected {local_shape}")
                return v
        else:
            value = local_shard(initial_value, meta)
        super().__init__(initial_value=value, dtype=tf.float32, name=table_name, trainable=trainable)
        attach_meta(self, meta)

    @property
    def table(self) -> TableMeta:
        return table_meta(self)


def _host_tier_table(cls, initial_value=None, *, shape=None, initializer="uniform", dtype=tf.float32,
                     mode: str = "distributed", name: Optional[str] = None, trainable: bool = True,
                     max_hbm_for_vectors=None):
    """sok.Variable(..., max_hbm_for_vectors=...): a hybrid DynamicVariable whose keys are the rows, or
    a plain table where the budget holds it whole."""
    from tf_sok.python.dynamic_variable import DynamicVariable

    value, (rows, dim) = cls._global_value(initial_value, shape, dtype, name)
    name = name or "sok_table"
    per_row = None if value is not None else per_row_initializer(initializer, name)
    budget = whole_table_budget(name, rows, dim, mode, max_hbm_for_vectors)
    if budget >= 0:
        return cls(value, shape=[rows, dim], initializer=per_row, mode=mode, name=name, trainable=trainable,
                   _budget_bytes=budget)
    table = DynamicVariable(dim, initializer=initializer if value is None else "zeros", var_type="hybrid",
                            max_hbm_for_vectors=max_hbm_for_vectors, name=name, trainable=trainable, mode=mode,
                            seed=zlib.crc32(name.encode()), _rows=rows)
    if value is not None:
        for shard in ([table] if not isinstance(table, ReplicaTable) else table.shards):
            meta = table_meta(shard)
            if meta.local_rows:
                shard.set_rows(shard_row_ids(meta), local_shard(value, meta))
    return table


def filter_variables(variables: Iterable) -> Tuple[list, list]:
    """Splits variables into (tf_sok tables, everything else).

    Example:
        >>> sok_vars, dense_vars = sok.filter_variables(model.trainable_variables)
    """
    sok_vars, other = [], []
    for v in variables:
        (sok_vars if table_meta(v) is not None else other).append(v)
    return sok_vars, other


def broadcast_variables(variables: Iterable, root: int = 0) -> None:
    """Sets every variable to rank `root`'s value (no-op in one process).

    Example (custom training loop, after the first step built the model):
        >>> sok_vars, dense_vars = sok.filter_variables(model.variables)
        >>> sok.broadcast_variables(dense_vars)
    """
    unready = broadcast_ready_variables(variables, root)
    if unready:
        v = unready[0][1]
        raise ValueError(f"broadcast_variables: {v.name} {list(v.shape)} has no value yet (made inside a traced "
                         f"function, e.g. a model first built inside model.fit, and initialised when it runs); "
                         f"broadcast after the first step, or build the model before, e.g. by calling it on a "
                         f"batch")


def _value_now(v):
    """v's value as the program runs now (eagerly), or None where it has none yet: a variable made
    inside a traced function is initialised when that function first runs."""
    try:
        value = tf.convert_to_tensor(v)
    except (tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError):
        return None
    return value if value.shape == v.shape else None


def broadcast_ready_variables(variables: Iterable, root: int = 0) -> list:
    """broadcast_variables for the variables that have a value now; returns (position, variable) of
    those that do not, for `broadcast_in_graph` in the function that initialises them."""
    ctx = context_lib.context()
    if ctx.communicator.mirrors_dense_variables:
        return []
    unready = []
    with tf.init_scope():
        for i, v in enumerate(variables):
            if table_meta(v) is not None:
                raise ValueError(f"broadcast_variables: {v.name} is a sharded tf_sok table; broadcast dense "
                                 f"variables only")
            value = _value_now(v)
            if value is None:
                unready.append((i, v))
                continue
            v.assign(ctx.communicator.broadcast(value, root, name=f"tf_sok.broadcast.{i}"))
    return unready


def broadcast_in_graph(pairs, root: int = 0) -> list:
    """Assignments of rank `root`'s values to the (position, variable) pairs, as ops of the
    function being traced."""
    comm = context_lib.context().communicator
    return [v.assign(comm.broadcast(tf.convert_to_tensor(v), root, name=f"tf_sok.broadcast.{i}"))
            for i, v in pairs]
