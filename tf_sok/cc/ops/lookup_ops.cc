// Fused multi-table sparse lookup and its gradient: op registrations and
// shape functions only (kernels live in cc/kernels/).
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sok {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

constexpr int kStatusWords = 4;  // impl::kErrorRecordWords

// Attributes every pooling op shares: which table each feature reads, how it
// pools, the id type and the tables' widths.
#define TF_SOK_POOLING_ATTRS                                \
  .Attr("num_tables: int >= 1")                             \
      .Attr("num_features: int >= 1")                       \
      .Attr("Tid: {int32, int64}")                          \
      .Attr("feature_table: list(int)")                     \
      .Attr("combiners: list({'sum', 'mean', 'sqrtn'})")    \
      .Attr("weighted: list(bool)")                         \
      .Attr("dims: list(int)")

// Output f is [rows of row_splits f - 1, dims[feature_table[f]]].
absl::Status PooledOutputShapes(InferenceContext* c) {
  int num_features, num_tables;
  std::vector<int> feature_table, dims;
  TF_RETURN_IF_ERROR(c->GetAttr("num_features", &num_features));
  TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &num_tables));
  TF_RETURN_IF_ERROR(c->GetAttr("feature_table", &feature_table));
  TF_RETURN_IF_ERROR(c->GetAttr("dims", &dims));
  if (static_cast<int>(feature_table.size()) != num_features ||
      static_cast<int>(dims.size()) != num_tables) {
    return absl::InvalidArgumentError(
        "tf_sok lookup: feature_table needs one entry per feature and dims one per table");
  }
  for (int f = 0; f < num_features; ++f) {
    ShapeHandle splits;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(num_tables + num_features + f), 1, &splits));
    auto n = c->Dim(splits, 0);
    auto batch = c->ValueKnown(n) ? c->MakeDim(c->Value(n) - 1) : c->UnknownDim();
    int t = feature_table[f];
    if (t < 0 || t >= num_tables) {
      return absl::InvalidArgumentError("tf_sok lookup: feature_table entry out of range");
    }
    c->set_output(f, c->Matrix(batch, dims[t]));
  }
  c->set_output(num_features, c->Vector(kStatusWords));
  return absl::OkStatus();
}

// Everything but the tables' input that the two forward pooling ops share.
// OUT: the outputs' type.
#define TF_SOK_POOLED_FORWARD(OUT)                        \
  .Input("ids: num_features * Tid")                       \
      .Input("row_splits: num_features * int64")          \
      .Input("weights: num_features * float")             \
      .Output("outputs: num_features * " OUT)             \
      .Output("status: int64")                            \
          TF_SOK_POOLING_ATTRS                            \
      .Attr("feature_names: list(string)")                \
      .Attr("table_names: list(string)")                  \
      .Attr("checked: bool = false")                      \
      .SetShapeFn(PooledOutputShapes)

REGISTER_OP("TfSokFusedLookup")
    .Input("tables: num_tables * resource")
    TF_SOK_POOLED_FORWARD("T")
    .Attr("T: {float, half, bfloat16} = DT_FLOAT")
    .Attr("distinct_ids: bool = false")
    .Attr("one_id_per_row: bool = false")
    .Doc(R"doc(
Looks up every feature's ragged ids in its table and combines each row
(sum, mean or sqrtn, optionally weighted) into one [batch, dim] output per
feature. Unweighted features pass an empty weights tensor. T: the outputs'
type (float16/bfloat16 for Keras mixed policies): rows are summed in float32
and rounded once (to nearest even); tables stay float32.

status: the first bad id or row split the kernels met, as TfSokLookupCheck reads
  it. The CPU kernel fails at once instead (status is then all zeros); a GPU
  never waits on its stream for it: bad ids contribute zero, and the check op,
  run after the lookup, turns the record into the error.
checked: the ids were produced (and checked) by tf_sok itself; status is not
  written (all zeros on the CPU, undefined on a GPU) and needs no check.
distinct_ids: feature t reads table t, one id per row, summed, unweighted, and
  its ids are strictly ascending; the gradient is then the output gradients as
  the rows of those ids (no sort).
one_id_per_row: as distinct_ids, but the ids may repeat and come in any order:
  the gradient's rows repeat alike (the update sums them).
)doc");

REGISTER_OP("TfSokFusedCombine")
    .Input("params: num_tables * float")
    TF_SOK_POOLED_FORWARD("float")
    .Doc(R"doc(
TfSokFusedLookup over plain float tensors instead of variables: pools rows of
`params` (e.g. vectors received from other ranks) per feature and row.
)doc");

REGISTER_OP("TfSokFusedCombineGrad")
    .Input("params: num_tables * float")
    .Input("ids: num_features * Tid")
    .Input("row_splits: num_features * int64")
    .Input("weights: num_features * float")
    .Input("output_grads: num_features * float")
    .Output("grads: num_tables * float")
    TF_SOK_POOLING_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      int num_tables;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &num_tables));
      for (int t = 0; t < num_tables; ++t) c->set_output(t, c->input(t));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Dense gradient of TfSokFusedCombine with respect to its params: grads[t] has
the shape of params[t] (only their shapes are read) and holds, at each id's
row, the sum of its coefficients times its rows' output gradients. On a GPU it
does not wait on the stream (nothing is sized by the number of distinct ids).
)doc");

REGISTER_OP("TfSokFusedLookupGrad")
    .Input("ids: num_features * Tid")
    .Input("row_splits: num_features * int64")
    .Input("weights: num_features * float")
    .Input("output_grads: num_features * T")
    .Output("indices: num_tables * int64")
    .Output("values: num_tables * float")
    TF_SOK_POOLING_ATTRS
    .Attr("T: {float, half, bfloat16} = DT_FLOAT")
    .Attr("rows: list(int) = []")
    .SetShapeFn([](InferenceContext* c) {
      int num_tables;
      std::vector<int> dims;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &num_tables));
      TF_RETURN_IF_ERROR(c->GetAttr("dims", &dims));
      for (int t = 0; t < num_tables; ++t) {
        c->set_output(t, c->Vector(c->UnknownDim()));
        c->set_output(num_tables + t, c->Matrix(c->UnknownDim(), dims[t]));
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Row-sparse gradient of TfSokFusedLookup: for each table, the distinct ids read
by its features (strictly ascending) and the summed gradient of each, padded to
a size known before the step runs (the table's id count, at most its rows) by
repeats of the last id with zero rows; summing repeated rows, as every user of
an IndexedSlices does, gives the exact gradient. A GPU never waits on its
stream for it. rows: the tables' row counts where known (empty: unknown, ids
then only need to lie in [0, 2^40)); smaller tables make a shorter sort key.
An id outside [0, rows[t]) is an error on the CPU; a GPU drops it (the lookup's
check, which lookup_sparse runs before the gradient, has failed the step).
T: the output gradients' type (the forward's outputs'); values are float32.
)doc");

REGISTER_OP("TfSokLookupCheck")
    .Input("status: int64")
    .Attr("feature_names: list(string)")
    .Attr("table_names: list(string)")
    .Attr("feature_table: list(int)")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle status;
      return c->WithRank(c->input(0), 1, &status);
    })
    .Doc(R"doc(
Fails with the lookup's error when `status` (a TfSokFusedLookup or
TfSokFusedCombine status output) records one, naming the feature, the table
and the offending value. On a GPU it completes once the stream has reached the
lookup, without blocking the thread that launched it, so the ops after a lookup
are queued while it runs. Stateful: a tf.function runs it before it returns.
)doc");

}  // namespace tf_sok
