"""A Keras optimizer that trains tf_sok tables with a sparse optimizer and
everything else with a Keras optimizer, so `model.compile` + `model.fit` work."""
from typing import Optional

import keras

import tensorflow as tf

from tf_sok.python import context as context_lib
from tf_sok.python.optimizers.base import SparseOptimizer
from tf_sok.python.variable import broadcast_variables, filter_variables, state_placement


class Optimizer(keras.optimizers.Optimizer):
    """Routes tf_sok tables to `sparse` and the other variables to `dense`.

    The tables' gradients stay `tf.IndexedSlices` and only touched rows (and
    their optimizer state) change. The sparse state is created as this
    optimizer's variables, so `model.save_weights` / `tf.train.Checkpoint`
    carry it. With several ranks (Horovod), the dense gradients are averaged
    across ranks in one grouped all-reduce before the dense update, and the
    dense weights are broadcast from rank 0 when the optimizer is built. Under
    tf.distribute the strategy does both (the Keras optimizer's all-reduce,
    mirrored variables); each replica updates its own table shards.

    Example:
        >>> model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(1e-3),
        ...                                             sparse=sok.optimizers.Adam(1e-2)),
        ...               loss="binary_crossentropy")
    """

    def __init__(self, dense: keras.optimizers.Optimizer, sparse: SparseOptimizer, name: Optional[str] = None,
                 **kwargs):
        if not isinstance(dense, keras.optimizers.Optimizer):
            raise TypeError(f"sok.keras.Optimizer: dense must be a Keras optimizer, got {type(dense).__name__}")
        if not isinstance(sparse, SparseOptimizer):
            raise TypeError(f"sok.keras.Optimizer: sparse must be a sok.optimizers optimizer, "
                            f"got {type(sparse).__name__}")
        if kwargs:
            raise ValueError(f"sok.keras.Optimizer: unsupported options {sorted(kwargs)}; set them on the "
                             f"dense optimizer")
        super().__init__(learning_rate=0.0, name=name or "sok_optimizer")
        self.dense = dense
        self.sparse = sparse

    def _slot(self, name, shape, initial_value, like):
        with state_placement(like):
            return self.add_variable(shape=shape, initializer=keras.initializers.Constant(initial_value),
                                     dtype="float32", name=name.replace("/", "_"))

    def build(self, var_list):
        sparse_vars, dense_vars = filter_variables(var_list)
        broadcast_variables(dense_vars, root=0)
        self.dense.build(dense_vars)
        self.sparse.build(sparse_vars, slot_factory=self._slot)
        super().build(var_list)

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        grads, trainable_variables = list(grads), list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        sparse_ids = {id(v) for v in filter_variables(trainable_variables)[0]}
        sparse_pairs, dense_grads, dense_vars = [], [], []
        for g, v in zip(grads, trainable_variables):
            if id(v) in sparse_ids:
                sparse_pairs.append((g, v))
            else:
                dense_grads.append(g)
                dense_vars.append(v)
        if sparse_pairs:
            self.sparse.apply_gradients(sparse_pairs)
        if dense_vars:
            comm = context_lib.context().communicator
            dense_grads = comm.reduce_dense_gradients(dense_grads)
            self.dense.apply(dense_grads, dense_vars)
        self.iterations.assign_add(1)

    def stateless_apply(self, *args, **kwargs):
        raise NotImplementedError("sok.keras.Optimizer updates tables in place; stateless_apply is not supported")

    @property
    def variables(self):
        return self._variables[:] + self.dense.variables

    @property
    def learning_rate(self):
        return self.dense.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.dense.learning_rate = value

    def get_config(self):
        raise NotImplementedError("sok.keras.Optimizer is not serialisable to a config; save weights instead")

