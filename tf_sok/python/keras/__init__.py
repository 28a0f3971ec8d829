"""Keras 3 facade: layers and an optimizer that route sparse and dense variables."""
from tf_sok.python.keras.optimizer import Optimizer

__all__ = ["Optimizer"]
