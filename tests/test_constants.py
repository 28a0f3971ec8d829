"""Numbers the C++ kernels and the Python side must agree on: each defined once per language,
compared here with what the built library reports."""
import pathlib
import re

import tensorflow as tf

import tf_sok as sok

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_python_constants_equal_the_librarys():
    from tf_sok.python.comm import nccl
    from tf_sok.python.ops import route_ops

    lib = sok.build_info()["constants"]
    assert lib["table_shift"] == route_ops.TABLE_SHIFT
    assert lib["max_exchange_widths"] == nccl.MAX_WIDTHS
    table = sok.Variable(tf.zeros([5, 2]), name="c")
    from tf_sok.python.ops.loader import ops
    result = ops().tf_sok_fused_lookup(
        tables=[table.handle], ids=[tf.constant([1], tf.int64)], row_splits=[tf.constant([0, 1], tf.int64)],
        weights=[tf.zeros([0])], feature_table=[0], combiners=["sum"], weighted=[False], dims=[2],
        feature_names=["f"], table_names=["c"])
    assert result.status.shape == [lib["status_words"]]          # the op's shape function agrees


def test_bazel_build_names_the_pinned_tensorflow():
    pinned = re.search(r"^tensorflow(?:-cpu)?==([\d.]+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    built = re.search(r'TF_SOK_BUILT_TF_VERSION=\\\\"([\d.]+)\\\\"', (ROOT / "BUILD").read_text()).group(1)
    assert built == pinned == tf.__version__
