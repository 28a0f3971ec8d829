// Ops of the input pipeline: registration and shape functions only.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sok {

using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfSokPinnedCopy")
    .Input("inputs: T")
    .Output("outputs: T")
    .Attr("T: list(type) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Copies of host tensors (numbers and bools) in memory a GPU copies from directly
(page-locked: TensorFlow's GPU host allocator where a GPU is present, plain host
memory otherwise). A copy of such memory to the device is one asynchronous DMA;
from pageable memory the CUDA driver stages it through its own buffers, holding
the copying host thread meanwhile.
)doc");

REGISTER_OP("TfSokAlignedSlices")
    .Input("inputs: T")
    .Input("begin: int64")
    .Input("end: int64")
    .Output("outputs: T")
    .Attr("T: list(type) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() - 2;
      for (int i = 0; i < n; ++i) {
        ::tensorflow::shape_inference::ShapeHandle s;
        TF_RETURN_IF_ERROR(c->ReplaceDim(c->input(i), 0, c->UnknownDim(), &s));
        c->set_output(i, s);
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Rows [begin[i], end[i]) of each host tensor inputs[i] (its first dimension). A slice
whose first element lies on an aligned address shares the input's memory (no copy;
TensorFlow's own slicing shares only slices whose both ends are aligned); others are
copied. Readers lay each batch of a block out at an aligned address, so that cutting a
batch from the block copies nothing.
)doc");

}  // namespace tf_sok
