"""Shared by examples/dlrm.py, deepfm.py and dcnv2.py: command line, data
(synthetic or Criteo files in TSV / Parquet / TFRecord), training with model.fit,
held-out loss and AUC after every epoch, TensorBoard logs and PNG plots."""
import argparse
import contextlib
import os
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

import tf_sok as sok
import tf_sok.data as sd

SYNTHETIC_VOCAB = 1_000_000


def parse_args(description, argv=None, dim=16, batch_size=2048, steps_per_execution=10):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", default="synthetic", help="'synthetic' or a file/directory of Criteo data")
    p.add_argument("--pool-rows", type=int, default=None,
                   help="synthetic data: rows generated once and cycled (default 262,144, rounded up to whole "
                        "batches): the model sees them again every pool-rows / batch-size steps, and learns a "
                        "small pool by heart (held-out AUC falls)")
    p.add_argument("--format", default=None, choices=["tsv", "parquet", "tfrecord"],
                   help="format of --data files (default: from the file names)")
    p.add_argument("--steps", type=int, default=300, help="training steps in all")
    p.add_argument("--epochs", type=int, default=3, help="the steps are split into this many epochs, each "
                                                       "followed by a held-out evaluation")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--holdout", type=float, default=0.1,
                   help="fraction of the batches of --data held out (every k-th batch), synthetic: of --steps")
    p.add_argument("--max-vocab", type=int, default=None,
                   help=f"cap on each table's rows (default: the files' own schema; synthetic {SYNTHETIC_VOCAB:,})")
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--steps-per-execution", type=int, default=steps_per_execution,
                   help="steps per model.fit call into TensorFlow (the fast setting; 1 for Keras' default)")
    p.add_argument("--jit-dense", choices=["auto", "on", "off"], default="auto",
                   help="compile the model's dense part with XLA (auto: on when a GPU is visible)")
    p.add_argument("--out", default=None, help="where plots and TensorBoard logs go (default out/<example>)")
    p.add_argument("--reader-workers", default="auto",
                   help="Parquet blocks built in this many processes (read_parquet(workers=)); 'auto': on a GPU "
                        "machine of 8 or more cores half of them (on an H200's 16 cores 8 workers fed DLRM and DCNv2 "
                        "at 0.97-0.98 of cached batches, 12 at 0.87-0.97: more workers contend with the training "
                        "process), else 0 (threads of this process)")
    p.add_argument("--distribute", choices=["none", "horovod", "mirrored"], default="none",
                   help="horovod: one rank per GPU under horovodrun, --batch-size per rank, each rank reading its "
                        "share of the data; mirrored: tf.distribute.MirroredStrategy over the visible GPUs, "
                        "--batch-size global")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="with --distribute mirrored: N logical CPU devices instead of the GPUs")
    p.add_argument("--host-tier-gib", type=float, default=None,
                   help="every table with a host tier: its rows in host memory, this many GiB of device memory "
                        "for each table's cached rows and their optimizer state (max_hbm_for_vectors)")
    p.add_argument("--prefetch", action="store_true",
                   help="with --host-tier-gib: each step prefetches the next batch's ids into the caches "
                        "(sok.keras.loop_on_host(model, prefetch=...); needs --steps-per-execution > 1)")
    p.add_argument("--verbose", type=int, default=2)
    p.add_argument("--seed", type=int, default=None,
                   help="seeds Python, NumPy and TensorFlow (keras.utils.set_random_seed): a run repeated as it "
                        "was (the synthetic data has seeds of its own)")
    a = p.parse_args(argv)
    if a.seed is not None:
        keras.utils.set_random_seed(a.seed)
    if not 0 < a.holdout < 1:
        p.error(f"--holdout must be in (0, 1), got {a.holdout}")
    if a.pool_rows is not None and a.pool_rows < 1:
        p.error(f"--pool-rows must be positive, got {a.pool_rows}")
    if a.steps < a.epochs:
        p.error(f"--steps ({a.steps}) must be at least --epochs ({a.epochs})")
    return a


def jit_dense(a) -> bool:
    """Whether the dense part is compiled by XLA (--jit-dense; auto: where a GPU is visible)."""
    if a.jit_dense == "auto":
        return bool(tf.config.list_physical_devices("GPU"))
    return a.jit_dense == "on"


def side_by_side(parts):
    """tf.concat(parts, axis=-1) whose gradient splits by the parts' static widths. TensorFlow's own
    gradient takes the axis tensor from the forward pass: under XLA (`jit_dense`) the forward
    function returns it to the backward one, which needs it at compile time, so it is copied from
    the GPU every step, and the host waits for the device there."""
    widths = [int(p.shape[-1]) for p in parts]

    @tf.custom_gradient
    def joined(*xs):
        return tf.concat(xs, axis=-1), lambda g: tf.split(g, widths, axis=-1)
    return joined(*parts)


