"""`sok.dump` / `sok.load`: tables and their optimizer state as files, in SOK 2.x's layout.

A dump is a directory. Per table (file stem: the table's name + ":0" with punctuation as "_", as SOK
names it) it holds `<stem>-key` (int64 global ids or keys), `<stem>-weight` (float32 rows) and, with
an optimizer, `<stem>-<Optimizer>-<slot>` (one per state array), each a 296-byte SOK header
followed by the raw little-endian values, rows in the same order in every file of the table. SOK's
`sok.load` reads these files; tf_sok reads SOK's.

Next to them, `tf_sok_manifest.json` (SOK's reader ignores it): format version, world size, the
tables (dim, mode, kind, rows), the optimizer (its class, hyper-parameters, step counter), and per
file a CRC-32 of the header and of every piece of rows, which `sok.load` checks before it changes
anything. A dump is written into a temporary directory that replaces `path` in one step
(renameat2 RENAME_EXCHANGE on Linux), so a dump killed part-way leaves the previous one in place.

Rows are keyed by global id (static tables) or key (dynamic tables), so `sok.load` re-shards: a
dump written under N ranks loads under M, in any mode; each rank streams the files in pieces and
keeps the rows it owns. `since=<previous dump>` writes a delta: only the rows whose value or state
differ from that dump, plus the keys of dynamic tables removed since; `sok.load([base, delta, ...])`
applies them in order.

Writers and readers need one file system all ranks see (as SOK's dump does).
"""
import ctypes
import glob
import json
import logging
import os
import shutil
import string
import uuid
import zlib
from typing import Dict, List, Optional

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

def _sparse_optimizer(optimizer):
    """The tf_sok SparseOptimizer behind `optimizer` (itself, sok.keras.Optimizer's `.sparse`)."""
    if optimizer is None:
        return None
    from tf_sok.python.optimizers.base import SparseOptimizer

    sparse = getattr(optimizer, "sparse", optimizer)
    if not isinstance(sparse, SparseOptimizer):
        raise TypeError(f"sok.dump / sok.load: optimizer must be a tf_sok optimizer (sok.OptimizerWrapper(...), "
                        f"sok.optimizers.*, sok.keras.Optimizer), got {type(optimizer).__name__}")
    return sparse


def _optimizer_name(sparse) -> str:
    return _SOK_OPTIMIZER.get(type(sparse).__name__, type(sparse).__name__)


def _state_names(sparse) -> List[str]:
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


class _Shard:
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
                for a in range(0, len(gaps), _piece_rows(m.dim)):
                    part = gaps[a:a + _piece_rows(m.dim)]
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


def _shards(variables, sparse) -> Dict[str, List[_Shard]]:
    """Table name -> this process's shards of it, in rank order."""
    out: Dict[str, List[_Shard]] = {}
    if isinstance(variables, (list, tuple)):
        variables = list(variables)
    else:
        variables = [variables]
    for v in variables:
        if v is None or table_meta(v) is None:
            raise TypeError(f"sok.dump / sok.load: {getattr(v, 'name', v)!r} is not a tf_sok table "
                            f"(sok.Variable, sok.DynamicVariable or a sok.layers table)")
        shards = [_Shard(s, sparse) for s in expand_tables([v])]
        name = shards[0].meta.name
        if name in out:
            raise ValueError(f"sok.dump / sok.load: two tables are named {name!r}; give tables distinct names")
        out[name] = sorted(shards, key=lambda s: s.meta.rank)
    return out


# ----------------------------------------------------------------------------------------------
# ranks

class _Ranks:
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


def _install(tmp: str, path: str) -> None:
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
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _resolve(path: str) -> str:
    """`path`, or the complete previous dump a kill between two renames left next to it."""
    if not os.path.exists(path) and os.path.exists(os.path.join(path + ".previous", MANIFEST)):
        _log.warning("sok.load: %s is missing; reading %s.previous, the dump it replaced", path, path)
        return path + ".previous"
    return path


# ----------------------------------------------------------------------------------------------
# dump

