"""The small model trained by both the workers and the references."""
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
