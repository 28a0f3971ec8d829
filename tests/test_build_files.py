"""BUILD (Bazel) lists exactly the C++/CUDA sources setup.py compiles."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bazel_build_lists_every_source():
    build = ROOT / "BUILD"
    listed = set(re.findall(r'"(tf_sok/cc/[^"]+)"', build.read_text()))
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "tf_sok" / "cc").rglob("*")
               if p.suffix in (".cc", ".cu", ".h", ".cuh")}
    assert on_disk, "no sources found"
    assert listed == on_disk
