// Routing op of the multi-rank lookup: registration and shape function only.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sok {

REGISTER_OP("TfSokRoute")
    .Input("keys: int64")
    .Output("unique_keys: int64")
    .Output("bucket_splits: int32")
    .Output("position: int64")
    .Output("unit_splits: int64")
    .Attr("num_buckets: int >= 1")
    .Attr("table_owner: list(int)")
    .Attr("by_table: bool = false")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle keys;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &keys));
      int num_buckets = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_buckets", &num_buckets));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(num_buckets));
      c->set_output(2, keys);
      c->set_output(3, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Groups keys ((table << 40) | row) for the all-to-all of the multi-rank lookup.

unique_keys: the distinct keys, bucket after bucket, ascending inside a bucket.
  by_table=false: bucket = the rank owning the row (table_owner[table] = -1:
  row-wise, rank row % num_buckets, and the key's row becomes row / num_buckets;
  table_owner[table] = k: rank k, row unchanged). by_table=true: bucket = table,
  key unchanged.
bucket_splits: how many distinct keys each bucket got; in host memory on every
  device, so the all-to-all that follows reads its sizes without a device round trip.
position: for every input key, the index of its key in unique_keys.
unit_splits: bucket after bucket, 0, 1, ..., the bucket's key count: split by
  bucket_splits + 1, the row splits of a lookup of each bucket's keys one per row.
)doc");

}  // namespace tf_sok
