// Sparse optimizer apply op: registration and shape function only.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sok {

REGISTER_OP("TfSokSparseApply")
    .Input("vars: num_tables * resource")
    .Input("slots: num_slot_vars * resource")
    .Input("steps: num_step_vars * resource")
    .Input("learning_rate: float")
    .Input("indices: num_tables * Tid")
    .Input("grads: num_tables * float")
    .Attr("num_tables: int >= 1")
    .Attr("num_slot_vars: int >= 0")
    .Attr("num_step_vars: int >= 0")
    .Attr("Tid: {int32, int64}")
    .Attr("algorithm: {'sgd', 'momentum', 'adagrad', 'adam', 'ftrl', 'rmsprop'}")
    .Attr("indices_unique: bool = false")
    .Attr("checked: bool = false")
    .Attr("beta1: float = 0.9")
    .Attr("beta2: float = 0.999")
    .Attr("epsilon: float = 1e-7")
    .Attr("momentum: float = 0.0")
    .Attr("nesterov: bool = false")
    .Attr("rho: float = 0.9")
    .Attr("centered: bool = false")
    .Attr("l1: float = 0.0")
    .Attr("l2: float = 0.0")
    .Attr("l2_shrinkage: float = 0.0")
    .Attr("lr_power: float = -0.5")
    .Attr("beta: float = 0.0")
    .Attr("table_names: list(string) = []")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle unused;
      int num_tables;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &num_tables));
      const int n = c->num_inputs();
      const int lr = n - 2 * num_tables - 1;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(lr), 0, &unused));
      for (int t = 0; t < num_tables; ++t) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(lr + 1 + t), 1, &unused));               // indices
        TF_RETURN_IF_ERROR(c->WithRank(c->input(lr + 1 + num_tables + t), 2, &unused));  // grads
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Applies one row-sparse gradient per table to the tables and their per-row
optimizer state in place, all tables in one call. Slots are table-major
(num_slot_vars = num_tables x slots per table; steps likewise). Duplicate
indices of a table are summed first; rows not named stay unchanged. An index
outside [0, rows) of any table fails the call before anything is written.
indices_unique: every table's indices are as the lookup gradient emits them:
strictly ascending, then repeats of the last one whose gradient rows are zero
(padding to a size known before the step runs), which are skipped; no grouping
is done. A decreasing index fails the call before anything is written.
checked: the indices are a tf_sok lookup gradient's own rows (in range and
strictly ascending by construction); a GPU does not wait on its stream to learn
whether the check found a bad one. The check still runs: a bad index would make
the call write nothing, never a wrong row.
)doc");

}  // namespace tf_sok
