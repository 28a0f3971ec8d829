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
from tf_sok.python.data import columnar
from tf_sok.python.data.convert import convert, main as convert_main

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


def expected(lines, schema=SCHEMA):
    """Independent reference: plain Python parsing of the same lines."""
    dense, cats, labels = [], {n: [] for n in schema.categorical_names}, []
    for l in lines:
        f = l.split("\t")
        labels.append(float(f[0]))
        dense.append([np.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]])
        for i, n in enumerate(schema.categorical_names):
            cats[n].append([int(f[14 + i], 16) % schema.vocab_sizes[i]] if f[14 + i] else [])
    return np.array(dense, np.float32), cats, np.array(labels, np.float32)[:, None]


def id_lists(feature):
    """Per-row id lists of a RaggedTensor, or of a (values, row_splits) pair (plain Python)."""
    if isinstance(feature, tf.RaggedTensor):
        return feature.to_list()
    values, splits = (t.numpy().tolist() for t in feature)
    assert splits[0] == 0 and splits[-1] == len(values)
    return [values[a:b] for a, b in zip(splits[:-1], splits[1:])]


def collect(ds):
    parts = list(ds)
    dense = np.concatenate([p[0].numpy() for p in parts])
    label = np.concatenate([p[2].numpy() for p in parts])
    cats = {n: sum((id_lists(p[1][n]) for p in parts), []) for n in SCHEMA.categorical_names}
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
    files = [str(tmp_path / "a.tsv"), str(tmp_path / "b.tsv")]
    got = collect(sd.read_tsv(files, 64, SCHEMA, parallel_files=1))
    assert_same(got, expected(lines))
    paired = sd.read_tsv(files, 64, SCHEMA, parallel_files=1, ragged_pairs=True)
    assert all(isinstance(b[1][n], tuple) for b in paired.take(1) for n in SCHEMA.categorical_names)
    assert_same(collect(paired), expected(lines))
    with pytest.raises(TypeError, match="read_tsv: ragged_pairs must be True or False, got 'yes'"):
        sd.read_tsv(files, 64, SCHEMA, ragged_pairs="yes")


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
    back = collect(reader(str(tmp_path / fmt), 100, parallel_files=1))   # schema: the one stored by the converter
    assert_same(back, collect(sd.read_tsv(str(src), 100, SCHEMA)))
    assert_same(back, expected(lines))
    paired = reader(str(tmp_path / fmt), 100, parallel_files=1, ragged_pairs=True)
    assert isinstance(next(iter(paired))[1]["C1"], tuple)
    assert_same(collect(paired), expected(lines))
    assert sd.schema_of(str(tmp_path / fmt)) == SCHEMA


