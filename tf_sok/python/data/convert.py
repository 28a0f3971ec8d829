"""Converts Criteo TSV files to Parquet or TFRecord.

    python -m tf_sok.data.convert --input day_0.tsv --output out_dir --format parquet|tfrecord
        [--vocab-sizes 1000,...(26)] [--max-vocab 10000000] [--rows-per-file 1000000]
        [--on-error raise|skip]

Categorical hex values are reduced modulo their table sizes on the way (the
output holds ids); integer features are stored raw. Reading the output with
`read_parquet` / `read_tfrecord` gives exactly what `read_tsv` gives.
"""
import argparse
import logging
import os
import sys
import time

from tf_sok.python.data.columnar import write_parquet, write_tfrecord
from tf_sok.python.data.pipeline import ReadStats
from tf_sok.python.data.schema import KAGGLE_CARDINALITIES, CriteoSchema
from tf_sok.python.data.tsv import read_tsv

_log = logging.getLogger("tf_sok.data.convert")


def convert(inputs, output: str, fmt: str, schema: CriteoSchema, rows_per_file: int = 1_000_000,
            on_error: str = "raise", batch_size: int = 8192) -> dict:
    """Converts TSV files; returns {"rows": ..., "skipped": ..., "files": [...]}."""
    if fmt not in ("parquet", "tfrecord"):
        raise ValueError(f"format must be 'parquet' or 'tfrecord', got {fmt!r}")
    os.makedirs(output, exist_ok=True)
    stats = ReadStats()
    batches = iter(read_tsv(inputs, min(batch_size, rows_per_file), schema, on_error=on_error, stats=stats, raw=True))
    writer = write_parquet if fmt == "parquet" else write_tfrecord
    files, rows, done = [], 0, False

    def chunk():  # up to rows_per_file rows of batches
        nonlocal rows, done
        taken = 0
        for dense, cats, label in batches:
            yield dense, cats, label
            taken += len(label)
            if taken >= rows_per_file:
                return
        done = True

    while not done:
        path = os.path.join(output, f"part-{len(files):05d}.{fmt}")
        n = writer(chunk(), path, schema)
        if n == 0:
            os.remove(path)
            break
        files.append(path)
        rows += n
    return {"rows": rows, "skipped": int(stats.skipped.numpy()), "files": files}


def main(argv=None):
    p = argparse.ArgumentParser(description="Convert Criteo TSV to Parquet or TFRecord")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--format", required=True, choices=["parquet", "tfrecord"])
    p.add_argument("--vocab-sizes", help="26 comma-separated table sizes (default: Criteo Kaggle's, capped)")
    p.add_argument("--max-vocab", type=int, default=10_000_000)
    p.add_argument("--rows-per-file", type=int, default=1_000_000)
    p.add_argument("--on-error", default="raise", choices=["raise", "skip"])
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.vocab_sizes.split(",")] if a.vocab_sizes else KAGGLE_CARDINALITIES
    schema = CriteoSchema.capped(a.max_vocab, sizes)
    t0 = time.time()
    res = convert(a.input, a.output, a.format, schema, a.rows_per_file, a.on_error)
    print(f"converted {res['rows']:,} rows ({res['skipped']:,} bad lines skipped) into {len(res['files'])} "
          f"{a.format} file(s) under {a.output} in {time.time() - t0:.1f}s")
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
