"""Keras layers over tf_sok tables. They describe tables; the lookup is the
fused `sok.lookup_sparse` and placement comes from each table's mode."""
import dataclasses
from typing import Dict, Mapping, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_sok.python import context as context_lib
from tf_sok.python.config import TableConfig, check_combiner
from tf_sok.python.lookup import lookup_sparse, ragged_pair
from tf_sok.python.serving import serving_lookup, serving_tables_of
from tf_sok.python.variable import (attach_meta, make_initializer, make_shards, per_row_initializer, table_meta,
                                    whole_table_budget)


class _DynamicWeight(keras.Variable):
    """A Keras weight whose value is a `sok.DynamicVariable`: Keras tracks it (trainable_variables,
    model.fit's gradients) and checkpoints save its key index with it. Its Keras shape is the
    capacity the table started with; the table grows past it."""

    def __init__(self, table, **kwargs):
        self._dynamic = table
        super().__init__(initializer="zeros", shape=(1, table.dimension), dtype="float32", **kwargs)

    def _initialize(self, value):
        self._value = self._dynamic

    @property
    def shape(self):
        return self._dynamic.shape

    def _trackable_children(self, *args, **kwargs):
        return {**super()._trackable_children(*args, **kwargs), "tf_sok_index": self._dynamic._index}


class _TableLayer(keras.layers.Layer):
    """Saves dynamic tables with their keys in Keras weight files (`save_weights`, `.keras`):
    a dynamic table's entry holds its value rows, and entries `<i>:<part>` its key index."""

    def save_own_variables(self, store):
        super().save_own_variables(store)
        for i, v in enumerate(self._trainable_variables + self._non_trainable_variables):
            if isinstance(v, _DynamicWeight):
                for part, value in v._dynamic._index._serialize_to_tensors().items():  # noqa: SLF001
                    store[f"{i}:{part}"] = value.numpy()

    def load_own_variables(self, store):
        weights = self._trainable_variables + self._non_trainable_variables
        plain = {k: store[k] for k in store.keys() if ":" not in k}
        for i, v in enumerate(weights):
            if str(i) not in plain:
                raise ValueError(f"layer {self.name!r}: the weights file has {len(plain)} variables, the layer "
                                 f"{len(weights)}")
            keyed = any(k.startswith(f"{i}:") for k in store.keys())
            if isinstance(v, _DynamicWeight):
                parts = {k.split(":", 1)[1]: store[k] for k in store.keys() if k.startswith(f"{i}:")}
                if not parts:
                    kind = "has a host tier" if v._dynamic.table.row_ids else "is dynamic"  # noqa: SLF001
                    raise ValueError(f"layer {self.name!r}: table {v.name!r} {kind} but the weights file holds a "
                                     f"plain array for it, no key index (saved from a table without one?); move "
                                     f"rows between the kinds with sok.dump / sok.load")
                v._dynamic._index._restore_from_tensors({k: tf.constant(x) for k, x in parts.items()})  # noqa: SLF001
                _assign_rows(v._dynamic, plain[str(i)])  # noqa: SLF001
            elif keyed and table_meta(v) is not None:
                raise ValueError(f"layer {self.name!r}: table {v.name!r} is a plain static table but the weights file "
                                 f"holds a key index for it (saved from a dynamic table or one with a host tier, "
                                 f"max_hbm_for_vectors); move rows between the kinds with sok.dump / sok.load")
            else:
                v.assign(plain[str(i)])


def _initializer_config(init):
    """A table's initializer as config: names and numbers as they are, Keras initializers serialised."""
    if init is None or isinstance(init, (str, int, float)):
        return init
    if isinstance(init, keras.initializers.Initializer):
        return keras.initializers.serialize(init)
    raise ValueError(f"a table initializer given as {type(init).__name__} cannot be saved in a config; use a "
                     f"name, a number or a keras.initializers.Initializer")


def _initializer_from_config(init):
    return keras.initializers.deserialize(init) if isinstance(init, dict) else init


def _assign_rows(var, value):
    """Sets a [None, dim] table array to `value` of any row count."""
    var.assign(tf.convert_to_tensor(value, tf.float32), read_value=False)


def _add_dynamic_table(layer: keras.layers.Layer, cfg: TableConfig):
    """A dynamic table's weight, or a static table's with a host tier (held the same way)."""
    from tf_sok.python.dynamic_variable import DynamicVariable
    from tf_sok.python.variable import Variable

    if not cfg.dynamic:
        table = Variable(shape=[cfg.vocab_size, cfg.dim], initializer=cfg.initializer, name=cfg.name, mode=cfg.mode,
                         max_hbm_for_vectors=cfg.max_hbm_for_vectors)
    else:
        table = DynamicVariable(cfg.dim, initializer=cfg.initializer, name=cfg.name, mode=cfg.mode,
                                init_capacity=cfg.vocab_size, max_capacity=cfg.max_capacity,
                                evict_strategy=cfg.evict_strategy, min_frequency=cfg.min_frequency, seed=cfg.seed,
                                max_hbm_for_vectors=cfg.max_hbm_for_vectors,
                                var_type="hybrid" if cfg.max_hbm_for_vectors is not None else None)
    with keras.name_scope(layer.name, caller=layer):
        weight = _DynamicWeight(table, trainable=True, autocast=False, name=cfg.name)
    layer._track_variable(weight)  # noqa: SLF001 (what add_weight does)
    attach_meta(weight, table.table)
    return weight


