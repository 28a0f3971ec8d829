"""`sok.export_saved_model`: a trained Keras model as a SavedModel of stock TensorFlow ops.

The tables of the model's `sok.layers` are gathered whole (through `sok.dump`, so sharded tables of
any number of ranks or replicas come together, streamed) and become, in the SavedModel:
- a static table: one `tf.Variable` [rows, dim], read by `tf.gather`;
- a dynamic table: a `tf.lookup.StaticHashTable` key -> row over a `tf.Variable` of its values. A key
  the table does not hold gets what the training lookup gives a key it has never seen: the table's
  initial value for that key (the same function of key, column and seed, computed here with stock
  ops), or zeros when the table admits keys only after `min_frequency` > 1 sightings.
Pooling (sum / mean / sqrtn, with weights) and sequence features follow `sok.lookup_sparse`. The
graph holds no tf_sok op: TensorFlow Serving, or `tf.saved_model.load` in a process that never
imports tf_sok, serves it.

Signatures: `serve` takes the model's inputs as the model does (ragged ids as `tf.RaggedTensor`);
`serving_default` (TensorFlow Serving) takes plain tensors: a ragged feature `f` as `f` (its
values) and `f_row_splits`, other inputs as they are; it returns {"output": the model's output}.
"""
import shutil
import tempfile
from typing import Dict

import numpy as np
import tensorflow as tf

from tf_sok.python.variable import ReplicaTable, backing_variable, table_meta

_SERVING_ATTR = "_tf_sok_serving"

_C_KEY = np.uint64(0x5DEECE66D)
_C_COLUMN = np.uint64(0xD1B54A32D192ED03)


def _mix(x):
    """splitmix64's finaliser on uint64 tensors (dynamic_index.h's MixBits)."""
    x = x + tf.constant(0x9E3779B97F4A7C15, tf.uint64)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(30, tf.uint64))) * \
        tf.constant(0xBF58476D1CE4E5B9, tf.uint64)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(27, tf.uint64))) * \
        tf.constant(0x94D049BB133111EB, tf.uint64)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(31, tf.uint64)))


def _unit(x):
    """[0, 1) from the top 53 bits."""
    return tf.cast(tf.bitwise.right_shift(x, tf.constant(11, tf.uint64)), tf.float64) * 2.0 ** -53


def initial_values(keys, dim: int, kind: int, a: float, b: float, seed: int):
    """[n, dim] float32: a dynamic table's initial value of each key (dynamic_index.h's InitialValue:
    kind 0 uniform [a, b), 1 normal (a, b), 2 normal truncated at 2 stddev, 3 the constant a)."""
    n = tf.size(keys)
    a, b = np.float32(a), np.float32(b)   # the kernel's float parameters (exactly: e.g. float32(0.05))
    if kind == 3:
        return tf.fill([n, dim], tf.constant(a, tf.float32))
    seed_bits = _mix(tf.constant(np.uint64(seed & (2**64 - 1)) ^ _C_KEY, tf.uint64))
    key_bits = _mix(tf.bitwise.bitwise_xor(seed_bits, _mix(tf.bitcast(tf.cast(keys, tf.int64), tf.uint64))))
    columns = tf.range(dim, dtype=tf.int64)
    x = _mix(key_bits[:, None] + tf.bitcast(columns, tf.uint64)[None, :] * tf.constant(_C_COLUMN, tf.uint64))
    if kind == 0:
        return a + (b - a) * tf.cast(_unit(x), tf.float32)   # in float, as the kernel

    def draw(x):
        u1 = _unit(x) + 2.0 ** -53
        x = _mix(x)
        u2 = _unit(x)
        z = tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(6.283185307179586 * u2)
        return z, _mix(x)

    z, x = draw(x)
    if kind == 2:        # truncated: draw again where |z| > 2
        def body(z, x):
            z2, x2 = draw(x)
            redo = tf.abs(z) > 2.0
            return tf.where(redo, z2, z), tf.where(redo, x2, x)
        z, _ = tf.while_loop(lambda z, x: tf.reduce_any(tf.abs(z) > 2.0), body, [z, x])
    return tf.cast(np.float64(a) + np.float64(b) * z, tf.float32)   # in double, as the kernel


