// NCCL collectives of the multi-rank lookup: registration and shape functions
// only. Kernels exist in CUDA builds (NCCL moves GPU memory only).
#include <vector>

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
    .Input("ids: num_features * int64")
    .Output("table_rows: int64")
    .Output("table_counts: int32")
    .Output("unit_splits: int64")
    .Output("group_gather: int64")
    .Output("group_totals: int32")
    .Output("slot: int64")
    .Output("group_send: num_groups * int32")
    .Output("group_recv: num_groups * int32")
    .Output("group_scatter: int64")
    .Attr("num_features: int >= 1")
    .Attr("num_groups: int >= 1")
    .Attr("key: int")
    .Attr("signature: int")
    .Attr("step: int")
    .Attr("feature_table: list(int)")
    .Attr("feature_rows: list(int)")
    .Attr("table_owner: list(int)")
    .Attr("table_group: list(int)")
    .Attr("feature_names: list(string)")
    .Attr("table_names: list(string)")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      int F = 0, G = 0;
      std::vector<int> owner;
      TF_RETURN_IF_ERROR(c->GetAttr("num_features", &F));
      TF_RETURN_IF_ERROR(c->GetAttr("num_groups", &G));
      TF_RETURN_IF_ERROR(c->GetAttr("table_owner", &owner));
      for (int f = 0; f < F; ++f) TF_RETURN_IF_ERROR(c->WithRank(c->input(f), 1, &unused));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(static_cast<int64_t>(owner.size())));
      c->set_output(2, c->Vector(c->UnknownDim()));
      c->set_output(3, c->Vector(c->UnknownDim()));
      c->set_output(4, c->Vector(G));
      c->set_output(5, c->Vector(c->UnknownDim()));
      for (int o = 6; o < 7 + 2 * G; ++o) c->set_output(o, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The multi-rank lookup's exchange plan, with one wait on the GPU stream. ids:
each feature's ids; feature f reads table feature_table[f] of feature_rows[f]
rows (named table_names[f]); table t is owned as table_owner[t] says (-1:
row-wise, row r on rank r % ranks as row r / ranks) and its vectors have width
group table_group[t]. Every rank checks its ids, routes the distinct keys
(table << 40 | row) to their owners and all-gathers its counts per owner and
table with its verdict; if the ranks' `signature`s differ or any rank has an id
outside its table, every rank fails alike, naming the lookup step, the
feature, the id, the rank and the table, before any key moves. Else the keys
move by one all-to-all and the op lays out, on this rank as an owner:
table_rows (local rows of the keys received, table by table; sizes
table_counts, host), unit_splits (table by table 0, 1, ..., its count: one row
per key), group_gather (group after group, sizes group_totals (host): the
vectors to return, in the all-to-all's order, as rows of the group's tables'
lookups concatenated in table order), group_send[g] (host: how many of them go
to each rank); and as a sender: group_recv[g] (host: how many vectors of group
g each rank returns here) and slot (for each id, its vector's row among those
of its group). group_scatter: group_gather's inverse within each group (for each
row of the group's lookups, its place among the vectors returned).
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
