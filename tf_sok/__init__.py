"""tf_sok: sparse embeddings for TensorFlow/Keras.

    import tf_sok as sok
    sok.init()
    table = sok.Variable(shape=[100_000, 32], initializer="uniform")
    emb = sok.lookup_sparse([table], [ragged_ids], combiners=["mean"])
"""
from tf_sok.python.checkpoint import restore
from tf_sok.python.config import TableConfig
from tf_sok.python.context import context, init
from tf_sok.python.dynamic_variable import DynamicVariable, assign, export, sparse_read_and_evict
from tf_sok.python.lookup import lookup_sparse
from tf_sok.python.ops.loader import build_info
from tf_sok.python.variable import (ReplicaTable, Variable, broadcast_variables, filter_variables, local_shard,
                                    table_meta)

__version__ = "0.1.0"

__all__ = ["init", "context", "Variable", "DynamicVariable", "export", "assign", "sparse_read_and_evict", "ReplicaTable", "TableConfig", "lookup_sparse", "filter_variables",
           "broadcast_variables", "local_shard", "table_meta", "build_info", "restore", "optimizers", "OptimizerWrapper", "layers", "keras"]


def __getattr__(name):
    # Optimizers and the Keras facade import Keras machinery: load them on first use.
    import importlib

    if name == "optimizers":
        return importlib.import_module("tf_sok.python.optimizers")
    if name == "OptimizerWrapper":
        return importlib.import_module("tf_sok.python.optimizers").OptimizerWrapper
    if name == "layers":
        return importlib.import_module("tf_sok.python.keras.layers")
    if name == "keras":
        return importlib.import_module("tf_sok.python.keras")
    raise AttributeError(f"module 'tf_sok' has no attribute {name!r}")
