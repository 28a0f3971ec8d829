// CUDA functor for the sparse optimizers. Indices are checked and grouped
// (radix sort + run-length encode) first; the update kernel then sums each
// group's gradient rows and updates its row once. If any index was out of
// range the update kernel writes nothing.
#include "tf_sok/cc/impl/gpu_util.cuh"
#include "tf_sok/cc/impl/optimizer.h"

namespace tf_sok {
namespace impl {
namespace gpu {
namespace {

constexpr int kThreads = 256;

template <typename Id>
__global__ void CheckAndWidenKernel(const Id* indices, long long n, long long rows,
                                    long long* keys, DeviceError* err) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const long long r = static_cast<long long>(indices[i]);
  if (r < 0 || r >= rows) Raise(err, ErrorKind::kIdOutOfRange, -1, i, r);
  keys[i] = r;
}

template <Algorithm A>
__global__ void UpdateKernel(Hyper h, SparseUpdate u, Groups g, const float* grads, int group,
                             const DeviceError* err) {
  const long long k = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
  const int lane = threadIdx.x % group;
  if (err->kind != 0 || k >= *g.num_unique) return;
  const long long row = g.unique_keys[k];
  const int dim = u.dim;
  const int begin = g.offsets[k], end = g.offsets[k + 1];
  const RowScalars rs = RowConstants(h, u.step ? u.step[row] : 0.0f);
  float* slot[3];
  for (int s = 0; s < 3; ++s) slot[s] = u.slots[s] ? u.slots[s] + row * dim : nullptr;
  float* w = u.var + row * dim;
  for (int j = lane; j < dim; j += group) {
    float gsum = 0.0f;
    for (int p = begin; p < end; ++p) gsum += grads[static_cast<long long>(g.order[p]) * dim + j];
    float unused = 0.0f;
    float& s0 = slot[0] ? slot[0][j] : unused;
    float& s1 = slot[1] ? slot[1][j] : unused;
    float& s2 = slot[2] ? slot[2][j] : unused;
    w[j] = UpdateElement<A>(h, rs, w[j], gsum, s0, s1, s2);
  }
}

__global__ void BumpStepKernel(float* step, Groups g, const DeviceError* err) {
  const long long k = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (err->kind != 0 || k >= *g.num_unique) return;
  step[g.unique_keys[k]] += 1.0f;
}

int KeyBits(long long rows) {
  int bits = 1;
  while (bits < 63 && (1LL << bits) < rows) ++bits;
  return bits;
}

}  // namespace
}  // namespace gpu

template <typename Id>
struct SparseApply<GpuDevice, Id> {
  Error operator()(const GpuDevice& d, const Hyper& h, const SparseUpdate& u, const Id* indices,
                   const float* grads, int64_t n) {
    using namespace gpu;
    cudaStream_t s = StreamOf(d);
    DeviceError* err = NewError(d);
    auto* keys = Alloc<long long>(d, n);
    if (!err || !keys) return OutOfMemory();
    CheckAndWidenKernel<Id><<<(n + kThreads - 1) / kThreads, kThreads, 0, s>>>(indices, n, u.rows,
                                                                               keys, err);
    Groups g;
    Error e = GroupByKey(d, keys, static_cast<int>(n), KeyBits(u.rows), &g);
    if (!e.ok()) return e;
    const int group = GroupWidth(u.dim, 1);
    DispatchAlgorithm(h.algorithm, [&](auto algo) {
      UpdateKernel<decltype(algo)::value><<<(n * group + kThreads - 1) / kThreads, kThreads, 0, s>>>(
          h, u, g, grads, group, err);
      return 0;
    });
    if (u.step) BumpStepKernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, s>>>(u.step, g, err);
    cudaError_t c = cudaGetLastError();
    if (c != cudaSuccess) return CudaFailure(c);
    return Collect(d, err);
  }
};

template <>
void DeviceCopy<GpuDevice>(const GpuDevice& d, void* dst, const void* src, size_t bytes) {
  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, gpu::StreamOf(d));
}

template struct SparseApply<GpuDevice, int32_t>;
template struct SparseApply<GpuDevice, int64_t>;

}  // namespace impl
}  // namespace tf_sok
