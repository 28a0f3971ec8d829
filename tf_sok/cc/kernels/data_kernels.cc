// Kernel of the input pipeline's pinned copy (a host kernel: it runs on the CPU device in
// tf.data's functions, which allocates gpu_compatible memory from TensorFlow's page-locked
// GPU host allocator when a GPU is present).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tf_sok {
namespace {

namespace tf = ::tensorflow;

// bytes copied per shard of one tensor: large tensors are copied by several threads
constexpr int64_t kShardBytes = int64_t{4} << 20;

class PinnedCopyOp : public tf::OpKernel {
 public:
  explicit PinnedCopyOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {}

  void Compute(tf::OpKernelContext* ctx) override {
    tf::AllocatorAttributes pinned;
    pinned.set_on_host(true);
    pinned.set_gpu_compatible(true);
    const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      const tf::Tensor& in = ctx->input(i);
      OP_REQUIRES(ctx, tf::DataTypeCanUseMemcpy(in.dtype()),
                  absl::InvalidArgumentError(absl::StrCat(
                      "tf_sok pinned copy: input ", i, " is ", tf::DataTypeString(in.dtype()),
                      "; only numbers and bools can be copied to page-locked memory")));
      tf::Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, in.shape(), &out, pinned));
      const int64_t bytes = static_cast<int64_t>(in.TotalBytes());
      if (bytes == 0) continue;
      const char* src = static_cast<const char*>(in.data());
      char* dst = static_cast<char*>(out->data());
      const int64_t shards = (bytes + kShardBytes - 1) / kShardBytes;
      tf::Shard(threads->num_threads, threads->workers, shards, /*cost_per_unit=*/kShardBytes,
                [&](int64_t begin, int64_t end) {
                  const int64_t lo = begin * kShardBytes, hi = std::min(bytes, end * kShardBytes);
                  std::memcpy(dst + lo, src + lo, hi - lo);
                });
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSokPinnedCopy").Device(tf::DEVICE_CPU), PinnedCopyOp);

}  // namespace
}  // namespace tf_sok
