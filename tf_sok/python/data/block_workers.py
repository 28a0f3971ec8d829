"""Parquet blocks built in worker processes, for readers that one process's Python lock limits.

The block builder (pyarrow's decoding, NumPy's assembly) holds Python's lock between its calls:
measured on 16 cores, threads of one process stop scaling near 8. With `read_parquet(...,
workers=k)` k spawned processes build the blocks in shared memory (/dev/shm), their arrays 64-byte
aligned and laid out batch by batch (blocks.py), so that TensorFlow takes them, and cuts batches
from them, without a copy.

Slabs: the reading process keeps shared-memory files ("slabs") mapped once, registered with the GPU
as page-locked memory where one is present (TfSokRegisterHost), and hands a free one to the worker
with each block to build. A block's tensors point into its slab; when the last of them is released
(the batches copied to the device), the slab is free again. So per batch the reading process maps
nothing, faults in no page, copies no id, and the pinned copy before the device passes the ids
through: the copy to the GPU is one DMA from the slab. Slabs are made as the pipeline needs them
(as many as its buffers hold blocks at once) by a thread of their own; a block that does not fit a
slab, or one built while none is free, comes back in a file of its own, mapped and unlinked.
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
import time
import weakref
from typing import Iterator, Optional, Tuple

import numpy as np

from tf_sok.python.data.schema import CriteoSchema

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
_PREFIX = "tf_sok_block_"
_pools = {}
_lock = threading.Lock()


# TF_SOK_PIN_SLABS=1: slabs registered with the GPU (page-locked in place) where one is present, so that
# the pinned copy before the device passes them through. Off by default: on an H200 (DCNv2 from 16
# Parquet files, 12 workers, 600 steps) registering the ~40 slabs the pipeline holds cost more than the
# copies it saves (2.37M samples/s registered vs 2.81M pageable, the training process copying).
PIN_SLABS = os.environ.get("TF_SOK_PIN_SLABS", "0") == "1"

# The workers yield the cores to the training process: its threads launch the step's GPU work, and
# a launch that waits for a core leaves the GPU idle.
WORKER_NICENESS = 10


def _start_worker(parent: int):
    """A worker's set-up: it yields the cores (WORKER_NICENESS) and ends with the process that
    started it (a parent ended by a signal or os._exit leaves no workers behind)."""
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # pragma: no cover (a system without priorities: run as is)
        pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, name="tf_sok_parent_watch", daemon=True).start()


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
                                                          initializer=_start_worker,
                                                          initargs=(os.getpid(),))
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


_slab_maps = {}


def _slab_map(path: str, size: int) -> mmap.mmap:
    """A worker's mapping of slab `path`, kept while the slab exists (its pages faulted in once)."""
    mm = _slab_maps.get(path)
    if mm is None:
        for gone in [p for p in _slab_maps if not os.path.exists(p)]:   # slabs the reader retired
            _slab_maps.pop(gone).close()
        with open(path, "r+b") as fh:
            mm = mmap.mmap(fh.fileno(), size)
        _slab_maps[path] = mm
    return mm


def _layout(arrays, buffer) -> list:
    base = np.frombuffer(buffer, np.uint8, count=1).ctypes.data
    return [(a.dtype.str, a.shape, a.ctypes.data - base if a.size else 0) for a in arrays]


def build_block(path: str, lo: int, hi: int, schema: CriteoSchema, id_dtype: str, batch_size: int,
                owner: int, slab: Optional[Tuple[str, int]] = None) -> tuple:
    """In a worker: rows [lo, hi) of Parquet file `path` as a block, built in place in shared memory:
    in `slab` (its path and size) when it fits there, else in a file of its own. Returns (the file's
    path, or None for the slab; [(dtype, shape, offset) of each array in the block's order]; the
    block's bound in bytes)."""
    import tempfile

    from tf_sok.python.data.columnar import arrow_block, block_bytes

    f, starts, in_range, columns = _parquet_file(path, schema)
    g0 = int(np.searchsorted(starts, lo, side="right")) - 1
    g1 = int(np.searchsorted(starts, hi, side="left"))
    table = f.read_row_groups(list(range(g0, g1)), columns=columns, use_threads=False)
    table = table.slice(lo - int(starts[g0]), hi - lo)
    bound = max(block_bytes(table, schema, id_dtype, batch_size), 1)

    def build(buffer):
        arena = _Arena(buffer)
        dense, cats, label, cuts = arrow_block(table, schema, f"Parquet file {path}", np.dtype(id_dtype), in_range,
                                               alloc=arena, batch_size=batch_size)
        arrays = [dense] + [a for n in schema.categorical_names for a in cats[n]] + [label, cuts]
        return _layout(arrays, buffer), arena.used

    if slab is not None and bound <= slab[1]:
        return None, build(_slab_map(*slab))[0], bound
    out = os.path.join(_SHM or tempfile.gettempdir(), f"{_PREFIX}{owner}_{secrets.token_hex(8)}")
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, bound)   # a sparse file: only the pages written take memory
        mm = mmap.mmap(fd, bound)
        layout, used = build(mm)
        mm.close()
        os.ftruncate(fd, max(used, 1))
    except BaseException:
        os.unlink(out)
        raise
    finally:
        os.close(fd)
    return out, layout, bound


