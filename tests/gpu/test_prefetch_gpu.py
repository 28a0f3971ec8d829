"""sok.prefetch on the GPU (its moves on a CUDA stream of its own, beside the step): training with it
equals the CPU table without a tier; the keys it brought in are hits at the next lookup."""
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tf_sok.data import zipf_ranks
from tests.helpers import to_ragged
from tests.python.test_dynamic import random_keys
from tests.python.test_hybrid import DIM, OPTIMIZERS, _assert_same_tables, _gib, _slot_widths
from tests.python.test_prefetch import check_lfu_scores_count_the_steps, check_prefetched_keys_are_hits, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                                  reason="no GPU visible to TensorFlow"),
              pytest.mark.usefixtures("tier_keys")]   # every test both ways (tests/gpu/conftest.py)


# (Adam's prefetches move rows on 8 blocks per SM, Adagrad's on the default grid)
@pytest.mark.parametrize("case,blocks_per_sm", [("adagrad", None), ("adam", "8")])
def test_gpu_training_with_prefetch_equals_the_cpu_table_without_a_tier(rng, monkeypatch, case, blocks_per_sm):
    if blocks_per_sm is not None:
        monkeypatch.setenv("TF_SOK_PREFETCH_BLOCKS_PER_SM", blocks_per_sm)
    cls, hp = OPTIMIZERS[case]
    pool = random_keys(rng, 20_000)
    batches, targets = [], []
    for _ in range(12):
        lens = rng.integers(0, 6, 2048)
        batches.append(to_ragged(lens, pool[zipf_ranks(rng, len(pool), int(lens.sum()), 1.05)]))
        targets.append(rng.standard_normal((2048, DIM)).astype(np.float32))
    # a cache of 8,000 rows (40 % of the keys; a batch uses ~2,500): room for the prefetches
    budget = _gib(8000, [DIM] + _slot_widths(cls(learning_rate=0.05, **hp)))
    with tf.device("/GPU:0"):
        gpu = sok.DynamicVariable(DIM, initializer="normal", seed=4, name=f"pf_{case}_gpu", var_type="hybrid",
                                  max_hbm_for_vectors=budget)
    with tf.device("/CPU:0"):
        cpu = sok.DynamicVariable(DIM, initializer="normal", seed=4, name=f"pf_{case}_cpu")
    opt_g, opt_c = cls(learning_rate=0.05, **hp), cls(learning_rate=0.05, **hp)
    out_g = train(gpu, opt_g, batches, targets, True, "/GPU:0")
    out_c = train(cpu, opt_c, batches, targets, False, "/CPU:0")
    for a, b in zip(out_g, out_c):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    _assert_same_tables(gpu, cpu, opt_g, opt_c, atol=2e-5, rtol=1e-4)
    stats = sok.cache_stats(gpu)
    assert stats["prefetched"] > 0 and stats["evicted"] > 0


def test_gpu_prefetched_keys_are_hits_at_the_next_lookup(rng):
    check_prefetched_keys_are_hits(rng, "/GPU:0", "pf_gpu_hits", keys=30_000, cache_rows=9_000, batch=3_000,
                                   steps=20)


@pytest.mark.parametrize("budget_rows,with_prefetch", [(16, False), (60, True)])
def test_gpu_lfu_scores_count_every_step_that_used_a_key(rng, budget_rows, with_prefetch):
    """The GPU cache's LFU scores carried over its host tier (the eviction kernel's scores, the add
    after the store plan, a prefetch on its stream): every cached key's score is its number of batches."""
    check_lfu_scores_count_the_steps(rng, "/GPU:0", f"lfu_count_gpu_{budget_rows}_{with_prefetch}", budget_rows,
                                     with_prefetch)
