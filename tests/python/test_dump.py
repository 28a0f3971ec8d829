"""sok.dump / sok.load: round trips for every optimizer (static and dynamic tables), SOK's file layout read
back with plain NumPy from its documented byte layout, dumps SOK writes (built here byte by byte), deltas,
corrupted / truncated files, and a dump killed part-way (kill -9)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_sok as sok
from tests.python.optimizers.test_optimizers import CASES
from tests.python.test_dynamic import random_keys

DIM = 4
ROWS = 37


def make(cls, hp, evict=False):
    static = sok.Variable(shape=[ROWS, DIM], initializer="uniform", name="emb")
    dyn = sok.DynamicVariable(DIM, initializer="normal", name="dyn", init_capacity=4,
                              **({"max_capacity": 24, "evict_strategy": "lru"} if evict else {}))
    return static, dyn, cls(learning_rate=0.05, **hp)


def train(tables, opt, batches):
    static, dyn = tables
    for ids, keys in batches:
        with tf.GradientTape() as tape:
            a, b = sok.lookup_sparse([static, dyn], [tf.ragged.constant(ids, tf.int64),
                                                     tf.ragged.constant(keys, tf.int64)], combiners=["sum", "mean"])
            loss = tf.reduce_sum(a * a) + tf.reduce_sum(tf.sin(b))
        opt.apply_gradients(zip(tape.gradient(loss, [static, dyn]), [static, dyn]))


def batches(rng, keys, n):
    out = []
    for _ in range(n):
        lens = rng.integers(0, 4, 6)
        out.append(([rng.integers(0, ROWS, k).tolist() for k in lens],
                    [rng.choice(keys, k).tolist() for k in lens]))
    return out


def by_key(var, arrays=()):
    """{key: (value, state...)} of a dynamic table, read through its export."""
    keys, rows = var.export_rows()
    vals = var.sparse_read_rows(rows).numpy()
    states = [tf.gather(a, rows).numpy() for a in arrays]
    return {int(k): [vals[i]] + [s[i] for s in states] for i, k in enumerate(keys.numpy())}


def assert_same(a_tables, a_opt, b_tables, b_opt):
    np.testing.assert_array_equal(a_tables[0].numpy(), b_tables[0].numpy())
    for x, y in zip(a_opt.slots(a_tables[0]), b_opt.slots(b_tables[0])):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    x, y = by_key(a_tables[1], a_opt.slots(a_tables[1])), by_key(b_tables[1], b_opt.slots(b_tables[1]))
    assert sorted(x) == sorted(y)
    for k in x:
        for u, v in zip(x[k], y[k]):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("case", ["sgd", "momentum", "adagrad", "adam", "ftrl", "rmsprop", "adamax", "adadelta"])
def test_round_trip_is_bit_identical_and_training_continues_alike(rng, tmp_path, case):
    cls, hp, _ = CASES[case] if case in CASES else (getattr(sok.optimizers, case.capitalize()), {}, None)
    keys = random_keys(rng, 20)
    work = batches(rng, keys, 6)
    *a, opt_a = make(cls, hp)
    train(a, opt_a, work[:3])
    sok.dump(str(tmp_path / "d"), a, opt_a)
    *b, opt_b = make(cls, hp)
    tf.gather(b[1], random_keys(rng, 5))          # keys the load must drop
    sok.load(str(tmp_path / "d"), b, opt_b)
    assert_same(a, opt_a, b, opt_b)
    assert int(opt_b.iterations.numpy()) == 3
    train(a, opt_a, work[3:])
    train(b, opt_b, work[3:])
    assert_same(a, opt_a, b, opt_b)


def _sok_header(path):
    """SOK's documented header, parsed field by field: name (256 bytes, right-aligned), file type (4,
    big-endian), state name (32), dtype index (4, big-endian)."""
    raw = open(path, "rb").read()
    return raw[:256].decode().strip(), int.from_bytes(raw[256:260], "big"), raw[260:292].decode().strip(), \
        int.from_bytes(raw[292:296], "big"), raw[296:]


def test_files_follow_sok_layout(rng, tmp_path):
    *t, opt = make(sok.optimizers.Adagrad, {"initial_accumulator_value": 0.1})
    train(t, opt, batches(rng, random_keys(rng, 12), 2))
    sok.dump(str(tmp_path / "d"), t, opt)
    files = sorted(os.listdir(tmp_path / "d"))
    assert files == sorted(["emb_0-key", "emb_0-weight", "emb_0-Adagrad-accumulator", "dyn_0-key", "dyn_0-weight",
                            "dyn_0-Adagrad-accumulator", "tf_sok_manifest.json"])
    name, kind, state, dtype, body = _sok_header(tmp_path / "d" / "emb_0-key")
    assert (name, kind, state, dtype) == ("emb", 0, "", 1)
    np.testing.assert_array_equal(np.frombuffer(body, "<i8"), np.arange(ROWS))
    name, kind, state, dtype, body = _sok_header(tmp_path / "d" / "emb_0-weight")
    assert (name, kind, state, dtype) == ("emb", 1, "", 5)
    np.testing.assert_array_equal(np.frombuffer(body, "<f4").reshape(ROWS, DIM), t[0].numpy())
    name, kind, state, dtype, body = _sok_header(tmp_path / "d" / "dyn_0-Adagrad-accumulator")
    assert (name, kind, state, dtype) == ("dyn", 2, "accumulator", 5)
    keys = np.frombuffer(_sok_header(tmp_path / "d" / "dyn_0-key")[4], "<i8")
    assert np.all(np.diff(keys) > 0)                 # sorted, as SOK writes them
    acc = np.frombuffer(body, "<f4").reshape(len(keys), DIM)
    ref = by_key(t[1], opt.slots(t[1]))
    for k, row in zip(keys, acc):
        np.testing.assert_array_equal(row, ref[int(k)][1])
    manifest = json.load(open(tmp_path / "d" / "tf_sok_manifest.json"))
    assert manifest["optimizer"]["class"] == "Adagrad" and manifest["world_size"] == 1
    assert manifest["tables"]["emb"]["rows"] == ROWS and manifest["tables"]["dyn"]["dynamic"]


def _write_sok_file(path, table, kind, state, dtype_index, data):
    with open(path, "wb") as f:
        f.write(table.rjust(256).encode() + kind.to_bytes(4, "big") + state.rjust(32).encode()
                + dtype_index.to_bytes(4, "big") + data.tobytes())


def test_loads_a_dump_written_by_sok(rng, tmp_path):
    """A localized static table (uint64 keys 0..rows-1, as SOK writes it) and a dynamic one, with
    Adagrad's accumulator, no manifest."""
    d = tmp_path / "sok"
    d.mkdir()
    w = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    acc = rng.random((ROWS, DIM)).astype(np.float32)
    perm = rng.permutation(ROWS)
    _write_sok_file(d / "emb_0-key", "", 0, "", 3, perm.astype(np.uint64))
    _write_sok_file(d / "emb_0-weight", "", 1, "", 5, w[perm])
    _write_sok_file(d / "emb_0-Adagrad-accumulator", "", 2, "accumulator", 5, acc[perm])
    keys = random_keys(rng, 9)
    dw, da = rng.standard_normal((9, DIM)).astype(np.float32), rng.random((9, DIM)).astype(np.float32)
    _write_sok_file(d / "dyn_0-key", "", 0, "", 1, keys)
    _write_sok_file(d / "dyn_0-weight", "", 1, "", 5, dw)
    _write_sok_file(d / "dyn_0-Adagrad-accumulator", "", 2, "accumulator", 5, da)
    *t, opt = make(sok.optimizers.Adagrad, {})
    sok.load(str(d), t, opt)
    np.testing.assert_array_equal(t[0].numpy(), w)
    np.testing.assert_array_equal(opt.slots(t[0])[0].numpy(), acc)
    got = by_key(t[1], opt.slots(t[1]))
    assert sorted(got) == sorted(keys.tolist())
    for i, k in enumerate(keys):
        np.testing.assert_array_equal(got[int(k)][0], dw[i])
        np.testing.assert_array_equal(got[int(k)][1], da[i])


