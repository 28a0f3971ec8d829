// CUDA functor for the sparse optimizers, all tables of a step at once. Every
// index is checked first; unless the caller promised unique indices, equal
// (table, row) keys are grouped by one radix sort over all tables; one update
// launch then sums each row's gradients and updates the row and its state. If
// any index was bad the update kernels write nothing.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "tf_sok/cc/impl/gpu_util.cuh"
#include "tf_sok/cc/impl/optimizer.h"

namespace tf_sok {
namespace impl {
namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxTables = 32;  // tables per launch (kernel parameter space)

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline long long Blocks(long long threads) { return (threads + kThreads - 1) / kThreads; }

// Up to kMaxTables tables of one fused update; positions of all tables' indices
// are numbered consecutively (table t owns [start[t], start[t + 1])).
template <typename Id>
struct Chunk {
  int num_tables;
  int first;                        // index of table 0 in the op's list (for errors)
  int shift;                        // keys are (table << shift) | row
  long long start[kMaxTables + 1];
  const Id* indices[kMaxTables];
  const float* grads[kMaxTables];
  SparseUpdate u[kMaxTables];
};

// Checks every index (and, when promised, strict ascent); when grouping is
// needed writes the key (table << shift) | row per position.
template <typename Id>
__global__ void CheckKernel(const Chunk<Id> c, bool ascending, long long* keys, DeviceError* err) {
  const long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= c.start[c.num_tables]) return;
  const int t = SegmentOf(c.start, c.num_tables, p);
  const long long i = p - c.start[t];
  const long long r = static_cast<long long>(c.indices[t][i]);
  if (r < 0 || r >= c.u[t].rows) {
    Raise(err, ErrorKind::kIdOutOfRange, c.first + t, i, r);
  } else if (ascending && i > 0 && r < static_cast<long long>(c.indices[t][i - 1])) {
    Raise(err, ErrorKind::kNotAscending, c.first + t, i, r);
  }
  if (keys) keys[p] = (static_cast<long long>(t) << c.shift) | r;
}

// Ungrouped (ascending) indices: position i of table t repeats the index before it.
template <typename Id>
__device__ __forceinline__ bool IsPadding(const Chunk<Id>& c, int t, long long i) {
  return i > 0 && c.indices[t][i] == c.indices[t][i - 1];
}

// VEC consecutive floats of a row (16-byte accesses when VEC == 4; every width
// of the launch is then a multiple of 4).
template <int VEC>
struct Floats {
  float v[VEC];
  __device__ void Load(const float* p) {
    if (VEC == 4) {
      const float4 x = *reinterpret_cast<const float4*>(p);
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    } else {
      for (int i = 0; i < VEC; ++i) v[i] = p[i];
    }
  }
  __device__ void Store(float* p) const {
    if (VEC == 4) {
      *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      for (int i = 0; i < VEC; ++i) p[i] = v[i];
    }
  }
};

// One group of `group` threads per updated row, each thread VEC floats of it at
// a time. Grouped: row k is the k-th distinct key and its gradient is the sum of
// its positions' rows. Not grouped: row k is position k (indices ascending; a
// repeat of the index before it is the lookup gradient's zero padding, skipped).
template <typename Id, Algorithm A, bool kGrouped, int VEC>
__global__ void UpdateKernel(Hyper h, const Chunk<Id> c, Groups g, int group, const DeviceError* err) {
  const long long k = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
  const int lane = threadIdx.x % group;
  if (err->kind != 0) return;
  if (h.lr_at != nullptr) h.lr = *h.lr_at;
  int t;
  long long row;
  int begin = 0, end = 1;
  if (kGrouped) {
    if (k >= *g.num_unique) return;
    const long long key = g.unique_keys[k];
    t = static_cast<int>(key >> c.shift);
    row = key & ((1LL << c.shift) - 1);
    begin = g.offsets[k], end = g.offsets[k + 1];
  } else {
    if (k >= c.start[c.num_tables]) return;
    t = SegmentOf(c.start, c.num_tables, k);
    if (IsPadding(c, t, k - c.start[t])) return;
    row = static_cast<long long>(c.indices[t][k - c.start[t]]);
  }
  const SparseUpdate& u = c.u[t];
  const int dim = u.dim;
  const float* grads = c.grads[t];
  const long long base = c.start[t];
  const RowScalars rs = RowConstants(h, u.step ? u.step[row] : 0.0f);
  float* slot[3];
  for (int s = 0; s < 3; ++s) slot[s] = u.slots[s] ? u.slots[s] + row * dim : nullptr;
  float* w = u.var + row * dim;
  for (int j = lane * VEC; j < dim; j += group * VEC) {
    Floats<VEC> gsum{}, wv, sv[3];
    for (int q = begin; q < end; ++q) {
      const long long p = kGrouped ? g.order[q] : k;
      Floats<VEC> x;
      x.Load(grads + (p - base) * dim + j);
      for (int i = 0; i < VEC; ++i) gsum.v[i] += x.v[i];
    }
    wv.Load(w + j);
    for (int s = 0; s < 3; ++s) {
      if (slot[s]) sv[s].Load(slot[s] + j);
      else sv[s] = Floats<VEC>{};
    }
    for (int i = 0; i < VEC; ++i)
      wv.v[i] = UpdateElement<A>(h, rs, wv.v[i], gsum.v[i], sv[0].v[i], sv[1].v[i], sv[2].v[i]);
    wv.Store(w + j);
    for (int s = 0; s < 3; ++s)
      if (slot[s]) sv[s].Store(slot[s] + j);
  }
}

// Adam's per-row step counters, once each row's update has read them.
template <typename Id, bool kGrouped>
__global__ void BumpStepKernel(const Chunk<Id> c, Groups g, const DeviceError* err) {
  const long long k = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (err->kind != 0) return;
  if (kGrouped) {
    if (k >= *g.num_unique) return;
    const long long key = g.unique_keys[k];
    c.u[key >> c.shift].step[key & ((1LL << c.shift) - 1)] += 1.0f;
  } else {
    if (k >= c.start[c.num_tables]) return;
    const int t = SegmentOf(c.start, c.num_tables, k);
    if (IsPadding(c, t, k - c.start[t])) return;
    c.u[t].step[static_cast<long long>(c.indices[t][k - c.start[t]])] += 1.0f;
  }
}

template <typename Id>
std::vector<Chunk<Id>> MakeChunks(const std::vector<TableUpdate<Id>>& tables) {
  std::vector<Chunk<Id>> chunks;
  for (size_t first = 0; first < tables.size(); first += kMaxTables) {
    Chunk<Id> c{};
    long long max_rows = 1;
    c.num_tables = static_cast<int>(std::min<size_t>(kMaxTables, tables.size() - first));
    c.first = static_cast<int>(first);
    for (int t = 0; t < c.num_tables; ++t) {
      const TableUpdate<Id>& in = tables[first + t];
      c.start[t + 1] = c.start[t] + in.n;
      c.indices[t] = in.indices;
      c.grads[t] = in.grads;
      c.u[t] = in.u;
      max_rows = std::max<long long>(max_rows, in.u.rows);
    }
    c.shift = BitsFor(max_rows - 1);
    chunks.push_back(c);
  }
  return chunks;
}

template <typename Id, bool kGrouped>
void LaunchUpdate(cudaStream_t s, const Hyper& h, const Chunk<Id>& c, const Groups& g,
                  long long rows, int max_dim, bool vec4, bool has_step, const DeviceError* err) {
  const int group = GroupWidth(max_dim, vec4 ? 4 : 1);
  DispatchAlgorithm(h.algorithm, [&](auto algo) {
    constexpr Algorithm A = decltype(algo)::value;
    auto kernel = vec4 ? UpdateKernel<Id, A, kGrouped, 4> : UpdateKernel<Id, A, kGrouped, 1>;
    kernel<<<Blocks(rows * group), kThreads, 0, s>>>(h, c, g, group, err);
    return 0;
  });
  if (has_step) BumpStepKernel<Id, kGrouped><<<Blocks(rows), kThreads, 0, s>>>(c, g, err);
}

}  // namespace
}  // namespace gpu

