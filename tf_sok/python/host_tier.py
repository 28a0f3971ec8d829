"""A hybrid table's cache counters and the host link it moves rows over (`var_type="hybrid"`
tables: rows in host memory, hot rows cached on the device)."""
import tensorflow as tf

from tf_sok.python.dynamic_variable import _dynamic
from tf_sok.python.ops.loader import ops

_STAT_NAMES = ("finds", "lookups", "misses", "loaded", "new_keys", "evicted", "bytes_to_device", "bytes_to_host",
               "dropped", "prefetched", "reads", "reads_from_host", "bytes_read_in_place",
               "bytes_read_gathered", "bytes_in_gathered")


def cache_stats(var) -> dict:
    """Counters of a hybrid table's cache since the table was made (this process's shard): `finds`
    (training lookups, assignments), `lookups` (ids looked up), `misses` (ids whose key was not cached),
    `hit_rate` (1 - misses / lookups), `loaded` (keys taken into the cache), `new_keys` (of those, keys
    the table had never held), `evicted` (keys written back to host memory to make room),
    `bytes_to_device` / `bytes_to_host` (rows of values and optimizer state moved; of the first,
    `bytes_in_gathered`: on a GPU, finds taking many small records in have the host's threads gather
    them and copy them over, the rest are read in place by the device's kernel), `dropped` (keys
    the table's max_capacity removed from it), `prefetched` (of `loaded`, keys `sok.prefetch` took in:
    their ids count as hits when a lookup uses them), `reads` (ids read by lookups that do not train,
    `training=False`), `reads_from_host` (of those, ids read from host memory, not cached), their bytes
    `bytes_read_in_place` (read over the host link by the device's kernel) and `bytes_read_gathered`
    (on a GPU, reads of many rows: gathered by the host's threads and copied over in one piece), `keys`
    (held in all), `cached` (held in device memory). A static table
    whose budget holds it whole has no cache: a ValueError says so.

    Example:
        >>> v = sok.DynamicVariable(dimension=16, var_type="hybrid", max_hbm_for_vectors=0.5)
        >>> sok.cache_stats(v)["hit_rate"]
    """
    from tf_sok.python.variable import table_meta
    meta = table_meta(var)
    if meta is not None and meta.budget_bytes >= 0:
        raise ValueError(f"sok.cache_stats: table {meta.name!r} has no cache: its max_hbm_for_vectors "
                         f"({meta.budget_bytes} bytes) holds all its rows with any optimizer's state, so it is held "
                         f"whole in device memory without a host tier")
    v = _dynamic(var, "sok.cache_stats")
    if not v.hybrid:
        raise ValueError(f"sok.cache_stats: {v.table.name!r} is not a hybrid table (var_type=\"hybrid\" with "
                         f"max_hbm_for_vectors)")
    with tf.device(v._index_device):
        counts = [int(x) for x in ops().tf_sok_dynamic_cache_stats(v._index.resource_handle).numpy()]
        keys = int(ops().tf_sok_dynamic_size(v._index.resource_handle)[0])
        cached = int(ops().tf_sok_dynamic_export(v._index.resource_handle)[0].shape[0])
    out = dict(zip(_STAT_NAMES, counts))
    out["hit_rate"] = 1.0 - out["misses"] / out["lookups"] if out["lookups"] else 0.0
    out.update(keys=keys, cached=cached)
    return out


def host_link_bandwidth(mib: int = 1024, repeats: int = 3, device: str = "/GPU:0") -> dict:
    """The link between pinned host memory and a GPU, measured over `mib` MiB (the best of `repeats`
    timings), in GB/s: `copy_to_device` / `copy_to_host` (DMA copies, cudaMemcpy) and `read_in_place`
    / `write_in_place` (a kernel reading or writing host memory directly, as a hybrid table moves its
    rows). What a hybrid table's misses cost: `sok.cache_stats` bytes over these rates.

    Example:
        >>> sok.host_link_bandwidth(256)["read_in_place"]
    """
    with tf.device(device):
        gbps = ops().tf_sok_host_link_bandwidth(bytes=int(mib) << 20, repeats=int(repeats)).numpy()
    return dict(zip(("copy_to_device", "copy_to_host", "read_in_place", "write_in_place"), map(float, gbps)))
