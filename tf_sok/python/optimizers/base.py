"""Sparse optimizers: per-row state, updates that touch only the batch's rows."""
import abc
import dataclasses
import inspect
import math
import numbers
from typing import Callable, Dict, Iterable, List, Optional

import tensorflow as tf

from tf_sok.python.ops import lookup_ops, optimizer_ops
from tf_sok.python.variable import backing_variable, expand_tables, state_placement, table_meta


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    name: str
    initial_value: float = 0.0
    per_row: bool = False  # a [rows] counter instead of a [rows, dim] tensor


# Creates one slot variable: (name, shape, initial_value, like_variable) -> variable.
SlotFactory = Callable[[str, List[int], float, object], object]


def _tf_slot(name, shape, initial_value, like):
    with state_placement(like):
        return tf.Variable(tf.fill(shape, tf.constant(initial_value, tf.float32)), trainable=False, name=name)


def finite_number(name: str, value) -> float:
    """A real, finite number (not a bool, string or NaN/inf), as a float; else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _dynamic_slot(name, table, per_row, initial_value):
    """State of a dynamic table: a tf.Variable of its rows ([None] or [None, dim]), next to it, attached
    to its index (grown with it; a row reset to `initial_value` when a new key takes it)."""
    var = backing_variable(table)
    with state_placement(table):
        rows = int(tf.shape(var)[0])
        shape = [None] if per_row else [None, var.dimension]
        value = tf.fill([rows] if per_row else [rows, var.dimension], tf.constant(initial_value, tf.float32))
        slot = tf.Variable(value, shape=tf.TensorShape(shape), trainable=False, name=name)
    var.attach_state(slot, initial_value)
    return slot


def _check_learning_rate(value):
    """A number (finite, >= 0), a callable (a Keras LearningRateSchedule, a function) or a
    tf.Variable / tensor."""
    if callable(value) or isinstance(value, (tf.Variable, tf.Tensor)) or hasattr(value, "dtype"):
        return value
    value = finite_number("learning_rate", value)
    if value < 0:
        raise ValueError(f"learning_rate must be >= 0, got {value}")
    return value


def _dense_rows(values: tf.Tensor, var) -> tf.Tensor:
    """The row indices of a dense gradient: it must have the table's shape (else ValueError,
    or in a graph with unknown shapes an InvalidArgumentError when it runs)."""
    want = backing_variable(var).shape
    name = table_meta(var).name
    if values.shape.rank is not None and not values.shape.is_compatible_with(want):
        raise ValueError(f"a dense gradient of table {name!r} has shape {values.shape}, the table {want}")
    rows = tf.shape(values, out_type=tf.int64)[0]
    check = tf.debugging.assert_equal(tf.shape(values, out_type=tf.int64), tf.shape(backing_variable(var),
                                                                                     out_type=tf.int64),
                                      message=f"a dense gradient of table {name} must have the shape of the table")
    with tf.control_dependencies([check]):
        return tf.range(rows)


class SparseOptimizer(tf.Module, abc.ABC):
    """Base of the tf_sok optimizers.

    Subclasses declare their slots and the op's hyper-parameters; this class
    creates the state per table, sums gradients of repeated rows and updates
    all tables in place with one op. Rows absent from a batch, and their state,
    never change.
    """

    algorithm: str = ""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        bound = inspect.signature(cls.__init__).bind(obj, *args, **kwargs)
        bound.apply_defaults()
        obj._init_args = {k: v for k, v in list(bound.arguments.items())[1:]}   # what get_config returns
        return obj

    def get_config(self) -> dict:
        """The constructor's arguments (a Keras LearningRateSchedule serialised): `from_config` makes
        the same optimizer. Keras' model.save stores it through sok.keras.Optimizer."""
        import keras

        config = dict(self._init_args)
        lr = config["learning_rate"]
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            config["learning_rate"] = keras.optimizers.schedules.serialize(lr)
        elif isinstance(lr, (tf.Variable, tf.Tensor)):
            config["learning_rate"] = float(lr.numpy())
        elif callable(lr):
            raise ValueError(f"{type(self).__name__}: a learning rate given as a plain callable cannot be saved "
                             f"in a config; use a keras.optimizers.schedules.LearningRateSchedule")
        return config

    @classmethod
    def from_config(cls, config: dict):
        import keras

        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = keras.optimizers.schedules.deserialize(config["learning_rate"])
        return cls(**config)

    def __init__(self, learning_rate=0.001, name: Optional[str] = None):
        super().__init__(name=name or type(self).__name__)
        self.learning_rate = _check_learning_rate(learning_rate)
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="iterations",
                                      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._slots: Dict[str, List] = {}       # checkpoint key -> the table's state
        self._slot_keys: Dict[object, str] = {}  # table variable ref -> its key in _slots
        self._slot_factory: SlotFactory = _tf_slot

    @abc.abstractmethod
    def slot_specs(self) -> List[SlotSpec]:
        """The per-row state, in the order the op expects."""

    @abc.abstractmethod
    def hyper(self) -> dict:
        """The op's static hyper-parameters (typed attributes)."""

    def current_learning_rate(self) -> tf.Tensor:
        lr = self.learning_rate
        if callable(lr):  # a Keras LearningRateSchedule or a plain callable
            try:
                lr = lr(self.iterations)
            except TypeError:
                lr = lr()
        return tf.convert_to_tensor(lr, tf.float32)

    def _key(self, var) -> str:
        return self._slot_keys[backing_variable(var).ref()]

    def build(self, var_list: Iterable, slot_factory: Optional[SlotFactory] = None) -> None:
        """Creates the state of each table in `var_list` (idempotent)."""
        if slot_factory is not None:
            self._slot_factory = slot_factory
        for var in expand_tables(var_list):
            meta = table_meta(var)
            if meta is None:
                raise TypeError(f"{type(self).__name__}: {var.name} is not a tf_sok table; use "
                                f"sok.filter_variables and a dense optimizer for the others")
            ref = backing_variable(var).ref()
            if ref in self._slot_keys:
                continue
            # tables may share a name: each gets its own state under a unique, stable key
            # (a dynamic table's by its name: its state is no Keras variable, and paths differ between models)
            base = meta.name if meta.dynamic else getattr(var, "path", None) or var.name.split(":")[0]
            key, n = base, 1
            while key in self._slots:
                key, n = f"{base}_{n}", n + 1
            self._slot_keys[ref] = key
            prefix = f"{meta.name}_replica{meta.rank}" if meta.num_ranks > 1 else meta.name
            if meta.dynamic:   # row arrays the table's index keeps in step with its keys
                self._slots[key] = [_dynamic_slot(f"{prefix}/{s.name}", var, s.per_row, s.initial_value)
                                    for s in self.slot_specs()]
                continue
            rows, dim = backing_variable(var).shape.as_list()
            self._slots[key] = [
                self._slot_factory(f"{prefix}/{s.name}", [rows] if s.per_row else [rows, dim],
                                   s.initial_value, var)
                for s in self.slot_specs()]

    def slots(self, var) -> List:
        """The state variables of one table (after build or the first apply)."""
        return self._slots[self._key(var)]

    def slot_names(self) -> List[str]:
        """The names of the per-row state, in the order `slots` gives it."""
        return [s.name for s in self.slot_specs()]

    def slot(self, var, name: str):
        """One state variable of table `var` by name (after build or the first apply)."""
        names = self.slot_names()
        if name not in names:
            raise KeyError(f"{type(self).__name__} has no slot {name!r}; its slots: {names}")
        return self.slots(var)[names.index(name)]

    def __getattr__(self, name):
        # SOK's wrapper calls get_slot_names() / get_slot(var, name): reached through __getattr__ on
        # purpose, since TensorFlow's checkpointing takes any object whose dir() lists get_slot_names
        # for a TF1 optimizer and would save this state a second time, as its slots
        if name == "get_slot_names":
            return self.slot_names
        if name == "get_slot":
            return self.slot
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def apply_gradients(self, grads_and_vars: Iterable, lr_scale=None) -> None:
        """Applies row-sparse gradients to tf_sok tables (`lr_scale`: a factor on this
        step's learning rate, as sok.keras.Optimizer passes it).

        Example:
            >>> opt = sok.optimizers.Adam(learning_rate=0.01)
            >>> opt.apply_gradients(zip(grads, sok_vars))
        """
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        self.build([v for _, v in pairs])
        lr = self.current_learning_rate()
        if lr_scale is not None:
            lr = lr * tf.cast(lr_scale, tf.float32)
        specs = self.slot_specs()
        # One entry per table: a table named twice gets its gradients concatenated.
        merged: Dict[object, list] = {}
        for g, var in pairs:
            if isinstance(g, tf.IndexedSlices):
                indices, values = g.indices, g.values
                if not indices.dtype.is_integer:
                    raise TypeError(f"{type(self).__name__}: the gradient of table {table_meta(var).name!r} has "
                                    f"{indices.dtype.name} indices; row indices must be int32 or int64")
            else:  # a dense gradient names every row
                values = tf.convert_to_tensor(g)
                indices = _dense_rows(values, var)
            entry = merged.setdefault(backing_variable(var).ref(), [var, [], []])
            entry[1].append(indices)
            entry[2].append(tf.cast(values, tf.float32))
        if merged:
            tables, all_indices, all_values, dense, steps = [], [], [], [], []
            for var, idx, vals in merged.values():
                tables.append(var)
                all_indices.append(idx[0] if len(idx) == 1 else tf.concat([tf.cast(i, tf.int64) for i in idx], 0))
                all_values.append(vals[0] if len(vals) == 1 else tf.concat(vals, 0))
                slots = self.slots(var)
                dense += [s.handle for s, spec in zip(slots, specs) if not spec.per_row]
                steps += [s.handle for s, spec in zip(slots, specs) if spec.per_row]
            kinds = [lookup_ops.rows_promise(i) for i in all_indices]   # rows a tf_sok lookup gradient made
            if not self.algorithm:   # an optimizer written with TensorFlow's ops (apply_rows)
                updated = self._apply_with_tf_ops(tables, all_indices, all_values, lr)
            else:
                updated = optimizer_ops.sparse_apply(
                    [backing_variable(v).handle for v in tables], dense, steps, lr, all_indices, all_values,
                    algorithm=self.algorithm, table_names=[table_meta(v).name for v in tables],
                    indices_unique=all(k == "ascending" for k in kinds), checked=all(kinds), **self.hyper())
            with tf.control_dependencies([updated] if updated is not None else []):
                self.iterations.assign_add(1)   # only once the update succeeded (a failed one leaves it)
            return
        self.iterations.assign_add(1)

    def apply_rows(self, var, slots, rows, grads, lr):
        """The update of distinct `rows` of `var` (and of its `slots`) by their summed `grads`, in
        TensorFlow ops: for optimizers without a fused kernel (algorithm = "")."""
        raise NotImplementedError

    def _apply_with_tf_ops(self, tables, all_indices, all_values, lr):
        """apply_rows per table, after every table's rows were checked (a bad index updates nothing)."""
        checks, prepared = [], []
        for var, idx in zip(tables, all_indices):
            v, idx = backing_variable(var), tf.cast(idx, tf.int64)
            rows = tf.shape(v, out_type=tf.int64)[0]
            checks.append(tf.debugging.Assert(
                tf.reduce_all((idx >= 0) & (idx < rows)),
                [f"{type(self).__name__}: table {table_meta(var).name}: a row index is outside [0, rows); nothing "
                 f"was updated; rows", rows, "indices", idx]))
            prepared.append(idx)
        updates = []
        with tf.control_dependencies(checks):
            for var, idx, vals in zip(tables, prepared, all_values):
                rows, position = tf.unique(idx)
                grads = tf.math.unsorted_segment_sum(vals, position, tf.size(rows))
                updates.append(self.apply_rows(backing_variable(var), [backing_variable(x) for x in self.slots(var)],
                                               rows, grads, lr))
        return tf.group(updates)

