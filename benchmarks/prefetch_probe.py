"""Where a prefetching hybrid step's time goes: the step without prefetch, the prefetch op alone
(eager, after a step), and the step with it; 8 hybrid tables as tier_bench's."""
import sys, os, time, argparse
import numpy as np
import tensorflow as tf
import tf_sok as sok
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tier_bench import batches, make_tables

a = argparse.Namespace(tables=8, keys=2_000_000, dim=128, batch=65536, cache_share=0.1, static=False)
data = batches(a, "zipf:1.05", 70)
tables = make_tables(a, "/GPU:0", True, "probe_")
opt = sok.optimizers.Adagrad(0.01)

def make(prefetch):
    @tf.function
    def step(batch, nxt):
        with tf.GradientTape() as tape:
            outs = sok.lookup_sparse(tables, list(batch), combiners="sum")
            loss = tf.add_n([tf.reduce_sum(o * o) for o in outs])
        if prefetch:
            sok.prefetch(tables, list(nxt))
        opt.apply_gradients(zip(tape.gradient(loss, tables), tables))
        return loss
    return step

plain, pf = make(False), make(True)
pre = tf.function(lambda nxt: sok.prefetch(tables, list(nxt)))
with tf.device("/GPU:0"):
    i = 0
    def t(f):
        t0 = time.perf_counter(); f(); return (time.perf_counter() - t0) * 1e3
    for _ in range(4):
        float(plain(data[i], data[i])); i += 1
    s = [t(lambda: float(plain(data[i], data[i]))) for i in range(i, i + 5)]; i += 5
    print("step without prefetch ms", np.round(s, 2))
    p, q = [], []
    for _ in range(5):
        p.append(t(lambda: float(plain(data[i], data[i]))))
        q.append(t(lambda: pre(data[i + 1]).numpy())); i += 1
    print("step (its batch prefetched before) ms", np.round(p, 2), "| prefetch op alone ms", np.round(q, 2))
    for _ in range(3):
        float(pf(data[i], data[i + 1])); i += 1
    r = []
    for _ in range(6):
        r.append(t(lambda: float(pf(data[i], data[i + 1])))); i += 1
    print("step with prefetch ms", np.round(r, 2))
    for _ in range(40):   # (TF_SOK_FIND_STAGES=1: the stage means print every 20 calls)
        float(pf(data[i], data[i + 1])); i += 1