def test_deltas_write_only_changes_and_a_chain_loads_to_the_final_tables(rng, tmp_path):
    keys = random_keys(rng, 60)
    *t, opt = make(sok.optimizers.Adam, {}, evict=True)     # max 24 keys, LRU: keys leave between dumps
    train(t, opt, batches(rng, keys[:20], 3))
    sok.dump(str(tmp_path / "base"), t, opt)
    paths = [str(tmp_path / "base")]
    for i in range(3):
        small = [([rng.integers(0, 5, 2).tolist()], [rng.choice(keys, 3).tolist()]) for _ in range(2)]
        train(t, opt, small)
        paths.append(str(tmp_path / f"delta{i}"))
        sok.dump(paths[-1], t, opt, since=paths[-2])
        manifest = json.load(open(os.path.join(paths[-1], "tf_sok_manifest.json")))
        assert manifest["tables"]["emb"]["count"] <= 10      # only touched rows (of 37)
    *u, opt_u = make(sok.optimizers.Adam, {}, evict=True)
    sok.load(paths, u, opt_u)
    assert_same(t, opt, u, opt_u)
    with pytest.raises(ValueError, match="is a delta; load its base first"):
        sok.load(paths[1:], u, opt_u)
    with pytest.raises(ValueError, match="is not a delta of"):
        sok.load([paths[0], paths[2]], u, opt_u)