class ServingTable(tf.Module):
    """One table as stock TensorFlow state: rows by id (static) or by key (dynamic)."""

    def __init__(self, name, dim, values, keys=None, unknown=None):
        super().__init__(name=name.replace("/", "_"))
        self.dim = dim
        self.values = tf.Variable(values, trainable=False, name="values")
        self.dynamic = keys is not None
        if self.dynamic:
            self.index = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(tf.constant(keys, tf.int64),
                                                    tf.range(len(keys), dtype=tf.int64)), -1)
            self.unknown = unknown         # (kind, a, b, seed), or None: zeros

    def vectors(self, ids):
        """[n, dim] rows of ids (a vector)."""
        if not self.dynamic:
            return tf.gather(self.values, ids)
        ids = tf.cast(ids, tf.int64)
        at = self.index.lookup(ids)
        found = tf.gather(self.values, tf.maximum(at, 0))
        if self.unknown is None:
            fresh = tf.zeros_like(found)
        else:
            fresh = initial_values(ids, self.dim, *self.unknown)
        return tf.where((at >= 0)[:, None], found, fresh)


def _as_ragged(ids, weights, dynamic: bool):
    """ids (ragged, sparse or dense) as ragged; dense ids < 0 are padding for static tables."""
    if isinstance(ids, tf.SparseTensor):
        ids = tf.sparse.reorder(ids)
        w = tf.RaggedTensor.from_sparse(tf.sparse.reorder(weights)) if isinstance(weights, tf.SparseTensor) else weights
        return tf.RaggedTensor.from_sparse(ids), w
    if isinstance(ids, tf.RaggedTensor):
        return ids, weights
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank == 1:
        ids = ids[:, None]
    keep = tf.ones_like(ids, tf.bool) if dynamic else ids >= 0
    w = tf.ragged.boolean_mask(weights, keep) if weights is not None and not isinstance(weights, tf.RaggedTensor) \
        else weights
    return tf.ragged.boolean_mask(ids, keep), w


def serving_lookup(table: ServingTable, ids, weights, combiner, dtype):
    """sok.lookup_sparse of one feature with stock ops."""
    ids, weights = _as_ragged(ids, weights, table.dynamic)
    vec = table.vectors(ids.values)
    if combiner is None:   # a sequence feature
        return tf.cast(ids.with_values(vec), dtype)
    w = tf.ones_like(vec[:, 0]) if weights is None else tf.cast(weights.values, tf.float32)
    rows = ids.value_rowids()
    n = ids.nrows()
    total = tf.math.unsorted_segment_sum(vec * w[:, None], rows, n)
    if combiner == "mean":
        total = tf.math.divide_no_nan(total, tf.math.unsorted_segment_sum(w, rows, n)[:, None])
    elif combiner == "sqrtn":
        total = tf.math.divide_no_nan(total, tf.sqrt(tf.math.unsorted_segment_sum(w * w, rows, n))[:, None])
    return tf.cast(total, dtype)


def serving_tables_of(layer):
    """The serving tables a layer reads while it is being exported (None: training)."""
    return getattr(layer, _SERVING_ATTR, None)


def _table_layers(model):
    from tf_sok.python.keras.layers import _TableLayer

    return [layer for layer in model._flatten_layers(include_self=True) if isinstance(layer, _TableLayer)]  # noqa: SLF001


def _specs(inputs):
    """Input signature from a sample batch (a dict of tensors, ragged or sparse, ragged ones also as
    (values, row_splits) pairs: served as ragged) or given specs."""
    from tf_sok.python.lookup import ragged_pair

    if isinstance(inputs, dict):
        inputs = {k: ragged_pair(v) for k, v in inputs.items()}

    def spec(x):
        if isinstance(x, tf.TypeSpec):
            return x
        if isinstance(x, tf.RaggedTensor):
            return tf.RaggedTensorSpec([None, None], x.dtype, 1, x.row_splits.dtype)
        if isinstance(x, tf.SparseTensor):
            return tf.SparseTensorSpec([None] + x.shape.as_list()[1:], x.dtype)
        x = tf.convert_to_tensor(x)
        return tf.TensorSpec([None] + x.shape.as_list()[1:], x.dtype)
    return tf.nest.map_structure(spec, inputs, expand_composites=False)


def _flat_signature(specs: Dict[str, tf.TypeSpec]):
    """TensorFlow Serving takes plain tensors: a ragged input f as f (values) and f_row_splits."""
    flat = {}
    for name, s in specs.items():
        if isinstance(s, tf.RaggedTensorSpec):
            flat[name] = tf.TensorSpec([None], s.dtype, name=name)
            flat[f"{name}_row_splits"] = tf.TensorSpec([None], s.row_splits_dtype, name=f"{name}_row_splits")
        elif isinstance(s, tf.SparseTensorSpec):
            raise ValueError(f"export_saved_model: input {name!r} is a SparseTensor; TensorFlow Serving's signature "
                             f"takes it as ragged (pass a tf.RaggedTensor in the sample) or dense")
        else:
            flat[name] = tf.TensorSpec(s.shape, s.dtype, name=name)
    return flat


