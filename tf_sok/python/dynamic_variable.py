"""`sok.DynamicVariable`: a table keyed by any int64 id (hashed ids, crossed features).

Storage is the same as a static table's: the values, and every optimizer slot, are
row arrays (`[rows, dim]` tf.Variables); a key -> row index (host memory, a
TensorFlow resource) hands out rows. A key's first lookup inserts it at its initial
value, a function of the key and the seed only (ranks and restarts agree). The
arrays grow by doubling as keys arrive; with `max_capacity`, a full table evicts by
score ("lru": the step that last touched a key, "lfu": how many steps touched it),
the evicted key's value and optimizer state leaving together. With
`min_frequency=k` a key is inserted on its k-th training lookup; before that it
reads zeros and its gradient is dropped.

The lookup, its gradient and the sparse optimizers see rows, as for a static
table: gradients of a DynamicVariable are `tf.IndexedSlices` over rows of its
value array (`sok.export` gives keys and values).
"""
import logging
import numbers

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import resource as resource_lib

from tf_sok.python import context as context_lib
from tf_sok.python.ops.loader import ops
from tf_sok.python.sharding import ShardingSpec
from tf_sok.python.variable import ReplicaTable, TableMeta, _check_same_on_all_ranks, attach_meta

_log = logging.getLogger("tf_sok")

# SOK / HierarchicalKV arguments that tune the GPU hash table's internals: accepted, not used here
_TUNING_ARGS = ("max_bucket_size", "max_load_factor", "block_size", "device_id", "io_by_cpu",
                "use_constant_memory", "reserved_key_start_bit", "num_of_buckets_per_alloc", "kv_mode")
_DEFAULT_INIT_ROWS = 8192
_uid = [0]


def initializer_kind(name: str) -> int:
    """The number of a per-key initializer's kind (as InitialValue's): 0 uniform, 1 normal, 2
    truncated normal, 3 constant."""
    return {"uniform": 0, "normal": 1, "truncated_normal": 2}.get(name, 3)


def _initializer_spec(initializer, name):
    """(kind, a, b) of the index's per-key initializer from SOK's strings or a Keras initializer."""
    if initializer is None or initializer == "":
        initializer = "uniform"
    if isinstance(initializer, str):
        s = initializer.strip().lower()
        if s in ("uniform", "random_uniform"):
            return "uniform", -0.05, 0.05
        if s in ("normal", "random", "random_normal"):
            return "normal", 0.0, 0.05
        if s == "truncated_normal":
            return "truncated_normal", 0.0, 0.05
        if s in ("zeros", "zero"):
            return "constant", 0.0, 0.0
        if s in ("ones", "one"):
            return "constant", 1.0, 0.0
        try:
            return "constant", float(s), 0.0
        except ValueError:
            pass
        initializer = keras.initializers.get(initializer)  # other Keras names ("glorot_uniform", ...) below
    if isinstance(initializer, numbers.Real) and not isinstance(initializer, bool):
        return "constant", float(initializer), 0.0
    cfg = initializer.get_config() if hasattr(initializer, "get_config") else {}
    kind = type(initializer).__name__
    if kind == "Zeros":
        return "constant", 0.0, 0.0
    if kind == "Ones":
        return "constant", 1.0, 0.0
    if kind == "Constant":
        return "constant", float(cfg["value"]), 0.0
    if kind == "RandomUniform":
        return "uniform", float(cfg["minval"]), float(cfg["maxval"])
    if kind == "RandomNormal":
        return "normal", float(cfg["mean"]), float(cfg["stddev"])
    if kind == "TruncatedNormal":
        return "truncated_normal", float(cfg["mean"]), float(cfg["stddev"])
    raise TypeError(f"sok.DynamicVariable {name!r}: initializer {initializer!r} is not supported: a key's initial "
                    f"value is drawn per key, so give \"uniform\", \"normal\"/\"random\", \"truncated_normal\", "
                    f"\"zeros\", \"ones\", a number (or its string), or keras.initializers RandomUniform, "
                    f"RandomNormal, TruncatedNormal, Constant, Zeros, Ones")