template <typename Id>
struct FusedSparseApply<GpuDevice, Id> {
  Error operator()(const GpuDevice& d, const Hyper& h, const std::vector<TableUpdate<Id>>& tables,
                   bool indices_unique, bool report) {
    using namespace gpu;
    cudaStream_t s = StreamOf(d);
    DeviceError* err = NewError(d);
    if (!err) return OutOfMemory();
    const std::vector<Chunk<Id>> chunks = MakeChunks(tables);
    std::vector<long long*> keys(chunks.size(), nullptr);
    // Every index of every table is checked before the first update runs: the
    // update kernels write nothing once the error flag is set.
    for (size_t k = 0; k < chunks.size(); ++k) {
      const long long n = chunks[k].start[chunks[k].num_tables];
      if (n == 0) continue;
      if (!indices_unique && !(keys[k] = Alloc<long long>(d, n))) return OutOfMemory();
      CheckKernel<Id><<<Blocks(n), kThreads, 0, s>>>(chunks[k], indices_unique, keys[k], err);
    }
    for (size_t k = 0; k < chunks.size(); ++k) {
      const Chunk<Id>& c = chunks[k];
      const long long n = c.start[c.num_tables];
      if (n == 0) continue;
      int max_dim = 1;
      bool has_step = false, vec4 = true;
      for (int t = 0; t < c.num_tables; ++t) {
        max_dim = std::max<int>(max_dim, c.u[t].dim);
        has_step = has_step || c.u[t].step != nullptr;
        vec4 = vec4 && c.u[t].dim % 4 == 0 && Aligned16(c.u[t].var) && Aligned16(c.grads[t]);
        for (int k = 0; k < 3; ++k) vec4 = vec4 && Aligned16(c.u[t].slots[k]);
      }
      Groups g;
      if (indices_unique) {
        LaunchUpdate<Id, false>(s, h, c, g, n, max_dim, vec4, has_step, err);
        continue;
      }
      const int bits = c.shift + (c.num_tables > 1 ? BitsFor(c.num_tables - 1) : 0);
      Error e = GroupByKey(d, keys[k], static_cast<int>(n), bits, &g);
      if (!e.ok()) return e;
      LaunchUpdate<Id, true>(s, h, c, g, n, max_dim, vec4, has_step, err);
    }
    cudaError_t c = cudaGetLastError();
    if (c != cudaSuccess) return CudaFailure(c);
    return report ? Collect(d, err) : Error();
  }
};

template <>
void DeviceCopy<GpuDevice>(const GpuDevice& d, void* dst, const void* src, size_t bytes) {
  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, gpu::StreamOf(d));
}

template struct FusedSparseApply<GpuDevice, int32_t>;
template struct FusedSparseApply<GpuDevice, int64_t>;

}  // namespace impl
}  // namespace tf_sok
