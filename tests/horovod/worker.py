"""Runs under horovodrun: `python -m tests.horovod.worker SCENARIO SEED OUTDIR`.
Each rank writes what it computed to OUTDIR/<scenario>.rank<r>.npz; the pytest
driver compares it with a single-process run of the same global batch."""
import os
import sys
import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

hvd.init()
_gpus = tf.config.list_physical_devices("GPU")
if _gpus:  # one GPU per rank
    tf.config.set_visible_devices(_gpus[hvd.local_rank() % len(_gpus)], "GPU")

import keras  # noqa: E402

import tf_sok as sok  # noqa: E402
from tests.horovod import cases, model  # noqa: E402
from tf_sok.python.comm.horovod import HorovodCommunicator  # noqa: E402


class HintCheckedHorovod(HorovodCommunicator):
    """Horovod's all-to-all, asserting that the receive sizes the exchange predicts
    (NCCL's all-to-all relies on them) equal what Horovod actually delivers."""

    def alltoall(self, tensor, splits, name=None, recv_splits=None):
        out, got = super().alltoall(tensor, splits, name)
        if recv_splits is not None:
            check = tf.debugging.assert_equal(tf.cast(got, tf.int32), tf.cast(recv_splits, tf.int32),
                                              message=f"predicted receive sizes of {name}")
            with tf.control_dependencies([check]):
                out = tf.identity(out)
        return out, got


def lookups(seed, out):
    """Forward outputs and table gradients, both reductions, eager and tf.function."""
    N, r = hvd.size(), hvd.rank()
    res = {}
    for reduction in ("sum", "mean"):
        if reduction == "mean" and os.environ.get("TF_SOK_EXCHANGE") != "nccl":
            ctx = sok.init(HintCheckedHorovod(hvd), sparse_grad_reduction=reduction, exchange="framework")
        else:
            ctx = sok.init(sparse_grad_reduction=reduction)  # finds the initialised Horovod by itself
            res["communicator"] = type(ctx.communicator).__name__   # TF_SOK_EXCHANGE picks it
        assert ctx.num_ranks == N
        tables = model.make_tables(seed, N)
        feats, upstream, _ = cases.rank_batch(seed, 0, r)

        def run():
            with tf.GradientTape() as tape:
                outs = model.lookup(tables, feats)
                loss = tf.add_n([tf.reduce_sum(o * upstream[n]) for o, (n, _, _, _) in zip(outs, cases.FEATURES)])
            return outs, tape.gradient(loss, list(tables.values()))

        for mode, fn in (("eager", run), ("function", tf.function(run))):
            outs, grads = fn()
            for (name, _, _, _), o in zip(cases.FEATURES, outs):
                res[f"{reduction}/{mode}/out/{name}"] = o.numpy()
            for name, g in zip(tables, grads):
                assert isinstance(g, tf.IndexedSlices), type(g)
                res[f"{reduction}/{mode}/grad/{name}"] = tf.math.unsorted_segment_sum(
                    g.values, g.indices, tables[name].shape[0]).numpy()
    np.savez(out, **res)


def training(seed, out):
    """STEPS steps of every sparse optimizer + Keras SGD on the dense weight,
    dense gradients averaged by hvd.DistributedGradientTape."""
    N, r = hvd.size(), hvd.rank()
    res = {}
    for reduction in ("mean", "sum"):
        res["communicator"] = type(sok.init(sparse_grad_reduction=reduction).communicator).__name__
        for opt_name, (cls, kwargs) in cases.OPTIMIZERS.items():
            tables = model.make_tables(seed, N)
            dense_w = tf.Variable(model.dense_init(seed))
            sparse_opt = getattr(sok.optimizers, cls)(**kwargs)
            dense_opt = keras.optimizers.SGD(0.05)

            @tf.function(reduce_retracing=True)   # (each step's batch sizes differ: one trace for all but the first)
            def step(feats, target):
                with tf.GradientTape(persistent=True) as tape:
                    loss = model.mean_loss(tables, dense_w, feats, target)
                sok_vars, dense_vars = sok.filter_variables(list(tables.values()) + [dense_w])
                dense_grads = hvd.DistributedGradientTape(tape).gradient(loss, dense_vars)
                sparse_opt.apply_gradients(zip(tape.gradient(loss, sok_vars), sok_vars))
                dense_opt.apply_gradients(zip(dense_grads, dense_vars))
                return loss

            for s in range(cases.STEPS):
                feats, _, target = cases.rank_batch(seed, s + 1, r)
                step(feats, tf.constant(target))
            for name, t in tables.items():
                res[f"{reduction}/{opt_name}/{name}"] = t.numpy()
            res[f"{reduction}/{opt_name}/dense"] = dense_w.numpy()
    np.savez(out, **res)


