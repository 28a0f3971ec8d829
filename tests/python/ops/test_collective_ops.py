"""What the NCCL collective ops need before they run: the library probe every rank
makes (so that all ranks fall back or fail alike) and its messages. The collectives
themselves run on GPUs: tests/gpu/test_nccl.py, tests/horovod."""
import os
import re
import subprocess
import sys

from tf_sok.python.ops import collective_ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_probe_reports_a_version_or_why_not():
    ok, text = collective_ops.probe()
    if ok:
        assert re.fullmatch(r"\d+\.\d+\.\d+", text), text
    elif collective_ops.available():
        assert text.startswith("cannot open NCCL ("), text
    else:
        assert "built without CUDA" in text


def test_probe_names_the_library_it_could_not_open():
    path = "/nonexistent/dir/libnccl-for-test.so.2"
    code = "from tf_sok.python.ops import collective_ops as c; print(repr(c.probe()))"
    env = dict(os.environ, TF_SOK_NCCL_LIBRARY=path, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    ok, text = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (our own repr of a tuple)
    assert ok is False
    if collective_ops.available():
        assert text.startswith(f"cannot open NCCL ({path}): ") and "TF_SOK_NCCL_LIBRARY" in text, text
    else:
        assert "built without CUDA" in text
