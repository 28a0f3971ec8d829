"""Soak: trains the DLRM example with model.fit for a set time and records the process's
resident memory, the GPU's allocated memory and the step time, to show they stay flat.

    python benchmarks/soak.py --minutes 60                    # defaults fit the machine (GPU: batch 65,536)
    python benchmarks/soak.py --minutes 5 --batch 4096 --dim 16 --max-vocab 100000

Prints one line per sample and a summary comparing the first and the last fifth of the run
(after the warm-up fifth is left out: TensorFlow's allocator and tf.data's buffers grow to
their working size first); writes the samples as JSON and a plot.
"""
import argparse
import json
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import tf_sok as sok  # noqa: E402
import tf_sok.data as sd  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def gpu_mib() -> float:
    if not tf.config.list_physical_devices("GPU"):
        return float("nan")
    return tf.config.experimental.get_memory_info("GPU:0")["current"] / 2**20


class Recorder(keras.callbacks.Callback):
    """Every `every` seconds: elapsed time, steps, RSS, GPU memory, mean step time since the last sample."""

    def __init__(self, every: float, minutes: float):
        super().__init__()
        self.every, self.deadline = every, time.perf_counter() + 60 * minutes
        self.samples, self.steps = [], 0
        self._t0 = self._last = None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self.steps = batch + 1
        if self._t0 is None:
            self._t0 = self._last = (now, self.steps)
            return
        if now - self._last[0] >= self.every:
            step_ms = (now - self._last[0]) / max(1, self.steps - self._last[1]) * 1e3
            self.samples.append({"seconds": now - self._t0[0], "steps": self.steps, "rss_mib": rss_mib(),
                                 "gpu_mib": gpu_mib(), "step_ms": step_ms, "loss": float(logs["loss"])})
            s = self.samples[-1]
            print(f"  {s['seconds']:8.0f} s  step {s['steps']:8d}  RSS {s['rss_mib']:9.1f} MiB  "
                  f"GPU {s['gpu_mib']:9.1f} MiB  {s['step_ms']:7.2f} ms/step  loss {s['loss']:.4f}", flush=True)
            self._last = (now, self.steps)
        if now >= self.deadline:
            self.model.stop_training = True


def summary(samples) -> dict:
    n = len(samples)
    if n < 10:
        return {"samples": n}
    fifth = n // 5
    first, last = samples[fifth:2 * fifth], samples[-fifth:]   # the first fifth is warm-up
    out = {"samples": n}
    for key in ("rss_mib", "gpu_mib", "step_ms"):
        a, b = np.mean([s[key] for s in first]), np.mean([s[key] for s in last])
        out[key] = {"early": float(a), "late": float(b), "change": float(b - a)}
    return out


def plot(samples, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["seconds"] / 60 for s in samples]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for axis, key, label in zip(ax, ("rss_mib", "gpu_mib", "step_ms"),
                                ("resident memory (MiB)", "GPU memory allocated (MiB)", "ms per step")):
        axis.plot(t, [s[key] for s in samples])
        axis.set(xlabel="minutes", ylabel=label)
    ax[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    import dlrm
    from criteo_common import default_optimizer

    gpu = bool(tf.config.list_physical_devices("GPU"))
    for g in tf.config.list_physical_devices("GPU"):   # take GPU memory as used (what is measured), not all
        tf.config.experimental.set_memory_growth(g, True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--every", type=float, default=None, help="seconds between samples (default: minutes)")
    p.add_argument("--batch", type=int, default=65536 if gpu else 4096)
    p.add_argument("--dim", type=int, default=128 if gpu else 16)
    p.add_argument("--max-vocab", type=int, default=10_000_000 if gpu else 100_000)
    p.add_argument("--spe", type=int, default=10, help="steps_per_execution")
    p.add_argument("--out", default="out/soak")
    a = p.parse_args(argv)
    every = a.every or max(1.0, a.minutes)     # ~60 samples over the run
    sok.init()
    schema = sd.CriteoSchema.capped(a.max_vocab)
    model = dlrm.DLRM(schema, a.dim)
    model.compile(optimizer=default_optimizer(), loss="binary_crossentropy", steps_per_execution=a.spe)
    ds = sd.for_keras(sd.synthetic(10**12, a.batch, sd.SyntheticConfig(schema=schema)))
    print(f"soak: DLRM, 26 tables of dim {a.dim} (at most {a.max_vocab:,} rows), batch {a.batch}, "
          f"steps_per_execution {a.spe}, {a.minutes} minutes, a sample every {every:.0f} s", flush=True)
    rec = Recorder(every, a.minutes)
    model.fit(ds, epochs=1, steps_per_epoch=10**9 - 10**9 % a.spe, callbacks=[rec], verbose=0)
    res = {"args": vars(a), "device": "GPU" if gpu else "CPU", "summary": summary(rec.samples), "samples": rec.samples}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(rec.samples, os.path.join(a.out, "soak.png"), f"DLRM soak, batch {a.batch}, {a.minutes} min")
    print("summary (second fifth vs last fifth):", json.dumps(res["summary"]), flush=True)
    return res


if __name__ == "__main__":
    main()
