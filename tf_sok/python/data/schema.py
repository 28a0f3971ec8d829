"""The Criteo layout: a label, 13 integer features, 26 categorical features.

A converter writes the schema it used (table sizes, multi-hot sizes) next to the
data — in the Parquet files' key-value metadata, and as `_tf_sok_schema.json`
in the output directory for both formats — and readers take it from there.
"""
import dataclasses
import json
import os
from typing import Optional, Sequence, Tuple

# Criteo Kaggle (DLRM) cardinalities.
KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
# MLPerf DLRM-DCNv2 multi-hot sizes per categorical feature.
DCNV2_HOTNESS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
NUM_DENSE = 13
NUM_CATEGORICAL = 26
METADATA_KEY = b"tf_sok.criteo_schema"      # Parquet key-value metadata
SCHEMA_FILE = "_tf_sok_schema.json"          # beside the files, every format
_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class CriteoSchema:
    """Column names and table sizes; categorical ids are taken modulo the sizes.

    Example:
        >>> CriteoSchema(vocab_sizes=(1000,) * 26).categorical_names[:2]
        ('C1', 'C2')
    """

    vocab_sizes: Tuple[int, ...] = tuple(min(c, 10_000_000) for c in KAGGLE_CARDINALITIES)
    hotness: Optional[Tuple[int, ...]] = None   # most ids per row and feature, when known

    def __post_init__(self):
        sizes = tuple(self.vocab_sizes)
        if len(sizes) != NUM_CATEGORICAL or any(isinstance(v, bool) or int(v) != v or v < 1 for v in sizes):
            raise ValueError(f"CriteoSchema: need {NUM_CATEGORICAL} positive integer vocab sizes, got {sizes}")
        object.__setattr__(self, "vocab_sizes", tuple(int(v) for v in sizes))
        if self.hotness is not None:
            hot = tuple(int(h) for h in self.hotness)
            if len(hot) != NUM_CATEGORICAL or min(hot) < 1:
                raise ValueError(f"CriteoSchema: hotness needs {NUM_CATEGORICAL} positive sizes, got {hot}")
            object.__setattr__(self, "hotness", hot)

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

    def to_json(self) -> str:
        return json.dumps({"format_version": _FORMAT_VERSION, "vocab_sizes": list(self.vocab_sizes),
                           "hotness": None if self.hotness is None else list(self.hotness)})

    @staticmethod
    def from_json(text, where: str) -> "CriteoSchema":
        try:
            d = json.loads(text)
            if d.get("format_version") != _FORMAT_VERSION:
                raise ValueError(f"format_version {d.get('format_version')!r}, expected {_FORMAT_VERSION}")
            return CriteoSchema(tuple(d["vocab_sizes"]), None if d.get("hotness") is None else tuple(d["hotness"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: unreadable tf_sok schema ({e})") from None

    def check_fits(self, tables: "CriteoSchema", where: str) -> None:
        """Raises ValueError when a table (`tables`) has fewer rows than this data's vocabulary.

        Example:
            >>> CriteoSchema.capped(100).check_fits(CriteoSchema.capped(1000), "data")   # fits
        """
        bad = [f"{n}: data has {d:,} ids, table {t:,} rows"
               for n, d, t in zip(self.categorical_names, self.vocab_sizes, tables.vocab_sizes) if d > t]
        if bad:
            raise ValueError(f"{where} was written with larger vocabularies than the model's tables ("
                             + "; ".join(bad) + "). Build the tables from the data's own schema "
                             "(sd.schema_of(path), the readers' default) or convert again with a smaller "
                             "--max-vocab.")


def write_schema_file(directory: str, schema: CriteoSchema) -> str:
    path = os.path.join(directory, SCHEMA_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(schema.to_json())
    os.replace(tmp, path)
    return path


def schema_file_of(files: Sequence[str]) -> Optional[CriteoSchema]:
    """The schema file beside the first file, if there is one."""
    path = os.path.join(os.path.dirname(os.path.abspath(files[0])), SCHEMA_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return CriteoSchema.from_json(f.read(), path)
