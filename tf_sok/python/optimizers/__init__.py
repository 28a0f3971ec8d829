"""Sparse optimizers for tf_sok tables."""
from tf_sok.python.optimizers.algorithms import SGD, Adagrad, Adam, Ftrl, Momentum, RMSprop
from tf_sok.python.optimizers.base import SlotSpec, SparseOptimizer
from tf_sok.python.optimizers.wrapper import OptimizerWrapper

__all__ = ["SGD", "Momentum", "Adagrad", "Adam", "Ftrl", "RMSprop", "SparseOptimizer", "SlotSpec",
           "OptimizerWrapper"]
