"""Criteo readers against hand-checked lines, round trips between formats, bad data."""
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import tf_sok.data as sd
from tf_sok.python.data.convert import main as convert_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCHEMA = sd.CriteoSchema(vocab_sizes=tuple(range(1000, 1026)))


def line(label, ints, cats):
    return "\t".join([label] + ints + cats)


def random_lines(rng, n):
    out = []
    for _ in range(n):
        ints = [("" if rng.random() < 0.1 else str(int(rng.integers(-2, 5000)))) for _ in range(13)]
        cats = [("" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}") for _ in range(26)]
        out.append(line(str(int(rng.integers(0, 2))), ints, cats))
    return out


def expected(lines):
    """Independent reference: plain Python parsing of the same lines."""
    dense, cats, labels = [], {n: [] for n in SCHEMA.categorical_names}, []
    for l in lines:
        f = l.split("\t")
        labels.append(float(f[0]))
        dense.append([np.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]])
        for i, n in enumerate(SCHEMA.categorical_names):
            cats[n].append([int(f[14 + i], 16) % SCHEMA.vocab_sizes[i]] if f[14 + i] else [])
    return np.array(dense, np.float32), cats, np.array(labels, np.float32)[:, None]


def collect(ds):
    parts = list(ds)
    dense = np.concatenate([p[0].numpy() for p in parts])
    label = np.concatenate([p[2].numpy() for p in parts])
    cats = {n: sum((p[1][n].to_list() for p in parts), []) for n in SCHEMA.categorical_names}
    return dense, cats, label


