"""The small model trained by both the workers and the references."""
import keras
import numpy as np
import tensorflow as tf

import tf_sok as sok
from tests.horovod import cases


def make_tables(seed, num_ranks):
    init = cases.global_tables(seed)
    return {k: sok.Variable(init[k], name=k, mode=cases.mode(k, num_ranks)) for k in cases.TABLES}


def ragged(feats, name, sparse=False):
    lens, ids, w = feats[name]
    rt = tf.RaggedTensor.from_row_lengths(ids, lens)
    wt = None if w is None else tf.RaggedTensor.from_row_lengths(w, lens)
    if sparse:
        return rt.to_sparse(), None if wt is None else wt.to_sparse()
    return rt, wt


def lookup(tables, feats, sparse_features=("f1",)):
    ids, weights = [], []
    for name, _, _, weighted in cases.FEATURES:
        i, w = ragged(feats, name, sparse=name in sparse_features)
        ids.append(i)
        weights.append(w if weighted else None)
    return sok.lookup_sparse([tables[t] for _, t, _, _ in cases.FEATURES], ids, weights,
                             combiners=[c for _, _, c, _ in cases.FEATURES],
                             feature_names=[n for n, _, _, _ in cases.FEATURES])


def predict(tables, dense_w, feats):
    outs = lookup(tables, feats)
    return tf.concat(outs, axis=1) @ dense_w


def mean_loss(tables, dense_w, feats, target):
    return tf.reduce_mean(tf.square(predict(tables, dense_w, feats) - target))


def dense_init(seed):
    width = sum(cases.TABLES[t][1] for _, t, _, _ in cases.FEATURES)
    return np.random.default_rng([seed, 99]).standard_normal((width, 1)).astype(np.float32) * 0.1


def single_process_lookup(seed, num_ranks):
    """Outputs (per feature, global batch) and dense gradients (per table) in one process."""
    sok.init()
    tables = make_tables(seed, 1)
    feats, upstream, _ = cases.global_batch(seed, 0, num_ranks)
    with tf.GradientTape() as tape:
        outs = lookup(tables, feats)
        loss = tf.add_n([tf.reduce_sum(o * upstream[n]) for o, (n, _, _, _) in zip(outs, cases.FEATURES)])
    grads = tape.gradient(loss, list(tables.values()))
    dense = {name: tf.math.unsorted_segment_sum(g.values, g.indices, tables[name].shape[0]).numpy()
             for name, g in zip(tables, grads)}
    return {n: o.numpy() for o, (n, _, _, _) in zip(outs, cases.FEATURES)}, dense


def single_process_training(seed, num_ranks, opt_name, loss_scale):
    sok.init()
    cls, kwargs = cases.OPTIMIZERS[opt_name]
    tables = make_tables(seed, 1)
    dense_w = tf.Variable(dense_init(seed))
    sparse_opt = getattr(sok.optimizers, cls)(**kwargs)
    dense_opt = keras.optimizers.SGD(0.05)
    for s in range(cases.STEPS):
        feats, _, target = cases.global_batch(seed, s + 1, num_ranks)
        with tf.GradientTape() as tape:
            loss = mean_loss(tables, dense_w, feats, tf.constant(target)) * loss_scale
        grads = tape.gradient(loss, list(tables.values()) + [dense_w])
        sparse_opt.apply_gradients(zip(grads[:-1], tables.values()))
        dense_opt.apply_gradients([(grads[-1] / loss_scale, dense_w)])  # dense grads are averaged
    return {k: v.numpy() for k, v in tables.items()}, dense_w.numpy()


class KerasModel(keras.Model):
    """The same model as `predict` as a Keras model: one fused EmbeddingCollection
    over the case tables (unweighted features) and a dense layer."""

    def __init__(self, num_ranks):
        super().__init__()
        self.embeddings = sok.layers.EmbeddingCollection(
            tables=[sok.TableConfig(k, rows, dim, mode=mode_k) for k, (rows, dim, _) in cases.TABLES.items()
                    for mode_k in [cases.mode(k, num_ranks)]],
            feature_to_table={n: t for n, t, _, _ in cases.FEATURES},
            combiners={n: c for n, _, c, _ in cases.FEATURES})
        self.head = keras.layers.Dense(1)

    def call(self, x):
        outs = self.embeddings(x)
        return self.head(tf.concat([outs[n] for n, _, _, _ in cases.FEATURES], axis=1))


def compile_keras_model(mdl):
    mdl.compile(optimizer=sok.keras.Optimizer(dense=keras.optimizers.SGD(0.1),
                                              sparse=sok.optimizers.Adagrad(0.05)), loss="mse")
    return mdl


def keras_inputs(feats):
    return {n: ragged(feats, n)[0] for n, _, _, _ in cases.FEATURES}


def set_keras_weights(mdl, seed):
    """Sets every weight from `seed`: tables from the global case tables (each
    shard its rows), dense weights in creation order."""
    tables = cases.global_tables(seed)
    rng = np.random.default_rng([seed, 7])
    for v in mdl.weights:
        meta = sok.table_meta(v)
        if meta is not None:
            v.assign(sok.local_shard(tables[meta.name], meta))
        elif v.trainable:
            v.assign(rng.standard_normal(v.shape).astype(np.float32) * 0.1)


def keras_batches(seed, num_ranks, steps):
    """Per step, per rank: (inputs, target) of the training steps (equal batches)."""
    return [[(keras_inputs(f), t) for f, _, t in (cases.rank_batch(seed, s + 1, r) for r in range(num_ranks))]
            for s in range(steps)]


def single_process_fit(seed, num_ranks, steps):
    """model.fit on the global batches; returns global tables and the dense weights."""
    sok.init()
    mdl = compile_keras_model(KerasModel(1))
    batches = [cases.global_batch(seed, s + 1, num_ranks) for s in range(steps)]
    x0 = keras_inputs(batches[0][0])
    mdl.test_on_batch(x0, batches[0][2])  # builds the model and the optimizer
    set_keras_weights(mdl, seed)
    ds = None
    for feats, _, target in batches:
        d = tf.data.Dataset.from_tensors((keras_inputs(feats), target))
        ds = d if ds is None else ds.concatenate(d)
    mdl.fit(ds, epochs=1, verbose=0)
    return keras_state(mdl)


def keras_state(mdl):
    """{table name or dense index: value}; tables as {global row: vector} pieces per shard."""
    out, dense_i = {}, 0
    for v in mdl.trainable_weights:
        meta = sok.table_meta(v)
        if meta is not None:
            out[f"table/{meta.name}/{meta.rank}"] = v.numpy()
        else:
            out[f"dense/{dense_i}"] = v.numpy()
            dense_i += 1
    return out