def collectives(seed, out):
    """The NCCL all-to-all (sizes exchanged or given), its gradient and the
    all-gather, eagerly and in a tf.function where the two all-to-alls do not
    depend on each other (the communicator must order them alike on every rank)."""
    N, r = hvd.size(), hvd.rank()
    comm = sok.init(exchange="nccl").communicator
    sizes, xs, keys, upstream = cases.alltoall_case(seed, N)
    res = {"communicator": type(comm).__name__}

    def run(x, k, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, recv = comm.alltoall(x, tf.constant(sizes[r]))
            k2, _ = comm.alltoall(k, tf.constant(sizes[r]), recv_splits=tf.constant(sizes[:, r]))
            loss = tf.reduce_sum(y * w)
        every = comm.allgather(tf.constant([[r, 7 * r - 3]], tf.int64))
        return y, recv, k2, every, tape.gradient(loss, x)

    for mode, fn in (("eager", run), ("function", tf.function(run))):
        for name, v in zip(("y", "recv", "keys", "every", "grad"), fn(tf.constant(xs[r]), tf.constant(keys[r]),
                                                                     tf.constant(upstream[r]))):
            res[f"{mode}/{name}"] = v.numpy()
    np.savez(out, **res)


def bad_configs(seed, out):
    N, r = hvd.size(), hvd.rank()
    errors = {}
    try:
        sok.init(exchange="nccl")  # every rank must learn that some rank cannot, instead of hanging
    except RuntimeError as e:
        errors["nccl"] = str(e)
    sok.init()
    try:
        sok.Variable(shape=[10 + r, 4], name="mismatch")
    except ValueError as e:
        errors["shape"] = str(e)
    try:
        sok.Variable(shape=[10, 4], name="far", mode=f"localized:{N}")
    except ValueError as e:
        errors["localized"] = str(e)
    a = sok.Variable(shape=[10, 4], name="ta")
    b = sok.Variable(shape=[12, 4], name="tb")
    ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
    try:
        sok.lookup_sparse([a, b] if r == 0 else [b, a], [ids, ids])
    except tf.errors.InvalidArgumentError as e:
        errors["order"] = str(e)
    try:
        bad = tf.ragged.constant([[1, 2], [3 if r == 0 else 10]], dtype=tf.int64)
        sok.lookup_sparse([a], [bad], feature_names=["clicks"])
    except tf.errors.InvalidArgumentError as e:
        errors["id"] = str(e)
    tiered = sok.Variable(shape=[10, 4], name="tiered", max_hbm_for_vectors=2 * 4 * 4 / 2**30)   # 2 rows cached
    try:
        bad = tf.ragged.constant([[1, 2], [3 if r == 0 else 10]], dtype=tf.int64)
        sok.lookup_sparse([tiered], [bad], feature_names=["views"])
    except tf.errors.InvalidArgumentError as e:
        errors["tier_id"] = str(e)
    held = sok.cache_stats(tiered)["keys"]
    out_ok = sok.lookup_sparse([a], [ids], combiners="sum")[0]  # still healthy afterwards
    # a localized static table with a host tier: every row on rank 0, looked up from every rank
    shelf_init = np.random.default_rng(seed).standard_normal((9, 3)).astype(np.float32)
    shelf = sok.Variable(shelf_init, name="shelf", mode="localized:0", max_hbm_for_vectors=2 * 3 * 4 / 2**30)
    shelf_ids = tf.ragged.constant([[r, 8], [5 - r, 0, 2]], dtype=tf.int64)
    # a budget that holds each rank's shard of 5 rows with any optimizer's state (not the whole 10):
    # a plain table on every rank, starting where the tier's rows do
    whole = sok.Variable(shape=[10, 4], name="halves", max_hbm_for_vectors=5 * 4 * 16 / 2**30)
    halves = sok.Variable(shape=[10, 4], name="halves", max_hbm_for_vectors=5 * 4 * 16 / 2**30 - 2**-30)
    every = tf.ragged.constant([list(range(10))], dtype=tf.int64)
    errors["whole_kind"] = type(whole).__name__ + "/" + type(halves).__name__
    whole_out, halves_out = (sok.lookup_sparse([t], [every], combiners="sum")[0].numpy() for t in (whole, halves))
    np.savez(out, **{k: np.array(v) for k, v in errors.items()}, ok=out_ok.numpy(), table=a.numpy(),
             whole_out=whole_out, halves_out=halves_out,
             tier_held=held, tier_ok=sok.lookup_sparse([tiered], [ids], combiners="sum")[0].numpy(),
             shelf_init=shelf_init, shelf_out=sok.lookup_sparse([shelf], [shelf_ids], combiners="sum")[0].numpy(),
             shelf_keys=sok.export(shelf)[0].numpy())


def keras_fit(seed, out):
    """model.fit of the DLRM example on each rank's own data; then a per-rank
    tf.train.Checkpoint restored into a fresh model."""
    from examples import dlrm_synthetic as demo

    sok.init()
    r = hvd.rank()
    mdl = demo.build_model()
    train = demo.make_dataset(*demo.make_data(40 * 256, seed=seed + r), 256)
    hist = demo.History()
    mdl.fit(train, epochs=1, verbose=0, callbacks=[hist])
    x, _ = next(iter(demo.make_dataset(*demo.make_data(512, seed=seed + 100 + r), 512)))
    before = mdl.predict_on_batch(x)
    path = tf.train.Checkpoint(model=mdl, optimizer=mdl.optimizer).save(
        os.path.join(os.path.dirname(out), f"ckpt_rank{r}", "ckpt"))
    fresh = demo.build_model()
    fresh(x)
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path).assert_existing_objects_matched()
    after = fresh.predict_on_batch(x)
    _, dense = sok.filter_variables(mdl.trainable_variables)
    np.savez(out, before=before, after=after, loss=np.array(hist.loss),
             **{f"dense{i}": v.numpy() for i, v in enumerate(dense)})


