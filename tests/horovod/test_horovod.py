"""Multi-process behaviour through the real launcher (horovodrun, Gloo): N ranks
must give what one process gives on the concatenated global batch."""
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.horovod import cases, model
from tests.seeds import fresh_seed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import horovod.runner.launch  # noqa: F401  (horovodrun's entry point, run with this interpreter)
    HOROVOD = True
except ImportError:
    HOROVOD = False
pytestmark = pytest.mark.skipif(not HOROVOD, reason="Horovod not installed (make test installs it)")

GPUS = 0
if os.environ.get("TF_SOK_TEST_HOROVOD_GPU") == "1":
    # the workers take the GPUs; the single-process references here run on the CPU, and must not
    # reserve GPU memory the workers' NCCL communicators need
    GPUS = len(tf.config.list_physical_devices("GPU"))
    tf.config.set_visible_devices([], "GPU")


# N ranks' training against one process's on the global batch: float32 sums in another order
# (per-rank partial sums; Horovod's fusion of tensors into one allreduce, whose chunks follow what was
# ready together, varies from run to run), which Adagrad's early steps amplify (seen: 3.1e-5 on a
# value of 0.08 after 3-rank dynamic training)
TRAINED = dict(rtol=5e-4, atol=2e-5)


def need_gpus(n):
    """In GPU mode each rank needs its own GPU (NCCL rejects two ranks on one)."""
    if os.environ.get("TF_SOK_TEST_HOROVOD_GPU") == "1" and n > GPUS:
        pytest.skip(f"{n} ranks need {n} GPUs, {GPUS} visible")


# How the lookup's data travels: on GPUs both tf_sok's NCCL ops and Horovod's own collectives; on
# the CPU Horovod's (NCCL moves GPU memory only).
EXCHANGES = {"nccl": "NcclCommunicator", "framework": "HorovodCommunicator"} if GPUS else \
    {"auto": "HorovodCommunicator"}


def launch(n, args, timeout=600, exchange="auto", **env_vars):
    """horovodrun -np n over Gloo (as `python -m horovod.runner.launch`, same interpreter). Ranks use the CPU unless TF_SOK_TEST_HOROVOD_GPU=1, where
    each rank takes GPU local_rank (the two-GPU machine)."""
    cmd, env = _launch_command(n, args, exchange, env_vars)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _launch_command(n, args, exchange, env_vars):
    env = {k: v for k, v in os.environ.items() if k != "TF_SOK_COLLECTIVE_TIMEOUT"}
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               TF_CPP_MIN_LOG_LEVEL="2", TF_SOK_EXCHANGE=exchange, **env_vars)
    if os.environ.get("TF_SOK_TEST_HOROVOD_GPU") != "1":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    cmd = [sys.executable, "-m", "horovod.runner.launch", "-np", str(n), "-H", f"localhost:{n}", "--gloo",
           sys.executable, *args]
    return cmd, env


def run_workers(n, scenario, seed, tmp_path, exchange="auto"):
    p = launch(n, ["-m", "tests.horovod.worker", scenario, str(seed), str(tmp_path)], exchange=exchange)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    ranks = [dict(np.load(tmp_path / f"{scenario}.rank{r}.npz")) for r in range(n)]
    for res in ranks:
        if "communicator" in res:
            assert str(res["communicator"]) == EXCHANGES[exchange], (exchange, str(res["communicator"]))
    return ranks


@pytest.fixture
def seed():
    return fresh_seed("horovod case")


# TF_SOK_TEST_HOROVOD_RANKS="4,8" runs the equivalence at other rank counts (e.g. on a GPU machine
# with that many GPUs); CI runs 2, 3 and 4 processes on its CPU cores.
RANKS = [int(n) for n in os.environ.get("TF_SOK_TEST_HOROVOD_RANKS", "2,3,4").split(",")]


@pytest.mark.parametrize("exchange", list(EXCHANGES))
@pytest.mark.parametrize("num_ranks", RANKS)
def test_lookup_and_gradients_equal_single_process(tmp_path, seed, num_ranks, exchange):
    need_gpus(num_ranks)
    ranks = run_workers(num_ranks, "lookups", seed, tmp_path, exchange)
    ref_out, ref_grad = model.single_process_lookup(seed, num_ranks)
    starts = np.cumsum([0] + [cases.batch_size(0, r) for r in range(num_ranks)])
    for r, res in enumerate(ranks):
        for reduction in ("sum", "mean"):
            for mode in ("eager", "function"):
                for name, _, _, _ in cases.FEATURES:
                    np.testing.assert_allclose(res[f"{reduction}/{mode}/out/{name}"],
                                               ref_out[name][starts[r]:starts[r + 1]], rtol=1e-5, atol=1e-6)
                for table in cases.TABLES:
                    rows = cases.local_rows(table, r, num_ranks)
                    expect = ref_grad[table][rows] / (num_ranks if reduction == "mean" else 1)
                    np.testing.assert_allclose(res[f"{reduction}/{mode}/grad/{table}"], expect, rtol=1e-5,
                                               atol=1e-5, err_msg=f"rank {r} {reduction} {mode} {table}")