def export_saved_model(model, path: str, inputs) -> None:
    """Writes `model` (Keras, with sok.layers) as a SavedModel without tf_sok ops to `path`.

    `inputs`: a batch of the model's inputs (a dict of tensors, `tf.RaggedTensor` ids included, or
    their `(values, row_splits)` pairs as the readers' `ragged_pairs=True` gives them: served as
    RaggedTensors) or their `tf.TypeSpec`s: it fixes the signature. Every rank calls it (the tables are gathered
    through `sok.dump`); rank 0 writes the model. Load it with `tf.saved_model.load(path)`:
    `.serve(batch)` takes what the model takes; the `serving_default` signature takes plain tensors.
    """
    from tf_sok.python import dump as dump_lib
    from tf_sok.python.dump_format import Ranks
    from tf_sok.python.dump_load import Reader
    from tf_sok.python.dynamic_variable import DynamicVariable

    layers = _table_layers(model)
    if not layers:
        raise ValueError("export_saved_model: the model has no sok.layers tables")
    tables = {}
    for layer in layers:
        for name, var in _layer_tables(layer).items():
            tables[name] = (layer, var)
    ranks = Ranks()
    tmp = ranks.agree(tempfile.mkdtemp(prefix="tf_sok_export_") if ranks.lead else "")
    try:
        dump_lib.dump(tmp, [v for _, v in tables.values()])
        if not ranks.lead:
            return
        reader = Reader(tmp)
        serving = {}
        for name, (layer, var) in tables.items():
            entry = reader.entry(name)
            keys, values = _read_table(reader, name, entry)
            if entry["dynamic"]:
                dyn = backing_variable(var.shards[0] if isinstance(var, ReplicaTable) else var)
                assert isinstance(dyn, DynamicVariable), type(dyn)
                unknown = None if dyn.min_frequency > 1 else dyn.initial_spec
                serving[name] = ServingTable(name, entry["dim"], values, keys, unknown)
            else:
                full = np.zeros([entry["rows"], entry["dim"]], np.float32)
                full[keys] = values
                serving[name] = ServingTable(name, entry["dim"], full)
    finally:
        if ranks.lead:
            shutil.rmtree(tmp, ignore_errors=True)
    specs = _specs(inputs)
    for layer in layers:
        setattr(layer, _SERVING_ATTR, {n: serving[n] for n in _layer_tables(layer)})
    try:
        module = tf.Module()
        module.tables = list(serving.values())
        module.dense = [backing_variable(v) for v in model.variables if table_meta(v) is None]

        @tf.function(input_signature=[specs])
        def serve(x):
            return model(x, training=False)

        flat = _flat_signature(specs)

        @tf.function(input_signature=[flat])
        def serving_default(x):
            batch = {}
            for name, s in specs.items():
                batch[name] = tf.RaggedTensor.from_row_splits(x[name], x[f"{name}_row_splits"], validate=False) \
                    if isinstance(s, tf.RaggedTensorSpec) else x[name]
            return {"output": model(batch, training=False)}

        module.serve = serve
        tf.saved_model.save(module, path, signatures={"serving_default": serving_default.get_concrete_function()})
    finally:
        for layer in layers:
            if hasattr(layer, _SERVING_ATTR):
                delattr(layer, _SERVING_ATTR)


def _layer_tables(layer):
    """name -> the table variable of a sok layer."""
    if hasattr(layer, "tables"):
        return dict(layer.tables)
    return {layer.config.name: layer.table}


def _read_table(reader, name, entry):
    """(keys, values) of a dumped table, read whole (rank 0 builds the served model)."""
    layout = [(f, w, True) for f, w in zip(entry["files"][:2], entry["widths"][:2])]
    keys, values = [], []
    for piece in reader.pieces(name, entry["count"], entry["dim"]):
        k, v = reader.read_piece(name, layout, piece)
        keys.append(k)
        values.append(v)
    if not keys:
        return np.zeros([0], np.int64), np.zeros([0, entry["dim"]], np.float32)
    return np.concatenate(keys), np.concatenate(values).astype(np.float32)
