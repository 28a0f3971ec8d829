"""Runs tf.distribute scenarios in a fresh process (logical devices must be set
up before TensorFlow starts):

    python -m tests.distribute.worker mirrored N OUTDIR SEED SCENARIO...
    python -m tests.distribute.worker multiworker N OUTDIR SEED SCENARIO...  (TF_CONFIG from the driver)

mirrored: one process, N logical CPU devices (N GPUs with TF_SOK_TEST_DISTRIBUTE_GPU=1, or N
logical GPUs on GPU 0 where fewer are visible).
multiworker: this process is one of N workers with one device each.
Writes OUTDIR/<scenario>.task<i>.npz; keys name the global replica (rank) they
belong to. The pytest driver compares them with one device on the global batch.
"""
import os
import sys

import numpy as np
import tensorflow as tf

KIND, N = sys.argv[1], int(sys.argv[2])
GPU = os.environ.get("TF_SOK_TEST_DISTRIBUTE_GPU") == "1"
EXCHANGE = os.environ.get("TF_SOK_TEST_DISTRIBUTE_EXCHANGE", "auto")  # sok.init(exchange=...)
if KIND == "mirrored":
    if GPU:
        gpus = tf.config.list_physical_devices("GPU")
        if len(gpus) < N:  # one GPU: N logical GPUs on it (the exchange's GPU code paths, not its speed)
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=16384)] * N)
        DEVICES = [f"/gpu:{i}" for i in range(N)]
    else:
        tf.config.set_visible_devices([], "GPU")
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * N)
        DEVICES = [f"/cpu:{i}" for i in range(N)]
    STRATEGY = tf.distribute.MirroredStrategy(DEVICES)
    TASK = 0
else:
    if not GPU:
        tf.config.set_visible_devices([], "GPU")
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()
    TASK = STRATEGY.cluster_resolver.task_id

import keras  # noqa: E402

import tf_sok as sok  # noqa: E402
from tf_sok.python.comm.strategy import StrategyCommunicator  # noqa: E402
from tests.horovod import cases, model  # noqa: E402


def init(res, **kwargs):
    """sok.init under the strategy with the exchange asked for; records which communicator ran."""
    ctx = sok.init(exchange=EXCHANGE, **kwargs)
    assert ctx.num_ranks == N
    res["communicator"] = type(ctx.communicator).__name__
    return ctx


def rank():
    return sok.context().communicator.rank


def per_rank(values, fn):
    """{global rank: fn(local value)} for a strategy.run result."""
    ranks = sok.context().communicator.local_ranks
    return {r: fn(v) for r, v in zip(ranks, STRATEGY.experimental_local_results(values))}


def lookups(seed, res):
    """Outputs and table gradients of each replica's batch, both reductions."""
    for reduction in ("sum", "mean"):
        with STRATEGY.scope():
            ctx = init(res, sparse_grad_reduction=reduction)
            comm = ctx.communicator
            assert isinstance(getattr(comm, "bootstrap", comm), StrategyCommunicator), comm
            tables = model.make_tables(seed, N)
            assert all(isinstance(t, sok.ReplicaTable) for t in tables.values())

        def run():
            feats, upstream, _ = cases.rank_batch(seed, 0, rank())
            with tf.GradientTape() as tape:
                outs = model.lookup(tables, feats)
                loss = tf.add_n([tf.reduce_sum(o * upstream[n]) for o, (n, _, _, _) in zip(outs, cases.FEATURES)])
            grads = tape.gradient(loss, list(tables.values()))  # the tables stand for the local shards
            dense = [tf.math.unsorted_segment_sum(g.values, g.indices, sok.table_meta(t).local_rows)
                     for g, t in zip(grads, tables.values())]
            return outs, dense

        modes = [("function", tf.function(lambda: STRATEGY.run(run)))]
        if KIND == "mirrored":
            modes.append(("eager", lambda: STRATEGY.run(run)))
        for mode, fn in modes:
            outs, grads = fn()
            for (name, _, _, _), o in zip(cases.FEATURES, outs):
                for r, v in per_rank(o, lambda t: t.numpy()).items():
                    res[f"{reduction}/{mode}/out/{name}/{r}"] = v
            for name, g in zip(tables, grads):
                for r, v in per_rank(g, lambda t: t.numpy()).items():
                    res[f"{reduction}/{mode}/grad/{name}/{r}"] = v
            for name, t in tables.items():  # shards live on their replica's device
                for r, shard in zip(sok.context().communicator.local_ranks, t.shards):
                    assert shard.device.endswith(sok.context().communicator.device(r).split(":")[-1]), shard.device


