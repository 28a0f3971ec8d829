"""The pieces `sok.dump` and `sok.load` share (see dump.py for the layout): SOK's file format, what a
process holds of each table, the ranks' collectives and replacing a directory in one step."""
import ctypes
import logging
import os
import shutil
import string
from typing import Dict, List

import numpy as np
import tensorflow as tf

from tf_sok.python import context as context_lib
from tf_sok.python.variable import backing_variable, expand_tables, table_meta

_log = logging.getLogger("tf_sok")

FORMAT_VERSION = 1
MANIFEST = "tf_sok_manifest.json"
HEADER_BYTES = 296                    # SOK: table name 256, file type 4, state name 32, dtype 4
_NAME_BYTES, _STATE_NAME_BYTES = 256, 32
KEY_FILE, WEIGHT_FILE, STATE_FILE = 0, 1, 2
# SOK's dtype indices (big-endian uint32 in the header)
DTYPE_INDEX = {np.dtype(np.int32): 0, np.dtype(np.int64): 1, np.dtype(np.uint32): 2, np.dtype(np.uint64): 3,
               np.dtype(np.float16): 4, np.dtype(np.float32): 5, np.dtype(np.float64): 6}
_INDEX_DTYPE = {v: k for k, v in DTYPE_INDEX.items()}
PIECE_BYTES = 16 << 20                # rows are written, checksummed and read in pieces of about this size
# tf_sok optimizer -> SOK's name in file names; tf_sok slot -> SOK's (Keras 2) slot name
_SOK_OPTIMIZER = {"SGD": "SGD", "Momentum": "SGD", "Adagrad": "Adagrad", "Adam": "Adam", "Adamax": "Adamax",
                  "Adadelta": "Adadelta", "Ftrl": "Ftrl", "RMSprop": "RMSprop"}
_SOK_SLOT = {("Adamax", "u"): "v", ("Adadelta", "accumulated_grad"): "accum_grad",
             ("Adadelta", "accumulated_delta"): "accum_var"}


class DumpError(ValueError):
    """A dump that cannot be read or does not fit the tables (names the file and what is wrong)."""


# ----------------------------------------------------------------------------------------------
# the SOK file format

def file_stem(table_name: str) -> str:
    """SOK's file stem of a table: its variable name (`<name>:0`) with punctuation as "_"."""
    stem = f"{table_name}:0"
    for ch in string.punctuation:
        stem = stem.replace(ch, "_")
    return stem


def encode_header(table: str, kind: int, state_name: str, dtype) -> bytes:
    name = table.rjust(_NAME_BYTES).encode()
    state = state_name.rjust(_STATE_NAME_BYTES).encode()
    if len(name) != _NAME_BYTES or len(state) != _STATE_NAME_BYTES:
        raise ValueError(f"sok.dump: table name {table!r} / state name {state_name!r} longer than SOK's "
                         f"{_NAME_BYTES} / {_STATE_NAME_BYTES} bytes")
    return (name + int(kind).to_bytes(4, "big") + state + DTYPE_INDEX[np.dtype(dtype)].to_bytes(4, "big"))


def decode_header(raw: bytes, path: str) -> dict:
    if len(raw) < HEADER_BYTES:
        raise DumpError(f"sok.load: {path} is truncated: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte "
                        f"header")
    kind = int.from_bytes(raw[256:260], "big")
    index = int.from_bytes(raw[292:296], "big")
    if kind not in (KEY_FILE, WEIGHT_FILE, STATE_FILE) or index not in _INDEX_DTYPE:
        raise DumpError(f"sok.load: {path} has no SOK header (file type {kind}, dtype index {index})")
    return {"table": raw[:256].decode(errors="replace").strip(), "kind": kind,
            "state": raw[260:292].decode(errors="replace").strip(), "dtype": _INDEX_DTYPE[index]}


# ----------------------------------------------------------------------------------------------
# what a process holds

def sparse_optimizer(optimizer):
    """The tf_sok SparseOptimizer behind `optimizer` (itself, sok.keras.Optimizer's `.sparse`)."""
    if optimizer is None:
        return None
    from tf_sok.python.optimizers.base import SparseOptimizer

    sparse = getattr(optimizer, "sparse", optimizer)
    if not isinstance(sparse, SparseOptimizer):
        raise TypeError(f"sok.dump / sok.load: optimizer must be a tf_sok optimizer (sok.OptimizerWrapper(...), "
                        f"sok.optimizers.*, sok.keras.Optimizer), got {type(optimizer).__name__}")
    return sparse


