// The ops of dynamic (hash-keyed) tables: registration and shape functions only.
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sok {

using ::tensorflow::shape_inference::InferenceContext;

namespace {

// A hybrid table's store rows: keys [n], rows [n, sum(widths)], widths [arrays].
absl::Status StoreRowsShape(InferenceContext* c) {
  c->set_output(0, c->Vector(c->UnknownDim()));
  c->set_output(1, c->Matrix(c->UnknownDim(), c->UnknownDim()));
  c->set_output(2, c->Vector(c->UnknownDim()));
  if (c->num_outputs() > 3) c->set_output(3, c->Vector(c->UnknownDim()));
  return absl::OkStatus();
}

// Ops over several dynamic tables (N indices, then N key lists): the key lists' shapes, vectors.
absl::Status KeyVectors(InferenceContext* c, std::vector<::tensorflow::shape_inference::ShapeHandle>* keys) {
  int n = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  keys->resize(n);
  for (int i = 0; i < n; ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(n + i), 1, &(*keys)[i]));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("TfSokDynamicIndex")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .Attr("table_name: string")
    .Attr("dim: int >= 1")
    .Attr("init_rows: int >= 1")
    .Attr("max_keys: int >= 0")
    .Attr("evict: {'none', 'lru', 'lfu'}")
    .Attr("min_frequency: int >= 1")
    .Attr("initializer: {'uniform', 'normal', 'truncated_normal', 'constant'}")
    .Attr("init_a: float")
    .Attr("init_b: float")
    .Attr("seed: int")
    .Attr("cache_bytes: int = -1")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
The key -> row index of a dynamic table (host memory). cache_bytes >= 0 makes a
hybrid table: the arrays hold at most the rows that fit in cache_bytes (a row of
every attached array counted) and every key's rows live in a host store behind
them, which evicted rows are written to and new keys' rows read from. init_rows: the value
arrays' rows at first; max_keys: at most this many keys (0: unbounded), evicting
by `evict` when full; min_frequency: a key is inserted on its min_frequency-th
sighting (before: row 0, which reads zeros). A new key's row starts at
`initializer` (uniform [a, b), normal / truncated_normal (mean a, stddev b),
constant a), a function of the key and `seed` only.
)doc");

REGISTER_OP("TfSokDynamicFind")
    .Input("index: resource")
    .Input("keys: int64")
    .Output("slots: int64")
    .Output("evicted_keys: int64")
    .Output("evicted_values: float")
    .Attr("insert: bool = true")
    .Attr("with_evicted: bool = false")
    .Attr("admit_all: bool = false")
    .Attr("insert_ratio: float = 1.0")
    .Attr("values_given: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle keys;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &keys));
      c->set_output(0, keys);
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->Matrix(c->UnknownDim(), c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Rows of `keys`. With insert: missing keys are admitted and inserted (evicting
when full), every key's score touched, and the arrays attached to the index
(TfSokDynamicAttach) kept in step: grown to the index's row count, the rows of
new keys set (values: the key's initial value; optimizer state: its fill).
with_evicted: the keys evicted to make room and their values before they left
(else both empty). admit_all: missing keys are inserted whatever their admission
count (an assignment). insert_ratio < 1: a new key is inserted with that
probability (a function of the key and the call: the low-frequency filter);
keys not inserted read row 0, zeros. Without insert: nothing changes and
missing keys give -1. values_given: the caller writes every key's values next
(an assignment, a load): a table without a host tier starts its new keys' values
at zero instead of drawing their initial values.
An error (a full table without eviction) changes nothing.
)doc");

REGISTER_OP("TfSokDynamicFindMany")
    .Input("indices: N * resource")
    .Input("keys: N * int64")
    .Output("slots: N * int64")
    .Attr("N: int >= 1")
    .Attr("insert_ratio: float = 1.0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      std::vector<::tensorflow::shape_inference::ShapeHandle> keys;
      TF_RETURN_IF_ERROR(KeyVectors(c, &keys));
      for (size_t i = 0; i < keys.size(); ++i) c->set_output(static_cast<int>(i), keys[i]);
      return absl::OkStatus();
    })
    .Doc(R"doc(
TfSokDynamicFind (insert, keys not inserted -> row 0) over several dynamic tables
in one op: on a GPU the calls read their missing-key counts back together, one
wait for all tables instead of one each. Each index appears once.
)doc");

REGISTER_OP("TfSokDynamicRead")
    .Input("indices: N * resource")
    .Input("keys: N * int64")
    .Output("values: N * float")
    .Attr("N: int >= 1")
    .Attr("dims: list(int)")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      std::vector<::tensorflow::shape_inference::ShapeHandle> keys;
      TF_RETURN_IF_ERROR(KeyVectors(c, &keys));
      std::vector<int64_t> dims;
      TF_RETURN_IF_ERROR(c->GetAttr("dims", &dims));
      if (dims.size() != keys.size()) return absl::InvalidArgumentError("TfSokDynamicRead: one dim per table");
      for (size_t i = 0; i < keys.size(); ++i)
        c->set_output(static_cast<int>(i), c->Matrix(c->Dim(keys[i], 0), dims[i]));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The values [n, dim] of keys in several dynamic tables (each index once), and
nothing changes: no key is inserted, no score touched, no row moved. A cached
key's row comes from the value array; a hybrid table's key that is not cached
is read from its host tier in place (over the host link, on a GPU); a key the
table does not hold reads its initial value, or zeros when the table admits keys
only after min_frequency > 1 sightings (as a served model does). dims: each
table's width. On a GPU: one wait for all tables' keys not cached.
)doc");

REGISTER_OP("TfSokRowSplitsValid")
    .Input("splits: N * int64")
    .Input("values: N * T")
    .Output("valid: bool")
    .Output("in_range: bool")
    .Output("offending: int64")
    .Attr("N: int >= 1")
    .Attr("T: type")
    .Attr("rows: list(int) = []")
    .SetShapeFn([](InferenceContext* c) {
      int n = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      for (int i = 0; i < 3; ++i) c->set_output(i, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Whether each feature's row_splits start at 0, never decrease and end at the
number of its values (valid); and, where rows (empty, or one entry per feature)
gives feature f a bound rows[f] >= 0, whether its values (int64) all lie in
[0, rows[f]) (in_range; true for the other features and for a feature without
values), with offending[f] the smallest of them if it is below 0, else the
largest (0 where in range). One op for many features; on a GPU one kernel per
check for up to 32 features, the answers left on the device.
)doc");

REGISTER_OP("TfSokDynamicTouchedSince")
    .Input("index: resource")
    .Input("since: int64")
    .Output("keys: int64")
    .Output("rows: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The keys the index holds that a find with insert (a training lookup, an
assignment) touched at or after `since` (nanoseconds since the epoch), and their
rows; since the index was made or last imported.
)doc");

REGISTER_OP("TfSokDynamicAttach")
    .Input("index: resource")
    .Input("array: resource")
    .Attr("fill: float")
    .Attr("values: bool = false")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc(R"doc(
Attaches a row array (a float32 variable [rows, ...]) to a dynamic table's index:
the table's values (`values`: new keys' rows get their initial value) or a state
array of an optimizer (new keys' rows get `fill`, and so does a row whose key was
evicted before another key took it). It is grown to the index's rows now.
)doc");

REGISTER_OP("TfSokDynamicSize")
    .Input("index: resource")
    .Output("size: int64")
    .Output("rows: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("The number of keys held, and the row count of the arrays.");

REGISTER_OP("TfSokDynamicExport")
    .Input("index: resource")
    .Output("keys: int64")
    .Output("slots: int64")
    .Output("scores: int64")
    .Output("generations: int64")
    .Output("candidate_keys: int64")
    .Output("candidate_counts: int64")
    .Output("counters: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < 6; ++i) c->set_output(i, c->Vector(c->UnknownDim()));
      c->set_output(6, c->Vector(3));
      return absl::OkStatus();
    })
    .Doc("The index's contents (keys by row), for checkpoints; counters: [clock, rows, next free row].");

REGISTER_OP("TfSokDynamicImport")
    .Input("index: resource")
    .Input("keys: int64")
    .Input("slots: int64")
    .Input("scores: int64")
    .Input("generations: int64")
    .Input("candidate_keys: int64")
    .Input("candidate_counts: int64")
    .Input("counters: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc("Replaces the index's contents with an export's (checked: an inconsistent one changes nothing).");

REGISTER_OP("TfSokDynamicStoreTouchedSince")
    .Input("index: resource")
    .Input("since: int64")
    .Output("keys: int64")
    .Output("rows: float")
    .Output("widths: int64")
    .SetIsStateful()
    .SetShapeFn(StoreRowsShape)
    .Doc(R"doc(
TfSokDynamicStoreExport's outputs for the keys of a hybrid table that a find with
insert touched at or after `since` (ns since the epoch), since the table was made
or restored: those cached (the cache's marks) and those written back to the host
store after such a touch (the store's marks).
)doc");

REGISTER_OP("TfSokDynamicStoreExport")
    .Input("index: resource")
    .Output("keys: int64")
    .Output("rows: float")
    .Output("widths: int64")
    .Output("scores: int64")
    .SetIsStateful()
    .SetShapeFn(StoreRowsShape)
    .Doc(R"doc(
A hybrid table's every key and its rows, after the cached rows are written back
to the host store (they stay cached). rows [n, sum(widths)]: each key's row of
every attached array side by side, in attach order (the values first). scores:
an LFU table's count of each key (the calls that used it, cached or not; 0 for
other tables), which TfSokDynamicStoreImport takes back.
)doc");

REGISTER_OP("TfSokDynamicCacheStats")
    .Input("index: resource")
    .Output("stats: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(15));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A hybrid table's counters since it was made, in this order: finds, key positions
looked up, positions whose key was not cached, keys taken into the cache, keys
of those the table had never held, keys written back to host memory, bytes read
from host memory, bytes written to it, keys its bound (max_capacity) dropped,
keys of those taken in that prefetches took in; then of read-only lookups
(TfSokDynamicRead): key positions read, those read from host memory, their bytes
read in place by the device, and their bytes gathered on the host and copied;
last, of the bytes read from host memory for keys taken in, those gathered on
the host and copied (a GPU's finds of many small records).
)doc");

REGISTER_OP("TfSokDynamicPrefetch")
    .Input("indices: N * resource")
    .Input("keys: N * int64")
    .Output("prefetched: int64")
    .Attr("N: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      std::vector<::tensorflow::shape_inference::ShapeHandle> keys;
      TF_RETURN_IF_ERROR(KeyVectors(c, &keys));
      c->set_output(0, c->Vector(static_cast<int64_t>(keys.size())));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Brings the rows of keys a later lookup will use into the caches of hybrid tables
(each index a hybrid table's, once): the keys each table's host tier holds are
taken in as if its last find had used them, evicting rows no find since the last
prefetch touched; keys new to a table are left to the find. No value changes. On
a GPU the work runs on a stream of its own, beside the step that is running.
prefetched: per table, the keys taken in.
)doc");

REGISTER_OP("TfSokHostLinkBandwidth")
    .Output("gbps: float64")
    .Attr("bytes: int >= 16")
    .Attr("repeats: int >= 1 = 3")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(4));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The link between pinned host memory and the GPU measured over `bytes`, the best
of `repeats` timings, in GB/s: a copy to the device, a copy to the host, a kernel
reading host memory in place, a kernel writing it in place. GPU only.
)doc");

REGISTER_OP("TfSokDynamicStoreImport")
    .Input("index: resource")
    .Input("keys: int64")
    .Input("rows: float")
    .Input("scores: int64")
    .Attr("clear_cache: bool = true")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc(R"doc(
Replaces a hybrid table's host store with keys and their rows (laid out as
TfSokDynamicStoreExport gives them) and, for an LFU table, their counts (scores
[n], as the export gives them; empty: every count 0). clear_cache: the cache
drops its keys first (else the caller restores the cache itself, as a
checkpoint does).
)doc");

}  // namespace tf_sok
