"""Criteo-format data for tf_sok models: readers, a synthetic generator, a converter.

Every reader yields (dense [b, 13] float32, {"C1".."C26": ragged int64 [b, (ids)]},
label [b, 1] float32); `for_keras(ds)` turns that into ({"dense", "C1", ...}, label).

    import tf_sok.data as sd
    ds = sd.read_tsv("day_0.tsv", batch_size=4096, schema=sd.CriteoSchema.capped(10_000_000))
    ds = sd.read_parquet("criteo_parquet/", 4096)      # after: python -m tf_sok.data.convert ...
    ds = sd.synthetic(1_000_000, 4096, sd.SyntheticConfig.dcnv2())
"""
from tf_sok.python.data.columnar import read_parquet, read_tfrecord, schema_of, write_parquet, write_tfrecord
from tf_sok.python.data.pipeline import ReadStats, for_keras, to_device
from tf_sok.python.data.schema import DCNV2_HOTNESS, KAGGLE_CARDINALITIES, CriteoSchema
from tf_sok.python.data.synthetic import SyntheticConfig, raw_batches, synthetic, write_criteo_tsv
from tf_sok.python.data.tsv import read_tsv
from tf_sok.python.data.zipf import zipf_ranks

__all__ = ["read_tsv", "read_parquet", "read_tfrecord", "write_parquet", "write_tfrecord", "synthetic",
           "raw_batches", "write_criteo_tsv", "SyntheticConfig", "CriteoSchema", "ReadStats", "for_keras", "to_device",
           "KAGGLE_CARDINALITIES", "DCNV2_HOTNESS", "schema_of", "zipf_ranks"]
