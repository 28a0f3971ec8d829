// Route on the GPU: cub radix sort + run-length grouping (gpu_util.cuh), one
// host wait for the distinct count and the keys per bucket (the splits output
// lives in host memory), then a stable radix sort of the distinct keys by
// bucket. Same function as route_cpu.cc.
#include <algorithm>
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


__global__ void CheckKeys(const long long* keys, int n, int num_tables, DeviceError* err) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && (keys[i] < 0 || (keys[i] >> kTableShift) >= num_tables))
    gpu::Raise(err, ErrorKind::kIdOutOfRange, -1, i, keys[i]);
}

// The owners of up to kParamTables tables travel as a kernel parameter (no
// host-to-device copy, so no wait); more tables use a device array.
constexpr int kParamTables = 512;
struct Owners {
  const int* device;  // nullptr: use inline
  int inline_owner[kParamTables];
  __device__ int operator[](long long t) const { return device ? device[t] : inline_owner[t]; }
};

struct State {
  gpu::Groups groups;
  Owners owner;
  int* counts = nullptr;  // [num_buckets], device: distinct keys per bucket
};

// Keys per bucket (and per bucket x table), counted before the op's one host
// wait so the splits come back with the distinct count. Keys naming no table
// (which Prepare's check reports) are not counted. A few counters take every
// key, so each block counts in shared memory (kShared) over a grid-stride loop
// and adds its totals once; kSharedBins bounds that, beyond it global atomics.
constexpr int kSharedBins = 8192;
constexpr int kCountBlocks = 1024;

template <bool kShared>
__global__ void CountKernel(const long long* unique_keys, const int* num_unique, const Owners owner, int B,
                            bool by_table, int num_tables, int* counts, int* bucket_table_counts) {
  extern __shared__ int hist[];  // [B] per bucket, then [B * num_tables] per bucket x table
  const int bins = B + (bucket_table_counts ? B * num_tables : 0);
  if (kShared) {
    for (int i = threadIdx.x; i < bins; i += blockDim.x) hist[i] = 0;
    __syncthreads();
  }
  const int U = *num_unique;
  for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < U; u += gridDim.x * blockDim.x) {
    const long long key = unique_keys[u];
    const long long table = key >> kTableShift;
    if (key < 0 || table >= num_tables) continue;
    int bucket;
    long long unused;
    BucketOf(key, B, by_table, by_table ? 0 : owner[table], &bucket, &unused);
    const long long cell = static_cast<long long>(bucket) * num_tables + table;
    if (kShared) {
      atomicAdd(&hist[bucket], 1);
      if (bucket_table_counts) atomicAdd(&hist[B + cell], 1);
    } else {
      atomicAdd(&counts[bucket], 1);
      if (bucket_table_counts) atomicAdd(&bucket_table_counts[cell], 1);
    }
  }
  if (kShared) {
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += blockDim.x) {
      if (hist[i] == 0) continue;
      atomicAdd(i < B ? &counts[i] : &bucket_table_counts[i - B], hist[i]);
    }
  }
}

__global__ void BucketKernel(const long long* unique_keys, int U, const Owners owner, int B, bool by_table,
                             int* bucket, int* iota, long long* out) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= U) return;
  const long long key = unique_keys[u];
  const int o = by_table ? 0 : owner[key >> kTableShift];
  BucketOf(key, B, by_table, o, &bucket[u], &out[u]);
  iota[u] = u;
}

__global__ void PlaceKernel(const int* by_bucket, const long long* out, int U, long long* unique_out,
                            int* place) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= U) return;
  const int u = by_bucket[i];
  unique_out[i] = out[u];
  place[u] = i;
}

// starts[b] = where bucket b's run 0, 1, ..., counts[b] begins in unit_splits
// (B + 1 entries; B is small: ranks or tables).
__global__ void UnitStartsKernel(const int* counts, int B, long long* starts) {
  long long at = 0;
  for (int b = 0; b < B; ++b) {
    starts[b] = at;
    at += counts[b] + 1;
  }
  starts[B] = at;
}

__global__ void UnitSplitsKernel(const long long* starts, int B, long long total, long long* unit_splits) {
  const long long k = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= total) return;
  unit_splits[k] = k - starts[gpu::SegmentOf(starts, B, k)];
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