def keras_fit_lazy(seed, out):
    """model.fit of a model whose dense weights Keras makes inside the first traced step (no eager
    build first), each rank's initial weights drawn from its own seed, over its own data."""
    import keras

    sok.init(sparse_grad_reduction="mean")
    r = hvd.rank()
    keras.utils.set_random_seed(seed + 7 * r)

    class Lazy(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = sok.layers.EmbeddingCollection(
                tables=[sok.TableConfig("t", 500, 8, combiner="mean")], feature_to_table={"f": "t"})
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(1, activation="sigmoid")

        def build(self, input_shape):   # as examples/dcnv2.py: the dense layers built here
            self.hidden.build((None, 8 + input_shape["dense"][-1]))
            self.out.build((None, 16))

        def call(self, x):
            return self.out(self.hidden(tf.concat([self.emb({"f": x["f"]})["f"], x["dense"]], axis=1)))

    rng = np.random.default_rng(seed + r)
    rows, batch = 64 * 40, 64
    ids = rng.integers(0, 500, rows * 2)
    dense = rng.standard_normal((rows, 4)).astype(np.float32)
    label = ((ids[0::2] % 2) ^ (dense[:, 0] > 0)).astype(np.float32)[:, None]
    ragged = tf.RaggedTensor.from_row_splits(ids, np.arange(0, 2 * rows + 1, 2))
    ds = tf.data.Dataset.from_tensor_slices(({"f": ragged, "dense": dense}, label)).batch(batch)
    model = Lazy()
    model.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.Adam(1e-2), sparse=sok.optimizers.Adam(1e-2)),
                  loss="binary_crossentropy", steps_per_execution=5)
    hist = model.fit(ds, epochs=3, verbose=0)
    _, dense_vars = sok.filter_variables(model.trainable_variables)
    np.savez(out, loss=np.array(hist.history["loss"]), **{f"dense{i}": v.numpy() for i, v in enumerate(dense_vars)})


def rank_dies(seed, out):
    """Rank 1 dies before a lookup; rank 0 must not wait forever."""
    sok.init()
    table = sok.Variable(shape=[10, 4], name="t")
    ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
    sok.lookup_sparse(table, ids)
    if hvd.rank() == 1:
        os._exit(3)
    sok.lookup_sparse(table, ids)


def rank_skips_lookup(seed, out):
    """Rank 1 runs one lookup fewer, then a collective of its own (eagerly or in a tf.function):
    the ranks wait on different collectives until rank 0's collective watchdog ends the job."""
    sok.init()
    table = sok.Variable(shape=[10, 4], name="t")
    ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
    sok.lookup_sparse(table, ids)
    mode = "function" if seed % 2 else "eager"

    def step():
        if hvd.rank() == 0:
            return sok.lookup_sparse(table, ids)
        return hvd.allreduce(tf.ones([3]), name="user_allreduce")

    print(f"rank {hvd.rank()}: stepping ({mode}) at {time.time():.3f}", flush=True)
    (tf.function(step) if mode == "function" else step)()
    print(f"rank {hvd.rank()}: the diverged step returned", flush=True)