def test_converter_command_line(tmp_path):
    src = os.path.join(ROOT, "examples", "data", "criteo_sample.tsv")
    p = subprocess.run([sys.executable, "-m", "tf_sok.data.convert", "--input", src, "--output", str(tmp_path / "o"),
                        "--format", "parquet", "--max-vocab", "1000"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "converted 4,000 rows" in p.stdout
    assert pq.read_table(str(tmp_path / "o")).num_rows == 4000
    assert sd.schema_of(str(tmp_path / "o")).vocab_sizes == tuple(min(c, 1000) for c in sd.KAGGLE_CARDINALITIES)


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


BAD_LINES = [  # (a bad line, what the error says of it): the readers and the converter say the same
    (line("1", ["1"] * 13, ["ab"] * 25), "has 39 tab-separated fields, expected 40"),
    (line("1", ["1"] * 13, ["zz"] + ["ab"] * 25), "categorical feature C1 is not a hex string"),
    (line("1", ["1.5"] + ["1"] * 12, ["ab"] * 26), "integer feature I1 is not an integer"),
    (line("7", ["1"] * 13, ["ab"] * 26), "the label is not 0 or 1"),
]


class TestBadData:
    def write(self, tmp_path, rng, bad_line, at=5):
        lines = random_lines(rng, 12)
        good = list(lines)
        lines.insert(at, bad_line)
        p = tmp_path / "bad.tsv"
        p.write_text("\n".join(lines) + "\n")
        return str(p), good

    @pytest.mark.parametrize("bad,reason", BAD_LINES)
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


@pytest.mark.parametrize("vocab,alpha", [(1_000, 1.05), (300_000, 1.05), (300_000, 1.2), (200_000, 1.0)])
def test_zipf_ids_follow_zipfs_law_over_the_vocabulary(rng, vocab, alpha):
    """zipf_ranks (the synthetic data's ids) against the exact probabilities r ** -alpha over the
    vocabulary (NumPy), band by band: the top rank alone, decades, and the ranks above the 65,536 it
    draws exactly; none outside the vocabulary (numpy's unbounded Zipf, clipped, put ~40 % of the draws
    at alpha 1.05 on one id)."""
    n = 2_000_000
    got = sd.zipf_ranks(rng, vocab, n, alpha)
    assert got.dtype == np.int64 and got.min() >= 0 and got.max() < vocab
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    counts = np.bincount(got, minlength=vocab)
    edges = [e for e in (0, 1, 10, 100, 1_000, 10_000, 65_536, 100_000) if e < vocab] + [vocab]
    for lo, hi in zip(edges, edges[1:]):
        expect = p[lo:hi].sum() * n
        sigma = np.sqrt(expect * (1 - expect / n))
        assert abs(counts[lo:hi].sum() - expect) <= 5 * sigma + 1, (lo, hi, counts[lo:hi].sum(), expect)
    with pytest.raises(ValueError, match="vocab must be positive"):
        sd.zipf_ranks(rng, 0, 10, 1.1)


def test_converter_general_hex_widths_and_several_inputs_in_parallel(tmp_path, rng):
    """Tokens of 1-15 hex digits (not only Criteo's 8) over two input files converted by two processes."""
    lines = []
    for _ in range(300):
        ints = [("" if rng.random() < 0.2 else str(int(rng.integers(-9, 10**6)))) for _ in range(13)]
        cats = [("" if rng.random() < 0.2 else f"{int(rng.integers(0, 16 ** 15)):x}"[:int(rng.integers(1, 16))])
                for _ in range(26)]
        lines.append(line(str(int(rng.integers(0, 2))), ints, cats))
    (tmp_path / "a.tsv").write_text("\n".join(lines[:170]) + "\n")
    (tmp_path / "b.tsv").write_text("\n".join(lines[170:]))          # no newline after the last line
    res = convert([str(tmp_path / "a.tsv"), str(tmp_path / "b.tsv")], str(tmp_path / "pq"), "parquet", SCHEMA,
                  rows_per_file=64, workers=2)
    assert res["rows"] == 300 and res["skipped"] == 0
    assert_same(collect(sd.read_parquet(res["files"], 50, parallel_files=1)), expected(lines))


class TestConverterBadLines:
    @pytest.mark.parametrize("bad,reason", BAD_LINES)
    def test_raise_names_file_and_line(self, tmp_path, rng, bad, reason):
        lines = random_lines(rng, 12)
        lines.insert(7, bad)
        src = tmp_path / "bad.tsv"
        src.write_text("\n".join(lines) + "\n")
        with pytest.raises(ValueError, match=rf"Criteo TSV {src}, line 8: {reason}"):
            convert([str(src)], str(tmp_path / "o"), "parquet", SCHEMA)

    def test_skip_counts_and_keeps_the_good_lines(self, tmp_path, rng):
        lines = random_lines(rng, 40)
        good = list(lines)
        lines[3:3] = [line("1", ["x"] * 13, ["ab"] * 26), line("1", ["1"] * 13, ["ab"] * 24), "1\t2"]
        src = tmp_path / "bad.tsv"
        src.write_text("\n".join(lines) + "\n")
        res = convert([str(src)], str(tmp_path / "o"), "parquet", SCHEMA, on_error="skip")
        assert res["skipped"] == 3 and res["rows"] == 40
        assert_same(collect(sd.read_parquet(str(tmp_path / "o"), 16)), expected(good))


def _write_random_parquet(rng, path, n, schema, multi_hot, statistics=True):
    """A Parquet file written by pyarrow directly (several row groups, nulls, empty lists)
    and the plain-Python reference of what reading it gives."""
    cols = {"label": pa.array(rng.integers(0, 2, n).astype(np.float32))}
    ref_dense = np.zeros((n, 13), np.float32)
    for i in range(13):
        vals = [None if rng.random() < 0.1 else int(rng.integers(-3, 10**5)) for _ in range(n)]
        cols[f"I{i + 1}"] = pa.array(vals, pa.int64())
        ref_dense[:, i] = [np.log1p(max(v or 0, 0)) for v in vals]
    ref_cats = {}
    for name, vocab in zip(schema.categorical_names, schema.vocab_sizes):
        if multi_hot:
            rows = [None if rng.random() < 0.05 else [int(x) for x in rng.integers(0, vocab, rng.integers(0, 5))]
                    for _ in range(n)]
            cols[name] = pa.array(rows, pa.list_(pa.int64()))
            ref_cats[name] = [r or [] for r in rows]
        else:
            vals = [None if rng.random() < 0.1 else int(rng.integers(0, vocab)) for _ in range(n)]
            cols[name] = pa.array(vals, pa.int64())
            ref_cats[name] = [[] if v is None else [v] for v in vals]
    pq.write_table(pa.table(cols), path, row_group_size=int(rng.integers(7, 60)), write_statistics=statistics)
    return ref_dense, ref_cats, cols["label"].to_numpy()[:, None]


@pytest.mark.parametrize("multi_hot", [True, False])
def test_parquet_matches_python_reference_over_files_and_row_groups(tmp_path, rng, multi_hot):
    parts = [_write_random_parquet(rng, str(tmp_path / f"p{k}.parquet"), int(rng.integers(50, 200)), SCHEMA, multi_hot)
             for k in range(3)]
    want = (np.concatenate([p[0] for p in parts]), {n: sum((p[1][n] for p in parts), [])
                                                   for n in SCHEMA.categorical_names},
            np.concatenate([p[2] for p in parts]))
    batch = int(rng.integers(5, 40))
    ds = sd.read_parquet(str(tmp_path), batch, SCHEMA, parallel_files=1, block_rows=int(rng.integers(1, 100)))
    got = collect(ds)
    assert_same(got, want)
    rows = [len(p[2]) for p in parts]         # whole batches, then each file's remainder
    assert [int(b[2].shape[0]) for b in ds] == sum(([batch] * (n // batch) + [n % batch][:n % batch] for n in rows), [])
    dropped = sd.read_parquet(str(tmp_path), batch, SCHEMA, drop_remainder=True)
    assert [int(b[2].shape[0]) for b in dropped] == [batch] * sum(n // batch for n in rows)
    # whole batches only: the batch size is in the static shapes (TensorFlow folds it in a step)
    dense_spec, cat_specs, label_spec = dropped.element_spec
    assert dense_spec.shape[0] == label_spec.shape[0] == batch
    assert all(cat_specs[n].shape[0] == batch for n in SCHEMA.categorical_names)
    assert ds.element_spec[0].shape[0] is None
    # several files at once, not in order: the same rows
    unordered = collect(sd.read_parquet(str(tmp_path), batch, SCHEMA, parallel_files=3, deterministic=False))
    assert_same(in_row_order(unordered), in_row_order(got))
    # int32 ids: the same values, converted while blocks are built
    narrow = sd.read_parquet(str(tmp_path), batch, SCHEMA, parallel_files=1, id_dtype=tf.int32)
    assert all(b[1][n].dtype == tf.int32 for b in narrow.take(2) for n in SCHEMA.categorical_names)
    assert_same(collect(narrow), want)
    # ids as (values, row_splits) pairs of plain tensors: the same rows, static batch sizes kept
    paired = sd.read_parquet(str(tmp_path), batch, SCHEMA, parallel_files=1, id_dtype=tf.int32, ragged_pairs=True,
                             drop_remainder=True)
    values_spec, splits_spec = paired.element_spec[1]["C1"]
    assert values_spec.dtype == tf.int32 and values_spec.shape.rank == 1 and splits_spec.shape[0] == batch + 1
    full = sum(n // batch * batch for n in rows)
    got_pairs = collect(paired)
    assert len(got_pairs[2]) == full
    assert_same(in_row_order(got_pairs), in_row_order(collect(dropped)))
    with pytest.raises(TypeError, match="read_parquet: ragged_pairs must be True or False, got 1"):
        sd.read_parquet(str(tmp_path), batch, SCHEMA, ragged_pairs=1)


@pytest.mark.parametrize("multi_hot", [True, False])
def test_parquet_pieces_of_one_file_give_its_whole_batches(tmp_path, rng, multi_hot):
    """Fewer files than parallel readers: each file is read as several runs of row groups side by
    side; between them they give every row once, in whole batches (the file's last one shorter)."""
    n = int(rng.integers(150, 400))
    want = _write_random_parquet(rng, str(tmp_path / "one.parquet"), n, SCHEMA, multi_hot)
    batch, parallel = int(rng.integers(3, 50)), int(rng.integers(2, 6))
    pieces = columnar._pieces([str(tmp_path / "one.parquet")], parallel, int(rng.integers(1, 100)))
    assert len(pieces) > 1 and all(groups is not None for _, groups in pieces)
    for deterministic in (True, False):
        ds = sd.read_parquet(str(tmp_path), batch, SCHEMA, parallel_files=parallel, deterministic=deterministic,
                             block_rows=int(rng.integers(1, 100)))
        sizes = sorted(int(b[2].shape[0]) for b in ds)
        assert sizes == sorted([batch] * (n // batch) + [n % batch][:n % batch]), (sizes, n, batch)
        assert_same(in_row_order(collect(ds)), in_row_order(want))
    dropped = [int(b[2].shape[0]) for b in sd.read_parquet(str(tmp_path), batch, SCHEMA, parallel_files=parallel,
                                                           drop_remainder=True)]
    assert dropped == [batch] * (n // batch)


def in_row_order(batches):
    """Rows sorted by their label and ids (exact values), so readers that interleave files compare row by row."""
    dense, cats, label = batches
    names = SCHEMA.categorical_names
    keys = [(float(label[i, 0]),) + tuple(tuple(cats[n][i]) for n in names) for i in range(len(label))]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return dense[order], {n: [cats[n][i] for i in order] for n in names}, label[order]


@pytest.mark.parametrize("statistics", [True, False])   # the range read from row-group statistics, or scanned
def test_parquet_id_outside_the_schema_names_file_column_and_value(tmp_path, rng, statistics):
    _write_random_parquet(rng, str(tmp_path / "x.parquet"), 30, sd.CriteoSchema(vocab_sizes=(5000,) * 26), False,
                          statistics)
    small = sd.CriteoSchema(vocab_sizes=(1000,) * 26)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"x.parquet: column C1 has id \d+ outside \[0, 1000\)"):
        collect(sd.read_parquet(str(tmp_path), 8, small))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"x.parquet: column C1 has id \d+ outside \[0, 1000\)"):
        collect(sd.read_parquet(str(tmp_path), 8, small, id_dtype=tf.int32))   # checked before the narrowing
    huge = sd.CriteoSchema(vocab_sizes=(2**31,) + (5000,) * 25)
    with pytest.raises(ValueError, match=r"id_dtype=tf.int32 needs every vocabulary under 2\*\*31, the largest is "
                                         r"2147483648"):
        sd.read_parquet(str(tmp_path), 8, huge, id_dtype=tf.int32)
    with pytest.raises(ValueError, match="id_dtype must be tf.int32 or tf.int64"):
        sd.read_parquet(str(tmp_path), 8, small, id_dtype=tf.float32)


@pytest.mark.parametrize("fmt", ["parquet", "tfrecord"])
def test_stored_schema_larger_than_the_tables_is_one_clear_error(tmp_path, rng, fmt):
    lines = random_lines(rng, 20)
    (tmp_path / "d.tsv").write_text("\n".join(lines) + "\n")
    convert([str(tmp_path / "d.tsv")], str(tmp_path / fmt), fmt, SCHEMA)
    tables = sd.CriteoSchema(vocab_sizes=(1000,) + SCHEMA.vocab_sizes[1:2] + (10,) + SCHEMA.vocab_sizes[3:])
    reader = sd.read_parquet if fmt == "parquet" else sd.read_tfrecord
    with pytest.raises(ValueError, match=r"C3: data has 1,002 ids, table 10 rows") as e:
        reader(str(tmp_path / fmt), 8, tables)
    assert "C1" not in str(e.value)       # C1's table (1000 rows) holds the data's 1000 ids
    bigger = sd.CriteoSchema(vocab_sizes=tuple(v * 2 for v in SCHEMA.vocab_sizes))
    assert_same(collect(reader(str(tmp_path / fmt), 8, bigger)), expected(lines))   # larger tables: fine


def test_synthetic_pool_is_cycled_and_a_small_run_is_all_distinct():
    cfg = sd.SyntheticConfig(schema=sd.CriteoSchema.capped(10_000))
    batches = list(sd.synthetic(10 * 64 + 5, 64, cfg, seed=4, pool_rows=3 * 64))
    assert [int(b[2].shape[0]) for b in batches] == [64] * 10 + [5]
    for i, b in enumerate(batches):
        a = batches[i % 3]
        np.testing.assert_array_equal(b[0].numpy(), a[0].numpy()[:len(b[0])])
        assert b[1]["C7"].to_list() == a[1]["C7"].to_list()[:len(b[0])]
    whole = collect(sd.synthetic(300, 64, cfg, seed=4))
    raw = next(sd.raw_batches(300, 300, cfg, seed=4))          # the generator's own rows, unbatched
    np.testing.assert_allclose(whole[0], np.log1p(np.maximum(raw[0], 0)).astype(np.float32), rtol=1e-6)
    assert whole[1]["C7"] == raw[1]["C7"].to_list()
    with pytest.raises(ValueError, match="positive"):
        sd.synthetic(0, 64, cfg)
    # the batch size is static where every batch is whole, and the rows are the same
    assert sd.synthetic(10 * 64 + 5, 64, cfg).element_spec[0].shape[0] is None
    fixed = sd.synthetic(300, 60, cfg, seed=4)
    assert fixed.element_spec[0].shape[0] == fixed.element_spec[2].shape[0] == 60
    assert fixed.element_spec[1]["C7"].shape[0] == 60
    again = collect(fixed)
    np.testing.assert_array_equal(again[0], whole[0])
    assert again[1]["C7"] == whole[1]["C7"]


@pytest.mark.parametrize("shape,dtype", [([0], np.int32), ([1], np.int64), ([777], np.int32), ((513, 13), np.int64),
                                         ([3001], np.float32)])
def test_block_arrays_are_aligned_so_tensorflow_takes_them_without_a_copy(shape, dtype):
    from tf_sok.python.data.blocks import aligned_empty

    arrays = [aligned_empty(shape, dtype) for _ in range(4)]
    for a in arrays:
        assert a.shape == tuple(shape) and a.dtype == dtype and a.flags["C_CONTIGUOUS"]
        assert a.size == 0 or a.ctypes.data % 64 == 0   # (an empty array has nothing to copy)
        a[...] = np.arange(a.size, dtype=dtype).reshape(shape)
    # the arrays do not overlap, and come through a generator dataset unchanged
    ds = tf.data.Dataset.from_generator(lambda: iter(arrays), output_signature=tf.TensorSpec(None, dtype))
    for a, t in zip(arrays, ds):
        np.testing.assert_array_equal(t.numpy(), np.arange(a.size, dtype=dtype).reshape(shape))


def test_written_ids_are_int32_under_2_31_rows_and_statistics_spare_the_scan(tmp_path, rng):
    schema = sd.CriteoSchema(vocab_sizes=(2**31 - 1,) + (77,) * 25)
    lines = random_lines(rng, 40)
    (tmp_path / "d.tsv").write_text("\n".join(lines) + "\n")
    convert([str(tmp_path / "d.tsv")], str(tmp_path / "pq"), "parquet", schema)
    path = sorted((tmp_path / "pq").glob("*.parquet"))[0]
    f = pq.ParquetFile(str(path))
    assert {f.schema_arrow.field(n).type for n in schema.categorical_names} == {pa.int32()}
    assert columnar._in_range_by_statistics(f, schema) == frozenset(schema.categorical_names)
    # a table smaller than a column's largest id: that column must be scanned (and then fails)
    small = sd.CriteoSchema(vocab_sizes=schema.vocab_sizes[:4] + (3,) + schema.vocab_sizes[5:])
    assert "C5" not in columnar._in_range_by_statistics(f, small)
    wide = sd.CriteoSchema(vocab_sizes=(2**31,) + (77,) * 25)
    assert pq.read_schema(str(path)).field("C1").type == pa.int32() and columnar.id_arrow_type(wide) == pa.int64()
    assert_same(collect(sd.read_parquet(str(path), 8, schema)), expected(lines, schema))


def test_parquet_blocks_built_in_worker_processes_equal_the_reference(tmp_path, rng):
    """read_parquet(workers=2): the same batches as the reference, whole files and pieces of one file
    (one of multi-hot lists, one of plain id columns, both with nulls: the blocks built in place in
    shared memory fit the size bound taken before building), int32 and int64 ids; an id outside its
    table and a file lacking columns name the file, column and value as in one process; workers must
    be a positive count."""
    parts = [_write_random_parquet(rng, str(tmp_path / f"p{k}.parquet"), int(rng.integers(80, 200)), SCHEMA, k == 0)
             for k in range(2)]
    want = (np.concatenate([p[0] for p in parts]), {n: sum((p[1][n] for p in parts), [])
                                                   for n in SCHEMA.categorical_names},
            np.concatenate([p[2] for p in parts]))
    batch = int(rng.integers(5, 40))
    for id_dtype, parallel in ((tf.int64, 1), (tf.int32, 5)):   # 5 > files: runs of row groups side by side
        ds = sd.read_parquet(str(tmp_path), batch, SCHEMA, parallel_files=parallel, id_dtype=id_dtype, workers=2,
                             block_rows=int(rng.integers(1, 100)), ragged_pairs=parallel > 1)
        got = collect(ds)
        assert_same(in_row_order(got), in_row_order(want))
        if parallel == 1:
            assert_same(got, want)   # in file order
    (tmp_path / "bad").mkdir()
    _write_random_parquet(rng, str(tmp_path / "bad" / "x.parquet"), 30, sd.CriteoSchema(vocab_sizes=(5000,) * 26),
                          False)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"x.parquet: column C1 has id \d+ outside \[0, 1000\)"):
        collect(sd.read_parquet(str(tmp_path / "bad"), 8, sd.CriteoSchema(vocab_sizes=(1000,) * 26), workers=2))
    pq.write_table(pa.table({"label": pa.array([1.0], pa.float32())}), str(tmp_path / "bad" / "y.parquet"))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"y.parquet lacks Criteo columns \['I1'"):
        collect(sd.read_parquet(str(tmp_path / "bad" / "y.parquet"), 8, SCHEMA, workers=2))
    with pytest.raises(ValueError, match="workers must be a positive number of processes, got 0"):
        sd.read_parquet(str(tmp_path), 8, SCHEMA, workers=0)
    # the workers yield the cores to the training process
    from tf_sok.python.data import block_workers
    pids = {f.result() for f in [block_workers._pool(2).submit(block_workers._ready) for _ in range(8)]}
    assert pids and all(os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + block_workers.WORKER_NICENESS)
                        for pid in pids)


def test_pinned_copy_keeps_every_tensor_of_a_batch(rng):
    """The copy into page-locked memory (plain host memory here) gives the same values, dtypes and
    ragged structure, for tensors of several MB (copied by several threads) and empty ones alike;
    strings pass through unchanged."""
    from tf_sok.python.data.pipeline import pinned_copy

    lens = rng.integers(0, 9, 40_000)
    ids = rng.integers(-2**63, 2**63 - 1, int(lens.sum()), dtype=np.int64, endpoint=True)
    batch = ({"dense": tf.constant(rng.random((40_000, 13), np.float32)),
              "ids": tf.RaggedTensor.from_row_lengths(ids, lens),
              "few": tf.RaggedTensor.from_row_lengths(tf.zeros([0], tf.int32), np.zeros(5, np.int64)),
              "half": tf.constant(rng.random(1001), tf.bfloat16), "flag": tf.constant(rng.random(77) < 0.5),
              "name": tf.constant(["a", "bc"])},
             tf.constant(rng.random((40_000, 1)), tf.float32))
    for got in (pinned_copy(*batch), next(iter(tf.data.Dataset.from_tensors(batch).map(pinned_copy)))):
        want, have = tf.nest.flatten(batch, expand_composites=True), tf.nest.flatten(got, expand_composites=True)
        assert len(want) == len(have)
        for w, h in zip(want, have):
            assert w.dtype == h.dtype and w.shape == h.shape
            np.testing.assert_array_equal(h.numpy(), w.numpy())
        assert got[0]["ids"].to_list() == batch[0]["ids"].to_list()


def test_ragged_pairs_carry_the_ragged_ids_as_plain_tensors(rng):
    """for_keras / to_device(ragged_pairs=True): each ragged feature becomes its (values,
    row_splits) pair, equal to the RaggedTensor's components; other tensors unchanged. Pairs from
    the source on (synthetic(ragged_pairs=True), int64 ids cast by for_keras) alike."""
    cfg = sd.SyntheticConfig.dcnv2(sd.CriteoSchema.capped(5_000))
    batch, seed = int(rng.integers(50, 300)), int(rng.integers(1000))
    src = sd.synthetic(3 * batch, batch, cfg, seed=seed, id_dtype=tf.int32)
    want = list(sd.for_keras(src, id_dtype=tf.int32))
    paired = sd.synthetic(3 * batch, batch, cfg, seed=seed, ragged_pairs=True)
    for got in (list(sd.for_keras(src, id_dtype=tf.int32, ragged_pairs=True)),
                list(sd.to_device(sd.for_keras(src, id_dtype=tf.int32), "/cpu:0", ragged_pairs=True)),
                list(sd.to_device(sd.for_keras(paired, id_dtype=tf.int32), "/cpu:0", ragged_pairs=True))):
        assert len(got) == len(want) == 3
        for (gx, gy), (wx, wy) in zip(got, want):
            assert sorted(gx) == sorted(wx)
            np.testing.assert_array_equal(gx["dense"].numpy(), wx["dense"].numpy())
            np.testing.assert_array_equal(gy.numpy(), wy.numpy())
            for n in cfg.schema.categorical_names:
                values, splits = gx[n]
                assert isinstance(values, tf.Tensor) and isinstance(splits, tf.Tensor)
                np.testing.assert_array_equal(values.numpy(), wx[n].values.numpy())
                np.testing.assert_array_equal(splits.numpy(), wx[n].row_splits.numpy())


def test_synthetic_int32_ids_are_the_int64_ones_converted_once():
    cfg = sd.SyntheticConfig.dcnv2(sd.CriteoSchema.capped(50_000))
    wide = list(sd.synthetic(3 * 256 + 7, 256, cfg, seed=9, pool_rows=2 * 256))
    narrow = list(sd.synthetic(3 * 256 + 7, 256, cfg, seed=9, pool_rows=2 * 256, id_dtype=tf.int32))
    assert len(wide) == len(narrow) == 4
    for (wd, wc, wy), (nd, nc, ny) in zip(wide, narrow):
        np.testing.assert_array_equal(nd.numpy(), wd.numpy())
        np.testing.assert_array_equal(ny.numpy(), wy.numpy())
        for n in cfg.schema.categorical_names:
            assert nc[n].values.dtype == tf.int32 and wc[n].values.dtype == tf.int64
            np.testing.assert_array_equal(nc[n].values.numpy(), wc[n].values.numpy())
            np.testing.assert_array_equal(nc[n].row_splits.numpy(), wc[n].row_splits.numpy())
    with pytest.raises(ValueError, match="under 2\\*\\*31, the largest is 3000000000"):
        sd.synthetic(64, 64, sd.SyntheticConfig(schema=sd.CriteoSchema(vocab_sizes=(3_000_000_000,) * 26)),
                     id_dtype=tf.int32)
    with pytest.raises(ValueError, match="tf.int32 or tf.int64"):
        sd.synthetic(64, 64, cfg, id_dtype=tf.int16)