def training(seed, res, optimizers=None):
    """cases.STEPS custom-loop steps (strategy.run) of each sparse optimizer +
    Keras SGD on a mirrored dense weight; loss averaged over the global batch."""
    for i, opt_name in enumerate(optimizers or cases.OPTIMIZERS):
        cls, kwargs = cases.OPTIMIZERS[opt_name]
        with STRATEGY.scope():
            init(res)
            tables = model.make_tables(seed, N)
            dense_w = tf.Variable(model.dense_init(seed))
            sparse_opt = getattr(sok.optimizers, cls)(**kwargs)
            if i % 2 == 0:  # else the optimizer creates each shard's state on first use, in replica context
                sparse_opt.build(list(tables.values()))
            dense_opt = keras.optimizers.SGD(0.05)

        @tf.function
        def step(s):
            def fn():
                feats, _, target = cases.rank_batch(seed, s + 1, rank())
                with tf.GradientTape() as tape:
                    err = model.predict(tables, dense_w, feats) - target
                    loss = tf.nn.compute_average_loss(tf.square(err)[:, 0], global_batch_size=len(target) * N)
                grads = tape.gradient(loss, list(tables.values()) + [dense_w])
                sparse_opt.apply_gradients(zip(grads[:-1], tables.values()))
                dense_opt.apply_gradients([(grads[-1], dense_w)])
            STRATEGY.run(fn)

        for s in range(cases.STEPS):
            step(s)
        for name, t in tables.items():
            for r, shard in zip(sok.context().communicator.local_ranks, t.shards):
                res[f"{opt_name}/{name}/{r}"] = shard.numpy()
                for slot in sparse_opt.slots(shard):  # each shard's state lives next to it
                    assert slot.device == shard.device, (slot.device, shard.device)
        res[f"{opt_name}/dense"] = dense_w.numpy()


def training_adam(seed, res):
    training(seed, res, ["adam"])


