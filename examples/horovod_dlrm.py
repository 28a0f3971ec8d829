"""The DLRM example trained by several processes with Horovod: embedding tables
sharded across the ranks (row-wise), lookups exchanged by all-to-all, dense
gradients averaged by Horovod inside sok.keras.Optimizer.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_dlrm.py [--steps 200]

Each rank reads its own part of the data (here: its own synthetic shard) and
must run the same number of steps, since every step exchanges embeddings.
Checkpoints are per rank (each holds its shards and their optimizer state) and
restore under the same number of ranks.
"""
import argparse
import os
import time

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()

import tf_sok as sok  # noqa: E402
from dlrm_synthetic import build_model, make_data, make_dataset  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--eval-rows", type=int, default=20_000, help="per rank")
    p.add_argument("--checkpoint", default="out/horovod_dlrm/ckpt")
    args = p.parse_args(argv)
    ctx = sok.init(sparse_grad_reduction="mean")  # N ranks x batch b trains like one process with N*b
    rank, n = ctx.rank, ctx.num_ranks
    train = make_dataset(*make_data(args.steps * args.batch_size, seed=1 + 10 * rank), args.batch_size)
    test = make_dataset(*make_data(args.eval_rows, seed=2 + 10 * rank), args.batch_size)
    model = build_model()
    t0 = time.time()
    hist = model.fit(train, epochs=1, verbose=2 if rank == 0 else 0, shuffle=False)
    secs = time.time() - t0
    loss, auc = model.evaluate(test, verbose=0)
    mean_auc = float(hvd.allreduce(tf.constant(auc), op=hvd.Average))
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        os.path.join(f"{args.checkpoint}_rank{rank}_of{n}", "ckpt"))
    if rank == 0:
        print(f"{n} ranks x {args.steps} steps x batch {args.batch_size}: {secs:.1f}s, "
              f"{n * args.steps * args.batch_size / secs:,.0f} samples/s in all; final training loss "
              f"{hist.history['loss'][-1]:.4f}; held-out AUC (mean over ranks) {mean_auc:.4f}; "
              f"rank 0 checkpoint {path}")


if __name__ == "__main__":
    main()