@pytest.mark.parametrize("exchange", list(EXCHANGES))
@pytest.mark.parametrize("n", RANKS[:1] + RANKS[-1:] if len(RANKS) > 1 else RANKS)
def test_training_with_every_optimizer_equals_single_process(tmp_path, seed, n, exchange):
    """"mean": per-rank mean losses train like one process on the global
    batch. "sum": the owners sum every rank's contributions, i.e. one process
    with the loss summed over ranks (N x the global mean). Dense weights are
    averaged by Horovod either way."""
    need_gpus(n)
    ranks = run_workers(n, "training", seed, tmp_path, exchange)
    for reduction, scale in (("mean", 1.0), ("sum", float(n))):
        for opt_name in cases.OPTIMIZERS:
            ref_tables, ref_dense = model.single_process_training(seed, n, opt_name, scale)
            for r, res in enumerate(ranks):
                for table in cases.TABLES:
                    np.testing.assert_allclose(res[f"{reduction}/{opt_name}/{table}"],
                                               ref_tables[table][cases.local_rows(table, r, n)],
                                               rtol=2e-4, atol=2e-5, err_msg=f"{reduction} {opt_name} {table}")
                np.testing.assert_allclose(res[f"{reduction}/{opt_name}/dense"], ref_dense, rtol=2e-4, atol=2e-5)
            for r in range(1, n):
                np.testing.assert_array_equal(ranks[0][f"{reduction}/{opt_name}/dense"],
                                              ranks[r][f"{reduction}/{opt_name}/dense"])


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", RANKS)
def test_nccl_alltoall_allgather_and_gradient_match_numpy(tmp_path, seed, num_ranks):
    """tf_sok's NCCL collectives (GPU ranks only) against the same exchange done in NumPy."""
    if not GPUS:
        pytest.skip("NCCL collectives need a GPU per rank (TF_SOK_TEST_HOROVOD_GPU=1 on a GPU machine)")
    need_gpus(num_ranks)
    ranks = run_workers(num_ranks, "collectives", seed, tmp_path, "nccl")
    sizes, xs, keys, upstream = cases.alltoall_case(seed, num_ranks)
    starts = np.concatenate([np.zeros((num_ranks, 1), np.int64), np.cumsum(sizes, 1)], 1)   # row offsets per sender
    for d, res in enumerate(ranks):
        want_y = np.concatenate([xs[s][starts[s, d]:starts[s, d + 1]] for s in range(num_ranks)])
        want_keys = np.concatenate([keys[s][starts[s, d]:starts[s, d + 1]] for s in range(num_ranks)])
        # rank d's gradient: for the rows it sent rank p, what p's upstream holds at their place
        recv_starts = [np.concatenate([[0], np.cumsum(sizes[:, p])]) for p in range(num_ranks)]
        want_grad = np.concatenate([upstream[p][recv_starts[p][d]:recv_starts[p][d + 1]] for p in range(num_ranks)])
        for mode in ("eager", "function"):
            np.testing.assert_array_equal(res[f"{mode}/y"], want_y)
            np.testing.assert_array_equal(res[f"{mode}/recv"], sizes[:, d])
            np.testing.assert_array_equal(res[f"{mode}/keys"], want_keys)
            np.testing.assert_array_equal(res[f"{mode}/every"], [[r, 7 * r - 3] for r in range(num_ranks)])
            np.testing.assert_array_equal(res[f"{mode}/grad"], want_grad.reshape(-1, 3))


