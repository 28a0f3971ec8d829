"""The fuzz suite (tests/fuzz/fuzzer.py) at CI size: every case gives the reference result or its
documented error with tables and slots unchanged; none crashes. `benchmarks/fuzz.py` runs more."""
import numpy as np
import tensorflow as tf

import tf_sok as sok
from tests.fuzz import fuzzer

CI_CASES = 1500


def test_fuzz_cases_agree_with_their_references_and_never_crash():
    seed = int(np.random.SeedSequence().entropy % 2**31)   # fresh cases each run; the seed replays them
    result = fuzzer.run_cases(CI_CASES, first_seed=seed, per_child=500)
    print(f"fuzz: {result['cases']} cases from seed {seed}: {sorted(result['counts'].items())}")
    assert result["cases"] == CI_CASES
    assert not result["crashes"], result["crashes"][:3]
    assert not result["failures"], result["failures"][:10]
    faults = sum(v for k, v in result["counts"].items() if not k.endswith("/valid"))
    assert faults > CI_CASES / 4 and len(result["counts"]) > 25   # faults and kinds are all drawn


def test_the_harness_notices_a_wrong_result_and_an_undocumented_error(monkeypatch):
    """The fuzzer can fail: with its NumPy reference replaced by a constant, valid lookups are
    wrong results; a RuntimeError on a faulty case is an undocumented error."""
    sok.init()
    seeds = [s for s in range(200) if fuzzer.Case(s).kind == "lookup" and fuzzer.Case(s).fault is None][:5]
    assert seeds
    monkeypatch.setattr(fuzzer, "np_lookup", lambda *a: np.full((len(a[1]), a[0].shape[1]), 7.5))
    verdicts = [fuzzer.run_one(s, tf, sok)[1] for s in seeds]
    assert "wrong_result" in verdicts, verdicts
    faulty = next(fuzzer.Case(s) for s in range(200) if fuzzer.Case(s).fault)
    assert fuzzer._verdict(faulty, RuntimeError("x"), True).startswith("undocumented_error")
    assert fuzzer._verdict(faulty, ValueError("x"), False) == "state_changed"