Error RouteOnStream(const GpuDevice& d, const int64_t* keys, int64_t n, const RouteSpec& spec, RoutePlan* plan,
                    const int** num_unique, const int** counts, int* bucket_table_counts) {
  plan->n = n;
  plan->num_unique = 0;
  plan->splits.assign(spec.num_buckets, 0);
  cudaStream_t s = StreamOf(d);
  auto* count = gpu::Alloc<int>(d, spec.num_buckets);
  if (!count) return gpu::OutOfMemory();
  cudaMemsetAsync(count, 0, sizeof(int) * spec.num_buckets, s);
  *counts = count;
  auto state = std::make_shared<State>();
  state->counts = count;
  plan->state = state;
  if (n == 0) {
    auto* zero = gpu::Alloc<int>(d, 1);
    if (!zero) return gpu::OutOfMemory();
    cudaMemsetAsync(zero, 0, sizeof(int), s);
    *num_unique = zero;
    return Error();
  }
  if (!spec.by_table && spec.num_tables <= kParamTables) {
    for (int t = 0; t < spec.num_tables; ++t) state->owner.inline_owner[t] = spec.table_owner[t];
  } else if (!spec.by_table) {
    auto* dev = gpu::Alloc<int>(d, spec.num_tables);
    if (!dev) return gpu::OutOfMemory();
    std::vector<int> host(spec.table_owner, spec.table_owner + spec.num_tables);
    cudaMemcpyAsync(dev, host.data(), sizeof(int) * host.size(), cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);  // `host` is pageable and dies here
    state->owner.device = dev;
  }
  const auto* k = reinterpret_cast<const long long*>(keys);
  Error e = gpu::GroupByKey(d, k, static_cast<int>(n), kTableShift + gpu::BitsFor(spec.num_tables),
                            &state->groups);
  if (!e.ok()) return e;
  const long long bins = spec.num_buckets + (bucket_table_counts ? 1LL * spec.num_buckets * spec.num_tables : 0);
  const int blocks = std::min(Blocks(n), kCountBlocks);
  if (bins <= kSharedBins) {
    CountKernel<true><<<blocks, kThreads, sizeof(int) * bins, s>>>(
        state->groups.unique_keys, state->groups.num_unique, state->owner, spec.num_buckets, spec.by_table,
        spec.num_tables, count, bucket_table_counts);
  } else {
    CountKernel<false><<<blocks, kThreads, 0, s>>>(state->groups.unique_keys, state->groups.num_unique,
                                                   state->owner, spec.num_buckets, spec.by_table, spec.num_tables,
                                                   count, bucket_table_counts);
  }
  *num_unique = state->groups.num_unique;
  cudaError_t c = cudaGetLastError();
  return c == cudaSuccess ? Error() : gpu::CudaFailure(c);
}

Error UnitSplitsOnStream(const GpuDevice& d, const int* counts, int num_buckets, int64_t total, int64_t* unit_splits) {
  auto* starts = gpu::Alloc<long long>(d, num_buckets + 1);
  if (!starts) return gpu::OutOfMemory();
  cudaStream_t s = StreamOf(d);
  UnitStartsKernel<<<1, 1, 0, s>>>(counts, num_buckets, starts);
  if (total > 0) {
    UnitSplitsKernel<<<Blocks(total), kThreads, 0, s>>>(starts, num_buckets, total,
                                                        reinterpret_cast<long long*>(unit_splits));
  }
  cudaError_t c = cudaGetLastError();
  return c == cudaSuccess ? Error() : gpu::CudaFailure(c);
}

template <>
Error Route<GpuDevice>::Prepare(const GpuDevice& d, const int64_t* keys, int64_t n, const RouteSpec& spec,
                                RoutePlan* plan) {
  if (n == 0) {
    plan->n = 0;
    plan->num_unique = 0;
    plan->splits.assign(spec.num_buckets, 0);
    return Error();
  }
  auto* err = gpu::NewError(d);
  if (!err) return gpu::OutOfMemory();
  CheckKeys<<<Blocks(n), kThreads, 0, StreamOf(d)>>>(reinterpret_cast<const long long*>(keys),
                                                     static_cast<int>(n), spec.num_tables, err);
  const int *num_unique = nullptr, *counts = nullptr;
  Error e = RouteOnStream(d, keys, n, spec, plan, &num_unique, &counts);
  if (!e.ok()) return e;
  int unique = 0;
  cudaMemcpyAsync(&unique, num_unique, sizeof(int), cudaMemcpyDeviceToHost, StreamOf(d));
  cudaMemcpyAsync(plan->splits.data(), counts, sizeof(int) * spec.num_buckets, cudaMemcpyDeviceToHost, StreamOf(d));
  e = gpu::Collect(d, err);  // waits for the stream: the one host wait of the op
  if (!e.ok()) return e;
  plan->num_unique = unique;
  return Error();
}

template <>
Error Route<GpuDevice>::Finish(const GpuDevice& d, const RoutePlan& plan, const RouteSpec& spec,
                               int64_t* unique_keys, int32_t* splits, int64_t* position, int64_t* unit_splits) {
  cudaStream_t s = StreamOf(d);
  const int B = spec.num_buckets;
  for (int b = 0; b < B; ++b) splits[b] = plan.splits[b];  // host memory, counted in Prepare
  const int U = static_cast<int>(plan.num_unique);
  if (unit_splits && U == 0) {
    cudaMemsetAsync(unit_splits, 0, sizeof(int64_t) * B, s);  // every bucket: [0]
  } else if (unit_splits) {
    Error e = UnitSplitsOnStream(d, static_cast<const State*>(plan.state.get())->counts, B, U + B, unit_splits);
    if (!e.ok()) return e;
  }
  if (U == 0) return Error();
  const State& st = *static_cast<const State*>(plan.state.get());
  const gpu::Groups& g = st.groups;
  auto* bucket = gpu::Alloc<int>(d, U);
  auto* sorted_bucket = gpu::Alloc<int>(d, U);
  auto* iota = gpu::Alloc<int>(d, U);
  auto* by_bucket = gpu::Alloc<int>(d, U);
  auto* out = gpu::Alloc<long long>(d, U);
  auto* place = gpu::Alloc<int>(d, U);
  if (!bucket || !sorted_bucket || !iota || !by_bucket || !out || !place) return gpu::OutOfMemory();
  BucketKernel<<<Blocks(U), kThreads, 0, s>>>(g.unique_keys, U, st.owner, B, spec.by_table, bucket, iota, out);
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