def _count(name, what, value, minimum):
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"sok.DynamicVariable {name!r}: {what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class _KeyIndex(resource_lib.TrackableResource):
    """The key -> row index resource; checkpoints save its contents."""

    def __init__(self, device, **attrs):
        self._attrs = attrs
        super().__init__(device=device)
        with tf.init_scope():
            self.resource_handle  # created now, eagerly: not inside the first function that uses it

    def _create_resource(self):
        _uid[0] += 1
        return ops().tf_sok_dynamic_index(shared_name=f"tf_sok_dynamic_{self._attrs['table_name']}_{_uid[0]}",
                                          **self._attrs)

    def _destroy_resource(self):
        tf.raw_ops.DestroyResourceOp(resource=self.resource_handle, ignore_lookup_error=True)

    def _serialize_to_tensors(self):
        out = {}
        with tf.device(self._resource_device):
            if self._attrs.get("cache_bytes", -1) >= 0:   # the host tier, its rows current first
                keys, rows, _, scores = ops().tf_sok_dynamic_store_export(self.resource_handle)
                out.update(store_keys=keys, store_rows=rows, store_scores=scores)
                with tf.control_dependencies([keys, rows]):
                    parts = ops().tf_sok_dynamic_export(self.resource_handle)
            else:
                parts = ops().tf_sok_dynamic_export(self.resource_handle)
        out.update(zip(_EXPORT_PARTS, parts))
        return out

    def _restore_from_tensors(self, restored_tensors):
        with tf.device(self._resource_device):
            done = ops().tf_sok_dynamic_import(self.resource_handle,
                                               *[tf.cast(restored_tensors[k], tf.int64) for k in _EXPORT_PARTS])
            if self._attrs.get("cache_bytes", -1) < 0:
                return done
            if "store_keys" not in restored_tensors:
                raise ValueError(f"sok.DynamicVariable {self._attrs['table_name']!r} is hybrid but the checkpoint "
                                 f"has no host tier for it (saved from a table without max_hbm_for_vectors?)")
            with tf.control_dependencies([done] if done is not None else []):
                return ops().tf_sok_dynamic_store_import(self.resource_handle, restored_tensors["store_keys"],
                                                         restored_tensors["store_rows"],
                                                         restored_tensors["store_scores"], clear_cache=False)


_EXPORT_PARTS = ("keys", "slots", "scores", "generations", "candidate_keys", "candidate_counts", "counters")


