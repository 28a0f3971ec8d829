"""The collective watchdog (tf_sok.python.comm.watchdog): a watch left open past its timeout
ends the process naming the collective; watches of completed or failed steps close. Each
case runs in a child process (an expiring watch ends its process). Through horovodrun:
tests/horovod (ranks that wait on different collectives)."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tf_sok.python.comm import watchdog
from tf_sok.python.comm.watchdog import watched

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = """
import time, tensorflow as tf
from tf_sok.python.comm.watchdog import watched, open_watches
"""


def run_child(code: str, timeout_env: str, limit: float = 120):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               TF_SOK_COLLECTIVE_TIMEOUT=timeout_env)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, capture_output=True,
                       text=True, timeout=limit)
    return p, time.time() - t0


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_collective_that_never_completes_ends_the_process_naming_it(mode):
    # the "collective" waits longer than the timeout (eagerly: a sleep; in a graph: a py_function sleep)
    code = """
    def stuck():
        time.sleep(30)
        return tf.constant(1.0)
    def run():
        return watched("Horovod allgather 'tf_sok.check.7' on rank 1 of 2",
                       lambda: tf.py_function(stuck, [], tf.float32) if %r == "function" else stuck())
    (tf.function(run) if %r == "function" else run)()
    print("returned")
    """ % (mode, mode)
    p, secs = run_child(code, "2")
    assert p.returncode == watchdog.EXIT_CODE, p.stderr[-2000:]
    assert "returned" not in p.stdout
    assert "tf_sok: Horovod allgather 'tf_sok.check.7' on rank 1 of 2 has waited 2 s" in p.stderr, p.stderr[-2000:]
    assert secs < 25


def test_completed_and_failed_steps_leave_no_watch_open_and_the_process_lives():
    code = """
    import numpy as np
    x = tf.constant(np.random.default_rng().normal(size=5).astype(np.float32))

    @tf.function
    def loop(x):
        def body(i, acc):
            return i + 1, acc + watched("sum", lambda: tf.reduce_sum(x), [x])
        return tf.while_loop(lambda i, acc: i < 500, body, (0, 0.0))[1]
    total = loop(x)
    assert abs(float(total) - 500 * float(tf.reduce_sum(x))) < 1e-2 * 500, float(total)
    assert open_watches() == 0, open_watches()

    @tf.function
    def failing(x):   # the collective's input check fails after the watch opened: the step ends
        y = watched("checked", lambda: tf.debugging.assert_all_finite(x / 0.0 * 0.0, "bad"), [x])
        return y
    try:
        failing(x)
        raise SystemExit("no error")
    except tf.errors.InvalidArgumentError:
        pass
    assert open_watches() == 0, open_watches()

    try:   # eagerly, the caller closes the watch when the collective raises
        watched("eager", lambda: tf.debugging.assert_all_finite(x / 0.0 * 0.0, "bad"))
        raise SystemExit("no error")
    except tf.errors.InvalidArgumentError:
        pass
    assert open_watches() == 0, open_watches()
    time.sleep(3)     # past the timeout: nothing ends the process
    print("alive")
    """
    p, _ = run_child(code, "1")
    assert p.returncode == 0 and "alive" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_zero_turns_the_watchdog_off():
    code = """
    print(watched("slow", lambda: (time.sleep(3), tf.constant(2.0))[1]).numpy(), open_watches())
    """
    p, _ = run_child(code, "0")
    assert p.returncode == 0 and p.stdout.split() == ["2.0", "0"], p.stdout + p.stderr[-2000:]


@pytest.mark.parametrize("raw,expected", [("", 90.0), ("30", 30.0), ("0", 0.0), ("2.5", 2.5)])
def test_timeout_from_the_environment(monkeypatch, raw, expected):
    monkeypatch.setenv(watchdog.TIMEOUT_ENV, raw)
    assert watchdog.timeout_s() == expected


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_bad_timeout_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv(watchdog.TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match="TF_SOK_COLLECTIVE_TIMEOUT"):
        watchdog.timeout_s()


def test_gradients_pass_through_a_watched_collective():
    import numpy as np
    import tensorflow as tf

    x = tf.Variable(np.random.default_rng().normal(size=(4, 3)).astype(np.float32))
    w = np.random.default_rng().normal(size=(4, 3)).astype(np.float32)

    @tf.function
    def grad():
        with tf.GradientTape() as tape:
            y = watched("grad test", lambda: x * 3.0, [x])
            loss = tf.reduce_sum(y * w)
        return tape.gradient(loss, x)

    np.testing.assert_allclose(grad().numpy(), 3.0 * w, rtol=1e-6)