def _add_table(layer: keras.layers.Layer, cfg: TableConfig):
    """The table's weight: this rank's shard, or under tf.distribute one
    weight per local replica (a ReplicaTable)."""
    budget = -1
    if cfg.max_hbm_for_vectors is not None and not cfg.dynamic:
        per_row = per_row_initializer(cfg.initializer, cfg.name)
        budget = whole_table_budget(cfg.name, cfg.vocab_size, cfg.dim, cfg.mode, cfg.max_hbm_for_vectors)
    if cfg.dynamic or (cfg.max_hbm_for_vectors is not None and budget < 0):
        return _add_dynamic_table(layer, cfg)
    per_replica = context_lib.context().communicator.per_replica_tables
    # a budget that holds the table: the rows a host tier would start at (its initializer names: "0.5")
    init = make_initializer(cfg.initializer) if budget < 0 else None

    def create(meta):
        name = f"{cfg.name}_replica{meta.rank}" if per_replica else cfg.name
        start = init or (lambda shape, dtype=None: per_row.shard(meta))
        weight = layer.add_weight(shape=(meta.local_rows, cfg.dim), initializer=start, name=name,
                                  trainable=True, dtype="float32", autocast=False)
        attach_meta(weight, dataclasses.replace(meta, budget_bytes=budget))
        return weight
    return make_shards(cfg.name, cfg.vocab_size, cfg.dim, cfg.mode, create)


