"""Loads the tf_sok op library once, checking the TensorFlow it was built for."""
import ctypes
import functools
import glob
import os

import tensorflow as tf

_LIB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "lib")
_REBUILD = ("rebuild it against the installed TensorFlow with `pip install --no-build-isolation -e .` "
            "(or `make build`) in the tf_sok checkout")


class OpLibraryError(RuntimeError):
    """The op library is missing or was built for another TensorFlow."""


def library_path() -> str:
    """Path of the compiled op library (raises OpLibraryError if not built)."""
    found = sorted(glob.glob(os.path.join(_LIB_DIR, "_tf_sok_ops*.so")))
    if not found:
        raise OpLibraryError(f"tf_sok op library not found in {_LIB_DIR}; {_REBUILD}")
    return found[0]


def build_info() -> dict:
    """What the op library was built against: TensorFlow version and CUDA archs, and the
    constants its kernels use that the Python side must agree with (a test checks them).

    Example:
        >>> build_info()["tensorflow"]
        '2.21.0'
    """
    _module()  # TensorFlow loads the library first: a plain dlopen would register its ops unseen by the wrappers
    so = ctypes.CDLL(library_path())
    so.TfSokBuiltTfVersion.restype = ctypes.c_char_p
    so.TfSokBuiltCudaArchs.restype = ctypes.c_char_p
    so.TfSokConstant.restype = ctypes.c_longlong
    so.TfSokConstant.argtypes = [ctypes.c_char_p]
    archs = so.TfSokBuiltCudaArchs().decode()
    return {"tensorflow": so.TfSokBuiltTfVersion().decode(),
            "cuda": bool(so.TfSokBuiltWithCuda()),
            "cuda_archs": [a for a in archs.split(",") if a],
            "constants": {n: so.TfSokConstant(n.encode())
                          for n in ("table_shift", "status_words", "max_exchange_widths")}}


@functools.lru_cache(maxsize=None)
def _module():
    path = library_path()
    try:
        return tf.load_op_library(path)
    except Exception as e:  # undefined symbols: built for another TensorFlow
        raise OpLibraryError(f"could not load {path} under TensorFlow {tf.__version__} ({e}); {_REBUILD}") from e


@functools.lru_cache(maxsize=None)
def ops():
    """The loaded op module (generated wrappers such as `tf_sok_fused_lookup`)."""
    path = library_path()
    module = _module()
    built = build_info()["tensorflow"]
    if built != tf.__version__:
        raise OpLibraryError(f"{path} was built for TensorFlow {built} but TensorFlow {tf.__version__} "
                             f"is installed; {_REBUILD}")
    return module
