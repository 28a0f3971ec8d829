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