def optimizer_name(sparse) -> str:
    return _SOK_OPTIMIZER.get(type(sparse).__name__, type(sparse).__name__)


def state_names(sparse) -> List[str]:
    name = type(sparse).__name__
    return [_SOK_SLOT.get((name, s), s) for s in sparse.slot_names()]


class _Affine:
    """first + step * i for i in [0, n): what slicing it gives is made then (static tables' ids)."""

    def __init__(self, first: int, step: int, n: int):
        self.first, self.step, self.n = first, step, n

    def __len__(self):
        return self.n

    def __getitem__(self, piece: slice) -> np.ndarray:
        a, b, _ = piece.indices(self.n)
        return self.first + self.step * np.arange(a, b, dtype=np.int64)


class Shard:
    """One rank's part of a table in this process, read and written by rows."""

    def __init__(self, var, sparse):
        self.meta = table_meta(var)
        self.var = backing_variable(var)
        self.dynamic = self.meta.dynamic
        self.state, self.per_row = [], []
        if sparse is not None:
            sparse.build([var])
            self.state = list(sparse.slots(var))
            self.per_row = [s.per_row for s in sparse.slot_specs()]
        self.refresh()

    def refresh(self):
        """The keys held and their local rows, in key order."""
        self.held = None
        with tf.device(self.var.device or None):
            if self.dynamic and self.var.hybrid:   # rows partly in host memory: read whole, through the cache
                keys, arrays = self.var.export_state(self.arrays())
                order = np.argsort(keys.numpy(), kind="stable")
                self.keys = keys.numpy()[order]
                self.rows = np.arange(len(order), dtype=np.int64)
                self.held = [a.numpy()[order] for a in arrays]
                if self.meta.row_ids:
                    self._every_row()
            elif self.dynamic:
                keys, rows = self.var.export_rows()
                order = tf.argsort(keys)
                self.keys = tf.gather(keys, order).numpy()
                self.rows = tf.gather(rows, order).numpy()
            else:   # row r holds global id first + step * r: made a piece at a time, never whole
                m = self.meta
                first, step = (m.rank, m.num_ranks) if m.sharding.kind == "distributed" else (0, 1)
                self.rows = _Affine(0, 1, m.local_rows)
                self.keys = _Affine(first, step, m.local_rows)

    def _every_row(self):
        """A static table with a host tier holds the rows it has seen: the others are at their
        initial value (a function of the row) and state fill; a dump holds every row."""
        m = self.meta
        first, step = (m.rank, m.num_ranks) if m.sharding.kind == "distributed" else (0, 1)
        every = first + step * np.arange(m.local_rows, dtype=np.int64)
        at = (self.keys - first) // step
        missing = np.ones(m.local_rows, bool)
        missing[at] = False
        from tf_sok.python.serving import initial_values
        fills = [None] + self.var.state_fills()
        full = []
        for which, (held, fill) in enumerate(zip(self.held, fills)):
            out = np.empty((m.local_rows,) + held.shape[1:], np.float32)
            out[at] = held
            if which == 0:
                gaps = np.flatnonzero(missing)
                for a in range(0, len(gaps), piece_rows(m.dim)):
                    part = gaps[a:a + piece_rows(m.dim)]
                    out[part] = initial_values(tf.constant(every[part]), m.dim, *self.var.initial_spec).numpy()
            else:
                out[missing] = fill
            full.append(out)
        self.keys, self.rows, self.held = every, np.arange(m.local_rows, dtype=np.int64), full

    def arrays(self) -> list:
        return [self.var] + self.state

    def read(self, which: int, rows: np.ndarray) -> np.ndarray:
        """Values of array `which` (0: the table, 1..: its state) at local `rows`."""
        if self.held is not None:
            return self.held[which][rows]
        rows = tf.constant(rows, tf.int64)
        with tf.device(self.var.device or None):
            if which == 0 and self.dynamic:       # tf.gather would take rows for keys
                return self.var.sparse_read_rows(rows).numpy()
            return tf.gather(self.arrays()[which], rows).numpy()

    def owns(self, keys: np.ndarray) -> np.ndarray:
        """Mask of `keys` this shard holds under its table's placement."""
        m = self.meta
        if m.sharding.kind == "localized":
            return np.full(len(keys), m.rank == m.sharding.owner)
        return np.mod(keys, m.num_ranks) == m.rank

    def write(self, keys: np.ndarray, blocks: List[np.ndarray]) -> None:
        """Sets the rows of `keys` (owned) to blocks[0] (values) and blocks[1:] (state)."""
        with tf.device(self.var.device or None):
            if self.dynamic:
                rows = self.var._assign(keys, blocks[0])[1]   # noqa: SLF001
            else:
                m = self.meta
                local = keys // m.num_ranks if m.sharding.kind == "distributed" else keys
                rows = tf.constant(local, tf.int64)
                self.var.scatter_update(tf.IndexedSlices(tf.constant(blocks[0]), rows))
            for array, block, per_row in zip(self.state, blocks[1:], self.per_row):
                if block is None:
                    continue
                value = tf.constant(block.reshape(-1) if per_row else block)
                array.scatter_update(tf.IndexedSlices(value, rows))


