"""The Criteo examples train for a few steps on synthetic data and on the committed sample."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("example", ["dlrm", "deepfm"])
@pytest.mark.parametrize("data", ["synthetic", "sample"])
def test_example_runs_and_learns(tmp_path, example, data):
    args = ["--steps", "40", "--batch-size", "256", "--eval-batches", "3", "--max-vocab", "20000",
            "--out", str(tmp_path), "--verbose", "0"]
    if data == "sample":
        args += ["--data", os.path.join(ROOT, "examples", "data", "criteo_sample.tsv"), "--format", "tsv"]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"{example}.py"), *args], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"), cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    auc = float(p.stdout.split("AUC ")[-1].split(";")[0])
    assert auc > 0.6, p.stdout
    assert os.path.getsize(tmp_path / "training.png") > 10_000
