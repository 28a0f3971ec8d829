"""Python wrapper of TfSokRoute (the routing of the multi-rank lookup)."""
from typing import Sequence

import tensorflow as tf

from tf_sok.python.ops.loader import ops

TABLE_SHIFT = 40  # keys are (table << TABLE_SHIFT) | row, as in cc/impl/route.h


def route(keys: tf.Tensor, *, num_buckets: int, table_owner: Sequence[int], by_table: bool = False):
    """(unique_keys, bucket_splits, position, unit_splits); see TfSokRoute.

    Example (2 ranks; table 0 row-wise, table 1 on rank 1):
        >>> route(tf.constant([5, (1 << 40) | 3, 5], tf.int64), num_buckets=2, table_owner=[-1, 1])
        # unique_keys [2, (1 << 40) | 3] (row 5 of table 0 is row 2 on rank 1), splits [0, 2], position [0, 1, 0],
        # unit_splits [0, 0, 1, 2]
    """
    return ops().tf_sok_route(keys=keys, num_buckets=num_buckets, table_owner=list(table_owner),
                              by_table=by_table)


tf.no_gradient("TfSokRoute")