class DynamicVariable(resource_variable_ops.ResourceVariable):
    """An embedding table keyed by any int64 id (SOK 2.x's `sok.DynamicVariable`).

    Example:
        >>> v = sok.DynamicVariable(dimension=16, initializer="normal", max_capacity=1 << 20,
        ...                         evict_strategy="lru")
        >>> emb = sok.lookup_sparse([v], [tf.ragged.constant([[2**62, -7], [5]], tf.int64)], combiners=["sum"])
        >>> keys, values = sok.export(v)

    Args:
      dimension: the embedding width.
      initializer: a key's initial value: "uniform" ([-0.05, 0.05)), "normal" / "random"
        (stddev 0.05), "truncated_normal", "zeros", "ones", a number or its string ("13"), or a Keras
        RandomUniform / RandomNormal / TruncatedNormal / Constant / Zeros / Ones initializer.
      var_type: "hbm" (every row where TensorFlow places the variable) or "hybrid" with
        `max_hbm_for_vectors`: a host tier (see below).
      max_hbm_for_vectors: with var_type "hybrid", the device memory in GiB (2**30 bytes, as SOK;
        fractions allowed) for cached rows, values and optimizer state together. Every key's rows live
        in host memory (pinned, on a GPU); the cache holds the rows that fit, the keys a step uses are
        brought in (their rows read from host memory by the GPU in place) and the least recently used
        (lfu: least often used, counting a key's lookups while it was out of the cache too) others
        written back to make room. A step whose keys exceed the budget
        holds them all for that step. On a CPU the cache is host memory too (same results; for tests).
      key_type: tf.int64 (int32 ids are cast).
      dtype: tf.float32.
      mode: "distributed" (key k on rank floormod(k, N)) or "localized:k" (every key on rank k).
      init_capacity: rows of the arrays at first (default 8192); they double as keys arrive.
      max_capacity: at most this many keys (default: unbounded). A hybrid table bounds its host
        tier so: of the keys not cached, those of least recent use leave (evict_strategy "lru", its
        default: as from a table without a tier), or those used least often (lfu: the counts they
        left the cache with, then the smaller key).
      evict_strategy: "lru" or "lfu": how a full table makes room (default: no eviction, a full table
        is an error naming it).
      min_frequency: training lookups a key needs before it is inserted (default 1).
      seed: the per-key initializer's seed.
    Other SOK / HierarchicalKV arguments (max_bucket_size, max_load_factor, ...) are accepted and
    ignored, with a logged note.
    """

    @classmethod
    def _variable_call(cls, *args, _rank=None, **kwargs):
        """Under tf.distribute: one shard per local replica (each with its own index), as a ReplicaTable."""
        comm = context_lib.context().communicator
        if _rank is not None or not comm.per_replica_tables:
            return None
        shards = []
        for rank in comm.local_ranks:
            with comm.placement(rank):
                shards.append(cls(*args, _rank=rank, **kwargs))
        return ReplicaTable(shards, comm.local_ranks)

    def __init__(self, dimension, initializer=None, var_type=None, name=None, constraint=None, trainable=True,
                 key_type=None, dtype=None, mode=None, init_capacity=None, max_capacity=None, evict_strategy=None,
                 min_frequency=1, seed=0, max_hbm_for_vectors=None, _rank=None, _rows=None, **kwargs):
        name = name or "sok_dynamic_variable"
        dimension = _count(name, "dimension", dimension, 1)
        unknown = sorted(set(kwargs) - set(_TUNING_ARGS))
        if unknown:
            raise TypeError(f"sok.DynamicVariable {name!r}: unexpected arguments {unknown}")
        if kwargs:
            _log.info("sok.DynamicVariable %r: %s only tune SOK's GPU hash table; ignored", name, sorted(kwargs))
        if var_type not in (None, "hbm", "hybrid"):
            raise ValueError(f"sok.DynamicVariable {name!r}: var_type must be \"hbm\" or \"hybrid\", got {var_type!r}")
        key_type = tf.as_dtype(key_type or tf.int64)
        if key_type not in (tf.int64, tf.int32):
            raise TypeError(f"sok.DynamicVariable {name!r}: key_type must be tf.int64 or tf.int32, got {key_type}")
        if tf.as_dtype(dtype or tf.float32) != tf.float32:
            raise ValueError(f"sok.DynamicVariable {name!r}: only float32 tables are supported, got {dtype}")
        if constraint is not None:
            raise ValueError(f"sok.DynamicVariable {name!r}: constraints are not supported")
        evict = evict_strategy.lower() if isinstance(evict_strategy, str) else evict_strategy
        if evict not in (None, "lru", "lfu"):
            raise ValueError(f"sok.DynamicVariable {name!r}: evict_strategy must be \"lru\" or \"lfu\", "
                             f"got {evict_strategy!r}")
        init_rows = _count(name, "init_capacity", init_capacity, 1) or _DEFAULT_INIT_ROWS
        max_keys = _count(name, "max_capacity", max_capacity, 1) or 0
        cache_bytes = _cache_bytes(name, var_type, max_hbm_for_vectors, max_keys)
        if cache_bytes >= 0:
            evict = evict or "lru"
        min_frequency = _count(name, "min_frequency", min_frequency, 1)
        kind, a, b = _initializer_spec(initializer, name)
        ctx = context_lib.context()
        context_lib.check_creation_scope(ctx, f"table {name!r}")
        spec = ShardingSpec.parse(mode or "distributed")
        spec.validate(ctx.num_ranks, name)
        reserved = 1   # row 0: what keys not inserted (not admitted yet, filtered) read: zeros
        if max_keys:
            init_rows = min(init_rows, max_keys + reserved)
        if cache_bytes >= 0:
            init_rows = min(init_rows, cache_bytes // (4 * dimension) + reserved)
        init_rows = max(init_rows, reserved + 1)
        with tf.init_scope():
            super().__init__(initial_value=tf.zeros([init_rows, dimension]), shape=tf.TensorShape([None, dimension]),
                             dtype=tf.float32, name=name, trainable=trainable)
        # the index lives with the rows: in GPU memory (GPU kernels) when they are on a GPU
        self._index_device = self.device
        self._index = _KeyIndex(self._index_device, table_name=name, dim=dimension, init_rows=init_rows,
                                max_keys=max_keys, evict=evict or "none", min_frequency=min_frequency,
                                initializer=kind, init_a=a, init_b=b, seed=int(seed), cache_bytes=cache_bytes)
        self._hybrid = cache_bytes >= 0
        self._attached, self._fills = [], []
        self._attach(self, 0.0, values=True)
        self._track_trackable(self._index, name="tf_sok_index")
        self._dimension = dimension
        self._key_type = key_type
        self._var_type = var_type or "hbm"
        self._mode = mode
        self.evict_strategy = evict
        self.max_capacity = max_keys or None
        self.min_frequency = min_frequency
        rank = ctx.rank if _rank is None else _rank
        if _rows is None:
            meta = TableMeta(name, max_keys, dimension, spec, max_keys, rank, ctx.num_ranks, dynamic=True)
        else:   # sok.Variable with a host tier: a static table of _rows rows, keyed by row
            meta = TableMeta(name, int(_rows), dimension, spec, spec.local_rows(int(_rows), rank, ctx.num_ranks),
                             rank, ctx.num_ranks, dynamic=True, row_ids=True)
        if ctx.num_ranks > 1 and not ctx.communicator.per_replica_tables:
            _check_same_on_all_ranks(ctx, meta)
        attach_meta(self, meta)

    @property
    def hybrid(self) -> bool:
        """Whether the table has a host tier (var_type "hybrid" with max_hbm_for_vectors)."""
        return self._hybrid

    @property
    def initial_spec(self):
        """(kind, a, b, seed) of a new key's value: kind 0 uniform [a, b), 1 normal (mean a, stddev b),
        2 the same truncated at 2 stddev, 3 the constant a (dynamic_index.h's InitialValue)."""
        at = self._index._attrs   # noqa: SLF001
        return initializer_kind(at["initializer"]), float(at["init_a"]), float(at["init_b"]), int(at["seed"])

    def __repr__(self):
        return (f"<sok.DynamicVariable {self._shared_name!r} dim={self._dimension} "
                f"evict={self.evict_strategy} max_capacity={self.max_capacity}>")

    # SOK's properties
    @property
    def dimension(self) -> int:
        return self._dimension

    @property
    def key_type(self):
        return self._key_type

    @property
    def handle_dtype(self):
        return tf.float32

    @property
    def backend_type(self) -> str:
        return self._var_type

    @property
    def mode(self):
        return self._mode

    @property
    def table(self) -> TableMeta:
        return self._tf_sok_table

    @property
    def size(self) -> tf.Tensor:
        """[number of keys held, dimension] (int64), as SOK's."""
        with tf.device(self._index_device):
            keys, _ = ops().tf_sok_dynamic_size(self._index.resource_handle)
        return tf.stack([keys, tf.constant(self._dimension, tf.int64)])

    def _keys(self, keys) -> tf.Tensor:
        keys = tf.convert_to_tensor(keys)
        if keys.dtype not in (tf.int32, tf.int64):
            raise TypeError(f"sok.DynamicVariable {self.table.name!r}: keys must be int32 or int64, got "
                            f"{keys.dtype.name}")
        keys = tf.cast(keys, tf.int64)
        return keys if keys.shape.rank == 1 else tf.reshape(keys, [-1])

    def rows_for(self, keys, insert: bool = True, with_evicted: bool = False, admit_all: bool = False,
                 insert_ratio: float = 1.0, values_given: bool = False):
        """Rows of the value array holding `keys` (any shape; int32 / int64), inserting missing keys at
        their initial value (the arrays grow, and the optimizer state of new keys' rows is reset, in
        the same op); insert=False: -1 for missing keys, nothing changes. with_evicted: also
        (evicted keys, their values) — what made room for the new keys. admit_all: missing keys are
        inserted even before min_frequency sightings (an assignment). insert_ratio < 1 (the
        low-frequency filter): a new key is inserted with that probability, drawn from the key and
        the lookup's clock; keys not inserted map to row 0, which reads zeros. A hybrid table's keys
        in its host tier are not new (its cache takes them in whatever the draw), nor are a static
        table's rows (a sok.Variable with a host tier is never filtered). values_given: the caller
        writes every key's values next (an assignment): new keys' values start at zero, not drawn from
        the initializer (a hybrid table draws them still)."""
        insert_ratio = self._filter_ratio(insert_ratio)
        if self._hybrid and not insert:
            raise ValueError(f"sok.DynamicVariable {self.table.name!r} is hybrid: rows_for(insert=False) would see "
                             f"only its cached keys")
        keys = tf.convert_to_tensor(keys)
        shape = tf.shape(keys)
        with tf.device(self._index_device):
            slots, ev_keys, ev_values = ops().tf_sok_dynamic_find(self._index.resource_handle, self._keys(keys),
                                                                  insert=insert, with_evicted=with_evicted,
                                                                  admit_all=admit_all, insert_ratio=float(insert_ratio),
                                                                  values_given=values_given)
        slots = tf.reshape(slots, shape)
        return (slots, ev_keys, ev_values) if with_evicted else slots

    def _filter_ratio(self, insert_ratio) -> float:
        """The low-frequency filter's ratio for this table: 1 (none) for a static table's rows."""
        return 1.0 if self.table.row_ids else float(insert_ratio)

    def _attach(self, array, fill: float, values: bool = False):
        with tf.init_scope(), tf.device(self._index_device):
            ops().tf_sok_dynamic_attach(self._index.resource_handle, array.handle, fill=float(fill), values=values)
        self._attached.append(array)
        self._fills.append(float(fill))

    def attach_state(self, array, fill: float):
        """Makes `array` ([rows] or [rows, dim] float32 tf.Variable of this table's rows) per-key
        state: it grows with the table, and a row gets `fill` whenever a new key takes it (an
        evicted key's state leaves with it). The sparse optimizers attach their slots."""
        self._attach(array, fill)

    def _base_gather(self, rows):
        return resource_variable_ops.ResourceVariable.sparse_read(self, rows)

    def sparse_read_rows(self, rows):
        """Rows of the value array (rows `rows_for` gave); the gradient reaches the table as a
        `tf.IndexedSlices` over them."""
        return self._base_gather(rows)

    def sparse_read(self, indices, name=None):
        """The rows of keys `indices` (inserted when missing): what tf.gather / tf.nn.embedding_lookup call."""
        return self._base_gather(self.rows_for(indices))

    def export(self):
        """(keys, values) of every key held (this process's shard)."""
        if self._hybrid:
            keys, arrays = self.export_state()
            return keys, arrays[0]
        keys, rows = self.export_rows()
        return keys, self._base_gather(rows)

    def export_state(self, arrays=None):
        """(keys, [rows of each array]) of every key held (this process's shard), host tensors; `arrays`:
        the value variable and state arrays attached to this table (default: all, in attach order).
        A hybrid table's cached rows are written back to its host tier first (they stay cached)."""
        arrays = list(self._attached) if arrays is None else list(arrays)
        where = [self._position(a) for a in arrays]
        if not self._hybrid:
            keys, rows = self.export_rows()
            with tf.device(self._index_device):
                return keys, [self._base_gather(rows) if a is self else tf.gather(a, rows) for a in arrays]
        with tf.device(self._index_device):
            keys, rows, widths, _ = ops().tf_sok_dynamic_store_export(self._index.resource_handle)
        bounds = np.concatenate([[0], np.cumsum(widths.numpy())])
        out = []
        for a, i in zip(arrays, where):
            part = rows[:, int(bounds[i]):int(bounds[i + 1])]
            out.append(part if len(a.shape) == 2 else tf.reshape(part, [-1]))
        return keys, out

    def set_rows(self, keys, values):
        """Makes a hybrid table hold exactly `keys` ([n] int64) with `values` ([n, dim]) in its host tier
        (its cache emptied; attached optimizer state at its fill). Eager only."""
        if not self._hybrid:
            raise ValueError(f"sok.DynamicVariable {self.table.name!r} is not hybrid; use sok.assign")
        keys = tf.convert_to_tensor(keys, tf.int64)
        values = tf.convert_to_tensor(values, tf.float32)
        n = tf.shape(keys)[0]
        state = [tf.fill([n, a.shape[1] if len(a.shape) == 2 else 1], f)
                 for a, f in zip(self._attached[1:], self._fills[1:])]
        with tf.device(self._index_device):
            ops().tf_sok_dynamic_store_import(self._index.resource_handle, keys, tf.concat([values] + state, 1),
                                              tf.zeros([0], tf.int64), clear_cache=True)

    def state_fills(self) -> list:
        """The value a new key's row of each attached array takes after the values (attach order)."""
        return list(self._fills[1:])

    def _position(self, array):
        for i, a in enumerate(self._attached):
            if a is array or getattr(a, "handle", None) is getattr(array, "handle", 0):
                return i
        raise ValueError(f"sok.DynamicVariable {self.table.name!r}: {getattr(array, 'name', array)!r} is not one of "
                         f"its arrays")

    def export_rows(self):
        """(keys, rows) of every key held (this process's shard): where each key's value and state live
        (not for hybrid tables, whose rows are partly in host memory: see export_state)."""
        if self._hybrid:
            raise ValueError(f"sok.DynamicVariable {self.table.name!r} is hybrid: its keys' rows are not all in its "
                             f"arrays; use export_state()")
        with tf.device(self._index_device):
            keys, rows = ops().tf_sok_dynamic_export(self._index.resource_handle)[:2]
        return keys, rows

    def touched_since(self, unix_ns: int):
        """(keys, rows) this rank holds that a find with insert (a training lookup, an assignment)
        touched at or after `unix_ns` (ns since the epoch), since the table was made or restored."""
        if self._hybrid:
            raise ValueError(f"sok.DynamicVariable {self.table.name!r} is hybrid: the rows of its keys are partly "
                             f"in host memory; use touched_values_since()")
        with tf.device(self._index_device):
            return ops().tf_sok_dynamic_touched_since(self._index.resource_handle, tf.constant(int(unix_ns), tf.int64))

    def touched_values_since(self, unix_ns: int):
        """(keys, values [n, dim]) of the keys this rank holds that a find with insert touched at or
        after `unix_ns` (ns since the epoch), since the table was made or restored. A hybrid table's
        come from its host tier (its cached rows written back first; they stay cached): the keys
        cached now and those written back after such a touch."""
        since = tf.constant(int(unix_ns), tf.int64)
        if not self._hybrid:
            keys, rows = self.touched_since(unix_ns)
            return keys, self._base_gather(rows)
        with tf.device(self._index_device):
            keys, rows, _ = ops().tf_sok_dynamic_store_touched_since(self._index.resource_handle, since)
        return keys, rows[:, :self._dimension]

    def remove_keys(self, keys=None):
        """Takes `keys` (those held; None: every key) out of the table; their rows become free. Eager only."""
        if self._hybrid:
            with tf.device(self._index_device):
                held, rows, _, counts = ops().tf_sok_dynamic_store_export(self._index.resource_handle)
                held, rows, counts = held.numpy(), rows.numpy(), counts.numpy()
                keep = np.zeros(len(held), bool) if keys is None else \
                    ~np.isin(held, np.asarray(keys, np.int64).reshape(-1))
                ops().tf_sok_dynamic_store_import(self._index.resource_handle, tf.constant(held[keep]),
                                                  tf.constant(rows[keep]), tf.constant(counts[keep]), clear_cache=True)
            return
        with tf.device(self._index_device):
            parts = [p.numpy() for p in ops().tf_sok_dynamic_export(self._index.resource_handle)]
            keep = np.zeros(len(parts[0]), bool) if keys is None else \
                ~np.isin(parts[0], np.asarray(keys, np.int64).reshape(-1))
            parts[0], parts[1], parts[2] = parts[0][keep], parts[1][keep], parts[2][keep]
            ops().tf_sok_dynamic_import(self._index.resource_handle, *[tf.constant(p, tf.int64) for p in parts])

    def assign_keys(self, keys, values):
        """Inserts or overwrites `keys` with `values` ([n, dim])."""
        return self._assign(keys, values)[0]

    def _assign(self, keys, values):
        """(the update, the keys' rows) of assign_keys. Values not [len(keys), dim] are an error before
        any key is inserted (the find leaves the new keys' values to the update)."""
        keys = tf.convert_to_tensor(keys)
        values = tf.convert_to_tensor(values, tf.float32)
        what = (f"sok.assign: table {self.table.name!r} (dim {self._dimension}): values must be [len(keys), dim], "
                f"got shape {values.shape} for keys of shape {keys.shape}")
        n, size = keys.shape.num_elements(), values.shape.num_elements()
        if n is not None and size is not None:
            last = values.shape[-1] if (values.shape.rank or 0) >= 2 else self._dimension
            if size != n * self._dimension or last != self._dimension:
                raise ValueError(what)
            checks = []
        else:
            checks = [tf.debugging.assert_equal(tf.size(values, tf.int64), tf.size(keys, tf.int64) * self._dimension,
                                                message=what)]
        with tf.control_dependencies(checks):
            values = tf.reshape(values, [-1, self._dimension])
            rows = tf.reshape(self.rows_for(keys, admit_all=True, values_given=True), [-1])
        return self.scatter_update(tf.IndexedSlices(values, rows)), rows


def _cache_bytes(name, var_type, max_hbm_for_vectors, max_keys) -> int:
    """The device-memory budget of a hybrid table's cached rows in bytes (-1: not hybrid)."""
    if max_hbm_for_vectors is None:
        if var_type == "hybrid":
            _log.info("sok.DynamicVariable %r: var_type=\"hybrid\" without max_hbm_for_vectors keeps every row "
                      "in device memory", name)
        return -1
    if var_type == "hbm":
        raise ValueError(f"sok.DynamicVariable {name!r}: max_hbm_for_vectors needs var_type=\"hybrid\" (a host "
                         f"tier), got var_type=\"hbm\"")
    if isinstance(max_hbm_for_vectors, bool) or not isinstance(max_hbm_for_vectors, numbers.Real) or \
            not max_hbm_for_vectors >= 0:
        raise ValueError(f"sok.DynamicVariable {name!r}: max_hbm_for_vectors must be a number of GiB >= 0, got "
                         f"{max_hbm_for_vectors!r}")
    return int(round(float(max_hbm_for_vectors) * 2**30))


def rows_for_tables(variables, keys, insert_ratio: float = 1.0) -> list:
    """`v.rows_for(k, insert_ratio=...)` for each (v, k) of `variables` and `keys` (vectors): tables
    whose indices share a device are found by one op, which on a GPU waits once for all of them."""
    rows = [None] * len(variables)
    by_device = {}
    for i, v in enumerate(variables):   # one op per device and filter ratio
        by_device.setdefault((v._index_device, v._filter_ratio(insert_ratio)), []).append(i)
    for (device, ratio), members in by_device.items():
        if len(members) == 1:
            i = members[0]
            rows[i] = variables[i].rows_for(keys[i], insert_ratio=ratio)
            continue
        with tf.device(device):
            out = ops().tf_sok_dynamic_find_many([variables[i]._index.resource_handle for i in members],
                                                 [variables[i]._keys(keys[i]) for i in members],
                                                 insert_ratio=ratio)
        for i, r in zip(members, out):
            rows[i] = r
    return rows


def read_tables(variables, keys) -> list:
    """The values [n, dim] of `keys` (vectors) in each of `variables`, nothing changed (a lookup
    that does not train: no key inserted, no score touched, no row moved): cached keys' rows from
    device memory, a hybrid table's other keys read from its host tier in place, keys not held
    their initial value (zeros for a table with min_frequency > 1), as a served model reads them.
    Tables whose indices share a device are read by one op."""
    values = [None] * len(variables)
    by_device = {}
    for i, v in enumerate(variables):
        by_device.setdefault(v._index_device, []).append(i)
    for device, members in by_device.items():
        with tf.device(device):
            out = ops().tf_sok_dynamic_read([variables[i]._index.resource_handle for i in members],
                                            [variables[i]._keys(keys[i]) for i in members],
                                            dims=[variables[i].dimension for i in members])
        for i, r in zip(members, out):
            values[i] = r
    return values


tf.no_gradient("TfSokDynamicRead")


def is_dynamic(var) -> bool:
    from tf_sok.python.variable import backing_variable
    return isinstance(backing_variable(var), DynamicVariable)


def export(var):
    """`(keys, values)` of a DynamicVariable (this rank's keys), as SOK's `sok.export`."""
    return _dynamic(var, "sok.export").export()


def assign(var, indices, values):
    """Inserts or overwrites keys `indices` of a DynamicVariable with `values` (SOK's `sok.assign`)."""
    return _dynamic(var, "sok.assign").assign_keys(indices, values)


def sparse_read_and_evict(var, indices):
    """(embeddings of `indices`, keys evicted to make room for them, their values) — SOK's
    `sok.sparse_read_and_evict` on a bounded DynamicVariable."""
    v = _dynamic(var, "sok.sparse_read_and_evict")
    rows, ev_keys, ev_values = v.rows_for(indices, with_evicted=True)
    return v._base_gather(rows), ev_keys, ev_values


def _dynamic(var, what) -> DynamicVariable:
    from tf_sok.python.variable import backing_variable
    v = backing_variable(var)
    if not isinstance(v, DynamicVariable):
        raise TypeError(f"{what}: {getattr(var, 'name', var)!r} is not a sok.DynamicVariable")
    return v
