"""tf_sok: sparse embeddings for TensorFlow/Keras.

    import tf_sok as sok
    sok.init()
    table = sok.Variable(shape=[100_000, 32], initializer="uniform")
    emb = sok.lookup_sparse([table], [ragged_ids], combiners=["mean"])
"""
from tf_sok.python.checkpoint import restore
from tf_sok.python.config import TableConfig
from tf_sok.python.context import context, init
from tf_sok.python.dump import dump, incremental_model_dump, load
from tf_sok.python.dynamic_variable import DynamicVariable, assign, export, sparse_read_and_evict
from tf_sok.python.host_tier import cache_stats, host_link_bandwidth
from tf_sok.python.lookup import lookup_sparse
from tf_sok.python.prefetch import prefetch
from tf_sok.python.serving import export_saved_model
from tf_sok.python.ops.loader import build_info
from tf_sok.python.variable import (ReplicaTable, Variable, broadcast_variables, filter_variables, local_shard,
                                    table_meta)

__version__ = "0.1.0"

import tensorflow as _tf

from tf_sok.python.ops.loader import OpLibraryError as _OpLibraryError, ops as _ops

try:   # registers the ops now: a SavedModel holding tf_sok ops loads right after `import tf_sok`
    _ops()
except _OpLibraryError:
    pass   # not built: the first op call raises, saying how to build it

# SOK's: the TensorFlow version as integers ([2, 21, 0])
tf_version = [int("".join(ch for ch in part if ch.isdigit()) or 0) for part in _tf.__version__.split(".")[:3]]

# SOK names tf_sok does not provide, and what to use instead
_SOK_ONLY = {
    "DistributedVariable": "sok.Variable(..., mode=\"distributed\")",
    "LocalizedVariable": "sok.Variable(..., mode=\"localized:<rank>\")",
    "Saver": "sok.dump / sok.load, tf.train.Checkpoint (tables, dynamic tables' keys and optimizer state) or model.save_weights",
    "DistributedEmbedding": "sok.layers.EmbeddingCollection / sok.lookup_sparse with mode=\"distributed\" tables",
    "All2AllDenseEmbedding": "sok.layers.EmbeddingCollection / sok.lookup_sparse",
    "all2all_dense_embedding": "sok.lookup_sparse",
    "set_comm_tool": "sok.init(comm_tool=...)",
}

__all__ = ["init", "context", "Variable", "DynamicVariable", "export", "assign", "sparse_read_and_evict", "cache_stats", "prefetch", "host_link_bandwidth", "dump", "load", "incremental_model_dump", "export_saved_model", "ReplicaTable", "TableConfig", "lookup_sparse", "filter_variables",
           "broadcast_variables", "local_shard", "table_meta", "build_info", "restore", "optimizers", "OptimizerWrapper",
           "SGD", "layers", "keras", "tf_version"]


def __getattr__(name):
    # Optimizers and the Keras facade import Keras machinery: load them on first use.
    import importlib

    if name == "optimizers":
        return importlib.import_module("tf_sok.python.optimizers")
    if name == "OptimizerWrapper":
        return importlib.import_module("tf_sok.python.optimizers").OptimizerWrapper
    if name == "SGD":   # SOK's sparse SGD
        return importlib.import_module("tf_sok.python.optimizers").SGD
    if name == "layers":
        return importlib.import_module("tf_sok.python.keras.layers")
    if name == "keras":
        return importlib.import_module("tf_sok.python.keras")
    if name in _SOK_ONLY:
        raise AttributeError(f"tf_sok has no {name} (a SOK name); use {_SOK_ONLY[name]}")
    raise AttributeError(f"module 'tf_sok' has no attribute {name!r}")
