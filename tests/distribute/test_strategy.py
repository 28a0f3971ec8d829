"""tf.distribute: R replicas x per-replica batch b must train like one device on
the global batch R*b. Each strategy runs in its own process (logical devices are
fixed when TensorFlow starts); the references run here, on one device."""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.horovod import cases, model
from tests.seeds import fresh_seed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIRRORED_SCENARIOS = ["lookups", "training", "fit", "dynamic"]


def _env(gpu=False, exchange="auto"):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               TF_SOK_TEST_DISTRIBUTE_EXCHANGE=exchange,
               TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    if gpu:
        env["TF_SOK_TEST_DISTRIBUTE_GPU"] = "1"
        env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.pop("TF_SOK_TEST_DISTRIBUTE_GPU", None)
    return env


def _load(outdir, scenarios, tasks):
    res = {}
    for s in scenarios:
        for t in range(tasks):
            res.update({f"{s}:{k}": v for k, v in np.load(os.path.join(outdir, f"{s}.task{t}.npz")).items()})
    return res


def start_mirrored(n, scenarios, seed, outdir, gpu=False, exchange="auto"):
    """The mirrored worker, started (finish_mirrored waits for it and reads its results)."""
    cmd = [sys.executable, "-m", "tests.distribute.worker", "mirrored", str(n), str(outdir), str(seed), *scenarios]
    with open(os.path.join(outdir, "worker.log"), "w") as log:  # (a file: a pipe left unread would block it)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(gpu, exchange), stdout=log, stderr=subprocess.STDOUT)
    return proc, scenarios, outdir


def finish_mirrored(started):
    proc, scenarios, outdir = started
    try:
        proc.wait(timeout=900)
    finally:
        proc.kill()
    with open(os.path.join(outdir, "worker.log")) as log:
        assert proc.returncode == 0, log.read()[-9000:]
    return _load(outdir, scenarios, 1)


def run_mirrored(n, scenarios, seed, outdir, gpu=False, exchange="auto"):
    return finish_mirrored(start_mirrored(n, scenarios, seed, outdir, gpu, exchange))


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_multiworker(n, scenarios, seed, outdir):
    """n worker processes on localhost, TF_CONFIG as a cluster manager would set it."""
    import json

    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(n)]}
    procs = []
    for i in range(n):
        env = _env()
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        cmd = [sys.executable, "-m", "tests.distribute.worker", "multiworker", str(n), str(outdir), str(seed),
               *scenarios]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        logs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-8000:]
    return _load(outdir, scenarios, n)


@pytest.fixture(scope="module")
def mirrored_workers(tmp_path_factory):
    """Both device counts' workers, started together (each mostly one core's tracing): {n: (seed, worker)}."""
    workers = {}
    for n in (2, 3):
        seed = fresh_seed(f"MirroredStrategy over {n} logical CPU devices")
        workers[n] = seed, start_mirrored(n, MIRRORED_SCENARIOS, seed, tmp_path_factory.mktemp(f"mirrored{n}"))
    yield workers
    for _, (proc, _, _) in workers.values():
        proc.kill()


@pytest.fixture(scope="module", params=[2, 3], ids=["2devices", "3devices"])
def mirrored(request, mirrored_workers):
    n = request.param
    seed, started = mirrored_workers[n]
    return n, seed, finish_mirrored(started)


@pytest.fixture(scope="module")
def multiworker(tmp_path_factory):
    seed = fresh_seed("MultiWorkerMirroredStrategy, 2 workers")
    return 2, seed, run_multiworker(2, ["lookups", "training_adam", "fit", "dynamic"], seed,
                                    tmp_path_factory.mktemp("mwms"))


def check_lookups(n, seed, res, modes):
    ref_out, ref_grad = model.single_process_lookup(seed, n)
    starts = np.cumsum([0] + [cases.batch_size(0, r) for r in range(n)])
    for r in range(n):
        for reduction in ("sum", "mean"):
            for mode in modes:
                for name, _, _, _ in cases.FEATURES:
                    np.testing.assert_allclose(res[f"lookups:{reduction}/{mode}/out/{name}/{r}"],
                                               ref_out[name][starts[r]:starts[r + 1]], rtol=1e-5, atol=1e-6)
                for table in cases.TABLES:
                    expect = ref_grad[table][cases.local_rows(table, r, n)] / (n if reduction == "mean" else 1)
                    np.testing.assert_allclose(res[f"lookups:{reduction}/{mode}/grad/{table}/{r}"], expect,
                                               rtol=1e-5, atol=1e-5, err_msg=f"replica {r} {reduction} {mode}")


