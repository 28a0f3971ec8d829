"""The Criteo examples train for a few steps on synthetic data, on the committed sample,
and on the converter's output with default settings on both sides."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SAMPLE = os.path.join(ROOT, "examples", "data", "criteo_sample.tsv")


# warnings a newcomer's first run used to print: AutoGraph unable to read the example's lambdas,
# Keras' "ran out of data" at the end of each epoch's held-out batches, Keras' shuffle note
NOISE = ("AutoGraph could not transform", "Your input ran out of data", "`shuffle=True` was passed")


def run(args, cwd=ROOT):
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert not [n for n in NOISE if n in p.stdout + p.stderr], p.stderr[-3000:]
    return p.stdout


def held_out_auc(stdout):
    return float(stdout.split("AUC ")[-1].split(";")[0])


@pytest.mark.parametrize("example", ["dlrm", "deepfm"])
@pytest.mark.parametrize("data", ["synthetic", "sample"])
def test_example_runs_and_learns(tmp_path, rng, example, data):
    # synthetic data: 80 steps, of which 60 train (3 epochs of 20, whole executions of
    # steps_per_execution=10) -- at 40 the held-out AUC of a rare initialization stayed near 0.52;
    # the sample's 4,000 lines are 16 batches: every 10th is held out, the others train all 30 steps
    steps, trained = (80, 60) if data == "synthetic" else (40, 30)
    args = ["--steps", str(steps), "--batch-size", "256", "--max-vocab", "20000", "--out", str(tmp_path),
            "--verbose", "0", "--seed", str(int(rng.integers(0, 2**31)))]
    if data == "sample":
        args += ["--data", SAMPLE, "--format", "tsv"]
    out = run([os.path.join(ROOT, "examples", f"{example}.py"), *args])
    assert held_out_auc(out) > 0.6, out
    assert f": {trained} steps in" in out, out
    assert os.path.getsize(tmp_path / "training.png") > 10_000
    assert os.listdir(tmp_path / "tensorboard")


def test_convert_then_train_with_defaults(tmp_path):
    """The converter's schema (here Criteo's cardinalities capped at 5,000) reaches the model's tables
    without any --max-vocab on the training side."""
    run(["-m", "tf_sok.data.convert", "--input", SAMPLE, "--output", str(tmp_path / "pq"), "--format", "parquet",
         "--max-vocab", "5000"])
    out = run([os.path.join(ROOT, "examples", "dlrm.py"), "--data", str(tmp_path / "pq"), "--steps", "20",
               "--batch-size", "256", "--out", str(tmp_path / "o"), "--verbose", "0"])
    assert held_out_auc(out) > 0.5, out
    # the blocks built by worker processes (what --reader-workers auto picks on a GPU machine)
    out = run([os.path.join(ROOT, "examples", "dlrm.py"), "--data", str(tmp_path / "pq"), "--steps", "20",
               "--batch-size", "256", "--out", str(tmp_path / "w"), "--verbose", "0", "--reader-workers", "2"])
    assert held_out_auc(out) > 0.5, out
    # tables smaller than the data's vocabulary: one clear error naming both sizes, before training
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "dlrm.py"), "--data", str(tmp_path / "pq"),
                        "--steps", "20", "--max-vocab", "1000"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode != 0 and "C3: data has 5,000 ids, table 1,000 rows" in p.stderr, p.stderr[-2000:]


def test_dcnv2_small_runs_and_learns(tmp_path):
    out = run([os.path.join(ROOT, "examples", "dcnv2.py"), "--steps", "60", "--batch-size", "512", "--dim", "16",
               "--max-vocab", "5000", "--out", str(tmp_path), "--verbose", "0"])
    assert held_out_auc(out) > 0.6, out


@pytest.mark.parametrize("prefetch", [False, True])
def test_dlrm_with_host_tiers_learns_on_a_cache_smaller_than_its_tables(tmp_path, prefetch):
    """--host-tier-gib: every table's rows in host memory, 200 rows (values and Adam's two moments) cached;
    --prefetch: each step prefetches the next batch's ids (1,000 rows cached: room for them). The
    tables whose rows with four arrays of state fit the budget are held whole instead."""
    import tf_sok.data as sd

    rows = 1000 if prefetch else 200
    gib = rows * 4 * 3 * 16 / 2**30
    out = run([os.path.join(ROOT, "examples", "dlrm.py"), "--steps", "40", "--batch-size", "256", "--max-vocab",
               "20000", "--dim", "16", "--host-tier-gib", repr(gib), "--out", str(tmp_path), "--verbose", "0"]
              + (["--prefetch"] if prefetch else []))
    assert held_out_auc(out) > 0.6, out
    vocab = sd.CriteoSchema.capped(20000).vocab_sizes
    whole = sum(1 for v in vocab if v * 16 * 4 * 4 <= round(gib * 2**30))
    assert 0 < whole < 26
    line = next(l for l in out.splitlines() if f"host tier, {26 - whole} tables ({whole} more held whole" in l)
    rate = float(line.split("hit rate ")[1].split(",")[0])
    cached, held = (int(x.replace(",", "")) for x in line.split("MB over the host link, ")[1].split(" rows")[0]
                    .split(" of "))
    prefetched = int(line.split("cached, ")[1].split(" keys prefetched")[0].replace(",", ""))
    # a table caches its budget's rows, or a batch's keys at most when they exceed it (20000-row tables)
    assert 0 < rate < 1 and cached <= (26 - whole) * max(rows, 256 * 2) and cached < held, line
    assert (prefetched > 0) == prefetch, line


@pytest.mark.parametrize("example", ["dlrm", "dcnv2"])
def test_dense_part_under_xla_trains_as_the_plain_model(example):
    """--jit-dense: the same weights give the same predictions and the same three training steps
    as the model without XLA (XLA's fused float32 kernels may round differently: tolerance 1e-4)."""
    import numpy as np
    import keras

    import tf_sok as sok
    import tf_sok.data as sd

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    module = __import__(example)

    sok.init()
    schema = sd.CriteoSchema.capped(500)
    kwargs = {"cross_rank": 8} if example == "dcnv2" else {}
    cfg = (sd.SyntheticConfig.dcnv2 if example == "dcnv2" else sd.SyntheticConfig)(schema=schema)
    batches = list(sd.for_keras(sd.synthetic(3 * 128, 128, cfg, seed=int(np.random.default_rng().integers(1 << 30)))))
    cls = getattr(module, "DCNv2" if example == "dcnv2" else "DLRM")
    # SGD: Adagrad's first steps from a zero accumulator take the sign of near-zero gradients,
    # which float rounding may flip
    plain, xla = same_weight_models(
        [(lambda jit=jit: cls(schema, 8, jit_dense=jit, **kwargs), batches[0][0]) for jit in (False, True)],
        lambda: sok.keras.Optimizer(dense=keras.optimizers.SGD(0.05), sparse=sok.optimizers.SGD(0.05)))
    np.testing.assert_allclose(xla.predict_on_batch(batches[0][0]), plain.predict_on_batch(batches[0][0]),
                               rtol=1e-4, atol=1e-5)
    for x, y in batches:
        lp, lx = plain.train_on_batch(x, y), xla.train_on_batch(x, y)
        np.testing.assert_allclose(lx, lp, rtol=1e-4)
    for a, b in zip(xla.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("jit", [False, True])
def test_side_by_side_is_tensorflows_concatenation_with_its_gradient(rng, jit):
    """The examples' concatenation (its gradient split by static widths, so no axis tensor goes
    from the forward to the backward XLA function) computes tf.concat and its gradient."""
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from criteo_common import side_by_side

    widths = [int(w) for w in rng.integers(1, 9, int(rng.integers(2, 6)))]
    parts = [tf.constant(rng.standard_normal((7, w)).astype(np.float32)) for w in widths]
    upstream = tf.constant(rng.standard_normal((7, sum(widths))).astype(np.float32))

    def both(xs):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(xs)
            ours, theirs = side_by_side(xs), tf.concat(xs, axis=-1)
            lo, lt = tf.reduce_sum(ours * upstream), tf.reduce_sum(theirs * upstream)
        return ours, theirs, tape.gradient(lo, xs), tape.gradient(lt, xs)
    ours, theirs, g_ours, g_theirs = tf.function(both, jit_compile=True)(parts) if jit else both(parts)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    for a, b, w in zip(g_ours, g_theirs, widths):
        assert a.shape == (7, w)
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("example", ["dlrm", "dcnv2", "deepfm"])
def test_example_models_train_on_ragged_pairs_as_on_ragged_tensors(example):
    """The examples feed a GPU their ragged ids as (values, row_splits) pairs (criteo_common.on_gpu):
    each example model with the same weights gives the same predictions and three training steps
    (losses, then weights) on pairs as on RaggedTensors, on fresh random batches."""
    import numpy as np
    import keras

    import tf_sok as sok
    import tf_sok.data as sd

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    module = __import__(example)

    sok.init()
    schema = sd.CriteoSchema.capped(400)
    cfg = (sd.SyntheticConfig.dcnv2 if example == "dcnv2" else sd.SyntheticConfig)(schema=schema)
    seed = int(np.random.default_rng().integers(1 << 30))
    ragged = list(sd.for_keras(sd.synthetic(3 * 96, 96, cfg, seed=seed)))
    pairs = list(sd.for_keras(sd.synthetic(3 * 96, 96, cfg, seed=seed), ragged_pairs=True))
    assert isinstance(pairs[0][0]["C1"], tuple)
    build = {"dlrm": lambda: module.DLRM(schema, 8), "deepfm": lambda: module.DeepFM(schema, 8),
             "dcnv2": lambda: module.DCNv2(schema, 8, cross_rank=8)}[example]
    on_ragged, on_pairs = same_weight_models(
        [(build, ragged[0][0]), (build, pairs[0][0])],
        lambda: sok.keras.Optimizer(dense=keras.optimizers.Adam(0.01), sparse=sok.optimizers.Adam(0.05)))
    np.testing.assert_allclose(on_pairs.predict_on_batch(pairs[0][0]), on_ragged.predict_on_batch(ragged[0][0]),
                               rtol=1e-5, atol=1e-6)
    for (xr, y), (xp, _) in zip(ragged, pairs):
        np.testing.assert_allclose(on_pairs.train_on_batch(xp, y), on_ragged.train_on_batch(xr, y), rtol=1e-5)
    for a, b in zip(on_pairs.get_weights(), on_ragged.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def same_weight_models(builds, optimizer):
    """Models built by each (build, first input) pair, called once on that input, given the first
    model's weights and compiled with a fresh optimizer() and binary cross-entropy."""
    models = []
    for build, first in builds:
        model = build()
        model(first)
        if models:
            model.set_weights(models[0].get_weights())
        model.compile(optimizer=optimizer(), loss="binary_crossentropy")
        models.append(model)
    return models


def test_a_pool_of_no_synthetic_rows_is_refused_before_training():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "dlrm.py"), "--pool-rows", "0"],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 2 and "--pool-rows must be positive, got 0" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("cores, gpus, arg, want", [
    (16, 1, "auto", 8), (9, 1, "auto", 4), (7, 1, "auto", None), (16, 0, "auto", None),
    (16, 1, "0", None), (16, 0, "3", 3)])
def test_reader_workers_auto_takes_half_the_cores_of_a_gpu_machine(monkeypatch, cores, gpus, arg, want):
    """--reader-workers auto: half the cores on a GPU machine of 8 or more cores (an H200's 16 cores fed
    both models best with 8 reader processes), else threads of the training process (None); a number
    is taken as is, 0 meaning threads."""
    import argparse
    import tensorflow as tf

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import criteo_common

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["GPU"] * gpus)
    assert criteo_common.reader_workers(argparse.Namespace(reader_workers=arg)) == want


@pytest.mark.parametrize("arg", ["-1", "many"])
def test_reader_workers_refuses_what_is_not_a_count(arg):
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import criteo_common

    with pytest.raises(SystemExit, match="--reader-workers: 'auto' or a number of processes"):
        criteo_common.reader_workers(argparse.Namespace(reader_workers=arg))
