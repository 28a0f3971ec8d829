"""Keras 3 + tf.distribute: two fixes tf_sok's models need.

1. Ragged or sparse inputs under a strategy.
Before `fit`/`evaluate` under a strategy, Keras' TensorFlow trainer builds the
model symbolically from the first batch, which it first averages across
replicas with `strategy.reduce("MEAN", batch)`. That fails for the ragged and
sparse id tensors embedding models take (they have no single device) and would
average ids if it did not. For such batches tf_sok hands Keras replica 0's
batch instead: the symbolic build only needs structure, dtypes and shapes.
Batches without composite tensors take Keras' own path unchanged.

2. model.fit under MultiWorkerMirroredStrategy (any model): Keras averages
each step's scalar logs with `strategy.reduce("MEAN", value, axis=0)`, which
fails on scalars ("Invalid reduction dimension 0 for input with 0 dimensions",
tensorflow/tensorflow#72388). Scalars are averaged across replicas with
axis=None instead; everything else takes Keras' path.
"""
import functools
import logging

import tensorflow as tf

try:  # Keras internals: if a Keras release moves them, tf_sok runs without these fixes
    from keras.src.backend.tensorflow import trainer as tf_trainer
    _ORIGINAL = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    _ORIGINAL_REDUCE = tf_trainer.reduce_per_replica
except (ImportError, AttributeError):  # pragma: no cover (depends on the Keras release)
    tf_trainer = None
    _ORIGINAL = _ORIGINAL_REDUCE = lambda *a, **k: None  # noqa: E731


def _composite(x) -> bool:
    return isinstance(x, (tf.RaggedTensor, tf.SparseTensor))


def _has_composite_replica_values(batch, strategy) -> bool:
    for v in tf.nest.flatten(batch, expand_composites=False):
        if isinstance(v, tf.distribute.DistributedValues):
            if any(_composite(x) for x in strategy.experimental_local_results(v)):
                return True
    return False


def _check_no_pairs(batch, strategy) -> None:
    """ValueError naming an input given as a (values, row_splits) pair: Keras cuts each batch among
    the replicas row by row, which cuts a pair's two tensors apart."""
    from tf_sok.python.lookup import is_ragged_pair

    def first(t):   # replica 0's part of a per-replica value
        return strategy.experimental_local_results(t)[0] if isinstance(t, tf.distribute.DistributedValues) else t

    x = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if not isinstance(x, dict):
        return
    for name, v in x.items():
        if isinstance(v, tuple) and is_ragged_pair(tuple(first(t) for t in v)):
            raise ValueError(
                f"model.fit under {type(strategy).__name__}: input {name!r} is a (values, row_splits) pair; Keras "
                f"splits each batch among the {strategy.num_replicas_in_sync} replicas by rows, which a pair "
                f"cannot follow. Feed RaggedTensors under tf.distribute (ragged_pairs=False, the readers' and "
                f"for_keras' default).")


@functools.wraps(_ORIGINAL)
def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = getattr(self, "_distribute_strategy", None)
    if strategy is None or iterator is None:
        return _ORIGINAL(self, iterator=iterator, data_batch=data_batch)
    for _, _, it in iterator:
        batch = next(it)
        break
    else:
        return _ORIGINAL(self, iterator=None, data_batch=data_batch)
    if strategy.num_replicas_in_sync > 1:
        _check_no_pairs(batch, strategy)
    if _has_composite_replica_values(batch, strategy):
        batch = tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues) else v, batch)
    elif all(isinstance(v, tf.distribute.DistributedValues) for v in tf.nest.flatten(batch)):
        batch = strategy.reduce("MEAN", batch, axis=None)
    with strategy.scope():
        self._symbolic_build(data_batch=batch)


def _scalar(v, strategy) -> bool:
    parts = strategy.experimental_local_results(v) if isinstance(v, tf.distribute.DistributedValues) else [v]
    return all(isinstance(x, tf.Tensor) and x.shape.rank == 0 for x in parts)


@functools.wraps(_ORIGINAL_REDUCE)
def reduce_per_replica(values, strategy, reduction):
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    if not multi_worker or reduction not in ("auto", "mean"):
        return _ORIGINAL_REDUCE(values, strategy, reduction)

    def one(v):
        if _scalar(v, strategy):
            return strategy.reduce("MEAN", v, axis=None)
        return _ORIGINAL_REDUCE(v, strategy, reduction)
    return tf.nest.map_structure(one, values)


def install() -> None:
    """Idempotent: routes Keras' symbolic build and log reduction through the functions above."""
    if tf_trainer is None:
        logging.getLogger("tf_sok").warning(
            "this Keras release moved its TensorFlow trainer; tf_sok's fixes for ragged inputs and "
            "MultiWorkerMirroredStrategy logs under tf.distribute are not applied")
        return
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = reduce_per_replica