def fit(seed, res):
    """model.fit with sok layers + sok.keras.Optimizer on per-replica batches;
    then a checkpoint restored into a fresh model under the same strategy."""
    with STRATEGY.scope():
        init(res)
        mdl = model.compile_keras_model(model.KerasModel(N))
    batches = model.keras_batches(seed, N, cases.STEPS)
    mdl.test_on_batch(*batches[0][0])  # builds the model and the optimizer
    model.set_keras_weights(mdl, seed)

    def dataset_fn(ctx):
        per_pipeline = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        ds = None
        for step in batches:  # replica r of this pipeline takes every per_pipeline-th element
            for j in range(per_pipeline):
                d = tf.data.Dataset.from_tensors(step[ctx.input_pipeline_id * per_pipeline + j])
                ds = d if ds is None else ds.concatenate(d)
        return ds

    mdl.fit(STRATEGY.distribute_datasets_from_function(dataset_fn), epochs=1, verbose=0)
    for shard in sok.filter_variables(mdl.trainable_variables)[0]:  # the Keras optimizer's state too
        for slot in mdl.optimizer.sparse.slots(shard):
            assert slot.value.device == shard.value.device and slot.shape[0] == shard.shape[0], slot.path
    for k, v in model.keras_state(mdl).items():
        res[f"fit/{k}"] = v
    x_eval = model.keras_inputs(cases.rank_batch(seed, 99, 0)[0])
    before = mdl.predict_on_batch(x_eval)
    path = tf.train.Checkpoint(model=mdl, optimizer=mdl.optimizer).save(
        os.path.join(OUTDIR, f"ckpt_task{TASK}", "ckpt"))
    with STRATEGY.scope():
        fresh = model.compile_keras_model(model.KerasModel(N))
    fresh.test_on_batch(*batches[0][0])
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path).assert_existing_objects_matched()
    res["ckpt/before"], res["ckpt/after"] = before, fresh.predict_on_batch(x_eval)
    weights = os.path.join(OUTDIR, f"task{TASK}.weights.h5")  # Keras' own format: every shard by layer
    mdl.save_weights(weights)
    with STRATEGY.scope():
        other = model.compile_keras_model(model.KerasModel(N))
    other.test_on_batch(*batches[0][0])
    other.load_weights(weights)
    res["ckpt/after_weights_h5"] = other.predict_on_batch(x_eval)
    for a, b in zip(mdl.optimizer.variables, fresh.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def errors(seed, res):
    """What each misuse raises (messages saved for the driver to check)."""
    ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        try:
            sok.init()
        except ValueError as e:
            res["unsupported"] = str(e)
    sok.init()  # no strategy: a single process
    with STRATEGY.scope():
        try:
            sok.Variable(shape=[10, 4], name="early")
        except RuntimeError as e:
            res["init_outside"] = str(e)
        try:
            sok.init(exchange="nccl")
        except RuntimeError as e:  # NcclUnavailable: no GPU per replica here
            res["nccl"] = str(e)
        sok.init()
        table = sok.Variable(np.random.default_rng(seed).standard_normal((10, 4)).astype(np.float32), name="ta")
    try:
        sok.Variable(shape=[10, 4], name="late")
    except RuntimeError as e:
        res["create_outside"] = str(e)
    try:
        sok.lookup_sparse(table, ids)
    except RuntimeError as e:
        res["cross_replica"] = str(e)
    before = [s.numpy() for s in table.shards]

    def bad():
        x = tf.ragged.constant([[1, 2], [3 if rank() == 0 else 10]], dtype=tf.int64)
        return sok.lookup_sparse([table], [x], feature_names=["clicks"])[0]

    for mode, fn in (("eager", lambda: STRATEGY.run(bad)), ("function", tf.function(lambda: STRATEGY.run(bad)))):
        try:
            fn()
        except tf.errors.InvalidArgumentError as e:
            res[f"bad_id/{mode}"] = str(e)
    ok = STRATEGY.run(lambda: sok.lookup_sparse(table, ids, combiners="sum"))
    res["ok"] = STRATEGY.experimental_local_results(ok)[0].numpy()
    # model.fit on batches whose ids are (values, row_splits) pairs: Keras would cut them apart
    import tf_sok.data as sd

    schema = sd.CriteoSchema.capped(100)
    pairs = sd.for_keras(sd.synthetic(64, 16, sd.SyntheticConfig(schema=schema), ragged_pairs=True))
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = sok.layers.EmbeddingCollection(tables=[sok.TableConfig("tp", 100, 2)],
                                                      feature_to_table={n: "tp" for n in schema.categorical_names})
            self.out = keras.layers.Dense(1)

        def call(self, x):
            e = self.emb({n: x[n] for n in schema.categorical_names})
            return self.out(tf.concat([x["dense"]] + list(e.values()), 1))

    with STRATEGY.scope():
        net = Net()
        net.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.SGD(0.1), sparse=sok.optimizers.SGD(0.1)),
                    loss="mse")
    try:
        net.fit(pairs, epochs=1, verbose=0)
    except ValueError as e:
        res["pairs"] = str(e)
    res["table_before"] = np.concatenate(before)
    res["table_after"] = np.concatenate([s.numpy() for s in table.shards])