class _Slab:
    """A shared-memory file, its pages allocated, mapped by the reading process (and registered
    with the GPU where TF_SOK_PIN_SLABS=1 and one is present)."""

    def __init__(self, size: int):
        import tempfile

        self.size = size
        self.path = os.path.join(_SHM or tempfile.gettempdir(), f"{_PREFIX}{os.getpid()}_slab_{secrets.token_hex(8)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # the pages taken now (a full /dev/shm is an OSError here, not a worker's SIGBUS later)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # pragma: no cover (no fallocate: a sparse file)
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.address = np.frombuffer(self.mm, np.uint8, count=1).ctypes.data
        self.pinned = PIN_SLABS and _register(self.address, size)

    def close(self):
        if self.pinned:
            _host_calls().TfSokUnregisterHost(_pointer(self.address))
        try:
            os.unlink(self.path)
        except OSError:
            pass
        # the mapping itself goes with the last array viewing it


def _pointer(address: int):
    import ctypes

    return ctypes.c_void_p(address)


_host = None


def _host_calls():
    """The op library's host-registration calls (ctypes)."""
    global _host
    if _host is None:
        import ctypes

        from tf_sok.python.ops.loader import _module, library_path

        _module()   # TensorFlow loads the library first
        so = ctypes.CDLL(library_path())
        so.TfSokRegisterHost.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
        so.TfSokRegisterHost.restype = ctypes.c_int
        so.TfSokUnregisterHost.argtypes = [ctypes.c_void_p]
        so.TfSokRegisterHostError.restype = ctypes.c_char_p
        so.TfSokPinnedCopyBytes.argtypes = [ctypes.c_int]
        so.TfSokPinnedCopyBytes.restype = ctypes.c_ulonglong
        _host = so
    return _host


def pinned_copy_bytes() -> dict:
    """Bytes `pinned_copy` passed through (they lay in registered slabs already) and copied, in this
    process so far."""
    so = _host_calls()
    return {"passed": int(so.TfSokPinnedCopyBytes(0)), "copied": int(so.TfSokPinnedCopyBytes(1))}


_register_failed = []


def _register(address: int, size: int) -> bool:
    """Registers a slab with the GPU (page-locked in place); False where there is none, or (once
    warned) where the driver refuses."""
    so = _host_calls()
    got = so.TfSokRegisterHost(_pointer(address), size)
    if got < 0 and not _register_failed:
        import warnings

        _register_failed.append(True)
        warnings.warn(f"tf_sok readers: registering {size} bytes of shared memory with the GPU failed "
                      f"({so.TfSokRegisterHostError().decode()}); batches are copied to page-locked memory instead")
    return got == 1


class Slabs:
    """The slabs of this process, up to `limit` bytes in all. A thread of their own makes them (maps
    and registers them: tens of ms each for a DCNv2 block) ahead of need, keeping `spare` free ones,
    so that a reader never waits for one: with none free, a block is built in a file of its own.
    Their size follows the largest block seen (1.1 x its bound); smaller ones are retired when freed."""

    def __init__(self, limit: int):
        self.limit = limit
        self.size = 0
        self.spare = 0
        self.free, self.total, self.made = [], 0, []
        self.stats = {"slabs": 0, "blocks_in_slabs": 0, "blocks_in_files": 0, "pinned_bytes": 0}
        self._lock = threading.RLock()   # a lease's finalizer may run in any thread, in any code
        self._wake = threading.Condition(self._lock)
        self._maker = None
        self._making = False

    def acquire(self, spare: int) -> Optional[_Slab]:
        """A free slab, or None (none free yet). `spare`: free slabs to keep ready (the workers)."""
        with self._lock:
            self.spare = max(self.spare, spare)
            slab = None
            while self.free and slab is None:
                slab = self.free.pop()
                if slab.size < self.size:
                    self._retire(slab)
                    slab = None
            self._wake.notify_all()
            return slab

    def _short(self) -> bool:
        return bool(self.size) and len(self.free) < self.spare and self.total + self.size <= self.limit

    def _make(self):
        while True:
            with self._lock:
                while not self._short():
                    self._making = False
                    self._wake.notify_all()
                    self._wake.wait()
                self._making = True
                size = self.size
                self.total += size   # taken now: another maker's check sees it
            try:
                slab = _Slab(size)
            except OSError:   # no room for another (/dev/shm full): make no more
                with self._lock:
                    self.total -= size
                    self.limit = self.total
                continue
            with self._lock:
                self.made.append(slab.path)
                self.stats["slabs"] += 1
                self.stats["pinned_bytes"] += size if slab.pinned else 0
                self.free.append(slab)

    def settled(self, timeout: float = 60.0) -> bool:
        """Waits until the maker has the spare slabs it wants (or can make no more)."""
        with self._lock:
            return self._wake.wait_for(lambda: not self._making and not self._short(), timeout)

    def release(self, slab: _Slab):
        with self._lock:
            if slab.size >= self.size and not _exiting():
                self.free.append(slab)
            else:
                self._retire(slab)

    def _retire(self, slab: _Slab):
        self.total -= slab.size
        self.stats["pinned_bytes"] -= slab.size if slab.pinned else 0
        slab.close()

    def learn(self, bound: int):
        """A block of `bound` bytes did not fit: later slabs are made to hold it."""
        with self._lock:
            want = -(-int(bound * 1.1) // (1 << 20)) << 20
            self.size = max(self.size, want)
            if self._maker is None:
                self._maker = threading.Thread(target=self._make, name="tf_sok_slab_maker", daemon=True)
                self._maker.start()
            self._wake.notify_all()

    def arrays(self, slab: _Slab, layout: list) -> list:
        """The block built in `slab`: arrays whose last release frees the slab."""
        import ctypes

        # what the block's arrays hang on (their NumPy base: not an array, so NumPy does not look
        # past it): when the last of them goes, so does it, and the slab is free again
        lease = (ctypes.c_ubyte * slab.size).from_buffer(slab.mm)
        weakref.finalize(lease, self.release, slab).atexit = False
        self.stats["blocks_in_slabs"] += 1
        return _arrays(lease, layout)

    def close(self):
        """At exit: every slab's file goes (those still mapped by tensors stay mapped)."""
        with self._lock:
            for path in self.made:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            self.free = []


_slabs = []


def slabs() -> Slabs:
    """This process' slabs (made on first use; at most a quarter of the host's memory)."""
    with _lock:
        if not _slabs:
            try:
                memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError):  # pragma: no cover (a system without these counts)
                memory = 16 << 30
            _slabs.append(Slabs(memory // 4))
            atexit.register(_slabs[0].close)
        return _slabs[0]


def _arrays(buffer, layout: list) -> list:
    out = []
    for dtype, shape, off in layout:
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out.append(np.ndarray(shape, dt, buffer=buffer, offset=off) if count else np.zeros(shape, dt))
    return out


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
    return _arrays(mm, layout)


def worker_blocks(workers: int, path: str, groups, batch_size: int, block_rows: int, schema: CriteoSchema,
                  id_dtype, ahead: int = 2) -> Iterator:
    """The blocks of one piece, in order, built by the worker pool `ahead` blocks in advance."""
    import pyarrow.parquet as pq

    from tf_sok.python.data.columnar import group_starts, piece_bounds

    pool = _pool(workers)
    store = slabs()
    begin, end = piece_bounds(group_starts(pq.ParquetFile(path).metadata), groups, batch_size)
    bounds = [(lo, min(lo + block_rows, end)) for lo in range(begin, end, block_rows)]
    pending = []   # (future, slab or None)
    dt = np.dtype(id_dtype).str
    n = len(schema.categorical_names)
    try:
        for i in range(len(bounds)):
            while len(pending) <= ahead and len(pending) + i < len(bounds):
                lo, hi = bounds[i + len(pending)]
                slab = store.acquire(workers)
                where = None if slab is None else (slab.path, slab.size)
                try:
                    pending.append((pool.submit(build_block, path, lo, hi, schema, dt, batch_size, os.getpid(), where),
                                    slab))
                except RuntimeError:
                    if slab is not None:
                        store.release(slab)
                    if _exiting():
                        return
                    raise
            fut, slab = pending.pop(0)
            try:
                file, layout, bound = fut.result()
            except BaseException as e:
                if slab is not None:
                    store.release(slab)
                if isinstance(e, (concurrent.futures.CancelledError, concurrent.futures.process.BrokenProcessPool)) \
                        and _exiting():
                    return
                raise
            if file is None:
                arrays = store.arrays(slab, layout)
            else:
                if slab is not None:
                    store.release(slab)
                store.learn(bound)
                store.stats["blocks_in_files"] += 1
                arrays = _mapped(file, layout)
            cats = {name: (arrays[1 + 2 * k], arrays[2 + 2 * k]) for k, name in enumerate(schema.categorical_names)}
            yield arrays[0], cats, arrays[1 + 2 * n], arrays[2 + 2 * n]
            del arrays, cats
    finally:
        for fut, slab in pending:   # a reader stopped early: its blocks in flight are dropped
            if not fut.cancel():
                try:
                    file = fut.result()[0]
                    if file is not None:
                        os.unlink(file)
                except Exception:  # noqa: BLE001 (the block failed; nothing to clean up)
                    pass
            if slab is not None:
                store.release(slab)
