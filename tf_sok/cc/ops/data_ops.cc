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

}  // namespace tf_sok
