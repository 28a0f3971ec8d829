// The collective watchdog's ops: registration and shape functions only.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sok {

REGISTER_OP("TfSokWatchOpen")
    .Output("token: int64")
    .Attr("what: string")
    .Attr("timeout_s: float")
    .Attr("eager: bool = false")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(2));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Opens a watch on the collective that runs after this op (`what` describes it):
unless TfSokWatchClose closes it within `timeout_s` seconds (0: no watch), the process ends
(exit code 124) with a message naming it. In a graph the watch also closes when
the step ends or fails (its cancellation); eagerly (`eager`) the caller closes it.
token: the watch and the step's cancellation token, for TfSokWatchClose.
)doc");

REGISTER_OP("TfSokWatchClose")
    .Input("token: int64")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: list(type) >= 0")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 1; i < c->num_inputs(); ++i) c->set_output(i - 1, c->input(i));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Closes the watch TfSokWatchOpen opened once the collective's outputs `x` are
ready, and passes them on unchanged (no copy, any device). Being stateful, it also
keeps shape inference from evaluating the collective while a graph is traced
(which it would do when the collective's inputs are constants).
)doc");

}  // namespace tf_sok
