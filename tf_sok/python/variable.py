"""Embedding table variables.

`sok.Variable` is a `tf.Variable` (a ResourceVariable) that also carries its
table description and sharding spec. Keras layers of tf_sok create Keras
weights and attach the same description, so both kinds are recognised by
`filter_variables`, `lookup_sparse` and the sparse optimizers.
"""
import dataclasses
import zlib
from typing import Any, Iterable, Optional, Tuple

import keras
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from tf_sok.python import context as context_lib
from tf_sok.python.sharding import ShardingSpec

_META_ATTR = "_tf_sok_table"


@dataclasses.dataclass(frozen=True)
class TableMeta:
    """What tf_sok knows about a table variable."""

    name: str
    rows: int            # global rows
    dim: int
    sharding: ShardingSpec
    local_rows: int      # rows held by this rank


def table_meta(var) -> Optional[TableMeta]:
    """The table description of a tf_sok variable, or None for other variables."""
    return getattr(var, _META_ATTR, None)


def attach_meta(var, meta: TableMeta) -> None:
    setattr(var, _META_ATTR, meta)


def backing_variable(var) -> tf.Variable:
    """The tf.Variable holding the data (a Keras weight wraps one)."""
    return var.value if isinstance(var, keras.Variable) else var


def make_meta(name: str, rows: int, dim: int, mode: str) -> TableMeta:
    """Describes a table for this rank; with several ranks, checks that every
    rank declares the same table at the same point (else ValueError on all)."""
    ctx = context_lib.context()
    spec = ShardingSpec.parse(mode)
    spec.validate(ctx.num_ranks, name)
    meta = TableMeta(name, int(rows), int(dim), spec, spec.local_rows(int(rows), ctx.rank, ctx.num_ranks))
    if ctx.num_ranks > 1:
        _check_same_on_all_ranks(ctx, meta)
    return meta


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


def local_shard(value: tf.Tensor, meta: TableMeta) -> tf.Tensor:
    """This rank's rows of a global [rows, dim] table value."""
    ctx = context_lib.context()
    if meta.sharding.kind == "distributed":
        return value[ctx.rank::ctx.num_ranks]
    return value if ctx.rank == meta.sharding.owner else value[:0]


def make_initializer(initializer: Any):
    """A callable(shape, dtype) from a Keras initializer spec or a callable."""
    if callable(initializer) and not isinstance(initializer, str):
        return initializer
    return keras.initializers.get(initializer)


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
    In one process the variable holds the whole table; with N ranks it holds
    this rank's shard (rank r: global rows r, r+N, r+2N, ... under
    "distributed"; all rows on rank k and none elsewhere under "localized:k").
    Every rank must create the same tables in the same order (checked).
    """

    def __init__(self, initial_value=None, *, shape=None, initializer="uniform", dtype=tf.float32,
                 mode: str = "distributed", name: Optional[str] = None, trainable: bool = True):
        if tf.as_dtype(dtype) != tf.float32:
            raise ValueError(f"sok.Variable {name!r}: only float32 tables are supported, got {dtype}")
        if initial_value is None:
            if shape is None or len(shape) != 2:
                raise ValueError(f"sok.Variable {name!r}: give initial_value or a 2-D shape [rows, dim]")
            global_shape = [int(shape[0]), int(shape[1])]
        else:
            if callable(initial_value):
                initial_value = initial_value()
            initial_value = tf.convert_to_tensor(initial_value, dtype=tf.float32)
            if initial_value.shape.rank != 2:
                raise ValueError(f"sok.Variable {name!r}: initial_value must be [rows, dim], "
                                 f"got shape {initial_value.shape}")
            global_shape = initial_value.shape.as_list()
        table_name = name or "sok_table"
        meta = make_meta(table_name, global_shape[0], global_shape[1], mode)
        local_shape = [meta.local_rows, global_shape[1]]
        if initial_value is None:
            init = make_initializer(initializer)
            value = lambda: tf.convert_to_tensor(init(local_shape, tf.float32), tf.float32)  # noqa: E731
        else:
            value = local_shard(initial_value, meta)
        super().__init__(initial_value=value, dtype=tf.float32, name=table_name, trainable=trainable)
        attach_meta(self, meta)

    @property
    def table(self) -> TableMeta:
        return table_meta(self)


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
    ctx = context_lib.context()
    if ctx.num_ranks == 1:
        return
    with tf.init_scope():
        for i, v in enumerate(variables):
            if table_meta(v) is not None:
                raise ValueError(f"broadcast_variables: {v.name} is a sharded tf_sok table; broadcast dense "
                                 f"variables only")
            v.assign(ctx.communicator.broadcast(tf.convert_to_tensor(v), root, name=f"tf_sok.broadcast.{i}"))
