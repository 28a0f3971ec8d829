"""Builds the sparse optimizer matching a dense optimizer's hyper-parameters: Keras 3's, tf_keras'
and tf_keras' legacy (OptimizerV2) optimizers alike, read from their configs."""
import tensorflow as tf

from tf_sok.python.optimizers import algorithms

_NEEDS_OFF = ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay", "use_ema", "amsgrad", "decay")
_SUPPORTED = "SGD, Adagrad, Adam, Adamax, Adadelta, Ftrl or RMSprop"


def _shared_learning_rate(optimizer):
    """The optimizer's own learning rate: its variable (so changing the dense rate changes the
    sparse one) or its schedule (which the sparse optimizer evaluates at its own step)."""
    if hasattr(optimizer, "_learning_rate"):        # Keras 3, tf_keras
        return optimizer._learning_rate
    if hasattr(optimizer, "_get_hyper"):            # tf_keras legacy (OptimizerV2): a number until built
        lr = optimizer._get_hyper("learning_rate")
        if isinstance(lr, (int, float)):
            return lambda: tf.convert_to_tensor(optimizer._get_hyper("learning_rate"), tf.float32)
        return lr
    return optimizer.get_config()["learning_rate"]


def OptimizerWrapper(optimizer):
    """The tf_sok optimizer equivalent to a dense optimizer (sharing its learning rate).

    Takes Keras 3 optimizers, tf_keras optimizers and tf_keras' legacy ones
    (`tf_keras.optimizers.legacy.*`, what SOK's own scripts pass): SGD (with or
    without momentum / Nesterov), Adagrad, Adam, Adamax, Adadelta, Ftrl, RMSprop.
    Options without a sparse meaning (clipping, weight decay, EMA, amsgrad, the
    legacy `decay`) raise ValueError; other optimizers raise ValueError naming them.
    The result keeps per-row (per-key) state and updates only the rows a batch
    touched; `get_slot(var, name)` / `get_slot_names()` give its state as SOK's does.

    Example:
        >>> sparse_opt = sok.OptimizerWrapper(keras.optimizers.Adam(0.01))
        >>> sparse_opt.apply_gradients(zip(sok_grads, sok_vars))
    """
    cls = type(optimizer).__name__
    if not hasattr(optimizer, "get_config"):
        raise TypeError(f"sok.OptimizerWrapper: expected a Keras or tf_keras optimizer, got {cls}")
    cfg = optimizer.get_config()
    for opt in _NEEDS_OFF:
        if cfg.get(opt):
            raise ValueError(f"sok.OptimizerWrapper: {cls} option {opt}={cfg[opt]!r} is not supported for sparse "
                             f"tables")
    lr = _shared_learning_rate(optimizer)
    if cls == "SGD":
        if cfg.get("momentum", 0.0) > 0:
            return algorithms.Momentum(lr, cfg["momentum"], bool(cfg.get("nesterov", False)))
        return algorithms.SGD(lr)
    if cls == "Adam":
        return algorithms.Adam(lr, cfg["beta_1"], cfg["beta_2"], cfg["epsilon"])
    if cls == "Adamax":
        return algorithms.Adamax(lr, cfg["beta_1"], cfg["beta_2"], cfg["epsilon"])
    if cls == "Adadelta":
        return algorithms.Adadelta(lr, cfg["rho"], cfg["epsilon"])
    if cls == "Adagrad":
        return algorithms.Adagrad(lr, cfg["initial_accumulator_value"], cfg["epsilon"])
    if cls == "Ftrl":
        return algorithms.Ftrl(lr, cfg["learning_rate_power"], cfg["initial_accumulator_value"],
                               cfg["l1_regularization_strength"], cfg["l2_regularization_strength"],
                               cfg.get("l2_shrinkage_regularization_strength", 0.0), cfg.get("beta", 0.0))
    if cls == "RMSprop":
        return algorithms.RMSprop(lr, cfg["rho"], cfg.get("momentum", 0.0), cfg["epsilon"],
                                  bool(cfg.get("centered", False)))
    raise ValueError(f"sok.OptimizerWrapper: no sparse equivalent of {cls}; use {_SUPPORTED}")
