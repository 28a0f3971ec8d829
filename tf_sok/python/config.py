"""Typed table configuration, validated on construction."""
import dataclasses
from typing import Any

COMBINERS = ("sum", "mean", "sqrtn")


def check_combiner(combiner: str, where: str) -> str:
    if combiner not in COMBINERS:
        raise ValueError(f"{where}: combiner must be one of {COMBINERS}, got {combiner!r}")
    return combiner


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Example:
        >>> TableConfig("user", vocab_size=1000, dim=16, combiner="sum")
        TableConfig(name='user', vocab_size=1000, dim=16, combiner='sum', initializer='uniform', mode='distributed')
    """

    name: str
    vocab_size: int
    dim: int
    combiner: str = "mean"
    initializer: Any = "uniform"   # Keras initializer name, instance or callable(shape, dtype)
    mode: str = "distributed"      # "distributed" | "localized:<rank>"

    def __post_init__(self):
        from tf_sok.python.sharding import ShardingSpec

        if not self.name or "/" in self.name:
            raise ValueError(f"table name must be non-empty without '/', got {self.name!r}")
        if int(self.vocab_size) < 1 or int(self.dim) < 1:
            raise ValueError(f"table {self.name!r}: vocab_size and dim must be >= 1, "
                             f"got {self.vocab_size} and {self.dim}")
        check_combiner(self.combiner, f"table {self.name!r}")
        ShardingSpec.parse(self.mode)
