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
import concurrent.futures
import glob
import json
import os
import shutil
import uuid
import zlib
from typing import Optional

import numpy as np

from tf_sok.python.dump_format import (FORMAT_VERSION, HEADER_BYTES, KEY_FILE, MANIFEST, STATE_FILE, WEIGHT_FILE,
                                       DumpError, Ranks, Shard, encode_header, file_stem, fsync_dir, install,
                                       optimizer_name, piece_rows, resolve, table_shards, sparse_optimizer, state_names)
from tf_sok.python.dump_load import State, load
from tf_sok.python.variable import backing_variable, expand_tables, table_meta

__all__ = ["DumpError", "dump", "incremental_model_dump", "load"]


# ----------------------------------------------------------------------------------------------
# dump

def _file_specs(stem: str, meta, sparse, shard: Shard):
    """(file name, header, row width, dtype) per array of the table: keys first, then arrays()."""
    specs = [(f"{stem}-key", encode_header(meta.name, KEY_FILE, "", np.int64), 1, np.int64),
             (f"{stem}-weight", encode_header(meta.name, WEIGHT_FILE, "", np.float32), meta.dim, np.float32)]
    if sparse is not None:
        opt = optimizer_name(sparse)
        for state, per_row in zip(state_names(sparse), shard.per_row):
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
    sparse = sparse_optimizer(optimizer)
    ranks = Ranks()
    tables = table_shards(dump_vars, sparse)
    previous = State(resolve(os.path.abspath(since))) if since else None
    path = os.path.abspath(path)
    token = ranks.agree(uuid.uuid4().hex[:16] if ranks.lead else "")
    tmp = f"{path}.tmp-{token}"
    manifest = {"format": "tf_sok dump", "version": FORMAT_VERSION, "id": uuid.uuid4().hex,
                "world_size": ranks.size, "tables": {}, "optimizer": None,
                "delta_of": previous.id if previous else None,
                "delta_of_path": previous.path if previous else None}
    if sparse is not None:
        manifest["optimizer"] = {"class": type(sparse).__name__, "sok_name": optimizer_name(sparse),
                                 "hyper": {k: _plain(v) for k, v in sparse.hyper().items()},
                                 "learning_rate": _plain(sparse.learning_rate),
                                 "iterations": int(sparse.iterations.numpy()), "states": state_names(sparse)}
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
        fsync_dir(tmp)
        install(tmp, path)
    else:
        _write_held(None, None, tables, ranks, previous)
    ranks.barrier()


def _write_rows(directory, specs, shard: Shard, keys, rows, first: int) -> list:
    """Writes one shard's rows at row offset `first` of the table's files; [first, n, crcs] per piece.
    A thread writes and checksums each piece while the next one is read from the table."""
    step = piece_rows(shard.meta.dim)
    fds = [os.open(os.path.join(directory, spec[0]), os.O_WRONLY) for spec in specs]

    def write(a, blocks):
        crcs = []
        for (_, _, width, dtype), fd, block in zip(specs, fds, blocks):
            raw = memoryview(np.ascontiguousarray(block, dtype)).cast("B")   # (the block's own bytes)
            _pwrite_all(fd, raw, HEADER_BYTES + (first + a) * width * np.dtype(dtype).itemsize)
            crcs.append(zlib.crc32(raw))
        return [first + a, len(blocks[0]), crcs]

    written = []
    try:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tf_sok.dump") as writer:
            for a in range(0, len(keys), step):
                b = min(len(keys), a + step)
                blocks = [keys[a:b]] + [shard.read(w, rows[a:b]) for w in range(len(shard.arrays()))]
                if len(written) >= 2:   # (one piece being written, one waiting, one being read: no more)
                    written[-2].result()
                written.append(writer.submit(write, a, blocks))
        pieces = [f.result() for f in written]
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return pieces


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """os.pwrite until every byte is written (a single call may write fewer)."""
    while len(data):
        done = os.pwrite(fd, data, offset)
        if done <= 0:
            raise OSError(f"sok.dump: a write at offset {offset} wrote nothing")
        data, offset = data[done:], offset + done


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


def _delta_rows(shard: Shard, previous: "State", table: str):
    """(keys, rows) of the shard whose value or state differ from the previous dump's (or are new)."""
    keys, rows = shard.keys, shard.rows
    step = piece_rows(shard.meta.dim)
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
    ranks = Ranks()
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

