"""Blocks laid out batch by batch, the aligned slices that cut them, and the worker processes'
shared-memory slabs, against plain NumPy / Python references on fresh random data."""
import gc
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_sok.data as sd
from tf_sok.python.data import block_workers
from tf_sok.python.data.blocks import ALIGN, aligned_slices, batched_ragged, splits_stride


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_batched_ragged_puts_each_batch_aligned_with_splits_from_zero(rng, id_dtype):
    for _ in range(6):
        rows = int(rng.integers(0, 300))
        lengths = rng.integers(0, 6, rows) * (rng.random(rows) < 0.8)
        ids = rng.integers(0, 2**31 - 1, int(lengths.sum()))
        cut = np.sort(rng.integers(0, len(ids) + 1, int(rng.integers(0, 4))))   # the ids in 1-4 chunks
        parts = np.split(ids.astype(rng.choice([np.int32, np.int64])), cut)
        batch = int(rng.choice([1, 3, 16, 100, 1000]))
        values, splits, cuts = batched_ragged(parts, np.cumsum(lengths), batch, id_dtype)
        assert values.dtype == id_dtype and splits.dtype == np.int64
        rows_of = [[int(x) for x in r] for r in np.split(ids, np.cumsum(lengths)[:-1])] if rows else []
        assert len(cuts) == -(-rows // batch)
        stride = splits_stride(batch)
        for j in range(len(cuts)):
            want = rows_of[j * batch:(j + 1) * batch]
            lo, hi = cuts[j]
            assert (values.ctypes.data + lo * values.itemsize) % ALIGN == 0
            assert values[lo:hi].tolist() == [x for r in want for x in r]
            s = splits[j * stride:j * stride + len(want) + 1]
            assert (splits.ctypes.data + j * stride * 8) % ALIGN == 0
            assert s.tolist() == np.concatenate([[0], np.cumsum([len(r) for r in want])]).tolist()


def test_aligned_slices_equal_numpy_slices_and_name_rows_outside_the_input(rng):
    arrays = [rng.random((int(rng.integers(1, 400)), 13)).astype(np.float32),
              rng.integers(-9, 9, int(rng.integers(1, 1000))).astype(np.int32),
              rng.integers(-9, 9, int(rng.integers(1, 1000))),
              rng.random(int(rng.integers(1, 50))) < 0.5]
    tensors = [tf.constant(a) for a in arrays]
    for _ in range(20):
        begin = [int(rng.integers(0, len(a) + 1)) for a in arrays]
        end = [int(rng.integers(b, len(a) + 1)) for a, b in zip(arrays, begin)]
        got = aligned_slices(tensors, begin, end)
        for a, b, e, g in zip(arrays, begin, end, got):
            assert g.dtype == tf.as_dtype(a.dtype)
            np.testing.assert_array_equal(g.numpy(), a[b:e])
    n = len(arrays[1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"rows \[3, {n + 1}\) of input 1 are outside its {n} rows"):
        aligned_slices(tensors, [0, 3, 0, 0], [1, n + 1, 1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rows \[2, 1\) of input 0"):
        aligned_slices(tensors, [2, 0, 0, 0], [1, 1, 1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"one bound per input \(4\)"):
        aligned_slices(tensors, [0, 0, 0], [1, 1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"input 0 is a int32 of shape \[\]"):
        aligned_slices([tf.constant(3)], [0], [0])


def _rows(batches):
    """Each row of read batches: (dense, label, {feature: ids})."""
    out = []
    for dense, cats, label in batches:
        lists = {n: r.to_list() for n, r in cats.items()}
        for i in range(len(label)):
            out.append((dense[i].numpy().tolist(), float(label[i, 0]), {n: lists[n][i] for n in lists}))
    return out


def _write(path, rows, config, seed):
    sd.write_parquet(sd.raw_batches(rows, min(rows, 500), config, seed=seed), path, config.schema)


def test_worker_blocks_reuse_slabs_only_after_their_batches_are_released(tmp_path, rng):
    """Read with worker processes: batches held by the caller keep their slab (a second read makes
    new slabs instead of writing over them, and the held batches stay equal to the reference);
    released, the slabs are reused by the next read; a block larger than the slabs comes back in a
    file of its own and makes later slabs larger. Every read equals the same files read in one
    process (the reference: no slabs, blocks in plain memory)."""
    schema = sd.CriteoSchema.capped(1000)
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir(), large.mkdir()
    seed = int(rng.integers(0, 2**31))
    for k in range(2):
        _write(str(small / f"p{k}.parquet"), int(rng.integers(700, 1200)), sd.SyntheticConfig(schema=schema), seed + k)
    _write(str(large / "p.parquet"), 6000, sd.SyntheticConfig.dcnv2(schema), seed + 7)
    batch, block_rows = int(rng.integers(20, 60)), 128

    def read(d, rows=block_rows, **kw):
        return sd.read_parquet(str(d), batch, parallel_files=2, block_rows=rows, id_dtype=tf.int32, **kw)

    want = _rows(read(small))
    store = block_workers.slabs()
    held = list(read(small, workers=2))
    assert _rows(held) == want
    assert store.settled()   # the maker has its spare slabs ready
    made, in_slabs = store.stats["slabs"], store.stats["blocks_in_slabs"]
    again = list(read(small, workers=2))
    assert store.stats["blocks_in_slabs"] > in_slabs
    assert store.settled() and store.stats["slabs"] > made   # the spare ones were taken and held: new ones
    assert _rows(held) == want and _rows(again) == want
    del held, again
    gc.collect()
    made, in_slabs = store.stats["slabs"], store.stats["blocks_in_slabs"]
    assert _rows(read(small, workers=2)) == want
    assert store.stats["blocks_in_slabs"] - in_slabs > store.stats["slabs"] - made   # slabs reused
    size, in_files = store.size, store.stats["blocks_in_files"]
    # blocks of 4096 DCNv2 rows (multi-hot): several MB, larger than the slabs so far
    assert _rows(read(large, 4096, workers=2)) == _rows(read(large, 4096))
    assert store.stats["blocks_in_files"] > in_files and store.size > size


def test_workers_end_with_the_process_that_started_them(tmp_path):
    """A reading process killed mid-read leaves no worker processes behind."""
    schema = sd.CriteoSchema.capped(1000)
    _write(str(tmp_path / "p.parquet"), 400, sd.SyntheticConfig(schema=schema), 3)
    script = f"""
import os, signal, tensorflow as tf, tf_sok.data as sd
from tf_sok.python.data import block_workers
ds = sd.read_parquet({str(tmp_path)!r}, 16, block_rows=32, workers=2)
next(iter(ds))
pool = block_workers._pool(2)
print(" ".join(str(p) for p in pool._processes), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 2, run.stderr[-2000:]
    deadline = time.time() + 60
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