@keras.saving.register_keras_serializable(package="tf_sok")
class Embedding(_TableLayer):
    """One table, one feature: ragged/sparse/dense ids (or a ragged feature's (values, row_splits)
    pair) -> [batch, dim].

    Example:
        >>> emb = sok.layers.Embedding(10_000, 16, combiner="mean")
        >>> emb(tf.ragged.constant([[1, 5], [7]], dtype=tf.int64)).shape
        TensorShape([2, 16])
    """

    def __init__(self, vocab_size: int, dim: int, combiner: str = "mean", initializer="uniform",
                 mode: str = "distributed", name: Optional[str] = None, dynamic: bool = False,
                 max_capacity: Optional[int] = None, evict_strategy: Optional[str] = None, min_frequency: int = 1,
                 max_hbm_for_vectors: Optional[float] = None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.supports_jit = False  # the fused ops have no XLA kernels: Keras' jit_compile="auto" must not pick XLA
        self.combiner = combiner   # None: a sequence feature ([batch, (ids), dim] ragged)
        self.config = TableConfig(name=(name or "embedding").replace("/", "_"), vocab_size=vocab_size, dim=dim,
                                  combiner=combiner or "sum", initializer=initializer, mode=mode, dynamic=dynamic,
                                  max_capacity=max_capacity, evict_strategy=evict_strategy,
                                  min_frequency=min_frequency, max_hbm_for_vectors=max_hbm_for_vectors)
        self.table = _add_table(self, self.config)

    def call(self, ids, weights=None, training=None):
        ids, weights = ragged_pair(ids), ragged_pair(weights)
        serving = serving_tables_of(self)
        if serving is not None:   # being exported (sok.export_saved_model): stock TensorFlow ops
            return serving_lookup(serving[self.config.name], ids, weights, self.combiner, self.compute_dtype)
        # outputs in the compute dtype (bfloat16/float16 under a Keras mixed policy) straight from the
        # kernel; tables, their gradients' rows and optimizer state stay float32
        # (evaluate / predict pass training=False: dynamic tables are read, not changed)
        return lookup_sparse([self.table], [ids], None if weights is None else [weights],
                             combiners=[self.combiner], feature_names=[self.name], dtype=self.compute_dtype,
                             training=training is not False)[0]

    def get_config(self):
        c = self.config
        return {**super().get_config(), "vocab_size": c.vocab_size, "dim": c.dim, "combiner": self.combiner,
                "initializer": _initializer_config(c.initializer), "mode": c.mode, "dynamic": c.dynamic,
                "max_capacity": c.max_capacity, "evict_strategy": c.evict_strategy,
                "min_frequency": c.min_frequency, "max_hbm_for_vectors": c.max_hbm_for_vectors}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["initializer"] = _initializer_from_config(config.get("initializer", "uniform"))
        return cls(**config)


@keras.saving.register_keras_serializable(package="tf_sok")
class EmbeddingCollection(_TableLayer):
    """Many features over many tables in ONE fused lookup.

    Args:
      tables: the tables (`sok.TableConfig`).
      feature_to_table: feature name -> table name (several features may share a table).
      combiners: optional feature name -> combiner (default: the table's combiner); None makes
        the feature a sequence: its output is [batch, (ids), dim] ragged (TorchRec's
        EmbeddingCollection; the pooled features are its EmbeddingBagCollection).
    call(inputs): a dict feature -> ids (ragged, a (values, row_splits) pair, sparse or dense), optionally
    `weights=` a dict of the same structure; returns a dict feature -> [batch, dim].

    Example:
        >>> coll = sok.layers.EmbeddingCollection(
        ...     tables=[sok.TableConfig("item", 100_000, 32), sok.TableConfig("user", 5_000, 16)],
        ...     feature_to_table={"clicked": "item", "viewed": "item", "user": "user"})
        >>> out = coll({"clicked": c, "viewed": v, "user": u})
    """

    def __init__(self, tables: Sequence[TableConfig], feature_to_table: Mapping[str, str],
                 combiners: Optional[Mapping[str, str]] = None, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False  # see Embedding
        by_name: Dict[str, TableConfig] = {}
        for t in tables:
            if t.name in by_name:
                raise ValueError(f"EmbeddingCollection: table {t.name!r} is defined twice")
            by_name[t.name] = t
        unknown = {f: t for f, t in feature_to_table.items() if t not in by_name}
        if unknown:
            raise ValueError(f"EmbeddingCollection: features map to unknown tables: {unknown}")
        combiners = dict(combiners or {})
        extra = set(combiners) - set(feature_to_table)
        if extra:
            raise ValueError(f"EmbeddingCollection: combiners given for unknown features {sorted(extra)}")
        self.table_configs = list(tables)
        self.feature_to_table = dict(feature_to_table)
        self.feature_names = list(feature_to_table)
        # a feature given combiner None is a sequence feature ([batch, (ids), dim] ragged)
        self.combiners = [combiners[f] if f in combiners and combiners[f] is None else
                          check_combiner(combiners.get(f, by_name[t].combiner), f"feature {f!r}")
                          for f, t in self.feature_to_table.items()]
        self.tables = {t.name: _add_table(self, t) for t in self.table_configs}

    def get_config(self):
        combiners = {f: c for f, c in zip(self.feature_names, self.combiners)}
        tables = [{**dataclasses.asdict(t), "initializer": _initializer_config(t.initializer)}
                  for t in self.table_configs]
        return {**super().get_config(), "tables": tables, "feature_to_table": self.feature_to_table,
                "combiners": combiners}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["tables"] = [TableConfig(**{**t, "initializer": _initializer_from_config(t["initializer"])})
                            for t in config["tables"]]
        return cls(**config)

    def call(self, inputs, weights=None, training=None):
        missing = [f for f in self.feature_names if f not in inputs]
        if missing:
            raise ValueError(f"EmbeddingCollection: inputs lack features {missing}")
        ids = [ragged_pair(inputs[f]) for f in self.feature_names]
        w = None if weights is None else [ragged_pair(weights.get(f)) for f in self.feature_names]
        serving = serving_tables_of(self)
        if serving is not None:   # being exported (sok.export_saved_model): stock TensorFlow ops
            return {f: serving_lookup(serving[self.feature_to_table[f]], x, None if w is None else w[i], c,
                                      self.compute_dtype)
                    for i, (f, x, c) in enumerate(zip(self.feature_names, ids, self.combiners))}
        outs = lookup_sparse([self.tables[self.feature_to_table[f]] for f in self.feature_names], ids, w,
                             combiners=self.combiners, feature_names=self.feature_names, dtype=self.compute_dtype,
                             training=training is not False)
        return dict(zip(self.feature_names, outs))   # in the compute dtype, as Embedding's


class DotInteraction(keras.layers.Layer):
    """DLRM's feature interaction: the pairwise dot products of [batch, n, dim] vectors (the
    bottom MLP's output and the embeddings), each distinct pair once: [batch, n(n-1)/2], pairs
    (i, j), i < j, in row-major order; with `self_interaction`, i <= j.

    The products are picked from the [n, n] matrix of all dots by one matmul with a constant 0/1
    matrix, so the backward pass is a matmul too: a `gather_nd` of the pairs has a scatter of
    atomic adds as its gradient (on an H200, 25 of the 44 ms of a DLRM step at batch 65,536).

    Example:
        >>> inter = sok.layers.DotInteraction()(tf.stack([bottom] + embeddings, axis=1))
    """

    def __init__(self, self_interaction: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.self_interaction = bool(self_interaction)

    def pairs(self, n: int):
        return [(i, j) for i in range(n) for j in range(i if self.self_interaction else i + 1, n)]

    def call(self, vectors):
        if vectors.shape.rank != 3 or vectors.shape[1] is None:
            raise ValueError(f"DotInteraction: expects [batch, n, dim] with n known, got {vectors.shape}")
        n = int(vectors.shape[1])
        pairs = self.pairs(n)
        pick = np.zeros((n * n, len(pairs)), np.float32)
        pick[[i * n + j for i, j in pairs], np.arange(len(pairs))] = 1.0
        dots = tf.reshape(tf.matmul(vectors, vectors, transpose_b=True), [-1, n * n])
        return tf.matmul(dots, tf.constant(pick, dots.dtype))

    def get_config(self):
        return {**super().get_config(), "self_interaction": self.self_interaction}