def _format(a) -> str:
    if a.format:
        return a.format
    for fmt in ("parquet", "tfrecord", "tsv"):
        if a.data.endswith(f".{fmt}") or (os.path.isdir(a.data) and any(
                f.endswith(f".{fmt}") for f in os.listdir(a.data))):
            return fmt
    return "tsv"


def make_strategy(cpu_devices: int) -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over the visible GPUs, or over `cpu_devices` logical CPU devices (2 when no
    GPU is visible)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and not cpu_devices:
        for g in gpus:
            tf.config.experimental.set_memory_growth(g, True)
        return tf.distribute.MirroredStrategy([f"/gpu:{i}" for i in range(len(gpus))])
    n = cpu_devices or 2
    tf.config.set_visible_devices([], "GPU")
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


class Launch:
    """How an example runs (--distribute): one process; a Horovod rank (each rank its own GPU, its
    share of the data and --batch-size rows per step; dense gradients averaged by Horovod, sparse
    ones by tf_sok's exchange with the same mean, so N ranks train as one process on N x the batch);
    or MirroredStrategy's replicas (the global batch split among them)."""

    def __init__(self, a):
        self.kind, self.rank, self.ranks, self.strategy, self.hvd = a.distribute, 0, 1, None, None
        if self.kind == "horovod":
            import horovod.tensorflow as hvd

            hvd.init()
            gpus = tf.config.list_physical_devices("GPU")
            if gpus:
                tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
                tf.config.experimental.set_memory_growth(gpus[hvd.local_rank() % len(gpus)], True)
            self.hvd, self.rank, self.ranks = hvd, hvd.rank(), hvd.size()
        elif self.kind == "mirrored":
            self.strategy = make_strategy(a.cpu_devices)

    def scope(self):
        return self.strategy.scope() if self.strategy else contextlib.nullcontext()

    def init(self):
        """sok.init() for this launch (inside scope())."""
        return sok.init(sparse_grad_reduction="mean" if self.hvd else "sum")

    def mean(self, x: float) -> float:
        """x averaged over the ranks (Horovod), else x."""
        return float(self.hvd.allreduce(tf.constant(x, tf.float32), op=self.hvd.Average)) if self.hvd else x

    def feed(self, ds):
        """The batches as the step takes them: prefetched to the GPU, except under MirroredStrategy
        (Keras distributes them there)."""
        return ds if self.strategy else on_gpu(ds)