def check_training(n, seed, res, scenario, optimizers):
    for opt_name in optimizers:
        ref_tables, ref_dense = model.single_process_training(seed, n, opt_name, 1.0)
        for r in range(n):
            for table in cases.TABLES:
                np.testing.assert_allclose(res[f"{scenario}:{opt_name}/{table}/{r}"],
                                           ref_tables[table][cases.local_rows(table, r, n)], rtol=2e-4, atol=2e-5,
                                           err_msg=f"{opt_name} {table} replica {r}")
        np.testing.assert_allclose(res[f"{scenario}:{opt_name}/dense"], ref_dense, rtol=2e-4, atol=2e-5)


def check_fit(n, seed, res):
    ref = model.single_process_fit(seed, n, cases.STEPS)
    for key, value in ref.items():
        if key.startswith("table/"):
            name = key.split("/")[1]
            for r in range(n):
                np.testing.assert_allclose(res[f"fit:fit/table/{name}/{r}"], value[cases.local_rows(name, r, n)],
                                           rtol=2e-4, atol=2e-5, err_msg=f"table {name} replica {r}")
        else:
            np.testing.assert_allclose(res[f"fit:fit/{key}"], value, rtol=2e-4, atol=2e-5, err_msg=key)
    assert sum(k.startswith("table/") for k in ref) == len(cases.TABLES)
    np.testing.assert_array_equal(res["fit:ckpt/after"], res["fit:ckpt/before"])
    np.testing.assert_array_equal(res["fit:ckpt/after_weights_h5"], res["fit:ckpt/before"])


def test_mirrored_lookups_and_gradients_equal_one_device(mirrored):
    n, seed, res = mirrored
    check_lookups(n, seed, res, ("eager", "function"))


def test_mirrored_training_with_every_optimizer_equals_one_device(mirrored):
    n, seed, res = mirrored
    check_training(n, seed, res, "training", cases.OPTIMIZERS)


def test_mirrored_model_fit_equals_one_device_and_checkpoint_restores(mirrored):
    n, seed, res = mirrored
    check_fit(n, seed, res)


def _one_device(seed, steps):
    """The dynamic scenario's model trained on one device on `steps` global batches: (tables, dense
    weight, their results)."""
    from tests.horovod import dynamic_case as dc
    import tf_sok as sok

    sok.init()
    tables = dc.make_tables(seed)
    dense_w = tf.Variable(dc.dense_init())
    dc.train(tables, dense_w, [dc.global_batch(seed, s) for s in range(steps)])
    return tables, dense_w, dc.results(tables, dense_w)


def _swapped_modes(n):
    """The modes the dynamic scenario reloads its dump with."""
    return {"users": f"localized:{n - 1}", "pairs": "distributed", "small": None}


def test_mirrored_dynamic_tables_train_like_one_device(mirrored):
    """Each key ends on its replica's shard (floormod(key, n), or the localized replica) with the value
    one device training on the global batch gives it."""
    from tests.horovod import dynamic_case as dc

    n, seed, res = mirrored
    _check_dynamic(n, res, "dynamic:", _one_device(seed, dc.STEPS)[2], dc.TABLES)


