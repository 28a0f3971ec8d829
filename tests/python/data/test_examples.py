"""The Criteo examples train for a few steps on synthetic data, on the committed sample,
and on the converter's output with default settings on both sides."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SAMPLE = os.path.join(ROOT, "examples", "data", "criteo_sample.tsv")


def run(args, cwd=ROOT):
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def held_out_auc(stdout):
    return float(stdout.split("AUC ")[-1].split(";")[0])


@pytest.mark.parametrize("example", ["dlrm", "deepfm"])
@pytest.mark.parametrize("data", ["synthetic", "sample"])
def test_example_runs_and_learns(tmp_path, example, data):
    args = ["--steps", "40", "--batch-size", "256", "--max-vocab", "20000", "--out", str(tmp_path), "--verbose", "0"]
    if data == "sample":
        args += ["--data", SAMPLE, "--format", "tsv"]
    out = run([os.path.join(ROOT, "examples", f"{example}.py"), *args])
    assert held_out_auc(out) > 0.6, out
    # the sample's 4,000 lines are 16 batches: every 10th is held out, the others train all 30 steps
    # (3 epochs of 10, whole executions of steps_per_execution=10)
    assert ": 30 steps in" in out, out
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
    # tables smaller than the data's vocabulary: one clear error naming both sizes, before training
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "dlrm.py"), "--data", str(tmp_path / "pq"),
                        "--steps", "20", "--max-vocab", "1000"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode != 0 and "C3: data has 5,000 ids, table 1,000 rows" in p.stderr, p.stderr[-2000:]


def test_dcnv2_small_runs_and_learns(tmp_path):
    out = run([os.path.join(ROOT, "examples", "dcnv2.py"), "--steps", "60", "--batch-size", "512", "--dim", "16",
               "--max-vocab", "5000", "--out", str(tmp_path), "--verbose", "0"])
    assert held_out_auc(out) > 0.6, out