def table_shards(variables, sparse) -> Dict[str, List[Shard]]:
    """Table name -> this process's shards of it, in rank order."""
    out: Dict[str, List[Shard]] = {}
    if isinstance(variables, (list, tuple)):
        variables = list(variables)
    else:
        variables = [variables]
    for v in variables:
        if v is None or table_meta(v) is None:
            raise TypeError(f"sok.dump / sok.load: {getattr(v, 'name', v)!r} is not a tf_sok table "
                            f"(sok.Variable, sok.DynamicVariable or a sok.layers table)")
        shards = [Shard(s, sparse) for s in expand_tables([v])]
        name = shards[0].meta.name
        if name in out:
            raise ValueError(f"sok.dump / sok.load: two tables are named {name!r}; give tables distinct names")
        out[name] = sorted(shards, key=lambda s: s.meta.rank)
    return out


# ----------------------------------------------------------------------------------------------
# ranks

class Ranks:
    """The collectives of a dump: nothing in one process; the communicator's host allgather else."""

    def __init__(self):
        ctx = context_lib.context()
        comm = ctx.communicator
        self.size = comm.size
        self.local = list(comm.local_ranks)
        self.lead = min(self.local) == 0
        self.comm = getattr(comm, "bootstrap", comm)
        self.alone = sorted(self.local) == list(range(self.size))
        self._n = 0

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[size, ...] from every process's [len(local), ...] rows (by rank)."""
        rows = np.asarray(rows, np.int64)
        if self.alone:
            return rows
        self._n += 1
        strategy = self.comm.strategy
        if strategy is not None:   # MultiWorkerMirroredStrategy: a collective of its replicas, one per process
            value = tf.constant(rows)
            out = strategy.run(lambda: tf.distribute.get_replica_context().all_gather(value, axis=0))
            return strategy.experimental_local_results(out)[0].numpy()
        return self.comm.allgather(tf.constant(rows), name=f"tf_sok.dump.{self._n}").numpy()

    def agree(self, value: str) -> str:
        """Rank 0's `value` on every rank (a string of at most 1,024 bytes)."""
        if self.alone:
            return value
        if len(value.encode()) > 1024:
            raise ValueError(f"sok.dump: path too long to share between ranks: {value!r}")
        raw = np.frombuffer(value.encode().ljust(1024), np.uint8).astype(np.int64)[None]
        every = self.gather(np.repeat(raw, len(self.local), axis=0))
        return bytes(every[0].astype(np.uint8)).decode().strip()

    def barrier(self):
        self.gather(np.zeros([len(self.local), 1]))

    def gather_keys(self, keys: np.ndarray) -> np.ndarray:
        """Every process's `keys` (any lengths), concatenated."""
        if self.alone:
            return keys
        lengths = self.gather(np.array([[len(keys)]]))[:, 0]
        padded = np.zeros([1, int(lengths.max())], np.int64)
        padded[0, :len(keys)] = keys
        every = self.gather(padded)
        return np.concatenate([every[i, :n] for i, n in enumerate(lengths)])


# ----------------------------------------------------------------------------------------------
# replacing a directory in one step

def _exchange(a: str, b: str) -> bool:
    """Swaps directories a and b atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, exchange = -100, 2
    return fn(at_fdcwd, a.encode(), at_fdcwd, b.encode(), exchange) == 0


def install(tmp: str, path: str) -> None:
    if not os.path.exists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)                  # now the previous dump
    else:                                   # two renames: a kill between them leaves path.previous
        old = path + ".previous"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str) -> str:
    """`path`, or the complete previous dump a kill between two renames left next to it."""
    if not os.path.exists(path) and os.path.exists(os.path.join(path + ".previous", MANIFEST)):
        _log.warning("sok.load: %s is missing; reading %s.previous, the dump it replaced", path, path)
        return path + ".previous"
    return path


def piece_rows(dim: int) -> int:
    return max(1, PIECE_BYTES // (4 * max(dim, 1)))

