"""Builds the sparse optimizer matching a Keras optimizer's hyper-parameters."""
import keras

from tf_sok.python.optimizers import algorithms

_UNSUPPORTED = ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay", "use_ema")


def OptimizerWrapper(optimizer: keras.optimizers.Optimizer):
    """The tf_sok optimizer equivalent to a Keras optimizer (sharing its learning rate).

    Supported: SGD (with or without momentum/Nesterov), Adagrad, Adam, Ftrl,
    RMSprop. Options without a sparse meaning (clipping, weight decay, EMA,
    amsgrad) raise ValueError.

    Example:
        >>> sparse_opt = sok.OptimizerWrapper(keras.optimizers.Adam(0.01))
        >>> sparse_opt.apply_gradients(zip(sok_grads, sok_vars))
    """
    cls = type(optimizer).__name__
    for opt in _UNSUPPORTED:
        if getattr(optimizer, opt, None):
            raise ValueError(f"sok.OptimizerWrapper: {cls} option {opt}={getattr(optimizer, opt)!r} is not "
                             f"supported for sparse tables")
    lr = optimizer._learning_rate  # a schedule, or the Keras variable holding the rate
    if isinstance(optimizer, keras.optimizers.SGD):
        if optimizer.momentum > 0:
            return algorithms.Momentum(lr, optimizer.momentum, optimizer.nesterov)
        return algorithms.SGD(lr)
    if isinstance(optimizer, keras.optimizers.Adam):
        if optimizer.amsgrad:
            raise ValueError("sok.OptimizerWrapper: Adam(amsgrad=True) is not supported for sparse tables")
        return algorithms.Adam(lr, optimizer.beta_1, optimizer.beta_2, optimizer.epsilon)
    if isinstance(optimizer, keras.optimizers.Adagrad):
        return algorithms.Adagrad(lr, optimizer.initial_accumulator_value, optimizer.epsilon)
    if isinstance(optimizer, keras.optimizers.Ftrl):
        return algorithms.Ftrl(lr, optimizer.learning_rate_power, optimizer.initial_accumulator_value,
                               optimizer.l1_regularization_strength, optimizer.l2_regularization_strength,
                               optimizer.l2_shrinkage_regularization_strength, optimizer.beta)
    if isinstance(optimizer, keras.optimizers.RMSprop):
        return algorithms.RMSprop(lr, optimizer.rho, optimizer.momentum, optimizer.epsilon, optimizer.centered)
    raise ValueError(f"sok.OptimizerWrapper: no sparse equivalent of {cls}; use SGD, Adagrad, Adam, Ftrl "
                     f"or RMSprop")
