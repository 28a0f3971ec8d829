// Sparse optimizer apply op: registration and shape function only.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sok {

REGISTER_OP("TfSokSparseApply")
    .Input("var: resource")
    .Input("slots: num_slots * resource")
    .Input("steps: num_steps * resource")
    .Input("learning_rate: float")
    .Input("indices: Tid")
    .Input("grads: float")
    .Attr("num_slots: int >= 0")
    .Attr("num_steps: int >= 0")
    .Attr("Tid: {int32, int64}")
    .Attr("algorithm: {'sgd', 'momentum', 'adagrad', 'adam', 'ftrl', 'rmsprop'}")
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
    .Attr("table_name: string = ''")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle unused;
      const int n = c->num_inputs();
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n - 3), 0, &unused));  // learning_rate
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n - 2), 1, &unused));  // indices
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n - 1), 2, &unused));  // grads
      return absl::OkStatus();
    })
    .Doc(R"doc(
Applies a row-sparse gradient to `var` and its per-row optimizer state in
place. Duplicate indices are summed first; rows not named stay unchanged.
An index outside [0, rows) fails before anything is written.
)doc");

}  // namespace tf_sok