def _check_dynamic(n, res, prefix, ref, modes):
    from tests.horovod import dynamic_case as dc

    np.testing.assert_allclose(res[f"{prefix}dense"], ref["dense"], rtol=1e-4, atol=1e-5)
    for r in range(n):
        np.testing.assert_allclose(res[f"{prefix}small/rows/{r}"], ref["small/rows"][r::n], rtol=1e-4, atol=1e-5)
    for name in dc.TABLES:
        mode = modes[name][1] if isinstance(modes[name], tuple) else modes[name]
        if mode is None:
            continue
        want = dict(zip(ref[f"{name}/keys"].tolist(), ref[f"{name}/values"]))
        got = {}
        for r in range(n):
            keys = res[f"{prefix}{name}/keys/{r}"]
            owner = np.full(len(keys), int(mode.split(":")[1])) if mode.startswith("localized") else np.mod(keys, n)
            assert (owner == r).all(), (name, r)
            got.update(zip(keys.tolist(), res[f"{prefix}{name}/values/{r}"]))
        assert set(got) == set(want), name
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=f"{name} key {k}")


def test_mirrored_dump_loads_under_other_modes_and_in_one_process(mirrored):
    """sok.dump of the dynamic scenario's tables under n replicas: loaded back there with the dynamic
    tables' modes swapped (and host tiers) and trained on equals one device training without a break; loaded in this
    one process it equals the one-device tables at the dump."""
    from tests.horovod import dynamic_case as dc
    import tf_sok as sok

    n, seed, res = mirrored
    _, dense_w, at_dump = _one_device(seed, dc.STEPS)
    loaded = dc.make_tables(seed + 1)
    sok.load(str(res["dynamic:dump_path"]), list(loaded.values()))
    one = dc.results(loaded, dense_w)
    _check_dynamic(1, {f"{k.replace('/rows', '/rows/0').replace('/keys', '/keys/0').replace('/values', '/values/0')}": v
                       for k, v in one.items()}, "", at_dump, {k: "distributed" for k in dc.TABLES} | {"small": None})
    _check_dynamic(n, res, "dynamic:resumed/", _one_device(seed, 2 * dc.STEPS)[2], _swapped_modes(n))


def test_mirrored_misuse_raises_clear_errors(tmp_path):
    res = run_mirrored(2, ["errors"], fresh_seed("errors"), tmp_path)
    assert "supports tf.distribute.MirroredStrategy and MultiWorkerMirroredStrategy; got OneDeviceStrategy" in \
        str(res["errors:unsupported"])
    assert "sok.init() was called outside it" in str(res["errors:init_outside"])
    assert "exchange='nccl' is unavailable on 2 of 2 rank(s)" in str(res["errors:nccl"])
    assert "create tables inside that strategy's scope()" in str(res["errors:create_outside"])
    assert "Call them inside strategy.run" in str(res["errors:cross_replica"])
    assert "model.fit under MirroredStrategy: input 'C1' is a (values, row_splits) pair; Keras splits each batch " \
        "among the 2 replicas" in str(res["errors:pairs"])
    for mode in ("eager", "function"):
        message = str(res[f"errors:bad_id/{mode}"]).replace("\\'", "'")  # graph errors escape quotes
        assert "feature 'clicks' has id 10 on rank 1, outside table 'ta' of 10 rows" in message, message
    np.testing.assert_array_equal(res["errors:table_after"], res["errors:table_before"])  # untouched
    table = res["errors:table_before"]
    full = np.empty_like(table)
    full[0::2], full[1::2] = table[:5], table[5:]  # shards of rows 0,2,.. and 1,3,..
    np.testing.assert_allclose(res["errors:ok"], np.stack([full[1] + full[2], full[3]]), rtol=1e-6)


