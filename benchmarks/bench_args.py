"""Command-line arguments for the shape of a benchmark step, shared by the
benchmarks (no TensorFlow import: drivers that only launch workers use it too)."""


def add_shape_args(p, iters: int = 20, warmup: int = 3):
    """--batch --tables --rows --dim --iters --warmup, with the common defaults."""
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--warmup", type=int, default=warmup)
