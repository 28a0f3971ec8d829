// Kernels of the input pipeline (host kernels: they run on the CPU device in tf.data's functions).
// The pinned copy allocates gpu_compatible memory from TensorFlow's page-locked GPU host allocator
// when a GPU is present, and passes through tensors that already lie in host memory registered
// with the GPU (TfSokRegisterHost: the readers' shared-memory slabs). The aligned slices cut
// batches out of a block, sharing its memory where a slice starts on an aligned address.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#if TF_SOK_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tf_sok {
namespace {

namespace tf = ::tensorflow;

// Host ranges registered with the GPU (page-locked in place): start -> end.
std::mutex registered_mu;
std::map<uintptr_t, uintptr_t>& Registered() {
  static auto* ranges = new std::map<uintptr_t, uintptr_t>();
  return *ranges;
}
std::string& RegisterError() {
  static auto* message = new std::string();
  return *message;
}

// bytes the pinned copy passed through (already page-locked) and copied, since the library loaded
std::atomic<uint64_t> passed_bytes{0}, copied_bytes{0};

bool InRegisteredRange(const void* data, size_t bytes) {
  const auto lo = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(registered_mu);
  auto& ranges = Registered();
  auto it = ranges.upper_bound(lo);
  if (it == ranges.begin()) return false;
  --it;
  return lo >= it->first && lo + bytes <= it->second;
}

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
      if (in.TotalBytes() > 0 && InRegisteredRange(in.data(), in.TotalBytes())) {
        ctx->set_output(i, in);   // page-locked already
        passed_bytes += in.TotalBytes();
        continue;
      }
      copied_bytes += in.TotalBytes();
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

class AlignedSlicesOp : public tf::OpKernel {
 public:
  explicit AlignedSlicesOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {}

  void Compute(tf::OpKernelContext* ctx) override {
    tf::OpInputList inputs;
    OP_REQUIRES_OK(ctx, ctx->input_list("inputs", &inputs));
    const tf::Tensor& begin = ctx->input(inputs.size());
    const tf::Tensor& end = ctx->input(inputs.size() + 1);
    const int n = inputs.size();
    OP_REQUIRES(ctx, begin.dims() == 1 && end.dims() == 1 && begin.NumElements() == n && end.NumElements() == n,
                absl::InvalidArgumentError(absl::StrCat("tf_sok aligned slices: begin and end must hold one bound "
                                                        "per input (", n, "), got shapes ", begin.shape().DebugString(),
                                                        " and ", end.shape().DebugString())));
    const auto b = begin.vec<int64_t>();
    const auto e = end.vec<int64_t>();
    for (int i = 0; i < n; ++i) {
      const tf::Tensor& in = inputs[i];
      OP_REQUIRES(ctx, in.dims() >= 1 && tf::DataTypeCanUseMemcpy(in.dtype()),
                  absl::InvalidArgumentError(absl::StrCat("tf_sok aligned slices: input ", i, " is a ",
                                                          tf::DataTypeString(in.dtype()), " of shape ",
                                                          in.shape().DebugString(),
                                                          "; rows of a number tensor of rank >= 1 expected")));
      const int64_t rows = in.dim_size(0);
      OP_REQUIRES(ctx, 0 <= b(i) && b(i) <= e(i) && e(i) <= rows,
                  absl::InvalidArgumentError(absl::StrCat("tf_sok aligned slices: rows [", b(i), ", ", e(i),
                                                          ") of input ", i, " are outside its ", rows, " rows")));
      tf::Tensor part = in.Slice(b(i), e(i));
      if (part.NumElements() == 0 ||
          reinterpret_cast<uintptr_t>(part.data()) % EIGEN_MAX_ALIGN_BYTES == 0) {
        ctx->set_output(i, part);   // shares the block's memory
        continue;
      }
      tf::Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, part.shape(), &out));
      std::memcpy(out->data(), part.data(), part.TotalBytes());
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSokAlignedSlices").Device(tf::DEVICE_CPU), AlignedSlicesOp);

}  // namespace
}  // namespace tf_sok

// Registers [data, data + bytes) with the GPU as page-locked memory (the pinned copy then passes
// tensors inside it through). Returns 1 when registered, 0 when there is no GPU to register with
// (or the library has no CUDA; nothing is recorded), -1 on a failure (TfSokRegisterHostError).
extern "C" {
__attribute__((visibility("default"))) int TfSokRegisterHost(void* data, unsigned long long bytes) {
  if (bytes == 0) return 0;
#if TF_SOK_WITH_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return 0;
  }
  const cudaError_t err = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    std::lock_guard<std::mutex> lock(tf_sok::registered_mu);
    tf_sok::RegisterError() = cudaGetErrorString(err);
    return -1;
  }
  const auto lo = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(tf_sok::registered_mu);
  tf_sok::Registered()[lo] = lo + bytes;
  return 1;
#else
  (void)data;
  return 0;
#endif
}

// Undoes TfSokRegisterHost for the range starting at `data` (no-op for one never registered).
__attribute__((visibility("default"))) void TfSokUnregisterHost(void* data) {
  const auto lo = reinterpret_cast<uintptr_t>(data);
  {
    std::lock_guard<std::mutex> lock(tf_sok::registered_mu);
    if (tf_sok::Registered().erase(lo) == 0) return;
  }
#if TF_SOK_WITH_CUDA
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
#endif
}

// The pinned copy's byte counts since the library loaded: which 0 passed through, 1 copied.
__attribute__((visibility("default"))) unsigned long long TfSokPinnedCopyBytes(int which) {
  return which == 0 ? tf_sok::passed_bytes.load() : tf_sok::copied_bytes.load();
}

__attribute__((visibility("default"))) const char* TfSokRegisterHostError() {
  return tf_sok::RegisterError().c_str();
}
}