def test_mirrored_nccl_collectives_are_per_replica_and_independent(tmp_path):
    """The NCCL exchange's graph under MirroredStrategy (traced on CPU devices): each
    replica's collectives run on its own device and communicator, and none waits for
    another replica's — tf.function would otherwise chain them in tracing order (replica
    0's step, then replica 1's), a hang once replica 0's collectives wait for replica 1."""
    n = 2
    res = run_mirrored(n, ["nccl_graph"], fresh_seed("nccl_graph"), tmp_path)
    ops = sorted(k for k in res if k.count("/") == 0 and k.startswith("nccl_graph:op"))
    info = np.stack([res[k] for k in ops])                          # [replica, key, foreign deps]
    kinds = [str(res[k + "/type"]) for k in ops]
    assert "TfSokNcclRouteKeys" in kinds and "TfSokNcclAllToAll" in kinds, kinds
    np.testing.assert_array_equal(info[:, 1], 100 + info[:, 0])    # its replica's communicator
    np.testing.assert_array_equal(np.bincount(info[:, 0], minlength=n), [len(ops) // n] * n)
    np.testing.assert_array_equal(info[:, 2], 0)                     # no other replica's collective upstream


def test_multiworker_lookups_training_and_fit_equal_one_device(multiworker):
    n, seed, res = multiworker
    check_lookups(n, seed, res, ("function",))
    check_training(n, seed, res, "training_adam", ["adam"])
    check_fit(n, seed, res)


def test_multiworker_dynamic_tables_and_dumps_equal_one_device(multiworker):
    """MultiWorkerMirroredStrategy, one process per worker: dynamic tables (with a static one) train
    like one device; a dump of both workers, loaded back with other modes, trains on alike."""
    from tests.horovod import dynamic_case as dc

    n, seed, res = multiworker
    _check_dynamic(n, res, "dynamic:", _one_device(seed, dc.STEPS)[2], dc.TABLES)
    _check_dynamic(n, res, "dynamic:resumed/", _one_device(seed, 2 * dc.STEPS)[2], _swapped_modes(n))


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["framework", "nccl"])
def test_mirrored_over_two_gpus_equals_one_device(tmp_path, exchange):
    """Two GPUs (nvidia-h200-x2), or two logical GPUs on one (the strategy's exchange only:
    NCCL needs a physical GPU per replica). The lookups run eagerly too, where the NCCL
    communicator hands the data to the strategy's collectives."""
    gpus = len(tf.config.list_physical_devices("GPU"))
    if not gpus:
        pytest.skip("no GPU visible to TensorFlow")
    if exchange == "nccl" and gpus < 2:
        pytest.skip(f"the NCCL exchange needs one GPU per replica; {gpus} visible")
    seed = fresh_seed(f"MirroredStrategy over 2 GPUs, {exchange} exchange")
    res = run_mirrored(2, MIRRORED_SCENARIOS, seed, tmp_path, gpu=True, exchange=exchange)
    expected = {"framework": "StrategyCommunicator", "nccl": "NcclCommunicator"}[exchange]
    assert all(str(res[f"{s}:communicator"]) == expected for s in MIRRORED_SCENARIOS), res["lookups:communicator"]
    check_lookups(2, seed, res, ("eager", "function"))
    check_training(2, seed, res, "training", cases.OPTIMIZERS)
    check_fit(2, seed, res)
    # the dynamic tables (and, after the dump, host tiers on every table) against one CPU device
    from tests.horovod import dynamic_case as dc
    with tf.device("/CPU:0"):
        _check_dynamic(2, res, "dynamic:", _one_device(seed, dc.STEPS)[2], dc.TABLES)
        _check_dynamic(2, res, "dynamic:resumed/", _one_device(seed, 2 * dc.STEPS)[2], _swapped_modes(2))


def test_mirrored_example_trains_and_checkpoints(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "mirrored_dlrm.py"), "--steps", "40",
                        "--batch-size", "1024", "--eval-rows", "8192", "--cpu-devices", "2",
                        "--checkpoint", str(tmp_path / "ckpt")], capture_output=True, text=True,
                       env=_env(), cwd=os.path.join(ROOT, "examples"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 replicas" in p.stdout, p.stdout
    assert float(p.stdout.split("AUC ")[-1].split(";")[0]) > 0.6, p.stdout
    assert os.path.exists(tmp_path / "ckpt_2replicas" / "checkpoint")


def test_dcnv2_example_trains_under_mirrored_strategy(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "dcnv2.py"), "--distribute", "mirrored",
                        "--cpu-devices", "2", "--steps", "60", "--batch-size", "512", "--dim", "8",
                        "--max-vocab", "5000", "--out", str(tmp_path), "--verbose", "0"],
                       capture_output=True, text=True, env=_env(), cwd=os.path.join(ROOT, "examples"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dcnv2: 2 replicas (StrategyCommunicator)" in p.stdout, p.stdout
    assert float(p.stdout.split("AUC ")[-1].split(";")[0]) > 0.6, p.stdout