def _fresh_and_copy(t, opt):
    before = [t[0].numpy()] + [s.numpy() for s in opt.slots(t[0])]
    return before, by_key(t[1], opt.slots(t[1]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "header", "manifest"])
def test_damaged_dump_is_an_error_naming_the_file_and_changes_nothing(rng, tmp_path, damage):
    *t, opt = make(sok.optimizers.Adagrad, {})
    train(t, opt, batches(rng, random_keys(rng, 10), 2))
    sok.dump(str(tmp_path / "d"), t, opt)
    target = tmp_path / "d" / ("dyn_0-Adagrad-accumulator" if damage != "manifest" else "tf_sok_manifest.json")
    raw = bytearray(open(target, "rb").read())
    if damage == "flip":
        raw[-5] ^= 0x10
    elif damage == "truncate":
        raw = raw[:-3]
    elif damage == "header":
        raw[10] ^= 0x01
    elif damage == "manifest":
        raw = raw[:len(raw) // 2]
    if damage == "missing":
        os.remove(target)
    else:
        open(target, "wb").write(bytes(raw))
    *u, opt_u = make(sok.optimizers.Adagrad, {})
    train(u, opt_u, batches(rng, random_keys(rng, 10), 1))
    before_static, before_dyn = _fresh_and_copy(u, opt_u)
    what = {"flip": "corrupted", "truncate": "truncated|bytes of rows", "missing": "missing",
            "header": "header .* corrupted", "manifest": "corrupted"}[damage]
    with pytest.raises(ValueError, match=what) as error:
        sok.load(str(tmp_path / "d"), u, opt_u)
    assert os.path.basename(target) in str(error.value)
    after_static, after_dyn = _fresh_and_copy(u, opt_u)
    for x, y in zip(before_static, after_static):
        np.testing.assert_array_equal(x, y)
    assert sorted(before_dyn) == sorted(after_dyn)


def test_mismatched_tables_and_optimizers_are_clear_errors(rng, tmp_path):
    *t, opt = make(sok.optimizers.Adam, {})
    train(t, opt, batches(rng, random_keys(rng, 10), 1))
    sok.dump(str(tmp_path / "d"), t, opt)
    other = sok.Variable(shape=[ROWS + 1, DIM], name="emb")
    with pytest.raises(ValueError, match=f"table 'emb'.* {ROWS} rows, the model's table has {ROWS + 1}"):
        sok.load(str(tmp_path / "d"), [other])
    wide = sok.DynamicVariable(DIM + 1, name="dyn")
    with pytest.raises(ValueError, match=f"table 'dyn'.*dim {DIM}, the model's is dynamic of dim {DIM + 1}"):
        sok.load(str(tmp_path / "d"), [wide])
    with pytest.raises(ValueError, match="holds the state of Adam, the optimizer given is Adagrad"):
        sok.load(str(tmp_path / "d"), t, sok.optimizers.Adagrad(0.1))
    with pytest.raises(ValueError, match="has no table 'nope'"):
        sok.load(str(tmp_path / "d"), [sok.Variable(shape=[3, DIM], name="nope")])
    with pytest.raises(ValueError, match="no dump at"):
        sok.load(str(tmp_path / "missing"), t)
    with pytest.raises(TypeError, match="is not a tf_sok table"):
        sok.dump(str(tmp_path / "e"), [tf.Variable([1.0])])
    with pytest.raises(ValueError, match="is the path being written"):
        sok.dump(str(tmp_path / "d"), t, opt, since=str(tmp_path / "d"))
    sok.load(str(tmp_path / "d"), t)                       # tables only: fine


_KILL_CHILD = r"""
import sys, numpy as np, tensorflow as tf, tf_sok as sok
sok.init()
path = sys.argv[1]
t = sok.Variable(shape=[20000, 16], initializer="zeros", name="emb")
d = sok.DynamicVariable(16, initializer="zeros", name="dyn")
opt = sok.optimizers.Adagrad(0.1)
opt.build([t, d])
for i in range(1, 10**6):
    t.assign(tf.fill([20000, 16], float(i)))
    sok.assign(d, np.arange(100 * i % 5000 + 1), np.full([100 * i % 5000 + 1, 16], float(i), np.float32))
    for s in opt.slots(t):
        s.assign(tf.fill(s.shape, float(i)))
    sok.dump(path, [t, d], opt)
    print(i, flush=True)
"""


def test_dump_killed_part_way_leaves_the_previous_dump_loadable(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_KILL_CHILD)
    path = str(tmp_path / "d")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    for delay in (0.05, 0.13, 0.31, 0.47):
        child = subprocess.Popen([sys.executable, str(script), path], stdout=subprocess.PIPE, env=env, text=True)
        first = child.stdout.readline()                  # one dump done
        assert first.strip(), "the child wrote no dump"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        t = sok.Variable(shape=[20000, 16], initializer="ones", name="emb")
        d = sok.DynamicVariable(16, name="dyn")
        opt = sok.optimizers.Adagrad(0.1)
        sok.load(path, [t, d], opt)
        value = t.numpy()
        i = value[0, 0]
        assert i >= 1 and np.all(value == i) and np.all(opt.slots(t)[0].numpy() == i)
        keys, vals = sok.export(d)
        assert len(keys.numpy()) == int(100 * i) % 5000 + 1 and np.all(vals.numpy() == i)
    sok.dump(path, [t, d], opt)                          # the next dump clears what the kills left
    assert sorted(os.listdir(tmp_path)) == ["child.py", "d"]


def test_incremental_model_dump_gives_the_keys_touched_since_a_time(rng):
    """SOK's incremental_model_dump: keys looked up in training (or assigned) at or after the time,
    with their current values; against the sets of keys each step used."""
    import datetime

    keys = random_keys(rng, 60)
    table = sok.DynamicVariable(4, initializer="normal", name="inc")
    static = sok.Variable(shape=[5, 4], name="st")
    opt = sok.optimizers.SGD(0.1)
    stamps, used = [], []
    for _ in range(5):
        stamps.append(datetime.datetime.now(datetime.timezone.utc))
        time.sleep(0.003)
        batch = rng.choice(keys[:50], 8)
        used.append(set(batch.tolist()))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(sok.lookup_sparse(table, tf.constant(batch[:, None]), combiners="sum")))
        opt.apply_gradients([(tape.gradient(loss, table), table)])
        time.sleep(0.003)
    stamps.append(datetime.datetime.now(datetime.timezone.utc))
    time.sleep(0.003)
    sok.assign(table, keys[50:53], np.ones([3, 4], np.float32))
    used.append(set(keys[50:53].tolist()))
    now = by_key(table)
    for k, t in enumerate(stamps):
        got_keys, got_values = sok.incremental_model_dump(table, t)
        assert set(got_keys.tolist()) == set().union(*used[k:]), k
        for key, value in zip(got_keys, got_values):
            np.testing.assert_array_equal(value, now[int(key)][0])
    naive = stamps[2].replace(tzinfo=None)              # naive datetimes are UTC
    assert set(sok.incremental_model_dump([table], naive)[0][0].tolist()) == set().union(*used[2:])
    assert len(sok.incremental_model_dump(table, time.time() + 60)[0]) == 0
    assert set(sok.incremental_model_dump(table, 0)[0].tolist()) == set(now)     # everything since creation
    with pytest.raises(TypeError, match="table 'st' is static, not a sok.DynamicVariable"):
        sok.incremental_model_dump(static, 0)
    with pytest.raises(TypeError, match="time_threshold must be a datetime or seconds since the epoch"):
        sok.incremental_model_dump(table, "yesterday")
