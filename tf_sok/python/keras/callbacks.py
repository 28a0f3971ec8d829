"""Keras callbacks for tf_sok tables."""
import logging

import keras

from tf_sok.python.dynamic_variable import DynamicVariable
from tf_sok.python.host_tier import cache_stats

_log = logging.getLogger("tf_sok")


def _hybrid_tables(model):
    seen, out = set(), []
    for w in model.variables:
        table = getattr(w, "_dynamic", w)
        if isinstance(table, DynamicVariable) and table.hybrid and id(table) not in seen:
            seen.add(id(table))
            out.append(table)
    return out


class CacheStats(keras.callbacks.Callback):
    """Logs one line per epoch and hybrid table (var_type "hybrid"): the epoch's cache hit rate, keys
    taken in and written back, bytes moved each way, keys held in all and in device memory, and ids
    read by lookups that do not train (validation) with those read from host memory; also
    puts `<table>_hit_rate` into the epoch's logs (History, TensorBoard).

    Example:
        >>> model.fit(ds, epochs=3, callbacks=[sok.keras.CacheStats()])
    """

    def __init__(self, tables=None):
        super().__init__()
        self._tables = tables
        self._start = {}

    def _targets(self):
        return list(self._tables) if self._tables is not None else _hybrid_tables(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._start = {t.table.name: cache_stats(t) for t in self._targets()}

    def on_epoch_end(self, epoch, logs=None):
        for t in self._targets():
            now, before = cache_stats(t), self._start.get(t.table.name, {})
            d = {k: now[k] - before.get(k, 0) for k in ("lookups", "misses", "loaded", "new_keys", "evicted",
                                                        "bytes_to_device", "bytes_to_host", "dropped", "prefetched",
                                                        "reads", "reads_from_host", "bytes_read_in_place",
                                                        "bytes_read_gathered")}
            rate = 1.0 - d["misses"] / d["lookups"] if d["lookups"] else 0.0
            # (lookups that do not train, e.g. validation's: ids read, of them read from host memory)
            reads = "" if not d["reads"] else \
                f"; {d['reads']} ids read without training ({d['reads_from_host']} from host memory, " \
                f"{(d['bytes_read_in_place'] + d['bytes_read_gathered']) / 1e6:.1f} MB)"
            _log.info("epoch %d, table %r: hit rate %.4f, %d keys taken in (%d new, %d prefetched), %d written back, "
                      "%.1f MB to the device, %.1f MB to the host; %d keys (%d dropped by max_capacity), %d cached%s",
                      epoch + 1, t.table.name, rate, d["loaded"], d["new_keys"], d["prefetched"], d["evicted"],
                      d["bytes_to_device"] / 1e6, d["bytes_to_host"] / 1e6, now["keys"], d["dropped"], now["cached"],
                      reads)
            if logs is not None:
                logs[f"{t.table.name}_hit_rate"] = rate
