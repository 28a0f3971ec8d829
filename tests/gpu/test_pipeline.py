"""The input pipeline's device path: batches prefetched to the GPU and model.fit on them."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
import tf_sok.data as sd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                                  reason="no GPU visible to TensorFlow")]


def test_prefetch_to_device_gives_the_same_batches_on_the_gpu():
    cfg = sd.SyntheticConfig.dcnv2(sd.CriteoSchema.capped(5_000))
    host = list(sd.for_keras(sd.synthetic(3 * 512, 512, cfg, seed=5)))
    on_gpu = list(sd.for_keras(sd.synthetic(3 * 512, 512, cfg, seed=5), device="/gpu:0"))
    assert len(on_gpu) == 3
    for (hx, hy), (gx, gy) in zip(host, on_gpu):
        assert "GPU" in gx["dense"].device and "GPU" in gx["C21"].values.device
        np.testing.assert_array_equal(gx["dense"].numpy(), hx["dense"].numpy())
        np.testing.assert_array_equal(gx["C21"].row_splits.numpy(), hx["C21"].row_splits.numpy())
        np.testing.assert_array_equal(gx["C21"].values.numpy(), hx["C21"].values.numpy())
        np.testing.assert_array_equal(gy.numpy(), hy.numpy())


def test_batches_from_page_locked_memory_equal_those_from_pageable_memory():
    """to_device copies each batch into page-locked memory first (pinned=True, the default) or
    hands TensorFlow the pageable batch: the same tensors reach the GPU either way."""
    cfg = sd.SyntheticConfig.dcnv2(sd.CriteoSchema.capped(5_000))
    src = sd.for_keras(sd.synthetic(4 * 1024 + 300, 1024, cfg, seed=11, id_dtype=tf.int32), id_dtype=tf.int32)
    pinned = list(sd.to_device(src, "/gpu:0"))
    pageable = list(sd.to_device(src, "/gpu:0", pinned=False))
    pairs = list(sd.to_device(src, "/gpu:0", ragged_pairs=True))   # ragged ids as plain (values, row_splits)
    host = list(src)
    assert len(pinned) == len(pageable) == len(pairs) == len(host) == 5
    for a, b, c, h in zip(pinned, pageable, pairs, host):
        assert all(isinstance(c[0][n], tuple) for n in c[0] if n != "dense")
        for x, y, p, z in zip(tf.nest.flatten(a, expand_composites=True), tf.nest.flatten(b, expand_composites=True),
                              tf.nest.flatten(c), tf.nest.flatten(h, expand_composites=True)):
            assert "GPU" in x.device and "GPU" in y.device and "GPU" in p.device and x.dtype == z.dtype == p.dtype
            np.testing.assert_array_equal(x.numpy(), z.numpy())
            np.testing.assert_array_equal(y.numpy(), z.numpy())
            np.testing.assert_array_equal(p.numpy(), z.numpy())


@pytest.mark.parametrize("pairs", [False, True])   # True: ragged ids as pairs, the loop on the host (the examples')
def test_fit_from_batches_prefetched_to_the_gpu_trains(pairs):
    schema = sd.CriteoSchema.capped(2_000)
    names = list(schema.categorical_names)

    class M(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = sok.layers.EmbeddingCollection(
                tables=[sok.TableConfig(n, v, 8, combiner="mean") for n, v in zip(names, schema.vocab_sizes)],
                feature_to_table={n: n for n in names})
            self.top = keras.layers.Dense(1, activation="sigmoid")

        def call(self, x):
            e = self.emb({n: x[n] for n in names})
            return self.top(tf.concat([x["dense"]] + [e[n] for n in names], 1))

    model = M()
    model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(1e-2), sparse=sok.optimizers.Adam(0.05)),
                  loss="binary_crossentropy", steps_per_execution=5)
    ds = sd.for_keras(sd.synthetic(60 * 1024, 1024, sd.SyntheticConfig(schema=schema), seed=1), device="/gpu:0",
                      ragged_pairs=pairs)
    if pairs:
        sok.keras.loop_on_host(model)
    h = model.fit(ds, epochs=3, steps_per_epoch=20, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0] - 0.01, h.history


def test_parquet_blocks_from_worker_slabs_reach_the_gpu_without_a_host_copy(tmp_path, monkeypatch):
    """read_parquet(workers=2) with TF_SOK_PIN_SLABS=1 builds its blocks in slabs registered with the
    GPU (once a first read sized them): the pinned copy
    before the device passes their ids, row splits and labels through (bytes counted by the op), and
    the batches on the GPU equal those read in one process and kept on the host."""
    from tf_sok.python.data import block_workers

    monkeypatch.setattr(block_workers, "PIN_SLABS", True)   # TF_SOK_PIN_SLABS=1
    schema = sd.CriteoSchema.capped(5_000)
    for k in range(2):
        sd.write_parquet(sd.raw_batches(4096, 1024, sd.SyntheticConfig.dcnv2(schema), seed=20 + k),
                         str(tmp_path / f"p{k}.parquet"), schema)

    def read(**kw):
        return sd.read_parquet(str(tmp_path), 512, parallel_files=2, block_rows=512, id_dtype=tf.int32,
                               drop_remainder=True, **kw)
    host = list(sd.for_keras(read(), ragged_pairs=True))
    list(read(workers=2))   # its first blocks size the slabs
    assert block_workers.slabs().settled()
    before = block_workers.pinned_copy_bytes()
    on_gpu = list(sd.for_keras(read(workers=2), device="/gpu:0", ragged_pairs=True))
    after = block_workers.pinned_copy_bytes()
    assert block_workers.slabs().stats["pinned_bytes"] > 0 and block_workers.slabs().stats["blocks_in_slabs"] > 0
    assert after["passed"] > before["passed"]
    assert len(on_gpu) == len(host) == 16
    for g, h in zip(on_gpu, host):
        for x, y in zip(tf.nest.flatten(g), tf.nest.flatten(h)):
            assert "GPU" in x.device and x.dtype == y.dtype
            np.testing.assert_array_equal(x.numpy(), y.numpy())
