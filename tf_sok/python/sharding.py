"""Placement of a table's rows across ranks.

`distributed`: row-wise round robin, global row r on rank r % N at local row
r // N. `localized:k`: the whole table on rank k.
"""
import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """How one table is placed; parse user strings with `ShardingSpec.parse`."""

    kind: str            # "distributed" | "localized"
    owner: int = -1      # localized: the owning rank

    @staticmethod
    def parse(mode: str) -> "ShardingSpec":
        """`"distributed"` or `"localized:K"`.

        Example:
            >>> ShardingSpec.parse("localized:1").owner
            1
        """
        if mode == "distributed":
            return ShardingSpec("distributed")
        m = re.fullmatch(r"localized:(\d+)", mode or "")
        if m:
            return ShardingSpec("localized", int(m.group(1)))
        raise ValueError(f"unknown table mode {mode!r}: use 'distributed' or 'localized:<rank>'")

    def validate(self, num_ranks: int, table: str) -> None:
        if self.kind == "localized" and not 0 <= self.owner < num_ranks:
            raise ValueError(f"table {table!r}: mode 'localized:{self.owner}' needs rank "
                             f"{self.owner}, but there are {num_ranks} rank(s)")

    def local_rows(self, rows: int, rank: int, num_ranks: int) -> int:
        """How many of the table's `rows` rank `rank` holds."""
        if self.kind == "distributed":
            return max(0, (rows - rank + num_ranks - 1) // num_ranks)
        return rows if rank == self.owner else 0

    def __str__(self) -> str:
        return self.kind if self.kind == "distributed" else f"localized:{self.owner}"