def datasets(a, synthetic_config=None, launch=None):
    """(train, held-out) tf.data pipelines of ({"dense", "C1".."C26"}, label) and the schema the
    model's tables take. Files: every k-th batch is held out (k = 1 / holdout), the others are
    cycled for training, so held-out data never takes the whole file. Under Horovod each rank
    takes every N-th batch (synthetic data: its own seed)."""
    launch = launch or Launch(argparse.Namespace(distribute="none"))
    rank, ranks = launch.rank, launch.ranks
    # categorical features as (values, row_splits) pairs, a fraction of a RaggedTensor's host time
    # per batch in tf.data; RaggedTensors where Keras splits batches among replicas (MirroredStrategy)
    pairs = launch.strategy is None
    if a.data == "synthetic":
        schema = sd.CriteoSchema.capped(a.max_vocab or SYNTHETIC_VOCAB)
        cfg = (synthetic_config or sd.SyntheticConfig)(schema=schema)
        eval_rows = max(1, int(a.steps * a.holdout)) * a.batch_size
        ids = id_dtype(schema)
        train = sd.synthetic(a.steps * a.batch_size, a.batch_size, cfg, seed=1 + 10 * rank, id_dtype=ids,
                             ragged_pairs=pairs, **({'pool_rows': a.pool_rows} if a.pool_rows else {}))
        test = sd.synthetic(eval_rows, a.batch_size, cfg, seed=2 + 10 * rank, id_dtype=ids, ragged_pairs=pairs)
        return launch.feed(sd.for_keras(train, id_dtype=ids)), launch.feed(sd.for_keras(test, id_dtype=ids)), schema
    fmt = _format(a)
    if fmt == "tsv":
        schema = sd.CriteoSchema.capped(a.max_vocab or 10_000_000)
        ds = sd.read_tsv(a.data, a.batch_size, schema=schema, ragged_pairs=pairs)
    else:
        stored = sd.schema_of(a.data, fmt)
        schema = sd.CriteoSchema.capped(a.max_vocab) if a.max_vocab else (stored or sd.CriteoSchema())
        ds = sd.read_parquet(a.data, a.batch_size, schema=schema, id_dtype=id_dtype(schema),
                             workers=reader_workers(a), ragged_pairs=pairs) if fmt == "parquet" \
            else sd.read_tfrecord(a.data, a.batch_size, schema=schema, ragged_pairs=pairs)
    every = max(2, round(1 / a.holdout))
    if ranks > 1:
        ds = ds.shard(ranks, rank)
    # named functions, not lambdas sharing a line: AutoGraph reads their source (it warns otherwise)
    def held_out(i, _):
        return i % every == 0

    def trains(i, _):
        return i % every != 0

    def batch_of(_, b):
        return b

    numbered = sd.for_keras(ds, id_dtype=id_dtype(schema)).enumerate()
    train = numbered.filter(trains).map(batch_of)
    test = numbered.filter(held_out).map(batch_of)
    if ranks > 1:   # every rank must run as many evaluation steps (each exchanges embeddings)
        test = test.repeat().take(max(1, int(a.steps * a.holdout) // a.epochs))
    return launch.feed(train.repeat()), launch.feed(test), schema


def reader_workers(a):
    """--reader-workers as read_parquet's `workers` (None: threads of this process)."""
    if a.reader_workers == "auto":
        cores = len(os.sched_getaffinity(0))
        return cores // 2 if cores >= 8 and tf.config.list_physical_devices("GPU") else None
    try:
        k = int(a.reader_workers)
    except ValueError:
        raise SystemExit(f"--reader-workers: 'auto' or a number of processes, got {a.reader_workers!r}")
    if k < 0:
        raise SystemExit(f"--reader-workers: 'auto' or a number of processes >= 0, got {k}")
    return k or None


def id_dtype(schema):
    """int32 ids when every table has fewer than 2**31 rows (half the bytes to the GPU)."""
    return tf.int32 if max(schema.vocab_sizes) < 2**31 else tf.int64


def on_gpu(ds):
    """Batches copied to the GPU two ahead of the step (where one is visible), from page-locked
    memory, their ragged ids as (values, row_splits) pairs, which tf_sok's layers take (on an H200,
    DCNv2 from cached batches 2.89M samples/s against 2.73M with RaggedTensors: see RESULTS.md)."""
    if not tf.config.list_physical_devices("GPU"):
        return ds
    return sd.to_device(ds, "/gpu:0", ragged_pairs=True)


class Curves(keras.callbacks.Callback):
    """Training loss/AUC per logged step, samples/s between logs (the first call, which
    traces the step, left out) and held-out loss/AUC per epoch."""

    def __init__(self, batch_size):
        super().__init__()
        self.batch_size = batch_size
        self.step, self.loss, self.auc, self.sps, self.eval_step, self.eval_loss, self.eval_auc = ([] for _ in range(7))
        self._last = None
        self._done = 0

    def on_train_batch_end(self, batch, logs=None):
        now, done = time.perf_counter(), self._done + batch + 1
        if self._last is not None and done > self._last[1]:
            self.step.append(done)
            self.loss.append(logs["loss"])
            self.auc.append(logs["auc"])
            self.sps.append((done - self._last[1]) * self.batch_size / (now - self._last[0]))
        self._last = (now, done)

    def on_epoch_end(self, epoch, logs=None):
        self._done = self._last[1] if self._last else self._done
        if logs and "val_loss" in logs:
            self.eval_step.append(self._done)
            self.eval_loss.append(logs["val_loss"])
            self.eval_auc.append(logs["val_auc"])

    def on_test_begin(self, logs=None):
        self._paused = time.perf_counter()

    def on_test_end(self, logs=None):  # evaluation time is not training time
        if self._last is not None:
            self._last = (self._last[0] + time.perf_counter() - self._paused, self._last[1])


def plot(c: Curves, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(c.step, c.loss, label="training (running mean)")
    ax[0].plot(c.eval_step, c.eval_loss, "o-", label="held-out")
    ax[1].plot(c.step, c.auc, label="training (running)")
    ax[1].plot(c.eval_step, c.eval_auc, "o-", label="held-out")
    ax[2].plot(c.step, c.sps)
    for axis, label in zip(ax, ("loss", "AUC", "samples/s (tracing step left out)")):
        axis.set(xlabel="step", ylabel=label)
    ax[0].legend()
    ax[1].legend()
    ax[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def default_optimizer():
    return sok.keras.Optimizer(dense=keras.optimizers.Adam(1e-3), sparse=sok.optimizers.Adam(0.01))


def next_batch_prefetch(model):
    """loop_on_host's prefetch for these examples: the next batch's ids of every feature of the model's
    EmbeddingCollection (`model.feature_ids(x)` where the model derives them, else x[feature])."""
    coll = model.embeddings

    def prefetch(batch):
        x = batch[0]
        ids = model.feature_ids(x) if hasattr(model, "feature_ids") else {f: x[f] for f in coll.feature_names}
        sok.prefetch([coll.tables[coll.feature_to_table[f]] for f in coll.feature_names],
                     [ids[f] for f in coll.feature_names])
    return prefetch


def run(name, build_model, a, optimizer=default_optimizer, synthetic_config=None):
    """Trains `build_model(schema, dim)` with model.fit, evaluating on held-out data after each epoch
    (--distribute: under Horovod or MirroredStrategy; rank 0 prints, plots and logs)."""
    launch = Launch(a)
    with launch.scope():
        ctx = launch.init()
        train, test, schema = datasets(a, synthetic_config, launch)
        tier = {} if a.host_tier_gib is None else {"max_hbm_for_vectors": a.host_tier_gib}
        model = build_model(schema, a.dim, **tier)
        per_epoch = a.steps // a.epochs
        spe = min(a.steps_per_execution, per_epoch)
        if launch.strategy and spe > 1:
            # Keras 3.15's multi-step loop under MirroredStrategy fails ("You must feed a value for
            # placeholder tensor 'while/cond/Placeholder'"), a plain Dense model as well
            print(f"{name}: steps_per_execution {spe} -> 1 under MirroredStrategy (Keras' multi-step loop "
                  "fails there)")
            spe = 1
        per_epoch -= per_epoch % spe          # Keras runs whole executions: an epoch is a multiple of them
        model.compile(optimizer=optimizer(), loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")],
                      steps_per_execution=spe)
        # the multi-step loop's control on the host: no wait for the GPU per step
        sok.keras.loop_on_host(model, prefetch=next_batch_prefetch(model) if tier and a.prefetch else None)
    first = launch.rank == 0
    out = a.out or os.path.join("out", name)
    os.makedirs(out, exist_ok=True)
    # samples/s of all ranks (the per-rank batch times the ranks); MirroredStrategy's batch is global
    curves = Curves(a.batch_size * launch.ranks)
    callbacks = [curves] + ([sok.keras.CacheStats()] if tier and first else [])   # a hit-rate line per epoch
    if first:
        try:
            callbacks.append(keras.callbacks.TensorBoard(os.path.join(out, "tensorboard"), update_freq="epoch"))
        except Exception as e:  # noqa: BLE001 (TensorBoard not installed: train without its logs)
            print(f"TensorBoard logs off: {e}")
    if launch.kind != "none" and first:
        print(f"{name}: {ctx.num_ranks} {'ranks' if launch.hvd else 'replicas'} ({type(ctx.communicator).__name__})")
    t0 = time.time()
    with warnings.catch_warnings():
        # the held-out batches are read to their end each epoch: Keras warns there that the input "ran
        # out of data" (it cannot know a filtered dataset's length); the training batches repeat
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        model.fit(train, epochs=a.epochs, steps_per_epoch=per_epoch, validation_data=test, callbacks=callbacks,
                  verbose=a.verbose if first else 0, shuffle=False)   # (tf.data batches: nothing to shuffle)
    secs = time.time() - t0
    if launch.hvd:   # held-out results averaged over the ranks' shares
        curves.eval_loss[-1], curves.eval_auc[-1] = launch.mean(curves.eval_loss[-1]), launch.mean(curves.eval_auc[-1])
    if not first:
        return {"loss": curves.loss, "eval_auc": curves.eval_auc[-1], "eval_loss": curves.eval_loss[-1]}
    png = os.path.join(out, "training.png")
    plot(curves, png, f"{name}, {a.data}, batch {a.batch_size}")
    sps = np.median(curves.sps) if curves.sps else float("nan")
    print(f"{name}: {curves.step[-1] if curves.step else 0} steps in {secs:.1f}s ({sps:,.0f} samples/s median, tracing left out); "
          f"final training loss {curves.loss[-1] if curves.loss else float('nan'):.4f}; "
          f"held-out loss {curves.eval_loss[-1]:.4f}, AUC {curves.eval_auc[-1]:.4f}; plot {png}")
    if tier:   # the tables' caches over the whole run
        stats = [sok.cache_stats(v._dynamic) for v in model.variables if getattr(v, "_dynamic", None) is not None]
        whole = sum(1 for v in model.variables if getattr(sok.table_meta(v), "budget_bytes", -1) >= 0)
        lookups, misses = sum(x["lookups"] for x in stats), sum(x["misses"] for x in stats)
        print(f"{name}: host tier, {len(stats)} tables ({whole} more held whole in device memory, their budget "
              f"holding them): hit rate {1 - misses / max(lookups, 1):.4f}, "
              f"{sum(x['bytes_to_device'] + x['bytes_to_host'] for x in stats) / 1e6:.1f} MB over the host link, "
              f"{sum(x['cached'] for x in stats):,} of {sum(x['keys'] for x in stats):,} rows held cached, "
              f"{sum(x['prefetched'] for x in stats):,} keys prefetched")
    return {"loss": curves.loss, "eval_auc": curves.eval_auc[-1], "eval_loss": curves.eval_loss[-1], "sps": sps}