def dynamic_training(seed, out, hybrid=False, filtered=False):
    """Dynamic tables (distributed and localized) with a static one in one fused lookup, trained on
    this rank's slice of each global batch ("mean" reduction); hybrid: with host tiers; filtered:
    under the low-frequency filter (each key drawn by its owner)."""
    from tests.horovod import dynamic_case as dc

    N, r = hvd.size(), hvd.rank()
    sok.init(sparse_grad_reduction="mean")
    tables = dc.make_tables(seed, hybrid=hybrid)
    dense_w = tf.Variable(dc.dense_init())
    pool = dc.HYBRID_POOL if hybrid else 30
    batches = [dc.rank_slice(*dc.global_batch(seed, s, pool, hybrid), r, N) for s in range(dc.STEPS)]
    # (with host tiers each step prefetches the next batch's keys: the results stay one process's)
    dc.train(tables, dense_w, batches, dense_tape=hvd.DistributedGradientTape, prefetch=hybrid,
             **(dc.FILTER if filtered else {}))
    if hybrid:   # every rank's shard of the distributed tables went through its host tier
        for name in ("users", "small"):
            stats = sok.cache_stats(tables[name])
            assert stats["evicted"] > 0 and stats["bytes_to_device"] > 0, (name, stats)
    # a lookup that does not train, before the results: it must leave every table as it is
    read = dc.read_outputs(tables, dc.rank_slice(dc.read_batch(seed), np.zeros((dc.GLOBAL_BATCH, 15)), r, N)[0])
    np.savez(out, read=read, **dc.results(tables, dense_w))


def hybrid_training(seed, out):
    dynamic_training(seed, out, hybrid=True)


def filtered_hybrid_training(seed, out):
    dynamic_training(seed, out, hybrid=True, filtered=True)


def sok_script(seed, out):
    """As SOK's own scripts: sok.init(comm_tool="horovod", use_legacy_optimizer=True), dynamic tables
    and sok.OptimizerWrapper over a tf_keras legacy optimizer."""
    import tf_keras

    from tests.horovod import dynamic_case as dc

    N, r = hvd.size(), hvd.rank()
    sok.init(comm_tool="horovod", use_legacy_optimizer=True, sparse_grad_reduction="mean")
    tables = dc.make_tables(seed)
    dense_w = tf.Variable(dc.dense_init())
    batches = [dc.rank_slice(*dc.global_batch(seed, s), r, N) for s in range(dc.STEPS)]
    dc.train(tables, dense_w, batches, dense_tape=hvd.DistributedGradientTape,
             sparse_opt=sok.OptimizerWrapper(tf_keras.optimizers.legacy.Adagrad(0.05)))
    np.savez(out, **dc.results(tables, dense_w))


def dump_tables(seed, out):
    """Trains the dynamic-table model for STEPS steps at this world size, then sok.dump's the tables
    and the Adam state next to `out` (rank 0 also saves the dense weight)."""
    from tests.horovod import dynamic_case as dc

    N, r = hvd.size(), hvd.rank()
    sok.init(sparse_grad_reduction="mean")
    tables = dc.make_tables(seed)
    dense_w = tf.Variable(dc.dense_init())
    opt = dc.adam()
    batches = [dc.rank_slice(*dc.global_batch(seed, s), r, N) for s in range(dc.STEPS)]
    dc.train(tables, dense_w, batches, dense_tape=hvd.DistributedGradientTape, sparse_opt=opt)
    sok.dump(os.path.join(os.path.dirname(out), "dump"), list(tables.values()), opt)
    keys, values = sok.incremental_model_dump(tables["users"], 0)   # every key touched, from every rank
    np.savez(out, dense=dense_w.numpy(), touched_keys=keys, touched_values=values)


def load_tables(seed, out):
    """Loads that dump at this world size, with other table modes, and trains STEPS more steps."""
    from tests.horovod import dynamic_case as dc

    N, r = hvd.size(), hvd.rank()
    sok.init(sparse_grad_reduction="mean")
    modes = {"users": f"localized:{N - 1}", "pairs": "distributed"}
    tables = dc.make_tables(seed, modes)
    opt = dc.adam()
    sok.load(os.path.join(os.path.dirname(out), "dump"), list(tables.values()), opt)
    dense_w = tf.Variable(np.load(os.path.join(os.path.dirname(out), "dump_tables.rank0.npz"))["dense"])
    batches = [dc.rank_slice(*dc.global_batch(seed, s), r, N) for s in range(dc.STEPS, 2 * dc.STEPS)]
    dc.train(tables, dense_w, batches, dense_tape=hvd.DistributedGradientTape, sparse_opt=opt)
    np.savez(out, **dc.results(tables, dense_w))


if __name__ == "__main__":
    scenario, seed, outdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    globals()[scenario](seed, os.path.join(outdir, f"{scenario}.rank{hvd.rank()}.npz"))
