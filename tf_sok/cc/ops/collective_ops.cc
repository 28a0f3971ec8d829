// NCCL collectives of the multi-rank lookup: registration and shape functions
// only. Kernels exist in CUDA builds (NCCL moves GPU memory only).
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sok {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Output 0: input 0's shape with an unknown number of rows (what other ranks send).
absl::Status RowsUnknown(InferenceContext* c) {
  ShapeHandle in, rest, out;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &in));
  TF_RETURN_IF_ERROR(c->Subshape(in, 1, &rest));
  TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

REGISTER_OP("TfSokNcclUniqueId")
    .Output("id: uint8")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(128));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A fresh NCCL unique id (128 bytes) that names a communicator to be created:
one rank makes it and sends it to the others.
)doc");

REGISTER_OP("TfSokNcclInit")
    .Input("id: uint8")
    .Output("version: string")
    .Attr("key: int")
    .Attr("rank: int >= 0")
    .Attr("size: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle id;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &id));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Joins NCCL communicator `key` as `rank` of `size` on the op's GPU; blocks until
every rank has joined. Returns the NCCL library's version.
)doc");

REGISTER_OP("TfSokNcclExchangeSplits")
    .Input("send_splits: int32")
    .Output("recv_splits: int32")
    .Attr("key: int")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle s;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &s));
      c->set_output(0, s);
      return absl::OkStatus();
    })
    .Doc(R"doc(
send_splits[p]: how many rows this rank will send rank p. recv_splits[p]: how
many rows rank p will send this rank. Both in host memory; the op waits for the
GPU once to read the counts.
)doc");

REGISTER_OP("TfSokNcclAllToAll")
    .Input("input: T")
    .Input("send_splits: int32")
    .Input("recv_splits: int32")
    .Output("output: T")
    .Attr("T: type")
    .Attr("key: int")
    .SetIsStateful()
    .SetShapeFn(RowsUnknown)
    .Doc(R"doc(
Sends rows send_splits[p] (consecutive, in rank order) of `input` to rank p and
receives recv_splits[p] rows from rank p: output holds them in rank order.
recv_splits must be what each rank sends here (TfSokNcclExchangeSplits gives
it); both splits in host memory. Asynchronous on the GPU stream.
)doc");

REGISTER_OP("TfSokNcclRouteKeys")
    .Input("ids: int64")
    .Input("feature_of: int64")
    .Input("features: int64")
    .Output("send_keys: int64")
    .Output("send_splits: int32")
    .Output("position: int64")
    .Output("recv_keys: int64")
    .Output("recv_splits: int32")
    .Attr("key: int")
    .Attr("signature: int")
    .Attr("step: int")
    .Attr("table_owner: list(int)")
    .Attr("feature_names: list(string)")
    .Attr("table_names: list(string)")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &unused));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, ids);
      c->set_output(3, c->Vector(c->UnknownDim()));
      c->set_output(4, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The multi-rank lookup's first exchange with one wait on the GPU stream. ids:
every feature's ids, concatenated; feature_of: the feature of each; features
[F, 2]: the table and the row count of each feature (table_names names each
feature's table). Every rank checks its ids, routes the distinct keys
(table << 40 | row) to the ranks owning their rows (table_owner as in
TfSokRoute) and all-gathers its counts per owner with its verdict; if the ranks'
`signature`s differ or any rank has an id outside its table, every rank fails
alike, naming the lookup step, the feature, the id, the rank and the table,
before any key moves. Else the keys move by one all-to-all.
send_keys, send_splits (host), position: as TfSokRoute's outputs. recv_keys,
recv_splits (host): what each rank sends here, in rank order.
)doc");

REGISTER_OP("TfSokNcclAllGather")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: type")
    .Attr("key: int")
    .SetIsStateful()
    .SetShapeFn(RowsUnknown)
    .Doc(R"doc(
Every rank's `input` (the same shape on every rank), concatenated along the
first axis in rank order.
)doc");

}  // namespace tf_sok
