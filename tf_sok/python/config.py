"""Typed table configuration, validated on construction."""
import dataclasses
from typing import Any, Optional

COMBINERS = ("sum", "mean", "sqrtn")


def check_combiner(combiner: str, where: str) -> str:
    if combiner not in COMBINERS:
        raise ValueError(f"{where}: combiner must be one of {COMBINERS}, got {combiner!r}")
    return combiner


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Example:
        >>> TableConfig("user", vocab_size=1000, dim=16, combiner="sum").mode
        'distributed'
        >>> TableConfig("item_hash", vocab_size=1 << 20, dim=16, dynamic=True, max_capacity=1 << 24,
        ...             evict_strategy="lfu").dynamic
        True

    dynamic=True makes the table a `sok.DynamicVariable` keyed by any int64 id: vocab_size is then
    its initial capacity (rows allocated at first; they double as keys arrive), and max_capacity,
    evict_strategy, min_frequency and seed mean what they mean there. max_hbm_for_vectors (GiB) gives
    a table, static or dynamic, a host tier (var_type "hybrid": every row in host memory, hot rows
    cached on the device; see `sok.Variable` for a static table's), except a static table it holds
    whole with any optimizer's state (rows x dim x 16 bytes): that one stays a plain weight.
    """

    name: str
    vocab_size: int
    dim: int
    combiner: str = "mean"
    initializer: Any = "uniform"   # Keras initializer name, instance or callable(shape, dtype)
    mode: str = "distributed"      # "distributed" | "localized:<rank>"
    dynamic: bool = False          # a hash-keyed table (sok.DynamicVariable)
    max_capacity: Optional[int] = None
    evict_strategy: Optional[str] = None
    min_frequency: int = 1
    seed: int = 0
    max_hbm_for_vectors: Optional[float] = None

    def __post_init__(self):
        from tf_sok.python.sharding import ShardingSpec

        if not self.name or "/" in self.name:
            raise ValueError(f"table name must be non-empty without '/', got {self.name!r}")
        if int(self.vocab_size) < 1 or int(self.dim) < 1:
            raise ValueError(f"table {self.name!r}: vocab_size and dim must be >= 1, "
                             f"got {self.vocab_size} and {self.dim}")
        check_combiner(self.combiner, f"table {self.name!r}")
        if not self.dynamic and (self.max_capacity is not None or self.evict_strategy is not None
                                 or self.min_frequency != 1):
            raise ValueError(f"table {self.name!r}: max_capacity, evict_strategy and min_frequency are for "
                             f"dynamic tables (dynamic=True)")
        ShardingSpec.parse(self.mode)
