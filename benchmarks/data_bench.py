"""Input pipeline throughput (rows/s) of each Criteo reader, measured side by side
on the same rows: TSV parsing, Parquet, TFRecord, and the synthetic generator.

    python benchmarks/data_bench.py [--rows 200000] [--batch 8192]
"""
import argparse
import os
import tempfile
import time

import tf_sok.data as sd
from tf_sok.python.data.convert import convert


def rows_per_second(ds):
    """Rows/s after the first batch (which includes tracing the parse function)."""
    it = iter(ds)
    next(it)
    t0, n = time.perf_counter(), 0
    for _, _, label in it:
        n += int(label.shape[0])
    return n / (time.perf_counter() - t0), n


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=8192)
    a = p.parse_args()
    schema = sd.CriteoSchema.capped(10_000_000)
    with tempfile.TemporaryDirectory() as d:
        tsv = os.path.join(d, "day.tsv")
        sd.write_criteo_tsv(tsv, a.rows, sd.SyntheticConfig(schema=schema), seed=1)
        for fmt in ("parquet", "tfrecord"):
            convert([tsv], os.path.join(d, fmt), fmt, schema, rows_per_file=a.rows // 4 + 1)
        print(f"{a.rows:,} Criteo rows, batch {a.batch}, {os.cpu_count()} CPU cores")
        for name, ds in (("TSV (parse + hash)", sd.read_tsv(tsv, a.batch, schema)),
                         ("Parquet (pyarrow)", sd.read_parquet(os.path.join(d, "parquet"), a.batch, schema)),
                         ("TFRecord", sd.read_tfrecord(os.path.join(d, "tfrecord"), a.batch, schema)),
                         ("synthetic one-hot", sd.synthetic(a.rows, a.batch, sd.SyntheticConfig(schema=schema))),
                         ("synthetic DCNv2 multi-hot", sd.synthetic(a.rows, a.batch, sd.SyntheticConfig.dcnv2(schema)))):
            rps, n = rows_per_second(ds)
            print(f"  {name:28s} {rps:12,.0f} rows/s ({n:,} rows)")


if __name__ == "__main__":
    main()