def assert_same(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
    np.testing.assert_array_equal(a[2], b[2])
    for n in SCHEMA.categorical_names:
        assert a[1][n] == b[1][n], n


def test_tsv_hand_checked_line(tmp_path):
    cats = ["68fd1e64", "", "FF"] + ["0"] * 23
    p = tmp_path / "one.tsv"
    p.write_text(line("1", ["3", "", "-5"] + ["0"] * 10, cats) + "\n")
    dense, c, label = next(iter(sd.read_tsv(str(p), 4, SCHEMA)))
    np.testing.assert_allclose(dense.numpy()[0, :3], [np.log(4.0), 0.0, 0.0], rtol=1e-6)  # missing and negative -> 0
    assert label.numpy().tolist() == [[1.0]]
    assert c["C1"].to_list() == [[0x68FD1E64 % 1000]]
    assert c["C2"].to_list() == [[]]                       # missing categorical: no id
    assert c["C3"].to_list() == [[255 % 1002]]


def test_tsv_matches_python_parsing_over_files_and_batches(tmp_path, rng):
    lines = random_lines(rng, 517)
    (tmp_path / "a.tsv").write_text("\n".join(lines[:300]) + "\n")
    (tmp_path / "b.tsv").write_text("\n".join(lines[300:]) + "\n")
    got = collect(sd.read_tsv([str(tmp_path / "a.tsv"), str(tmp_path / "b.tsv")], 64, SCHEMA, parallel_files=1))
    assert_same(got, expected(lines))


@pytest.mark.parametrize("fmt", ["parquet", "tfrecord"])
def test_round_trip_through_converter(tmp_path, rng, fmt):
    lines = random_lines(rng, 700)
    src = tmp_path / "day.tsv"
    src.write_text("\n".join(lines) + "\n")
    sizes = ",".join(str(v) for v in SCHEMA.vocab_sizes)
    res = convert_main(["--input", str(src), "--output", str(tmp_path / fmt), "--format", fmt,
                        "--vocab-sizes", sizes, "--rows-per-file", "256"])
    assert res["rows"] == 700 and len(res["files"]) >= 2
    reader = sd.read_parquet if fmt == "parquet" else sd.read_tfrecord
    back = collect(reader(str(tmp_path / fmt), 100, SCHEMA, parallel_files=1))
    assert_same(back, collect(sd.read_tsv(str(src), 100, SCHEMA)))
    assert_same(back, expected(lines))


def test_converter_command_line(tmp_path):
    src = os.path.join(ROOT, "examples", "data", "criteo_sample.tsv")
    p = subprocess.run([sys.executable, "-m", "tf_sok.data.convert", "--input", src, "--output", str(tmp_path / "o"),
                        "--format", "parquet", "--max-vocab", "1000"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "converted 4,000 rows" in p.stdout
    assert pq.read_table(str(tmp_path / "o")).num_rows == 4000


def test_parquet_with_scalar_columns_and_nulls(tmp_path):
    n = 5
    cols = {"label": pa.array([1.0, 0.0, 1.0, 0.0, 1.0], pa.float32())}
    cols.update({f"I{i + 1}": pa.array([1, None, 3, 4, 5], pa.int64()) for i in range(13)})
    cols.update({f"C{i + 1}": pa.array([7, None, 9, 0, 999], pa.int64()) for i in range(26)})
    pq.write_table(pa.table(cols), str(tmp_path / "x.parquet"))
    dense, c, label = next(iter(sd.read_parquet(str(tmp_path), n, SCHEMA)))
    np.testing.assert_allclose(dense.numpy()[:, 0], np.log1p([1, 0, 3, 4, 5]), rtol=1e-6)
    assert c["C1"].to_list() == [[7], [], [9], [0], [999]]
    assert label.numpy().ravel().tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]


class TestBadData:
    def write(self, tmp_path, rng, bad_line, at=5):
        lines = random_lines(rng, 12)
        good = list(lines)
        lines.insert(at, bad_line)
        p = tmp_path / "bad.tsv"
        p.write_text("\n".join(lines) + "\n")
        return str(p), good

    @pytest.mark.parametrize("bad,reason", [
        (line("1", ["1"] * 13, ["ab"] * 25), "has 39 tab-separated fields, expected 40"),
        (line("1", ["1"] * 13, ["zz"] + ["ab"] * 25), "categorical feature C1 is not a hex string"),
        (line("1", ["1.5"] + ["1"] * 12, ["ab"] * 26), "integer feature I1 is not an integer"),
        (line("7", ["1"] * 13, ["ab"] * 26), "the label is not 0 or 1"),
    ])
    def test_bad_line_names_file_and_line(self, tmp_path, rng, bad, reason):
        path, _ = self.write(tmp_path, rng, bad)
        with pytest.raises(tf.errors.InvalidArgumentError, match=rf"Criteo TSV {path}, line 6: {reason}"):
            collect(sd.read_tsv(path, 4, SCHEMA))

    def test_truncated_file(self, tmp_path, rng):
        lines = random_lines(rng, 9)
        p = tmp_path / "cut.tsv"
        p.write_text("\n".join(lines) + "\n" + lines[0][:37])  # the writer died mid-line
        with pytest.raises(tf.errors.InvalidArgumentError, match=rf"{p}, line 10: has \d+ tab-separated fields"):
            collect(sd.read_tsv(str(p), 4, SCHEMA))

    def test_skip_counts_and_keeps_columns_aligned(self, tmp_path, rng):
        path, good = self.write(tmp_path, rng, line("1", ["x"] * 13, ["ab"] * 26), at=3)
        stats = sd.ReadStats()
        got = collect(sd.read_tsv(path, 4, SCHEMA, on_error="skip", stats=stats))
        assert int(stats.skipped.numpy()) == 1
        assert_same(got, expected(good))
        with pytest.raises(ValueError, match="on_error"):
            sd.read_tsv(path, 4, SCHEMA, on_error="ignore")


def test_synthetic_shape_hotness_and_skew():
    schema = sd.CriteoSchema.capped(50_000)
    cfg = sd.SyntheticConfig.dcnv2(schema, alpha=1.2)
    dense, cats, label = next(iter(sd.synthetic(4096, 4096, cfg, seed=3)))
    assert dense.shape == (4096, 13) and label.shape == (4096, 1) and len(cats) == 26
    for f, (name, vocab) in enumerate(zip(schema.categorical_names, schema.vocab_sizes)):
        lens = cats[name].row_lengths().numpy()
        assert lens.max() <= sd.DCNV2_HOTNESS[f]
        ids = cats[name].values.numpy()
        assert ids.min() >= 0 and ids.max() < vocab
    ids = cats["C21"].values.numpy()  # 100-hot over 1e4+ rows: Zipf makes the top id very frequent
    assert np.bincount(ids).max() / len(ids) > 0.05
    assert 0.2 < label.numpy().mean() < 0.8
