"""The Criteo layout: a label, 13 integer features, 26 categorical features."""
import dataclasses
from typing import Sequence, Tuple

# Criteo Kaggle (DLRM) cardinalities.
KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
# MLPerf DLRM-DCNv2 multi-hot sizes per categorical feature.
DCNV2_HOTNESS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
NUM_DENSE = 13
NUM_CATEGORICAL = 26


@dataclasses.dataclass(frozen=True)
class CriteoSchema:
    """Column names and table sizes; categorical ids are taken modulo the sizes.

    Example:
        >>> CriteoSchema(vocab_sizes=(1000,) * 26).categorical_names[:2]
        ('C1', 'C2')
    """

    vocab_sizes: Tuple[int, ...] = tuple(min(c, 10_000_000) for c in KAGGLE_CARDINALITIES)

    def __post_init__(self):
        if len(self.vocab_sizes) != NUM_CATEGORICAL or min(self.vocab_sizes) < 1:
            raise ValueError(f"CriteoSchema: need {NUM_CATEGORICAL} positive vocab sizes, got {self.vocab_sizes}")

    @property
    def dense_names(self) -> Tuple[str, ...]:
        return tuple(f"I{i + 1}" for i in range(NUM_DENSE))

    @property
    def categorical_names(self) -> Tuple[str, ...]:
        return tuple(f"C{i + 1}" for i in range(NUM_CATEGORICAL))

    @property
    def num_columns(self) -> int:
        return 1 + NUM_DENSE + NUM_CATEGORICAL

    @staticmethod
    def capped(cap: int, sizes: Sequence[int] = KAGGLE_CARDINALITIES) -> "CriteoSchema":
        return CriteoSchema(tuple(min(int(c), cap) for c in sizes))