def nccl_graph(seed, res):
    """The NCCL exchange's step under MirroredStrategy, traced only (no GPU needed): a
    communicator with the real wiring but no NCCL behind it. For every NCCL op: the
    replica of its device, its communicator key, and how many NCCL ops of other replicas
    it depends on (through data or control inputs, transitively)."""
    from tf_sok.python.comm.nccl import NcclCommunicator

    with STRATEGY.scope():
        ctx = sok.init(exchange="framework")
        comm = object.__new__(NcclCommunicator)
        comm.__dict__.update(_boot=ctx.communicator, _device=None, _per_replica=True,
                             _keys={r: 100 + r for r in range(N)}, version="traced only")
        ctx.communicator = comm
        tables = model.make_tables(seed, N)

    def run():
        feats, upstream, _ = cases.rank_batch(seed, 0, rank())
        with tf.GradientTape() as tape:
            outs = model.lookup(tables, feats)
            loss = tf.add_n([tf.reduce_sum(o * upstream[n]) for o, (n, _, _, _) in zip(outs, cases.FEATURES)])
        return tape.gradient(loss, list(tables.values()))

    graph = tf.function(lambda: STRATEGY.run(run)).get_concrete_function().graph
    replica_of = {d: r for r, d in enumerate(STRATEGY.extended.worker_devices)}
    nccl = [op for op in graph.get_operations() if op.type.startswith("TfSokNccl")]
    for i, op in enumerate(nccl):
        mine = replica_of[tf.DeviceSpec.from_string(op.device).to_string()]
        seen, stack, foreign = set(), list(op.inputs) + list(op.control_inputs), 0
        while stack:
            x = stack.pop()
            up = x if isinstance(x, tf.Operation) else x.op
            if up.name in seen:
                continue
            seen.add(up.name)
            if up.type.startswith("TfSokNccl") and replica_of[tf.DeviceSpec.from_string(up.device).to_string()] != mine:
                foreign += 1
            stack.extend(list(up.inputs) + list(up.control_inputs))
        res[f"op{i}"] = np.array([mine, op.get_attr("key"), foreign])
        res[f"op{i}/type"] = op.type


def dynamic(seed, res):
    """Dynamic tables (distributed and localized) with a static one in one fused lookup, trained in a
    custom loop: each replica on its slice of each global batch, the loss averaged over the global
    batch (replica gradients summed at the owners and by the strategy)."""
    from tests.horovod import dynamic_case as dc

    with STRATEGY.scope():
        init(res)
        tables = dc.make_tables(seed)
        dense_w = tf.Variable(dc.dense_init())
        sparse_opt = dc.adam()
        dense_opt = keras.optimizers.SGD(0.05)
    batches = [dc.global_batch(seed, s) for s in range(2 * dc.STEPS)]

    def train(tables, sparse_opt, steps):
        for s in steps:
            def fn(s=s):
                feats, target = dc.rank_slice(*batches[s], rank(), N)
                feats = {k: (tf.constant(v[0]), tf.constant(v[1])) for k, v in feats.items()}
                with tf.GradientTape() as tape:
                    loss = dc.loss_fn(tables, dense_w, feats, tf.constant(target)) / N
                names = list(tables)
                grads = tape.gradient(loss, [tables[n] for n in names] + [dense_w])
                sparse_opt.apply_gradients(zip(grads[:-1], [tables[n] for n in names]))
                dense_opt.apply_gradients([(grads[-1], dense_w)])
            STRATEGY.run(tf.function(fn))

    def record(tables, prefix):
        for name, t in tables.items():
            for r, shard in zip(sok.context().communicator.local_ranks, t.shards):
                if dc.TABLES[name][1] is None:
                    res[f"{prefix}{name}/rows/{r}"] = dc.static_rows(shard)
                else:
                    keys, values = sok.export(shard)
                    res[f"{prefix}{name}/keys/{r}"], res[f"{prefix}{name}/values/{r}"] = keys.numpy(), values.numpy()
        res[f"{prefix}dense"] = dense_w.numpy()

    train(tables, sparse_opt, range(dc.STEPS))
    record(tables, "")
    # sok.dump under N replicas; loaded back with the dynamic tables' modes swapped and host tiers on
    # every table (3 cached rows per replica), STEPS more steps
    res["dump_path"] = path = os.path.join(OUTDIR, "dynamic_dump")
    sok.dump(path, list(tables.values()), sparse_opt)
    with STRATEGY.scope():
        resumed = dc.make_tables(seed, {"users": f"localized:{N - 1}", "pairs": "distributed"}, hybrid=True)
        resumed_opt = dc.adam()
    sok.load(path, list(resumed.values()), resumed_opt)
    train(resumed, resumed_opt, range(dc.STEPS, 2 * dc.STEPS))
    record(resumed, "resumed/")


if __name__ == "__main__":
    OUTDIR, SEED = sys.argv[3], int(sys.argv[4])
    for scenario in sys.argv[5:]:
        results = {}
        globals()[scenario](SEED, results)
        np.savez(os.path.join(OUTDIR, f"{scenario}.task{TASK}.npz"), **{k: np.asarray(v) for k, v in results.items()})
        print(f"{scenario}: {len(results)} results", flush=True)