def test_bad_configurations_raise_on_every_rank(tmp_path, seed):
    ranks = run_workers(2, "bad_configs", seed, tmp_path)
    for r, res in enumerate(ranks):
        if not GPUS:
            assert "exchange='nccl' is unavailable on 2 of 2 rank(s); on this rank: this process sees no GPU" in \
                str(res["nccl"]) or "built without CUDA" in str(res["nccl"])
        assert "ranks declare different tables" in str(res["shape"]) and "'mismatch'" in str(res["shape"])
        assert "mode 'localized:2' needs rank 2, but there are 2 rank(s)" in str(res["localized"])
        assert "ranks disagree on lookup step" in str(res["order"])
        assert "feature 'clicks' has id 10 on rank 1, outside table 'ta' of 10 rows" in str(res["id"])
        # a static table with a host tier: the same error on every rank before any key moves
        assert "feature views on rank 1: id 10 is outside [0, 10) of table tiered" in str(res["tier_id"])
        assert int(res["tier_held"]) == 0
        # the localized tiered table: rows from rank 0's host tier, as NumPy sums them
        init = res["shelf_init"]
        np.testing.assert_allclose(res["shelf_out"], [init[r] + init[8], init[5 - r] + init[0] + init[2]],
                                   rtol=1e-6)
        assert sorted(res["shelf_keys"].tolist()) == (list(range(9)) if r == 0 else [])
        # a budget that holds each rank's shard: plain tables, starting at the tier's rows
        assert str(res["whole_kind"]) == "Variable/DynamicVariable"
        np.testing.assert_allclose(res["whole_out"], res["halves_out"], rtol=1e-6)
        assert np.abs(res["whole_out"]).max() > 0
    # the tables were not touched and the job could go on
    assert ranks[0]["ok"].shape == (2, 4) and ranks[0]["tier_ok"].shape == (2, 4)


def test_model_fit_averages_dense_weights_and_checkpoint_round_trips(tmp_path, seed):
    ranks = run_workers(2, "keras_fit", seed % 1000, tmp_path)
    dense_keys = sorted(k for k in ranks[0] if k.startswith("dense"))
    assert len(dense_keys) >= 6
    for k in dense_keys:  # each rank trained on different data, yet the dense weights agree
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k])
    for res in ranks:
        assert np.mean(res["loss"][-5:]) < np.mean(res["loss"][:5])
        np.testing.assert_array_equal(res["after"], res["before"])
    assert not np.array_equal(ranks[0]["before"], ranks[1]["before"])  # different inputs per rank


def test_dense_weights_made_inside_the_first_step_are_broadcast(tmp_path, seed):
    """Weights Keras makes inside the traced training function have no value before it runs: they
    are broadcast from rank 0 in the first step, so ranks that drew different initial weights hold
    the same ones after training (without the broadcast each would keep its own)."""
    ranks = run_workers(2, "keras_fit_lazy", seed % 1000, tmp_path)
    dense_keys = sorted(k for k in ranks[0] if k.startswith("dense"))
    assert len(dense_keys) == 4
    for k in dense_keys:
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k])
    for res in ranks:
        assert res["loss"][-1] < res["loss"][0]


