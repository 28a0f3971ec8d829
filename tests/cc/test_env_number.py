"""impl::EnvNumber, the reader of the tuning settings (TF_SOK_PREFETCH_BLOCKS_PER_SM, TF_SOK_GATHER_SHARE,
TF_SOK_READ_GATHER_MIN_ROWS): compiled into a small program and run under fresh random values, against
Python's own reading of them."""
import math
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROGRAM = r"""
#include <cstdio>
#include "tf_sok/cc/impl/env.h"
int main() {
  for (int i = 0; i < 2; ++i) {   // (read twice: told once)
    const auto x = tf_sok::impl::EnvNumber("TF_SOK_TEST_SETTING", LO, HI, WHOLE);
    if (x) std::printf("%.17g\n", *x); else std::printf("none\n");
  }
}
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    src = tmp_path_factory.mktemp("env") / "env_number.cc"
    src.write_text(PROGRAM)
    exes = {}

    def make(lo, hi, whole):
        key = (lo, hi, whole)
        if key not in exes:
            exe = src.with_name(f"env_number_{len(exes)}")
            subprocess.run(["g++", "-std=c++17", f"-I{ROOT}", f"-DLO={lo!r}", f"-DHI={hi!r}",
                            f"-DWHOLE={'true' if whole else 'false'}", str(src), "-o", str(exe)], check=True)
            exes[key] = exe
        return exes[key]
    return make


def _expected(value, lo, hi, whole):
    """Python's reading: the number, or None (unset / empty / not a number in range)."""
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except ValueError:
        return None
    if math.isnan(x) or not lo <= x <= hi or (whole and x != math.floor(x)):
        return None
    return x


@pytest.mark.parametrize("lo,hi,whole", [(1.0, 64.0, True), (0.0, 1.0, False), (-1e15, 1e15, True)])
def test_env_number_reads_numbers_in_range_and_tells_of_others(build, rng, lo, hi, whole):
    exe = build(lo, hi, whole)
    span = hi - lo
    values = [None, "", "abc", "8x", " ", str(int(rng.integers(-5, 5)))]
    values += [repr(float(v)) for v in rng.uniform(lo - 0.2 * span, hi + 0.2 * span, 6)]
    values += [str(int(v)) for v in rng.uniform(lo - 0.2 * span, hi + 0.2 * span, 6)]
    for value in values:
        env = {"PATH": "/usr/bin:/bin"} | ({} if value is None else {"TF_SOK_TEST_SETTING": value})
        run = subprocess.run([str(exe)], env=env, capture_output=True, text=True, check=True)
        want = _expected(value, lo, hi, whole)
        got = [None if line == "none" else float(line) for line in run.stdout.split()]
        assert got == [want, want], value
        told = [line for line in run.stderr.splitlines() if "TF_SOK_TEST_SETTING" in line]
        if want is None and value not in (None, ""):
            # named with its value and the range, once for the two reads
            assert len(told) == 1 and f'"{value}"' in told[0] and "is ignored" in told[0], run.stderr
        else:
            assert told == [], run.stderr
