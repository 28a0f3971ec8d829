"""`sok.load`: a dump (and the deltas written after it) read back into the tables, re-sharded."""
import concurrent.futures
import json
import logging
import os
import zlib
from typing import List, Optional

import numpy as np

from tf_sok.python.dump_format import (FORMAT_VERSION, HEADER_BYTES, MANIFEST, DumpError, Ranks, Shard,
                                       decode_header, file_stem, optimizer_name, piece_rows, resolve, table_shards,
                                       sparse_optimizer, state_names)

_log = logging.getLogger("tf_sok")


# ----------------------------------------------------------------------------------------------
# reading a dump

class Reader:
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

    def layout(self, table: str, shard: Shard, sparse) -> List[tuple]:
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
            opt = optimizer_name(sparse)
            for state, per_row in zip(state_names(sparse), shard.per_row):
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
        step = piece_rows(dim)
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

    def read_pieces(self, table: str, layout, pieces):
        """read_piece of each of `pieces` in order, the next one read (and checked) on a thread meanwhile."""
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tf_sok.load") as pool:
            ahead = pool.submit(self.read_piece, table, layout, pieces[0]) if pieces else None
            for j in range(len(pieces)):
                blocks = ahead.result()
                ahead = pool.submit(self.read_piece, table, layout, pieces[j + 1]) if j + 1 < len(pieces) else None
                yield blocks

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


class State:
    """The tables as a chain of dumps (a base, then deltas) leaves them: rows by key, for deltas."""

    def __init__(self, path: str):
        chain = [Reader(path)]
        while chain[0].manifest is not None and chain[0].manifest.get("delta_of"):
            chain.insert(0, Reader(resolve(chain[0].manifest["delta_of_path"])))
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
    sparse = sparse_optimizer(optimizer)
    readers = _chain(path)
    ranks = Ranks()
    tables = table_shards(load_vars, sparse)
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
            for blocks in reader.read_pieces(name, layout, pieces):   # every checksum and key before anything changes
                keys = blocks[0]
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
        for blocks in reader.read_pieces(name, layout, pieces):
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


def _chain(paths) -> List[Reader]:
    readers = [Reader(resolve(os.path.abspath(p))) for p in ([paths] if isinstance(paths, (str, os.PathLike))
                                                                else list(paths))]
    if readers[0].manifest is not None and readers[0].manifest.get("delta_of"):
        raise DumpError(f"sok.load: {readers[0].path} is a delta; load its base first: "
                        f"sok.load([base, ..., delta], ...)")
    for before, after in zip(readers, readers[1:]):
        if after.manifest is None or after.manifest.get("delta_of") != before.id:
            raise DumpError(f"sok.load: {after.path} is not a delta of {before.path} (give a base dump and the "
                            f"deltas written after it, in order)")
    return readers
