// CUDA helpers shared by the tf_sok CUDA functors: error flag, scratch,
// grouping of positions by key (radix sort + run-length encode + scan).
#ifndef TF_SOK_CC_IMPL_GPU_UTIL_CUH_
#define TF_SOK_CC_IMPL_GPU_UTIL_CUH_

#include <cuda_runtime.h>

#include <cub/cub.cuh>

#include "tf_sok/cc/impl/common.h"

namespace tf_sok {
namespace impl {
namespace gpu {

inline cudaStream_t StreamOf(const GpuDevice& d) { return static_cast<cudaStream_t>(d.stream); }

// Device-side error record; the first writer wins.
using DeviceError = ErrorRecord;

__device__ __forceinline__ void Raise(DeviceError* e, ErrorKind kind, int group, long long item,
                                      long long value, long long limit = 0) {
  if (atomicCAS(&e->kind, 0, static_cast<int>(kind)) == 0) {
    e->group = group;
    e->item = item;
    e->value = value;
    e->limit = limit;
  }
}

template <typename T>
T* Alloc(const GpuDevice& d, size_t count) {
  return static_cast<T*>(d.scratch->Allocate(sizeof(T) * (count > 0 ? count : 1)));
}

inline Error OutOfMemory() {
  Error e;
  e.kind = ErrorKind::kOutOfMemory;
  return e;
}

inline Error CudaFailure(cudaError_t c) {
  Error e;
  e.kind = ErrorKind::kCudaError;
  e.value = static_cast<int64_t>(c);
  return e;
}

// Waits for the stream and returns what the kernels recorded.
inline Error Collect(const GpuDevice& d, const DeviceError* dev) {
  DeviceError host{};
  cudaMemcpyAsync(&host, dev, sizeof(host), cudaMemcpyDeviceToHost, StreamOf(d));
  cudaError_t c = cudaStreamSynchronize(StreamOf(d));
  if (c != cudaSuccess) return CudaFailure(c);
  return FromRecord(host);
}

inline DeviceError* NewError(const GpuDevice& d) {
  auto* e = Alloc<DeviceError>(d, 1);
  if (e) cudaMemsetAsync(e, 0, sizeof(DeviceError), StreamOf(d));
  return e;
}

// Positions 0..n-1 grouped by keys[pos]: unique keys (ascending), group
// offsets (offsets[u]..offsets[u+1]) into order, and the group count on device.
struct Groups {
  long long* unique_keys = nullptr;
  int* offsets = nullptr;  // [n + 1]
  int* order = nullptr;    // [n]
  int* num_unique = nullptr;
};

__global__ void IotaKernel(int* out, int n);
__global__ void SetFirstZero(int* offsets);

inline Error GroupByKey(const GpuDevice& d, const long long* keys, int n, int key_bits,
                        Groups* g) {
  cudaStream_t s = StreamOf(d);
  auto* pos = Alloc<int>(d, n);
  auto* sorted_keys = Alloc<long long>(d, n);
  auto* counts = Alloc<int>(d, n);
  g->unique_keys = Alloc<long long>(d, n);
  g->offsets = Alloc<int>(d, n + 1);
  g->order = Alloc<int>(d, n);
  g->num_unique = Alloc<int>(d, 1);
  if (!pos || !sorted_keys || !counts || !g->unique_keys || !g->offsets || !g->order ||
      !g->num_unique) {
    return OutOfMemory();
  }
  IotaKernel<<<(n + 255) / 256, 256, 0, s>>>(pos, n);
  size_t b1 = 0, b2 = 0, b3 = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, b1, keys, sorted_keys, pos, g->order, n, 0, key_bits, s);
  cub::DeviceRunLengthEncode::Encode(nullptr, b2, sorted_keys, g->unique_keys, counts,
                                     g->num_unique, n, s);
  cub::DeviceScan::InclusiveSum(nullptr, b3, counts, g->offsets + 1, n, s);
  size_t bytes = b1 > b2 ? (b1 > b3 ? b1 : b3) : (b2 > b3 ? b2 : b3);
  void* temp = d.scratch->Allocate(bytes);
  if (!temp) return OutOfMemory();
  cub::DeviceRadixSort::SortPairs(temp, b1, keys, sorted_keys, pos, g->order, n, 0, key_bits, s);
  cub::DeviceRunLengthEncode::Encode(temp, b2, sorted_keys, g->unique_keys, counts,
                                     g->num_unique, n, s);
  cub::DeviceScan::InclusiveSum(temp, b3, counts, g->offsets + 1, n, s);
  SetFirstZero<<<1, 1, 0, s>>>(g->offsets);
  cudaError_t c = cudaGetLastError();
  return c == cudaSuccess ? Error() : CudaFailure(c);
}

// Bits needed to hold values in [0, max_value] (at least 1): the radix sort's key width.
inline int BitsFor(long long max_value) {
  int bits = 1;
  while (bits < 63 && (max_value >> bits) != 0) ++bits;
  return bits;
}

// Index of the segment holding item r, given starts[0..n] ascending (starts[n] = total).
template <typename T>
__device__ __forceinline__ int SegmentOf(const T* starts, int n, long long r) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Threads per row: a power of two covering dim/vec, at most a warp.
inline int GroupWidth(int max_dim, int vec) {
  int need = (max_dim + vec - 1) / vec, g = 1;
  while (g < need && g < 32) g <<= 1;
  return g;
}

}  // namespace gpu
}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_GPU_UTIL_CUH_
