"""A Keras optimizer that trains tf_sok tables with a sparse optimizer and
everything else with a Keras optimizer, so `model.compile` + `model.fit` work."""
import logging
from typing import Optional

import keras

import tensorflow as tf

from tf_sok.python import context as context_lib
from tf_sok.python.optimizers.base import SparseOptimizer
from tf_sok.python.variable import broadcast_in_graph, broadcast_ready_variables, filter_variables, state_placement

_log = logging.getLogger("tf_sok")


def _tensors(grads):
    """The tensors behind gradients (an IndexedSlices' values), for control dependencies."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads
            if isinstance(g, (tf.Tensor, tf.IndexedSlices)) and not isinstance(g, tf.Variable)]


@keras.saving.register_keras_serializable(package="tf_sok")
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

    Learning rates: `optimizer.learning_rate` is the dense optimizer's rate, and
    with `sparse_lr_follows_dense=True` (the default) the sparse optimizer's rate
    is scaled by dense_rate(now) / dense_rate(when this optimizer was made). So whatever changes the
    dense rate — Keras' `ReduceLROnPlateau` or `LearningRateScheduler`, a dense
    schedule, or assigning `optimizer.learning_rate` — changes both halves in
    proportion (each change is logged at info level, with both rates). With
    False, the halves are independent: set `optimizer.sparse.learning_rate`
    yourself. `optimizer.sparse_learning_rate` is the rate the next update uses.

    Example:
        >>> model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(1e-3),
        ...                                             sparse=sok.optimizers.Adam(1e-2)),
        ...               loss="binary_crossentropy")
    """

    def __init__(self, dense: keras.optimizers.Optimizer, sparse: SparseOptimizer, name: Optional[str] = None,
                 sparse_lr_follows_dense: bool = True, **kwargs):
        if not isinstance(dense, keras.optimizers.Optimizer):
            raise TypeError(f"sok.keras.Optimizer: dense must be a Keras optimizer, got {type(dense).__name__}")
        if not isinstance(sparse, SparseOptimizer):
            raise TypeError(f"sok.keras.Optimizer: sparse must be a sok.optimizers optimizer, "
                            f"got {type(sparse).__name__}")
        if kwargs:
            raise ValueError(f"sok.keras.Optimizer: unsupported options {sorted(kwargs)}; set them on the "
                             f"dense optimizer")
        if not isinstance(sparse_lr_follows_dense, bool):
            raise TypeError(f"sok.keras.Optimizer: sparse_lr_follows_dense must be a bool, "
                            f"got {sparse_lr_follows_dense!r}")
        super().__init__(learning_rate=0.0, name=name or "sok_optimizer")
        self.dense = dense
        self.sparse = sparse
        self.sparse_lr_follows_dense = sparse_lr_follows_dense
        self._dense_lr0 = float(keras.ops.convert_to_numpy(dense.learning_rate))  # the ratio's base
        self._dense_lr_at_build = None
        self._broadcast_in_first_step = []

    def _slot(self, name, shape, initial_value, like):
        with state_placement(like):
            return self.add_variable(shape=shape, initializer=keras.initializers.Constant(initial_value),
                                     dtype="float32", name=name.replace("/", "_"))

    def build(self, var_list):
        sparse_vars, dense_vars = filter_variables(var_list)
        # rank 0's dense weights to every rank now; weights Keras made inside the training function
        # (a model first built there) have no value until it runs: they are broadcast in its first step
        self._broadcast_in_first_step = broadcast_ready_variables(dense_vars, root=0)
        self.dense.build(dense_vars)
        self.sparse.build(sparse_vars, slot_factory=self._slot)
        super().build(var_list)
        # checkpointed with the rest, so a restored model keeps the ratio it trained with
        self._dense_lr_at_build = self.add_variable(shape=(), initializer=keras.initializers.Constant(
            self._dense_lr0), dtype="float32", name="dense_learning_rate_at_build")

    def _sparse_lr_scale(self):
        if not self.sparse_lr_follows_dense:
            return None
        return tf.math.divide_no_nan(tf.cast(self.dense.learning_rate, tf.float32), self._dense_lr_at_build)

    @property
    def sparse_learning_rate(self) -> float:
        """The sparse optimizer's rate for its next update (after build)."""
        lr = self.sparse.current_learning_rate()
        scale = self._sparse_lr_scale() if self.built else None
        return float(lr if scale is None else lr * scale)

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
        done = []  # what the counters wait for: in a graph, a failed step moves none of them
        if sparse_pairs:
            self.sparse.apply_gradients(sparse_pairs, lr_scale=self._sparse_lr_scale())
            done.append(self.sparse.iterations.read_value())
        if dense_vars:
            comm = context_lib.context().communicator
            dense_grads = comm.reduce_dense_gradients(dense_grads)
            synced = []
            if self._broadcast_in_first_step:
                later = self._broadcast_in_first_step

                def broadcast():
                    with tf.control_dependencies(broadcast_in_graph(later, root=0)):
                        return tf.constant(True)
                synced.append(tf.cond(tf.equal(tf.convert_to_tensor(self.iterations), 0), broadcast,
                                      lambda: tf.constant(False)))
            with tf.control_dependencies(done + synced + _tensors(dense_grads)):
                self.dense.apply(dense_grads, dense_vars)
            done.append(tf.convert_to_tensor(self.dense.iterations))
        with tf.control_dependencies(done):
            self.iterations.assign_add(1)

    def _dynamic_state(self):
        """{weights-file key: variable} of the sparse optimizer's state of dynamic tables (plain
        tf.Variables that grow with their tables, so not among this optimizer's Keras variables)."""
        out = {}
        for key, slots in self.sparse._slots.items():   # noqa: SLF001
            for i, slot in enumerate(slots):
                if slot.shape.rank is not None and slot.shape[0] is None:
                    out[f"sparse:{key}:{i}"] = slot
        return out

    def save_own_variables(self, store):
        """Keras' weights file: this optimizer's variables, and the state of dynamic tables."""
        super().save_own_variables(store)
        for name, slot in self._dynamic_state().items():
            store[name] = slot.numpy()

    def load_own_variables(self, store):
        dynamic = self._dynamic_state()
        saved = {k for k in store.keys() if k.startswith("sparse:")}
        plain = [k for k in store.keys() if not k.startswith("sparse:")]
        if len(plain) != len(self.variables):   # Keras would warn and skip: the state would be lost
            raise ValueError(f"sok.keras.Optimizer: the weights file holds {len(plain)} optimizer variables, this "
                             f"optimizer has {len(self.variables)}" + ("" if self.built else " (it is not built)") +
                             "; build the model and then the optimizer first (e.g. model(batch), then "
                             "model.optimizer.build(model.trainable_variables)), or fit one step, and load again")
        if saved - set(dynamic):
            raise ValueError(f"sok.keras.Optimizer: the weights file holds state of dynamic tables this optimizer "
                             f"has not built ({sorted(saved - set(dynamic))[:4]}); build it first "
                             f"(optimizer.build(model.trainable_variables)) or fit a step")
        super().load_own_variables({k: store[k] for k in store.keys() if not k.startswith("sparse:")})
        for name, slot in dynamic.items():
            if name in store:
                slot.assign(store[name])

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
        if self.built and tf.executing_eagerly():
            _log.info("learning rate: dense %.6g, sparse %.6g (%s)", float(self.dense.learning_rate),
                      self.sparse_learning_rate, "follows the dense" if self.sparse_lr_follows_dense
                      else "independent")

    def get_config(self):
        """Both halves' configs (model.save / keras.models.load_model rebuild this optimizer)."""
        return {"name": self.name, "dense": keras.optimizers.serialize(self.dense),
                "sparse": {"class_name": type(self.sparse).__name__, "config": self.sparse.get_config()},
                "sparse_lr_follows_dense": self.sparse_lr_follows_dense}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        from tf_sok.python import optimizers as sparse_optimizers

        sparse_cls = getattr(sparse_optimizers, config["sparse"]["class_name"], None)
        if sparse_cls is None:
            raise ValueError(f"sok.keras.Optimizer: unknown sparse optimizer {config['sparse']['class_name']!r}")
        return cls(dense=keras.optimizers.deserialize(config["dense"], custom_objects=custom_objects),
                   sparse=sparse_cls.from_config(config["sparse"]["config"]), name=config.get("name"),
                   sparse_lr_follows_dense=config.get("sparse_lr_follows_dense", True))

