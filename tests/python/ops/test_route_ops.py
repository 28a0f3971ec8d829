"""TfSokRoute (routing of the multi-rank lookup) against a NumPy reference."""

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import np_route, random_route_keys
from tf_sok.python.ops.route_ops import route
from tests.seeds import fresh_seed


@pytest.fixture
def rng():
    return np.random.default_rng(fresh_seed("route"))


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_route_by_owner_matches_numpy(rng, num_ranks):
    for n, max_row in ((0, 10), (1, 10), (5000, 1000), (20000, 1 << 39)):
        keys = random_route_keys(rng, n, 4, max_row)
        owners = [-1, rng.integers(0, num_ranks), -1, num_ranks - 1]
        got = route(tf.constant(keys, tf.int64), num_buckets=num_ranks, table_owner=owners)
        want = np_route(keys, num_ranks, owners)
        assert len(got) == len(want) == 4
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.numpy(), w)
        # each rank receives keys of rows it holds; mapped back to global rows they are the input's
        uniq, splits, position, _ = (x.numpy() for x in got)
        rank = np.repeat(np.arange(num_ranks), splits)
        table, row = uniq >> 40, uniq & ((1 << 40) - 1)
        owner = np.asarray(owners)[table]
        assert np.all((owner < 0) | (owner == rank))
        global_keys = (table << 40) | np.where(owner < 0, row * num_ranks + rank, row)
        np.testing.assert_array_equal(np.sort(global_keys), np.unique(keys))
        np.testing.assert_array_equal(global_keys[position], keys)


def test_route_by_table_matches_numpy(rng):
    keys = random_route_keys(rng, 30000, 5, 100000)
    got = route(tf.constant(keys), num_buckets=5, table_owner=[0] * 5, by_table=True)
    for g, w in zip(got, np_route(keys, 5, None, by_table=True)):
        np.testing.assert_array_equal(g.numpy(), w)
    # unit_splits split per table: the row splits of one key per row
    uniq, splits, _, unit = got
    for t, part in enumerate(tf.split(unit, splits + 1, num=5)):
        np.testing.assert_array_equal(part.numpy(), np.arange(splits[t].numpy() + 1))


def test_route_rejects_keys_of_unknown_tables_and_negative_keys():
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"key 3298534883328 at position 1 names table 3"):
        route(tf.constant([5, 3 << 40], tf.int64), num_buckets=2, table_owner=[-1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"key -4 at position 0"):
        route(tf.constant([-4], tf.int64), num_buckets=2, table_owner=[-1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"table owner 2 is not a rank in \[0, 2\)"):
        route(tf.constant([1], tf.int64), num_buckets=2, table_owner=[2])
