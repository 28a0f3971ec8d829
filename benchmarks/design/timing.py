"""CUDA-event timing shared by the design scripts (CuPy)."""
import numpy as np


def timeit(fn, reps=10):
    """Median milliseconds of fn() over reps runs, after one warm-up, by CUDA events."""
    import cupy as cp

    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        ev0.record()
        fn()
        ev1.record()
        ev1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(ev0, ev1))
    return float(np.median(ts))
