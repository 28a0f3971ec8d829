"""The DLRM example under tf.distribute.MirroredStrategy: every replica (GPU, or
logical CPU device) holds a row-wise shard of each table and its optimizer
state; lookups exchange ids and vectors between replicas (device-to-device
copies), dense gradients use the strategy's all-reduce; plain model.fit.

    python examples/mirrored_dlrm.py                  # all GPUs, or 2 logical CPU devices
    python examples/mirrored_dlrm.py --cpu-devices 3  # 3 logical CPU devices

The same model and data as examples/dlrm_synthetic.py. The batch is global
(split across replicas); R replicas x batch b trains like one device with R*b.
A checkpoint restores under the same strategy and number of replicas.
"""
import argparse
import os
import time

import tensorflow as tf

from criteo_common import make_strategy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4096, help="global, split across replicas")
    p.add_argument("--eval-rows", type=int, default=50_000)
    p.add_argument("--cpu-devices", type=int, default=0, help="use N logical CPU devices even if GPUs exist")
    p.add_argument("--checkpoint", default="out/mirrored_dlrm/ckpt")
    args = p.parse_args(argv)
    strategy = make_strategy(args.cpu_devices)

    import tf_sok as sok
    from dlrm_synthetic import build_model, make_data, make_dataset

    with strategy.scope():
        ctx = sok.init()  # picks up the strategy: each replica is a rank
        model = build_model()
    train = make_dataset(*make_data(args.steps * args.batch_size, seed=1), args.batch_size)
    test = make_dataset(*make_data(args.eval_rows, seed=2), args.batch_size)
    t0 = time.time()
    hist = model.fit(train, epochs=1, verbose=2, shuffle=False)
    secs = time.time() - t0
    loss, auc = model.evaluate(test, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        os.path.join(f"{args.checkpoint}_{ctx.num_ranks}replicas", "ckpt"))
    print(f"{ctx.num_ranks} replicas ({', '.join(strategy.extended.worker_devices)}) x {args.steps} steps x global "
          f"batch {args.batch_size}: {secs:.1f}s, {args.steps * args.batch_size / secs:,.0f} samples/s; final "
          f"training loss {hist.history['loss'][-1]:.4f}; held-out loss {loss:.4f}, AUC {auc:.4f}; checkpoint {path}")


if __name__ == "__main__":
    main()
