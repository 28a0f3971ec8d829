"""Keras 3 facade: layers and an optimizer that route sparse and dense variables."""
from tf_sok.python.keras import compat
from tf_sok.python.keras.callbacks import CacheStats
from tf_sok.python.keras.fit_loop import loop_on_host
from tf_sok.python.keras.optimizer import Optimizer

compat.install()

__all__ = ["Optimizer", "CacheStats", "loop_on_host"]
