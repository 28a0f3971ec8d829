"""Runs the fuzz suite (tests/fuzz/fuzzer.py) at size: counts per call kind, mode and fault, and
every failure or crash with the seed that replays it.

    python benchmarks/fuzz.py --calls 30000 [--first-seed 0] [--device cpu|gpu] [--jobs 4] [--minutes 10]
        [--json out.json]
"""
import concurrent.futures
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.fuzz.fuzzer import run_cases  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=30000, help="cases in all (about half lookups, 40%% updates)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="gpu: the children see the GPU")
    p.add_argument("--per-child", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=1, help="child processes at once (seed ranges split between them)")
    p.add_argument("--minutes", type=float, default=None, help="stop starting children after this long")
    p.add_argument("--json")
    a = p.parse_args()
    t0 = time.time()
    if a.device == "gpu":   # children at once share the GPU: each takes memory as it needs it
        os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    share = -(-a.calls // a.jobs)
    limit = a.minutes * 60 if a.minutes else None
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        parts = list(pool.map(lambda j: run_cases(min(share, a.calls - j * share), a.first_seed + j * share,
                                                  a.per_child, a.device, limit), range(a.jobs)))
    r = {"counts": {}, "failures": [], "crashes": []}
    for part in parts:
        for k, v in part["counts"].items():
            r["counts"][k] = r["counts"].get(k, 0) + v
        r["failures"] += part["failures"]
        r["crashes"] += part["crashes"]
    r["cases"] = sum(part["cases"] for part in parts)
    by_kind = {}
    for key, n in r["counts"].items():
        by_kind[key.split("/")[0]] = by_kind.get(key.split("/")[0], 0) + n
    print(f"fuzz ({a.device}, {a.jobs} jobs): {r['cases']} cases from seed {a.first_seed} in {time.time() - t0:.0f} s: "
          f"{by_kind}; {len(r['failures'])} failures, {len(r['crashes'])} crashes")
    for f in r["failures"][:20] + r["crashes"][:5]:
        print("  ", f)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    sys.exit(1 if r["failures"] or r["crashes"] else 0)


if __name__ == "__main__":
    main()
