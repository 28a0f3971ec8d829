"""The impl/ layer stays free of TensorFlow; ops/ only registers ops."""
import pathlib
import re

CC = pathlib.Path(__file__).resolve().parents[2] / "tf_sok" / "cc"


def test_impl_includes_no_tensorflow_header():
    offenders = []
    for f in sorted((CC / "impl").rglob("*")):
        if f.suffix in (".h", ".cc", ".cu", ".cuh"):
            for line in f.read_text().splitlines():
                if re.match(r'\s*#\s*include\s*[<"](tensorflow|xla|tsl|Eigen|unsupported/Eigen)/', line):
                    offenders.append(f"{f.name}: {line.strip()}")
    assert (CC / "impl" / "lookup_cpu.cc").exists()
    assert offenders == []


def test_ops_files_register_ops_only():
    for f in sorted((CC / "ops").glob("*.cc")):
        text = f.read_text()
        assert "REGISTER_OP" in text
        assert "REGISTER_KERNEL_BUILDER" not in text, f.name
