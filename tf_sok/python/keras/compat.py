"""Keras 3 + tf.distribute with ragged or sparse inputs.

Before `fit`/`evaluate` under a strategy, Keras' TensorFlow trainer builds the
model symbolically from the first batch, which it first averages across
replicas with `strategy.reduce("MEAN", batch)`. That fails for the ragged and
sparse id tensors embedding models take (they have no single device) and would
average ids if it did not. For such batches tf_sok hands Keras replica 0's
batch instead: the symbolic build only needs structure, dtypes and shapes.
Batches without composite tensors take Keras' own path unchanged.
"""
import functools

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer

_ORIGINAL = tf_trainer.TensorFlowTrainer._maybe_symbolic_build


def _composite(x) -> bool:
    return isinstance(x, (tf.RaggedTensor, tf.SparseTensor))


def _has_composite_replica_values(batch, strategy) -> bool:
    for v in tf.nest.flatten(batch, expand_composites=False):
        if isinstance(v, tf.distribute.DistributedValues):
            if any(_composite(x) for x in strategy.experimental_local_results(v)):
                return True
    return False


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
    if _has_composite_replica_values(batch, strategy):
        batch = tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues) else v, batch)
    elif all(isinstance(v, tf.distribute.DistributedValues) for v in tf.nest.flatten(batch)):
        batch = strategy.reduce("MEAN", batch, axis=None)
    with strategy.scope():
        self._symbolic_build(data_batch=batch)


def install() -> None:
    """Idempotent: routes Keras' symbolic build through the function above."""
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
