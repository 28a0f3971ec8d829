// Route on the GPU: cub radix sort + run-length grouping (gpu_util.cuh), one
// host wait for the distinct count, then a stable radix sort of the distinct
// keys by bucket. Same function as route_cpu.cc.
#include <vector>

#include "tf_sok/cc/impl/gpu_util.cuh"
#include "tf_sok/cc/impl/route.h"

namespace tf_sok {
namespace impl {
namespace {

using gpu::DeviceError;
using gpu::StreamOf;

constexpr int kThreads = 256;

inline int Blocks(long long n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

struct State {
  gpu::Groups groups;
};

__global__ void CheckKeys(const long long* keys, int n, int num_tables, DeviceError* err) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && (keys[i] < 0 || (keys[i] >> kTableShift) >= num_tables))
    gpu::Raise(err, ErrorKind::kIdOutOfRange, -1, i, keys[i]);
}

__global__ void BucketKernel(const long long* unique_keys, int U, const int* owner, int B, bool by_table,
                             int* bucket, int* iota, long long* out, int* counts) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= U) return;
  const long long key = unique_keys[u];
  const int o = by_table ? 0 : owner[key >> kTableShift];
  BucketOf(key, B, by_table, o, &bucket[u], &out[u]);
  iota[u] = u;
  atomicAdd(&counts[bucket[u]], 1);
}

__global__ void PlaceKernel(const int* by_bucket, const long long* out, int U, long long* unique_out,
                            int* place) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= U) return;
  const int u = by_bucket[i];
  unique_out[i] = out[u];
  place[u] = i;
}

// Sorted position j belongs to the group u with offsets[u] <= j < offsets[u + 1].
__global__ void PositionKernel(const int* offsets, const int* order, const int* place, int U, int n,
                               long long* position) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  int lo = 0, hi = U - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= j) lo = mid; else hi = mid - 1;
  }
  position[order[j]] = place[lo];
}

}  // namespace

template <>
Error Route<GpuDevice>::Prepare(const GpuDevice& d, const int64_t* keys, int64_t n, const RouteSpec& spec,
                                RoutePlan* plan) {
  plan->n = n;
  plan->num_unique = 0;
  if (n == 0) return Error();
  auto* err = gpu::NewError(d);
  if (!err) return gpu::OutOfMemory();
  const auto* k = reinterpret_cast<const long long*>(keys);
  CheckKeys<<<Blocks(n), kThreads, 0, StreamOf(d)>>>(k, static_cast<int>(n), spec.num_tables, err);
  auto state = std::make_shared<State>();
  Error e = gpu::GroupByKey(d, k, static_cast<int>(n), kTableShift + gpu::BitsFor(spec.num_tables),
                            &state->groups);
  if (!e.ok()) return e;
  int num_unique = 0;
  cudaMemcpyAsync(&num_unique, state->groups.num_unique, sizeof(int), cudaMemcpyDeviceToHost, StreamOf(d));
  e = gpu::Collect(d, err);  // waits for the stream: the one host wait of the op
  if (!e.ok()) return e;
  plan->num_unique = num_unique;
  plan->state = state;
  return Error();
}

template <>
Error Route<GpuDevice>::Finish(const GpuDevice& d, const RoutePlan& plan, const RouteSpec& spec,
                               int64_t* unique_keys, int32_t* splits, int64_t* position) {
  cudaStream_t s = StreamOf(d);
  const int B = spec.num_buckets;
  cudaMemsetAsync(splits, 0, sizeof(int32_t) * B, s);
  const int U = static_cast<int>(plan.num_unique);
  if (U == 0) return Error();
  const gpu::Groups& g = static_cast<const State*>(plan.state.get())->groups;
  auto* owner = gpu::Alloc<int>(d, spec.num_tables);
  auto* bucket = gpu::Alloc<int>(d, U);
  auto* sorted_bucket = gpu::Alloc<int>(d, U);
  auto* iota = gpu::Alloc<int>(d, U);
  auto* by_bucket = gpu::Alloc<int>(d, U);
  auto* out = gpu::Alloc<long long>(d, U);
  auto* place = gpu::Alloc<int>(d, U);
  if (!owner || !bucket || !sorted_bucket || !iota || !by_bucket || !out || !place) return gpu::OutOfMemory();
  if (!spec.by_table) {
    std::vector<int> host(spec.table_owner, spec.table_owner + spec.num_tables);
    cudaMemcpyAsync(owner, host.data(), sizeof(int) * host.size(), cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);  // `host` is pageable and dies here
  }
  BucketKernel<<<Blocks(U), kThreads, 0, s>>>(g.unique_keys, U, owner, B, spec.by_table, bucket, iota, out,
                                              splits);
  size_t bytes = 0;
  const int bits = gpu::BitsFor(B);
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, bucket, sorted_bucket, iota, by_bucket, U, 0, bits, s);
  void* temp = d.scratch->Allocate(bytes);
  if (!temp) return gpu::OutOfMemory();
  cub::DeviceRadixSort::SortPairs(temp, bytes, bucket, sorted_bucket, iota, by_bucket, U, 0, bits, s);
  PlaceKernel<<<Blocks(U), kThreads, 0, s>>>(by_bucket, out, U, reinterpret_cast<long long*>(unique_keys),
                                             place);
  PositionKernel<<<Blocks(plan.n), kThreads, 0, s>>>(g.offsets, g.order, place, U, static_cast<int>(plan.n),
                                                     reinterpret_cast<long long*>(position));
  cudaError_t c = cudaGetLastError();
  return c == cudaSuccess ? Error() : gpu::CudaFailure(c);
}

}  // namespace impl
}  // namespace tf_sok
