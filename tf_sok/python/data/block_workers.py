"""Parquet blocks built in worker processes, for readers that one process's Python lock limits.

The block builder (pyarrow's decoding, NumPy's assembly) holds Python's lock between its calls:
measured on 16 cores, threads of one process stop scaling near 8. With `read_parquet(...,
workers=k)` k spawned processes build the blocks; each block comes back as one file in shared
memory (/dev/shm), mapped by the reader and unlinked at once, its arrays 64-byte aligned so
TensorFlow takes them without a copy (the mapping lives as long as the tensors do).
"""
import atexit
import concurrent.futures
import contextlib
import glob
import mmap
import multiprocessing
import os
import secrets
import sys
import threading
from typing import Iterator, Tuple

import numpy as np

from tf_sok.python.data.schema import CriteoSchema

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
_PREFIX = "tf_sok_block_"
_pools = {}
_lock = threading.Lock()


# The workers yield the cores to the training process: its threads launch the step's GPU work, and
# a launch that waits for a core leaves the GPU idle.
WORKER_NICENESS = 10


def _lower_priority():
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # pragma: no cover (a system without priorities: run as is)
        pass


def _ready() -> int:
    return os.getpid()


@contextlib.contextmanager
def _main_not_reimported():
    """Spawned processes re-import the main script unless it has no file or spec: scripts without an
    `if __name__ == "__main__":` guard would run again in every worker. The workers need only tf_sok."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[k]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def _pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """A process pool of `workers` spawned processes, shared by the readers of this process; all of
    them started now."""
    with _lock:
        if workers not in _pools:
            _remove_stale_blocks()
            pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers,
                                                          mp_context=multiprocessing.get_context("spawn"),
                                                          initializer=_lower_priority)
            with _main_not_reimported():
                started = [pool.submit(_ready) for _ in range(workers)]   # one process per task while none idles
                concurrent.futures.wait(started)
            _pools[workers] = pool
            atexit.register(_close, pool)
        return _pools[workers]


_closing = threading.Event()


def _close(pool):
    _closing.set()
    pool.shutdown(wait=False, cancel_futures=True)


def _exiting() -> bool:
    """Whether the interpreter is exiting (the pools are shut down then): readers still pulling
    blocks (tf.data's prefetch threads) end quietly."""
    import concurrent.futures.process as cfp

    return _closing.is_set() or getattr(cfp, "_global_shutdown", False) or sys.is_finalizing()


def _remove_stale_blocks():
    """Block files of readers that died before mapping them (their pid is gone)."""
    import tempfile

    for path in glob.glob(os.path.join(_SHM or tempfile.gettempdir(), _PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(_PREFIX):].split("_")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except (ValueError, PermissionError):
            pass


_files = {}


def _parquet_file(path: str, schema: CriteoSchema):
    """(ParquetFile, row group starts, the columns whose statistics hold their range), per worker."""
    import pyarrow.parquet as pq

    from tf_sok.python.data.columnar import _in_range_by_statistics, criteo_columns, group_starts

    if path not in _files:
        if len(_files) > 64:
            _files.clear()
        f = pq.ParquetFile(path)
        _files[path] = (f, group_starts(f.metadata), _in_range_by_statistics(f, schema), criteo_columns(f, path, schema))
    return _files[path]


class _Arena:
    """Arrays placed one after the other, each 64-byte aligned, in a writable buffer."""

    def __init__(self, buffer):
        self.buffer, self.used = buffer, 0

    def __call__(self, shape, dtype):
        dtype = np.dtype(dtype)
        start = -(-self.used // 64) * 64
        count = int(np.prod(shape, dtype=np.int64))
        self.used = start + count * dtype.itemsize
        return np.ndarray(shape, dtype, buffer=self.buffer, offset=start)


def build_block(path: str, lo: int, hi: int, schema: CriteoSchema, id_dtype: str, owner: int) -> Tuple[str, list]:
    """In a worker: rows [lo, hi) of Parquet file `path` as a block, built in place in one
    shared-memory file: (its path, [(dtype, shape, offset) of each array in the block's order])."""
    import tempfile

    from tf_sok.python.data.columnar import arrow_block, block_bytes

    f, starts, in_range, columns = _parquet_file(path, schema)
    g0 = int(np.searchsorted(starts, lo, side="right")) - 1
    g1 = int(np.searchsorted(starts, hi, side="left"))
    table = f.read_row_groups(list(range(g0, g1)), columns=columns, use_threads=False)
    table = table.slice(lo - int(starts[g0]), hi - lo)
    bound = max(block_bytes(table, schema, id_dtype), 1)
    out = os.path.join(_SHM or tempfile.gettempdir(), f"{_PREFIX}{owner}_{secrets.token_hex(8)}")
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, bound)   # a sparse file: only the pages written take memory
        mm = mmap.mmap(fd, bound)
        arena = _Arena(mm)
        dense, cats, label = arrow_block(table, schema, f"Parquet file {path}", np.dtype(id_dtype), in_range,
                                         alloc=arena)
        arrays = [dense] + [a for n in schema.categorical_names for a in cats[n]] + [label]
        base = np.frombuffer(mm, np.uint8, count=1).ctypes.data
        layout = [(a.dtype.str, a.shape, a.ctypes.data - base if a.size else 0) for a in arrays]
        del dense, cats, label, arrays
        mm.close()
        os.ftruncate(fd, max(arena.used, 1))
    except BaseException:
        os.unlink(out)
        raise
    finally:
        os.close(fd)
    return out, layout


def _mapped(path: str, layout: list):
    """The arrays of a block file: mapped with all its pages mapped by one call (no fault per page;
    shared: a private writable mapping would copy every page), the file unlinked (the mapping
    outlives the name)."""
    try:
        with open(path, "r+b") as fh:
            size = os.fstat(fh.fileno()).st_size
            mm = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.unlink(path)
    out = []
    for dtype, shape, off in layout:
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out.append(np.ndarray(shape, dt, buffer=mm, offset=off) if count else np.zeros(shape, dt))
    return out


def worker_blocks(workers: int, path: str, groups, batch_size: int, block_rows: int, schema: CriteoSchema,
                  id_dtype, ahead: int = 2) -> Iterator:
    """The blocks of one piece, in order, built by the worker pool `ahead` blocks in advance."""
    import pyarrow.parquet as pq

    from tf_sok.python.data.columnar import group_starts, piece_bounds

    pool = _pool(workers)
    begin, end = piece_bounds(group_starts(pq.ParquetFile(path).metadata), groups, batch_size)
    bounds = [(lo, min(lo + block_rows, end)) for lo in range(begin, end, block_rows)]
    pending = []
    dt = np.dtype(id_dtype).str
    try:
        for i in range(len(bounds)):
            while len(pending) <= ahead and len(pending) + i < len(bounds):
                lo, hi = bounds[i + len(pending)]
                try:
                    pending.append(pool.submit(build_block, path, lo, hi, schema, dt, os.getpid()))
                except RuntimeError:
                    if _exiting():
                        return
                    raise
            try:
                arrays = _mapped(*pending.pop(0).result())
            except (concurrent.futures.CancelledError, concurrent.futures.process.BrokenProcessPool):
                if _exiting():
                    return
                raise
            n = len(schema.categorical_names)
            cats = {name: (arrays[1 + 2 * k], arrays[2 + 2 * k]) for k, name in enumerate(schema.categorical_names)}
            yield arrays[0], cats, arrays[1 + 2 * n]
    finally:
        for fut in pending:   # a reader stopped early: its blocks in flight are dropped
            if not fut.cancel():
                try:
                    os.unlink(fut.result()[0])
                except Exception:  # noqa: BLE001 (the block failed; nothing to clean up)
                    pass
