"""The sparse optimizers. Formulas follow Keras 3's optimizers, applied to
the rows a batch touched only (Adam and Adamax keep their step count per row,
like SOK's and TensorFlow Addons' LazyAdam)."""
from typing import List

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from tf_sok.python.optimizers.base import SlotSpec, SparseOptimizer, finite_number


def _positive(name, value):
    value = finite_number(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _non_negative(name, value):
    value = finite_number(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _unit(name, value):
    value = finite_number(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


class SGD(SparseOptimizer):
    """w -= lr * g on the touched rows."""

    algorithm = "sgd"

    def slot_specs(self) -> List[SlotSpec]:
        return []

    def hyper(self) -> dict:
        return {}


class Momentum(SparseOptimizer):
    """Keras SGD with momentum, per row: v = m*v - lr*g; w += v (Nesterov: w += m*v - lr*g)."""

    algorithm = "momentum"

    def __init__(self, learning_rate=0.01, momentum=0.9, nesterov=False, name=None):
        super().__init__(learning_rate, name)
        self.momentum = _unit("momentum", momentum)
        self.nesterov = _flag("nesterov", nesterov)

    def slot_specs(self):
        return [SlotSpec("momentum")]

    def hyper(self):
        return {"momentum": self.momentum, "nesterov": self.nesterov}


class Adagrad(SparseOptimizer):
    """a += g^2; w -= lr * g / sqrt(a + eps)."""

    algorithm = "adagrad"

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7, name=None):
        super().__init__(learning_rate, name)
        self.initial_accumulator_value = _non_negative("initial_accumulator_value", initial_accumulator_value)
        self.epsilon = _positive("epsilon", epsilon)

    def slot_specs(self):
        return [SlotSpec("accumulator", self.initial_accumulator_value)]

    def hyper(self):
        return {"epsilon": self.epsilon}


class _Moments(SparseOptimizer):
    """The hyper-parameters Adam and Adamax share (beta_1, beta_2, epsilon), checked."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, name=None):
        super().__init__(learning_rate, name)
        self.beta_1 = _unit("beta_1", beta_1)
        self.beta_2 = _unit("beta_2", beta_2)
        self.epsilon = _positive("epsilon", epsilon)


class Adam(_Moments):
    """Lazy Adam: moments and the step count t advance only for touched rows.

    m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2);
    w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps).
    """

    algorithm = "adam"

    def slot_specs(self):
        return [SlotSpec("m"), SlotSpec("v"), SlotSpec("step", per_row=True)]

    def hyper(self):
        return {"beta1": self.beta_1, "beta2": self.beta_2, "epsilon": self.epsilon}


class Ftrl(SparseOptimizer):
    """FTRL-Proximal as Keras 3's Ftrl (l1, l2, l2 shrinkage, beta, lr power)."""

    algorithm = "ftrl"

    def __init__(self, learning_rate=0.001, learning_rate_power=-0.5, initial_accumulator_value=0.1,
                 l1_regularization_strength=0.0, l2_regularization_strength=0.0,
                 l2_shrinkage_regularization_strength=0.0, beta=0.0, name=None):
        super().__init__(learning_rate, name)
        self.learning_rate_power = finite_number("learning_rate_power", learning_rate_power)
        if self.learning_rate_power > 0:
            raise ValueError(f"learning_rate_power must be <= 0, got {learning_rate_power}")
        self.initial_accumulator_value = _non_negative("initial_accumulator_value", initial_accumulator_value)
        self.l1 = _non_negative("l1_regularization_strength", l1_regularization_strength)
        self.l2 = _non_negative("l2_regularization_strength", l2_regularization_strength)
        self.l2_shrinkage = _non_negative("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength)
        self.beta = _non_negative("beta", beta)

    def slot_specs(self):
        return [SlotSpec("accumulator", self.initial_accumulator_value), SlotSpec("linear")]

    def hyper(self):
        return {"l1": self.l1, "l2": self.l2, "l2_shrinkage": self.l2_shrinkage,
                "lr_power": self.learning_rate_power, "beta": self.beta}


class RMSprop(SparseOptimizer):
    """Keras RMSprop per row (rho, momentum, centered)."""

    algorithm = "rmsprop"

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False, name=None):
        super().__init__(learning_rate, name)
        self.rho = _unit("rho", rho)
        self.momentum = _unit("momentum", momentum)
        self.epsilon = _positive("epsilon", epsilon)
        self.centered = _flag("centered", centered)

    def slot_specs(self):
        specs = [SlotSpec("velocity")]
        if self.centered:
            specs.append(SlotSpec("average_gradient"))
        if self.momentum > 0:
            specs.append(SlotSpec("momentum"))
        return specs

    def hyper(self):
        return {"rho": self.rho, "momentum": self.momentum, "epsilon": self.epsilon, "centered": self.centered}


def _rows_update(var, rows, new):
    return var.scatter_update(tf.IndexedSlices(new, rows))


def _rows(var, rows):
    """Rows of a row array by row number (a DynamicVariable's tf.gather would take keys)."""
    return resource_variable_ops.resource_gather(var.handle, rows, dtype=var.dtype)


class Adamax(_Moments):
    """Lazy Adamax (Keras 3's formula, per row): m += (g - m)(1 - b1); u = max(b2 u, |g|);
    w -= lr m / ((1 - b1^t)(u + eps)), t counting the row's updates. TensorFlow's ops (no fused kernel)."""

    algorithm = ""

    def slot_specs(self):
        return [SlotSpec("m"), SlotSpec("u"), SlotSpec("step", per_row=True)]

    def hyper(self):
        return {}

    def apply_rows(self, var, slots, rows, grads, lr):
        m_var, u_var, t_var = slots
        t = _rows(t_var, rows) + 1.0
        m = _rows(m_var, rows)
        m = m + (grads - m) * (1.0 - self.beta_1)
        u = tf.maximum(self.beta_2 * _rows(u_var, rows), tf.abs(grads))
        w = _rows(var, rows) - (lr * m) / ((1.0 - tf.pow(self.beta_1, t))[:, None] * (u + self.epsilon))
        return tf.group([_rows_update(m_var, rows, m), _rows_update(u_var, rows, u), _rows_update(t_var, rows, t),
                         _rows_update(var, rows, w)])


class Adadelta(SparseOptimizer):
    """Adadelta per row (Keras 3's formula): a = rho a + (1 - rho) g^2;
    d = -sqrt(s + eps) / sqrt(a + eps) g; s = rho s + (1 - rho) d^2; w += lr d.
    TensorFlow's ops (no fused kernel)."""

    algorithm = ""

    def __init__(self, learning_rate=0.001, rho=0.95, epsilon=1e-7, name=None):
        super().__init__(learning_rate, name)
        self.rho = _unit("rho", rho)
        self.epsilon = _positive("epsilon", epsilon)

    def slot_specs(self):
        return [SlotSpec("accumulated_grad"), SlotSpec("accumulated_delta")]

    def hyper(self):
        return {}

    def apply_rows(self, var, slots, rows, grads, lr):
        acc_var, delta_var = slots
        acc = self.rho * _rows(acc_var, rows) + (1.0 - self.rho) * tf.square(grads)
        acc_delta = _rows(delta_var, rows)
        d = -tf.sqrt(acc_delta + self.epsilon) / tf.sqrt(acc + self.epsilon) * grads
        acc_delta = self.rho * acc_delta + (1.0 - self.rho) * tf.square(d)
        w = _rows(var, rows) + lr * d
        return tf.group([_rows_update(acc_var, rows, acc), _rows_update(delta_var, rows, acc_delta),
                         _rows_update(var, rows, w)])

