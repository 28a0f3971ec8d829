"""Sparse optimizers for tf_sok tables."""
from tf_sok.python.optimizers.algorithms import SGD, Adadelta, Adagrad, Adam, Adamax, Ftrl, Momentum, RMSprop
from tf_sok.python.optimizers.base import SlotSpec, SparseOptimizer
from tf_sok.python.optimizers.wrapper import OptimizerWrapper

__all__ = ["SGD", "Momentum", "Adagrad", "Adam", "Adamax", "Adadelta", "Ftrl", "RMSprop", "SparseOptimizer", "SlotSpec",
           "OptimizerWrapper"]