def _piece_rows(dim: int) -> int:
    return max(1, PIECE_BYTES // (4 * max(dim, 1)))


def _file_specs(stem: str, meta, sparse, shard: _Shard):
    """(file name, header, row width, dtype) per array of the table: keys first, then arrays()."""
    specs = [(f"{stem}-key", encode_header(meta.name, KEY_FILE, "", np.int64), 1, np.int64),
             (f"{stem}-weight", encode_header(meta.name, WEIGHT_FILE, "", np.float32), meta.dim, np.float32)]
    if sparse is not None:
        opt = _optimizer_name(sparse)
        for state, per_row in zip(_state_names(sparse), shard.per_row):
            specs.append((f"{stem}-{opt}-{state}", encode_header(meta.name, STATE_FILE, state, np.float32),
                          1 if per_row else meta.dim, np.float32))
    return specs


def _plain(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def dump(path: str, dump_vars, optimizer=None, since: Optional[str] = None) -> None:
    """Writes tables (and `optimizer`'s state of them) to directory `path` (SOK 2.x's call).

    `dump_vars`: a table or a list of them (sok.Variable, sok.DynamicVariable, sok.layers tables;
    under tf.distribute, the ReplicaTable). `optimizer`: the tf_sok optimizer training them (None:
    tables only). `since`: the path of an earlier dump (full or delta) of the same tables: write
    only the rows whose value or state changed since it, and the keys dynamic tables dropped
    (`sok.load([base, delta1, delta2, ...])` applies a chain). Every rank calls it; `path` is
    replaced whole, in one step.
    """
    if since is not None and os.path.abspath(since) == os.path.abspath(path):
        raise ValueError(f"sok.dump: since={since!r} is the path being written; write a delta to a new path")
    sparse = _sparse_optimizer(optimizer)
    ranks = _Ranks()
    tables = _shards(dump_vars, sparse)
    previous = _State(_resolve(os.path.abspath(since))) if since else None
    path = os.path.abspath(path)
    token = ranks.agree(uuid.uuid4().hex[:16] if ranks.lead else "")
    tmp = f"{path}.tmp-{token}"
    manifest = {"format": "tf_sok dump", "version": FORMAT_VERSION, "id": uuid.uuid4().hex,
                "world_size": ranks.size, "tables": {}, "optimizer": None,
                "delta_of": previous.id if previous else None,
                "delta_of_path": previous.path if previous else None}
    if sparse is not None:
        manifest["optimizer"] = {"class": type(sparse).__name__, "sok_name": _optimizer_name(sparse),
                                 "hyper": {k: _plain(v) for k, v in sparse.hyper().items()},
                                 "learning_rate": _plain(sparse.learning_rate),
                                 "iterations": int(sparse.iterations.numpy()), "states": _state_names(sparse)}
    if ranks.lead:
        for stale in glob.glob(glob.escape(path) + ".tmp-*"):     # dumps to this path killed part-way
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(tmp)
    names = sorted(tables)
    picked = {n: [_delta_rows(s, previous, n) if previous else (s.keys, s.rows) for s in tables[n]]
              for n in names}
    counts = ranks.gather(np.array([[len(picked[n][i][0]) for n in names] for i in range(len(ranks.local))],
                                   np.int64).reshape(len(ranks.local), len(names)))        # [ranks, tables]
    specs = {n: _file_specs(file_stem(n), tables[n][0].meta, sparse, tables[n][0]) for n in names}
    if ranks.lead:
        for t, n in enumerate(names):
            total = int(counts[:, t].sum())
            for fname, header, width, dtype in specs[n]:
                with open(os.path.join(tmp, fname), "wb") as f:
                    f.write(header)
                    f.truncate(HEADER_BYTES + total * width * np.dtype(dtype).itemsize)
    ranks.barrier()
    mine = {}
    for t, n in enumerate(names):
        mine[n] = []
        for s, (keys, rows) in zip(tables[n], picked[n]):
            mine[n] += _write_rows(tmp, specs[n], s, keys, rows, int(counts[:s.meta.rank, t].sum()))
    with open(os.path.join(tmp, f".pieces-{min(ranks.local)}.json"), "w") as f:
        json.dump(mine, f)
        f.flush()
        os.fsync(f.fileno())
    ranks.barrier()
    if ranks.lead:
        parts = []
        for r in range(ranks.size):
            part = os.path.join(tmp, f".pieces-{r}.json")
            if os.path.exists(part):
                with open(part) as f:
                    parts.append(json.load(f))
                os.remove(part)
        for t, n in enumerate(names):
            meta = tables[n][0].meta
            entry = {"stem": file_stem(n), "dim": meta.dim, "mode": str(meta.sharding), "dynamic": meta.keyed,
                     "rows": meta.rows, "count": int(counts[:, t].sum()), "files": [x[0] for x in specs[n]],
                     "widths": [x[2] for x in specs[n]], "headers": [zlib.crc32(x[1]) for x in specs[n]],
                     "pieces": sorted(p for part in parts for p in part.get(n, []))}
            manifest["tables"][n] = entry
        manifest["held"] = {}
        _write_held(tmp, manifest, tables, ranks, previous)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        _install(tmp, path)
    else:
        _write_held(None, None, tables, ranks, previous)
    ranks.barrier()


def _write_rows(directory, specs, shard: _Shard, keys, rows, first: int) -> list:
    """Writes one shard's rows at row offset `first` of the table's files; [first, n, crcs] per piece."""
    step = _piece_rows(shard.meta.dim)
    pieces = []
    fds = [os.open(os.path.join(directory, spec[0]), os.O_WRONLY) for spec in specs]
    try:
        for a in range(0, len(keys), step):
            b = min(len(keys), a + step)
            blocks = [keys[a:b]] + [shard.read(w, rows[a:b]) for w in range(len(shard.arrays()))]
            crcs = []
            for (_, _, width, dtype), fd, block in zip(specs, fds, blocks):
                raw = np.ascontiguousarray(block, dtype).tobytes()
                os.pwrite(fd, raw, HEADER_BYTES + (first + a) * width * np.dtype(dtype).itemsize)
                crcs.append(zlib.crc32(raw))
            pieces.append([first + a, b - a, crcs])
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return pieces


def _write_held(directory, manifest, tables, ranks, previous) -> None:
    """A delta of a dynamic table records the keys it held then (key order) and those dropped since."""
    if previous is None:
        return
    for n in sorted(tables):
        if not tables[n][0].meta.keyed:
            continue
        held = ranks.gather_keys(np.concatenate([s.keys for s in tables[n]]))
        if manifest is None:
            continue
        held = np.sort(held)
        removed = np.setdiff1d(previous.held(n), held, assume_unique=True)
        for kind, keys in (("held", held), ("removed", removed)):
            raw = keys.astype(np.int64).tobytes()
            fname = f"{file_stem(n)}-{kind}"
            with open(os.path.join(directory, fname), "wb") as f:
                f.write(encode_header(n, KEY_FILE, kind, np.int64) + raw)
            manifest["held"].setdefault(n, {})[kind] = [fname, int(len(keys)), zlib.crc32(raw)]


def _delta_rows(shard: _Shard, previous: "_State", table: str):
    """(keys, rows) of the shard whose value or state differ from the previous dump's (or are new)."""
    keys, rows = shard.keys, shard.rows
    step = _piece_rows(shard.meta.dim)
    out_keys, out_rows = [np.zeros([0], np.int64)], [np.zeros([0], np.int64)]
    for a in range(0, len(keys), step):
        k, r = keys[a:a + step], rows[a:a + step]
        old = previous.rows(table, k, len(shard.arrays()))
        changed = np.ones(len(k), bool)
        if old is not None:
            found, arrays = old
            same = found.copy()
            for w, before in enumerate(arrays):
                now = shard.read(w, r[found]).reshape(int(found.sum()), -1)
                same[found] &= np.all(now.view(np.uint32) == before.reshape(now.shape).view(np.uint32), axis=1)
            changed = ~same
        out_keys.append(k[changed])
        out_rows.append(r[changed])
    return np.concatenate(out_keys), np.concatenate(out_rows)


# ----------------------------------------------------------------------------------------------
# reading a dump

class _Reader:
    """One dump directory: its manifest (SOK dumps have none) and piece-wise, checked reads."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise DumpError(f"sok.load: no dump at {path}")
        self.path = path
        self.manifest = None
        manifest_path = os.path.join(path, MANIFEST)
        if os.path.exists(manifest_path):
            try:
                with open(manifest_path) as f:
                    self.manifest = json.load(f)
            except ValueError as e:
                raise DumpError(f"sok.load: {manifest_path} is corrupted ({e})") from None
            if self.manifest.get("version", 0) > FORMAT_VERSION:
                raise DumpError(f"sok.load: {path} has format version {self.manifest['version']}; this tf_sok "
                                f"reads up to {FORMAT_VERSION}")

    @property
    def id(self):
        return (self.manifest or {}).get("id")

    def entry(self, table: str) -> Optional[dict]:
        if self.manifest is None:
            return None
        entry = self.manifest["tables"].get(table)
        if entry is None:
            raise DumpError(f"sok.load: {self.path} has no table {table!r}; it has "
                            f"{sorted(self.manifest['tables'])}")
        return entry

    def layout(self, table: str, shard: _Shard, sparse) -> List[tuple]:
        """(file, width, required) per array of the table: keys, values, then the optimizer's state."""
        entry = self.entry(table)
        if entry is not None:
            files, widths = entry["files"], entry["widths"]
            if sparse is not None and len(files) != 2 + len(shard.state):
                saved = (self.manifest.get("optimizer") or {}).get("class")
                raise DumpError(f"sok.load: table {table!r}: {self.path} holds "
                                f"{'no optimizer state' if saved is None else f'the state of {saved}'}, "
                                f"the optimizer given is {type(sparse).__name__}")
            if sparse is None:
                files, widths = files[:2], widths[:2]
            return [(f, w, True) for f, w in zip(files, widths)]
        stem, dim = file_stem(table), shard.meta.dim
        out = [(f"{stem}-key", 1, True), (f"{stem}-weight", dim, True)]
        if sparse is not None:
            opt = _optimizer_name(sparse)
            for state, per_row in zip(_state_names(sparse), shard.per_row):
                out.append((f"{stem}-{opt}-{state}", 1 if per_row else dim, not per_row))   # SOK has no per-row state
        return out

    def check(self, table: str, layout) -> int:
        """Headers and sizes of the table's files (and the manifest's header checksums); the row count."""
        count, entry = None, self.entry(table)
        for i, (fname, width, required) in enumerate(layout):
            p = os.path.join(self.path, fname)
            if not os.path.exists(p):
                if required:
                    raise DumpError(f"sok.load: table {table!r}: {p} is missing")
                _log.warning("sok.load: table %r: %s is missing (SOK keeps no such state); it keeps its "
                             "current value", table, p)
                continue
            with open(p, "rb") as f:
                raw = f.read(HEADER_BYTES)
            head = decode_header(raw, p)
            if entry is not None and zlib.crc32(raw) != entry["headers"][i]:
                raise DumpError(f"sok.load: table {table!r}: the header of {p} is corrupted (checksum mismatch)")
            ok = (np.int64, np.uint64, np.int32, np.uint32) if i == 0 else (np.float32,)
            if head["dtype"] not in [np.dtype(d) for d in ok]:
                raise DumpError(f"sok.load: table {table!r}: {p} holds {head['dtype']}; tf_sok reads "
                                f"{'integer keys' if i == 0 else 'float32'} there")
            size, item = os.path.getsize(p) - HEADER_BYTES, head["dtype"].itemsize
            if count is None:
                if size % item:
                    raise DumpError(f"sok.load: table {table!r}: {p} is truncated ({size} bytes of keys)")
                count = size // item
            elif size != count * width * item:
                raise DumpError(f"sok.load: table {table!r}: {p} has {size} bytes of rows, expected {count} rows "
                                f"x {width} values = {count * width * item} bytes (truncated, or written for "
                                f"another dim)")
        if entry is not None and entry["count"] != count:
            raise DumpError(f"sok.load: table {table!r}: the files hold {count} rows, the manifest says "
                            f"{entry['count']}")
        return count

    def pieces(self, table: str, count: int, dim: int):
        entry = self.entry(table)
        if entry is not None:
            return [tuple(p) for p in entry["pieces"]]
        step = _piece_rows(dim)
        return [(a, min(count, a + step) - a, None) for a in range(0, count, step)]

    def read_piece(self, table: str, layout, piece) -> List[Optional[np.ndarray]]:
        """The piece's keys (int64) and rows of every array (None: a missing optional file)."""
        first, n, crcs = piece
        out = []
        for i, (fname, width, _) in enumerate(layout):
            p = os.path.join(self.path, fname)
            if not os.path.exists(p):
                out.append(None)
                continue
            if i == 0:
                with open(p, "rb") as f:
                    dtype = decode_header(f.read(HEADER_BYTES), p)["dtype"]
            else:
                dtype = np.dtype(np.float32)
            size = n * width * dtype.itemsize
            with open(p, "rb") as f:
                f.seek(HEADER_BYTES + first * width * dtype.itemsize)
                raw = f.read(size)
            if len(raw) != size:
                raise DumpError(f"sok.load: table {table!r}: {p} is truncated")
            if crcs is not None and zlib.crc32(raw) != crcs[i]:
                raise DumpError(f"sok.load: table {table!r}: {p} is corrupted (rows {first}..{first + n - 1} fail "
                                f"their checksum)")
            block = np.frombuffer(raw, dtype)
            out.append(block.astype(np.int64) if i == 0 else block.reshape(n, width))
        return out

    def held_file(self, table: str, kind: str) -> Optional[np.ndarray]:
        """A delta's held / removed keys of a dynamic table (None: not a delta, or not dynamic)."""
        item = ((self.manifest or {}).get("held") or {}).get(table, {}).get(kind)
        if item is None:
            return None
        fname, n, crc = item
        p = os.path.join(self.path, fname)
        if not os.path.exists(p):
            raise DumpError(f"sok.load: table {table!r}: {p} is missing")
        with open(p, "rb") as f:
            f.seek(HEADER_BYTES)
            raw = f.read()
        if len(raw) != 8 * n or zlib.crc32(raw) != crc:
            raise DumpError(f"sok.load: table {table!r}: {p} is corrupted or truncated")
        return np.frombuffer(raw, np.int64)


class _State:
    """The tables as a chain of dumps (a base, then deltas) leaves them: rows by key, for deltas."""

    def __init__(self, path: str):
        chain = [_Reader(path)]
        while chain[0].manifest is not None and chain[0].manifest.get("delta_of"):
            chain.insert(0, _Reader(_resolve(chain[0].manifest["delta_of_path"])))
            if chain[0].id != chain[1].manifest["delta_of"]:
                raise DumpError(f"sok.dump: {chain[0].path} was replaced after {chain[1].path} was written "
                                f"against it; take a full dump")
        if chain[0].manifest is None:
            raise DumpError(f"sok.dump: since={path} is not a tf_sok dump (no {MANIFEST})")
        self.chain, self.path, self.id = chain, chain[-1].path, chain[-1].id
        self._index = {}

    def _keys(self, table: str):
        """Per dump of the chain: (sorted keys, their row positions)."""
        if table not in self._index:
            out = []
            for r in self.chain:
                entry = r.entry(table)
                with open(os.path.join(r.path, entry["files"][0]), "rb") as f:
                    f.seek(HEADER_BYTES)
                    keys = np.frombuffer(f.read(), np.int64)
                order = np.argsort(keys, kind="stable")
                out.append((keys[order], order))
            self._index[table] = out
        return self._index[table]

    def rows(self, table: str, keys: np.ndarray, arrays: int):
        """(found mask, [values of each array at the found keys]) as the chain leaves them."""
        where = np.full(len(keys), -1)
        source = np.full(len(keys), -1)
        for c, (sorted_keys, order) in enumerate(self._keys(table)):     # in order: later dumps win
            removed = self.chain[c].held_file(table, "removed")
            if removed is not None and len(removed):
                gone = np.isin(keys, removed)
                where[gone], source[gone] = -1, -1
            if len(sorted_keys) == 0:
                continue
            at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
            hit = sorted_keys[at] == keys
            where[hit], source[hit] = order[at[hit]], c
        found = source >= 0
        if not found.any():
            return found, [np.zeros([0], np.float32)] * arrays
        values = []
        for w in range(arrays):
            block = None
            for c, r in enumerate(self.chain):
                pick = found & (source == c)
                if not pick.any():
                    continue
                entry = r.entry(table)
                if w + 1 >= len(entry["files"]):
                    return None                    # the previous dump has no optimizer state: all rows
                width = entry["widths"][w + 1]
                data = np.memmap(os.path.join(r.path, entry["files"][w + 1]), np.float32, "r", HEADER_BYTES)
                part = np.asarray(data.reshape(-1, width)[where[pick]])
                if block is None:
                    block = np.zeros([len(keys), width], np.float32)
                block[pick] = part
            values.append(block[found])
        return found, values

    def held(self, table: str) -> np.ndarray:
        """The keys a dynamic table held at the end of the chain (sorted)."""
        last = self.chain[-1].held_file(table, "held")
        return last if last is not None else self._keys(table)[0][0]


# ----------------------------------------------------------------------------------------------
# load

def load(path, load_vars, optimizer=None) -> None:
    """Reads a dump into tables (and `optimizer`'s state of them): SOK 2.x's `sok.load`.

    `path`: a dump directory (tf_sok's or SOK's), or a list: a base dump then deltas written after
    it, applied in order. The dump may come from any number of ranks and table modes: each rank keeps
    the rows it owns now. Everything is checked first (headers, sizes, checksums, shapes, the
    optimizer's kind); a dump that fails leaves every table and state unchanged. A full dump replaces
    a dynamic table's keys; a delta inserts, overwrites and removes keys. Every rank calls it.
    """
    sparse = _sparse_optimizer(optimizer)
    readers = _chain(path)
    ranks = _Ranks()
    tables = _shards(load_vars, sparse)
    plans = []
    for reader in readers:
        for name, shards in tables.items():
            meta = shards[0].meta
            layout = reader.layout(name, shards[0], sparse)
            count = reader.check(name, layout)
            entry = reader.entry(name)
            if entry is not None:
                if entry["dim"] != meta.dim or entry["dynamic"] != meta.keyed:
                    raise DumpError(f"sok.load: table {name!r}: {reader.path} holds a "
                                    f"{'dynamic' if entry['dynamic'] else 'static'} table of dim {entry['dim']}, "
                                    f"the model's is {'dynamic' if meta.keyed else 'static'} of dim {meta.dim}")
                if not meta.keyed and entry["rows"] != meta.rows:
                    raise DumpError(f"sok.load: table {name!r}: {reader.path} holds {entry['rows']} rows, the "
                                    f"model's table has {meta.rows}")
            pieces = reader.pieces(name, count, meta.dim)
            delta = reader.manifest is not None and bool(reader.manifest.get("delta_of"))
            if not meta.keyed and not delta and count != meta.rows:
                raise DumpError(f"sok.load: table {name!r}: {reader.path} holds {count} rows, the model's table "
                                f"has {meta.rows}")
            for piece in pieces:             # every checksum and key before anything changes
                keys = reader.read_piece(name, layout, piece)[0]
                if not meta.keyed and len(keys) and (keys.min() < 0 or keys.max() >= meta.rows):
                    bad = keys[(keys < 0) | (keys >= meta.rows)][0]
                    raise DumpError(f"sok.load: table {name!r}: {reader.path} has row id {bad}, outside the "
                                    f"table's [0, {meta.rows})")
            plans.append((reader, name, shards, layout, pieces, delta))
    for reader, name, shards, layout, pieces, delta in plans:
        for s in shards:
            if s.dynamic and not delta:         # a full dump replaces the keys
                s.var.remove_keys()
            elif s.dynamic:
                gone = reader.held_file(name, "removed")
                if gone is not None and len(gone):
                    s.var.remove_keys(gone[s.owns(gone)])
        if all(s.meta.sharding.kind == "localized" and s.meta.rank != s.meta.sharding.owner for s in shards):
            continue                            # another rank's table (every rank checked it above)
        for piece in pieces:
            blocks = reader.read_piece(name, layout, piece)
            keys = blocks[0]
            for s in shards:
                own = s.owns(keys)
                if own.any():
                    s.write(keys[own], [b[own] if b is not None else None for b in blocks[1:]])
    if sparse is not None:
        saved = (readers[-1].manifest or {}).get("optimizer")
        if saved is not None:
            sparse.iterations.assign(saved["iterations"])
    ranks.barrier()


def _chain(paths) -> List[_Reader]:
    readers = [_Reader(_resolve(os.path.abspath(p))) for p in ([paths] if isinstance(paths, (str, os.PathLike))
                                                                else list(paths))]
    if readers[0].manifest is not None and readers[0].manifest.get("delta_of"):
        raise DumpError(f"sok.load: {readers[0].path} is a delta; load its base first: "
                        f"sok.load([base, ..., delta], ...)")
    for before, after in zip(readers, readers[1:]):
        if after.manifest is None or after.manifest.get("delta_of") != before.id:
            raise DumpError(f"sok.load: {after.path} is not a delta of {before.path} (give a base dump and the "
                            f"deltas written after it, in order)")
    return readers


# ----------------------------------------------------------------------------------------------
# SOK's incremental dump

def incremental_model_dump(dump_vars, time_threshold):
    """SOK's `incremental_model_dump`: the keys of dynamic tables touched (looked up for training, or
    assigned) at or after `time_threshold`, and their current values, gathered from every rank.

    `time_threshold`: a `datetime` (naive ones are UTC) or seconds since the epoch. Returns
    `(keys, values)` NumPy arrays for one table, a list of them for a list. Touches are counted
    since the table was made or restored in this process (a lookup that failed counts too: its
    keys are reported with their unchanged values). For files on disk and static tables, write a
    delta instead: `sok.dump(path, tables, optimizer, since=previous_dump)`.
    """
    import datetime

    if isinstance(time_threshold, datetime.datetime):
        if time_threshold.tzinfo is None:
            time_threshold = time_threshold.replace(tzinfo=datetime.timezone.utc)
        since = int(time_threshold.timestamp() * 1e9)
    elif isinstance(time_threshold, (int, float)) and not isinstance(time_threshold, bool):
        since = int(time_threshold * 1e9)
    else:
        raise TypeError(f"incremental_model_dump: time_threshold must be a datetime or seconds since the epoch, "
                        f"got {type(time_threshold).__name__}")
    single = not isinstance(dump_vars, (list, tuple))
    ranks = _Ranks()
    out = []
    for v in ([dump_vars] if single else list(dump_vars)):
        meta = table_meta(v)
        if meta is None or not meta.dynamic:
            what = f"table {meta.name!r} is static," if meta is not None else f"{getattr(v, 'name', v)!r} is"
            raise TypeError(f"incremental_model_dump: {what} not a sok.DynamicVariable (static tables: "
                            f"sok.dump(..., since=previous_dump))")
        keys, values = [], []
        for shard in expand_tables([v]):
            var = backing_variable(shard)
            k, x = var.touched_values_since(since)
            keys.append(k.numpy())
            values.append(x.numpy())
        k, x = np.concatenate(keys), np.concatenate(values).reshape(-1, meta.dim)
        if not ranks.alone:
            k = ranks.gather_keys(k)
            x = ranks.gather_keys(x.view(np.uint32).astype(np.int64).reshape(-1)).astype(np.uint32) \
                .view(np.float32).reshape(-1, meta.dim)
        out.append((k, x))
    return out[0] if single else out

