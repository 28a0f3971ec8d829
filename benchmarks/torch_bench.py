"""PyTorch peer of benchmarks/gpu_bench.py: torch.nn.EmbeddingBag on the same
shapes and ids (same generators and seeds), in its own process. Prints a table
and, last, one JSON line that gpu_bench.py reads.

    python benchmarks/torch_bench.py [--batch 65536] [--iters 20]
"""
import argparse
import json
import time

import numpy as np
import torch

from gpu_common import CARDINALITIES, fixed_hot_batch


def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--hotness", type=int, nargs="+", default=[1, 10, 64])
    p.add_argument("--train-hotness", type=int, nargs="+", default=[1, 10])
    a = p.parse_args()
    dev = torch.device("cuda:0")
    out = {"forward": {}, "train": {}}
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    rows = 10_000_000
    rng = np.random.default_rng(0)
    for dim in a.dims:
        bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", device=dev)
        for hot in a.hotness:
            for dist in ("uniform", "zipf:1.05", "zipf:1.2"):
                ids, splits = fixed_hot_batch(rng, rows, a.batch, hot, dist)
                i = torch.from_numpy(ids).to(dev)
                o = torch.from_numpy(splits[:-1]).to(dev)
                with torch.no_grad():
                    s = timed(lambda: bag(i, o), a.iters)
                out["forward"][f"{dist}/{dim}/{hot}"] = s * 1e3
                print(f"forward {dist:>9s} dim {dim:3d} hot {hot:2d}: {s * 1e3:8.3f} ms")
        del bag
        torch.cuda.empty_cache()
    rng = np.random.default_rng(1)
    dim = 128
    for hot in a.train_hotness:
        raw = [fixed_hot_batch(rng, r, a.batch, hot, "zipf:1.05") for r in CARDINALITIES]
        batch = [(torch.from_numpy(i).to(dev), torch.from_numpy(s[:-1]).to(dev)) for i, s in raw]
        for name in ("adam", "sgd"):
            bags = [torch.nn.EmbeddingBag(r, dim, mode="sum", sparse=True, device=dev) for r in CARDINALITIES]
            for b in bags:
                torch.nn.init.uniform_(b.weight, -0.05, 0.05)
            params = [b.weight for b in bags]
            opt = torch.optim.SparseAdam(params, lr=1e-3) if name == "adam" else torch.optim.SGD(params, lr=1e-2)

            def step():
                opt.zero_grad(set_to_none=True)
                loss = sum((b(i, o) ** 2).sum() for b, (i, o) in zip(bags, batch))
                loss.backward()
                opt.step()

            s = timed(step, a.iters)
            out["train"][f"{name}/{hot}"] = s * 1e3
            print(f"step {hot:2d} id/feature {name:4s}: {s * 1e3:8.2f} ms ({a.batch / s:12,.0f} samples/s)")
            del bags, params, opt
            torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