def test_dcnv2_example_trains_under_horovodrun(tmp_path):
    """examples/dcnv2.py --distribute horovod: 2 ranks, each on its share of the data, learn (the
    exchange and the averaging themselves are checked against one process above)."""
    p = launch(2, [os.path.join(ROOT, "examples", "dcnv2.py"), "--distribute", "horovod", "--steps", "60",
                   "--batch-size", "256", "--dim", "8", "--max-vocab", "5000", "--out", str(tmp_path),
                   "--verbose", "0"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "dcnv2: 2 ranks (HorovodCommunicator)" in p.stdout, p.stdout[-3000:]
    auc = float(re.search(r"held-out loss [0-9.]+, AUC ([0-9.]+)", p.stdout).group(1))
    assert auc > 0.6, p.stdout[-3000:]


def test_a_dead_rank_stops_the_job_in_bounded_time(tmp_path):
    t0 = time.time()
    p = launch(2, ["-m", "tests.horovod.worker", "rank_dies", "0", str(tmp_path)], timeout=300)
    assert p.returncode != 0
    assert "exit with status code 3" in p.stdout + p.stderr or "Exit code: 3" in p.stdout + p.stderr
    assert time.time() - t0 < 120


DIVERGED = "test_ranks_waiting_on_different_collectives_end_in_bounded_time"


class DivergedJob:
    """The diverging ranks' job (worker rank_skips_lookup) started in the background, its output in a
    file; each rank prints the time it steps into the diverging collectives (rank 0's watchdog counts
    from there)."""

    def __init__(self, outdir, mode_seed, timeout):
        cmd, env = _launch_command(2, ["-m", "tests.horovod.worker", "rank_skips_lookup", str(mode_seed),
                                       str(outdir)], "auto",
                                   {"TF_SOK_COLLECTIVE_TIMEOUT": timeout} if timeout else {})
        self.log = os.path.join(outdir, "job.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.ended = None   # when the job ended, taken by a thread waiting for it (finish may come much later)
        self.waiter = threading.Thread(target=self._wait, daemon=True)
        self.waiter.start()

    def _wait(self):
        self.proc.wait()
        self.ended = time.time()

    def finish(self, timeout):
        """(exit code, output, seconds from rank 0's step into its collective to the job's end)."""
        self.waiter.join(timeout=timeout)
        self.proc.kill()
        self.waiter.join()
        ended = self.ended
        with open(self.log) as f:
            out = f.read()
        stepped = re.search(r"rank 0: stepping \(\w+\) at ([\d.]+)", out)
        return self.proc.returncode, out, ended - float(stepped.group(1)) if stepped else None


@pytest.fixture(scope="module", autouse=True)
def default_timeout_job(request, tmp_path_factory):
    """The default-timeout case waits the default 90 s: its job starts with this module (where that
    case is to run), so that the wait overlaps the tests before it."""
    wanted = any(item.name == f"{DIVERGED}[function-default-timeout]" for item in request.session.items)
    job = DivergedJob(tmp_path_factory.mktemp("diverged_default"), 1, None) if wanted and HOROVOD else None
    yield job
    if job:
        job.proc.kill()


@pytest.mark.parametrize("mode_seed,timeout", [(0, "5"), (1, "5"), (1, None)],
                         ids=["eager", "function", "function-default-timeout"])
def test_ranks_waiting_on_different_collectives_end_in_bounded_time(tmp_path, mode_seed, timeout,
                                                                    default_timeout_job):
    """Rank 1 runs a lookup fewer and then an allreduce of its own: rank 0's watchdog ends it
    after TF_SOK_COLLECTIVE_TIMEOUT (default 90 s) naming the collective, and horovodrun stops
    the job (within 30 s of the limit from rank 0's step into its diverging collective)."""
    from tf_sok.python.comm.watchdog import DEFAULT_TIMEOUT_S, EXIT_CODE

    limit = float(timeout or DEFAULT_TIMEOUT_S)
    job = default_timeout_job if timeout is None else DivergedJob(tmp_path, mode_seed, timeout)
    code, out, elapsed = job.finish(timeout=limit + 300)
    assert code != 0, out[-3000:]
    assert elapsed is not None, out[-3000:]
    assert "the diverged step returned" not in out
    assert re.search(r"tf_sok: Horovod allgather 'tf_sok\.check\.\d+' on rank 0 of 2 has waited \d+ s", out), \
        out[-3000:]
    assert f"Exit code: {EXIT_CODE}" in out or f"exit with status code {EXIT_CODE}" in out, out[-3000:]
    assert limit - 1 < elapsed < limit + 30, elapsed


@pytest.mark.parametrize("n, scenario", [(2, "dynamic_training"), (3, "dynamic_training"), (2, "sok_script"),
                                         (3, "hybrid_training"), (2, "filtered_hybrid_training")])
def test_dynamic_tables_train_like_one_process(tmp_path, seed, n, scenario):
    """Each key ends on its owner (floormod(key, n), or the localized rank) with the value one
    process training on the global batch gives it; dense weights alike. sok_script: written as
    SOK's scripts are (comm_tool, OptimizerWrapper over a tf_keras legacy optimizer). hybrid_training:
    the ranks' tables, static and dynamic, have host tiers (3 cached rows) and prefetch each next
    batch's keys, the one process's none; filtered_hybrid_training: so, under the low-frequency
    filter (ratio 0.5) in both. Then each rank reads its slice of a batch with training=False (keys
    new to the tables among them) before its results are taken: the outputs are the one process's,
    and no table changed."""
    import tf_keras

    from tests.horovod import dynamic_case as dc
    import tf_sok as sok

    need_gpus(n)
    ranks = run_workers(n, scenario, seed, tmp_path)
    sok.init()
    tables = dc.make_tables(seed)
    dense_w = tf.Variable(dc.dense_init())
    sparse_opt = sok.OptimizerWrapper(tf_keras.optimizers.legacy.Adagrad(0.05)) if scenario == "sok_script" else None
    hybrid = scenario in ("hybrid_training", "filtered_hybrid_training")
    pool = dc.HYBRID_POOL if hybrid else 30
    batches = [dc.global_batch(seed, s, pool, hybrid) for s in range(dc.STEPS)]
    dc.train(tables, dense_w, batches, sparse_opt=sparse_opt, **(dc.FILTER if scenario.startswith("filtered") else {}))
    ref = dc.results(tables, dense_w)
    if scenario != "sok_script":   # (written as SOK's scripts are: no lookup without training)
        read = dc.read_outputs(tables, dc.read_batch(seed))
        b = dc.GLOBAL_BATCH // n
        for r, res in enumerate(ranks):
            np.testing.assert_allclose(res["read"], read[r * b:(r + 1) * b], **TRAINED, err_msg=f"rank {r}")
    if scenario.startswith("filtered"):   # the filter left keys out (they read zeros, on one process as on N)
        used = {int(k) for feats, _ in batches for f in ("u", "u2") for k in feats[f][1]}
        assert len(ref["users/keys"]) < len(used)
    for r, res in enumerate(ranks):
        np.testing.assert_allclose(res["dense"], ref["dense"], **TRAINED)
        np.testing.assert_allclose(res["small/rows"], ref["small/rows"][r::n], **TRAINED)
    for name, (_, mode) in dc.TABLES.items():
        if mode is None:
            continue
        want = dict(zip(ref[f"{name}/keys"].tolist(), ref[f"{name}/values"]))
        got = {}
        for r, res in enumerate(ranks):
            keys = res[f"{name}/keys"]
            owner = np.full(len(keys), int(mode.split(":")[1])) if mode.startswith("localized") else np.mod(keys, n)
            assert (owner == r).all(), (name, r, keys[owner != r])
            got.update(zip(keys.tolist(), res[f"{name}/values"]))
        assert set(got) == set(want), name
        for k in want:
            np.testing.assert_allclose(got[k], want[k], **TRAINED, err_msg=f"{name} key {k}")



def test_dump_at_three_ranks_loads_at_one_two_and_four(tmp_path, seed):
    """sok.dump under horovodrun -np 3 (static + dynamic tables, Adam state), sok.load under 1, 2 and 4
    ranks with the dynamic tables' modes swapped (distributed <-> localized), then STEPS more steps:
    equal to one process training all 2 * STEPS global batches without a break."""
    from tests.horovod import dynamic_case as dc
    import tf_sok as sok

    need_gpus(4)
    p = launch(3, ["-m", "tests.horovod.worker", "dump_tables", str(seed), str(tmp_path)])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    sok.init()
    tables = dc.make_tables(seed)
    dense_w = tf.Variable(dc.dense_init())
    dc.train(tables, dense_w, [dc.global_batch(seed, s) for s in range(dc.STEPS)])
    at_dump = dc.results(tables, dense_w)
    for r in range(3):         # sok.incremental_model_dump gathered every rank's keys on each rank
        got = np.load(tmp_path / f"dump_tables.rank{r}.npz")
        want = dict(zip(at_dump["users/keys"].tolist(), at_dump["users/values"]))
        assert sorted(got["touched_keys"].tolist()) == sorted(want)
        for k, v in zip(got["touched_keys"], got["touched_values"]):
            np.testing.assert_allclose(v, want[int(k)], **TRAINED)
    tables = dc.make_tables(seed)
    dense_w = tf.Variable(dc.dense_init())
    dc.train(tables, dense_w, [dc.global_batch(seed, s) for s in range(2 * dc.STEPS)])
    ref = dc.results(tables, dense_w)
    for m in (1, 2, 4):
        p = launch(m, ["-m", "tests.horovod.worker", "load_tables", str(seed), str(tmp_path)])
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        ranks = [dict(np.load(tmp_path / f"load_tables.rank{r}.npz")) for r in range(m)]
        for r, res in enumerate(ranks):
            np.testing.assert_allclose(res["dense"], ref["dense"], **TRAINED)
            np.testing.assert_allclose(res["small/rows"], ref["small/rows"][r::m], **TRAINED)
        for name in ("users", "pairs"):
            owner = {"users": lambda k: np.full(len(k), m - 1), "pairs": lambda k: np.mod(k, m)}[name]
            got = {}
            for r, res in enumerate(ranks):
                keys = res[f"{name}/keys"]
                assert (owner(keys) == r).all(), (m, name, r)
                got.update(zip(keys.tolist(), res[f"{name}/values"]))
            want = dict(zip(ref[f"{name}/keys"].tolist(), ref[f"{name}/values"]))
            assert set(got) == set(want), (m, name)
            for k in want:
                np.testing.assert_allclose(got[k], want[k], **TRAINED, err_msg=f"m={m} {name} key {k}")
