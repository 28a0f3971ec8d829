// CUDA functors for the fused lookup and its gradient. One launch covers up to
// kChunk features of any tables: a group of G threads per (feature, row), each
// thread holding VEC floats of the accumulator (16-byte loads when VEC == 4).
#include <algorithm>

#include "tf_sok/cc/impl/gpu_util.cuh"
#include "tf_sok/cc/impl/lookup.h"

namespace tf_sok {
namespace impl {
namespace gpu {
namespace {

constexpr int kChunk = 32;     // features per launch (kernel parameter space)
constexpr int kThreads = 256;

template <typename Id>
struct Batch {
  int num_features;
  long long row_start[kChunk + 1];  // prefix of batch sizes
  const Id* ids[kChunk];
  const long long* splits[kChunk];
  const float* weights[kChunk];
  float* rows_out[kChunk];          // forward: outputs; backward: output gradients
  const float* table[kChunk];
  long long table_rows[kChunk];
  long long num_ids[kChunk];
  long long id_base[kChunk];        // backward: offset of the feature's ids in the table's list
  int dim[kChunk];
  int combiner[kChunk];
  int feature_index[kChunk];        // index in the op's feature list (for errors)
};

template <int VEC>
struct Vec;
template <>
struct Vec<1> {
  using T = float;
  __device__ static T Zero() { return 0.0f; }
  __device__ static T Load(const float* p) { return *p; }
  __device__ static void Store(float* p, T v) { *p = v; }
  __device__ static void Fma(T& acc, float w, T x) { acc += w * x; }
  __device__ static T Scale(T v, float s) { return v * s; }
  __device__ static void AtomicAdd(float* p, T v) { atomicAdd(p, v); }
};
template <>
struct Vec<4> {
  using T = float4;
  __device__ static T Zero() { return make_float4(0, 0, 0, 0); }
  __device__ static T Load(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
  __device__ static void Store(float* p, T v) { *reinterpret_cast<float4*>(p) = v; }
  __device__ static void Fma(T& a, float w, T x) {
    a.x += w * x.x, a.y += w * x.y, a.z += w * x.z, a.w += w * x.w;
  }
  __device__ static T Scale(T v, float s) { return make_float4(v.x * s, v.y * s, v.z * s, v.w * s); }
  __device__ static void AtomicAdd(float* p, T v) {
    atomicAdd(p, v.x), atomicAdd(p + 1, v.y), atomicAdd(p + 2, v.z), atomicAdd(p + 3, v.w);
  }
};

template <typename Id>
__device__ __forceinline__ int FindFeature(const Batch<Id>& b, long long r) {
  int f = 0;
  while (f + 1 < b.num_features && r >= b.row_start[f + 1]) ++f;
  return f;
}

// Checks one row's splits; reports the first problem it sees.
template <typename Id>
__device__ __forceinline__ bool RowBounds(const Batch<Id>& b, int f, long long row, long long batch,
                                          DeviceError* err, long long* s, long long* e) {
  *s = b.splits[f][row];
  *e = b.splits[f][row + 1];
  const int fi = b.feature_index[f];
  if (row == 0 && *s != 0) {
    Raise(err, ErrorKind::kBadSplits, fi, 0, *s);
    return false;
  }
  if (*e < *s || *e > b.num_ids[f]) {
    Raise(err, ErrorKind::kBadSplits, fi, row + 1, *e);
    return false;
  }
  if (row + 1 == batch && *e != b.num_ids[f]) {
    Raise(err, ErrorKind::kBadSplits, fi, row + 1, *e);
    return false;
  }
  return true;
}

template <typename Id, int VEC>
__global__ void ForwardKernel(const Batch<Id> b, int group, DeviceError* err) {
  using V = Vec<VEC>;
  const long long r = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
  const int lane = threadIdx.x % group;
  if (r >= b.row_start[b.num_features]) return;
  const int f = FindFeature(b, r);
  const long long row = r - b.row_start[f];
  const long long batch = b.row_start[f + 1] - b.row_start[f];
  long long s, e;
  if (!RowBounds(b, f, row, batch, err, &s, &e)) return;
  const int dim = b.dim[f];
  const float* table = b.table[f];
  const float* weights = b.weights[f];
  const Id* ids = b.ids[f];
  float* out = b.rows_out[f] + row * dim;
  for (int j0 = lane * VEC; j0 < dim; j0 += group * VEC) {
    typename V::T acc = V::Zero();
    float wsum = 0.0f, wsq = 0.0f;
    for (long long i = s; i < e; ++i) {
      const long long id = static_cast<long long>(ids[i]);
      const float w = weights ? weights[i] : 1.0f;
      wsum += w;
      wsq += w * w;
      if (id < 0 || id >= b.table_rows[f]) {
        Raise(err, ErrorKind::kIdOutOfRange, b.feature_index[f], i, id);
        continue;
      }
      V::Fma(acc, w, V::Load(table + id * dim + j0));
    }
    V::Store(out + j0, V::Scale(acc, CombinerScale(static_cast<Combiner>(b.combiner[f]), wsum, wsq)));
  }
}

// Backward, per id: its key, the output-gradient row it reads, its coefficient.
template <typename Id>
__global__ void ExpandKernel(const Batch<Id> b, long long* keys, float* coef,
                             const float** grad_rows) {
  const long long r = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= b.row_start[b.num_features]) return;
  const int f = FindFeature(b, r);
  const long long row = r - b.row_start[f];
  const long long s = b.splits[f][row], e = b.splits[f][row + 1];
  const float* weights = b.weights[f];
  float wsum = 0.0f, wsq = 0.0f;
  for (long long i = s; i < e; ++i) {
    const float w = weights ? weights[i] : 1.0f;
    wsum += w;
    wsq += w * w;
  }
  const float scale = CombinerScale(static_cast<Combiner>(b.combiner[f]), wsum, wsq);
  const float* grow = b.rows_out[f] + row * b.dim[f];
  for (long long i = s; i < e; ++i) {
    const long long p = b.id_base[f] + i;
    keys[p] = static_cast<long long>(b.ids[f][i]);
    coef[p] = (weights ? weights[i] : 1.0f) * scale;
    grad_rows[p] = grow;
  }
}

// Sums each id group's scaled output-gradient rows. Work is cut into chunks
// of kSegChunk sorted positions (hot ids make very long groups): a group that
// lies inside one chunk is stored directly; one that spans chunks is added
// atomically into the zeroed output.
constexpr int kSegChunk = 32;

template <int VEC>
__global__ void SegmentSumKernel(Groups g, int total, const float* coef,
                                 const float* const* grad_rows, int dim, int group,
                                 long long* indices, float* values) {
  using V = Vec<VEC>;
  const long long chunk = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
  const int lane = threadIdx.x % group;
  const long long start = chunk * kSegChunk;
  if (start >= total) return;
  const int stop = static_cast<int>(start + kSegChunk < total ? start + kSegChunk : total);
  // the group holding position `start`: the last u with offsets[u] <= start
  int lo = 0, hi = *g.num_unique - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (g.offsets[mid] <= start) lo = mid; else hi = mid - 1;
  }
  for (int j0 = lane * VEC; j0 < dim; j0 += group * VEC) {
    int u = lo;
    for (int k = static_cast<int>(start); k < stop; ++u) {
      const int seg_begin = g.offsets[u], seg_end = g.offsets[u + 1];
      const int end = seg_end < stop ? seg_end : stop;
      typename V::T acc = V::Zero();
      for (; k < end; ++k) {
        const int p = g.order[k];
        V::Fma(acc, coef[p], V::Load(grad_rows[p] + j0));
      }
      float* out = values + static_cast<long long>(u) * dim + j0;
      if (seg_begin >= start && seg_end <= stop) {
        V::Store(out, acc);
      } else {
        V::AtomicAdd(out, acc);
      }
      if (j0 == lane * VEC && lane == 0 && seg_begin >= start) indices[u] = g.unique_keys[u];
    }
  }
}

template <typename Id>
Batch<Id> MakeBatch(const std::vector<FeatureView<Id>>& features, size_t first, size_t count) {
  Batch<Id> b{};
  b.num_features = static_cast<int>(count);
  b.row_start[0] = 0;
  for (size_t k = 0; k < count; ++k) {
    const auto& ft = features[first + k];
    b.row_start[k + 1] = b.row_start[k] + ft.batch;
    b.ids[k] = ft.ids;
    b.splits[k] = reinterpret_cast<const long long*>(ft.splits);
    b.weights[k] = ft.weights;
    b.num_ids[k] = ft.num_ids;
    b.combiner[k] = static_cast<int>(ft.combiner);
    b.feature_index[k] = static_cast<int>(first + k);
  }
  return b;
}

bool AllDivisibleBy4(const int* dims, int n) {
  for (int k = 0; k < n; ++k)
    if (dims[k] % 4) return false;
  return true;
}

}  // namespace
}  // namespace gpu

template <typename Id>
struct FusedLookup<GpuDevice, Id> {
  Error operator()(const GpuDevice& d, const std::vector<TableView>& tables,
                   const std::vector<FeatureView<Id>>& features,
                   const std::vector<float*>& outputs) {
    using namespace gpu;
    DeviceError* err = NewError(d);
    if (!err) return OutOfMemory();
    for (size_t first = 0; first < features.size(); first += kChunk) {
      const size_t count = std::min<size_t>(kChunk, features.size() - first);
      Batch<Id> b = MakeBatch(features, first, count);
      int max_dim = 1;
      for (size_t k = 0; k < count; ++k) {
        const TableView& t = tables[features[first + k].table];
        b.table[k] = t.data;
        b.table_rows[k] = t.rows;
        b.dim[k] = t.dim;
        b.rows_out[k] = outputs[first + k];
        max_dim = std::max(max_dim, t.dim);
      }
      const long long total = b.row_start[count];
      if (total == 0) continue;
      const bool vec4 = AllDivisibleBy4(b.dim, b.num_features);
      const int group = GroupWidth(max_dim, vec4 ? 4 : 1);
      const long long blocks = (total * group + kThreads - 1) / kThreads;
      if (vec4) {
        ForwardKernel<Id, 4><<<blocks, kThreads, 0, StreamOf(d)>>>(b, group, err);
      } else {
        ForwardKernel<Id, 1><<<blocks, kThreads, 0, StreamOf(d)>>>(b, group, err);
      }
    }
    cudaError_t c = cudaGetLastError();
    if (c != cudaSuccess) return CudaFailure(c);
    return Collect(d, err);
  }
};

template <typename Id>
struct LookupGrad<GpuDevice, Id> {
  Error Prepare(const GpuDevice& d, const std::vector<TableGradInput<Id>>& tables,
                std::vector<GradPlan<Id>>* plans) {
    using namespace gpu;
    const size_t T = tables.size();
    plans->assign(T, GradPlan<Id>());
    // Every table's sort and dedup is queued first; their unique counts then come
    // back in ONE device-to-host copy, so the stream is waited on once per op.
    int* counts = Alloc<int>(d, T);
    if (!counts) return OutOfMemory();
    cudaMemsetAsync(counts, 0, sizeof(int) * T, StreamOf(d));
    for (size_t t = 0; t < T; ++t) {
      Error e = PrepareTable(d, tables[t], &(*plans)[t], counts + t);
      if (!e.ok()) return e;
    }
    std::vector<int> host(T, 0);
    cudaMemcpyAsync(host.data(), counts, sizeof(int) * T, cudaMemcpyDeviceToHost, StreamOf(d));
    cudaError_t c = cudaStreamSynchronize(StreamOf(d));
    if (c != cudaSuccess) return CudaFailure(c);
    for (size_t t = 0; t < T; ++t) (*plans)[t].num_unique = host[t];
    return Error();
  }

  // Queues one table's expand + group-by-id; its unique count lands in *count (device).
  Error PrepareTable(const GpuDevice& d, const TableGradInput<Id>& in, GradPlan<Id>* plan, int* count) {
    using namespace gpu;
    const auto& features = in.features;
    const int dim = in.dim;
    long long total = 0;
    for (const auto& ft : features) total += ft.num_ids;
    plan->dim = dim;
    plan->total_ids = total;
    plan->num_unique = 0;
    if (total == 0) return Error();
    auto* keys = Alloc<long long>(d, total);
    auto* coef = Alloc<float>(d, total);
    auto* grad_rows = Alloc<const float*>(d, total);
    if (!keys || !coef || !grad_rows) return OutOfMemory();
    long long base = 0;
    for (size_t first = 0; first < features.size(); first += kChunk) {
      const size_t count = std::min<size_t>(kChunk, features.size() - first);
      Batch<Id> b = MakeBatch(features, first, count);
      for (size_t k = 0; k < count; ++k) {
        b.rows_out[k] = const_cast<float*>(in.out_grads[first + k]);
        b.dim[k] = dim;
        b.id_base[k] = base;
        base += features[first + k].num_ids;
      }
      const long long rows = b.row_start[count];
      if (rows > 0) {
        ExpandKernel<Id><<<(rows + kThreads - 1) / kThreads, kThreads, 0, StreamOf(d)>>>(
            b, keys, coef, grad_rows);
      }
    }
    auto g = std::make_shared<Groups>();
    Error e = GroupByKey(d, keys, static_cast<int>(total), 64, g.get());
    if (!e.ok()) return e;
    cudaMemcpyAsync(count, g->num_unique, sizeof(int), cudaMemcpyDeviceToDevice, StreamOf(d));
    plan->coef = coef;
    plan->grad_rows = grad_rows;
    plan->state = g;
    return Error();
  }

  void Finish(const GpuDevice& d, const GradPlan<Id>& plan, int64_t* indices, float* values) {
    using namespace gpu;
    const Groups& g = *static_cast<const Groups*>(plan.state.get());
    const bool vec4 = plan.dim % 4 == 0;
    const int group = GroupWidth(plan.dim, vec4 ? 4 : 1);
    const int total = static_cast<int>(plan.total_ids);
    const long long chunks = (total + kSegChunk - 1) / kSegChunk;
    const long long blocks = (chunks * group + kThreads - 1) / kThreads;
    auto* idx = reinterpret_cast<long long*>(indices);
    const auto* coef = static_cast<const float*>(plan.coef);
    const auto* rows = static_cast<const float* const*>(plan.grad_rows);
    cudaMemsetAsync(values, 0, sizeof(float) * plan.num_unique * plan.dim, StreamOf(d));
    if (vec4) {
      SegmentSumKernel<4><<<blocks, kThreads, 0, StreamOf(d)>>>(g, total, coef, rows, plan.dim, group,
                                                              idx, values);
    } else {
      SegmentSumKernel<1><<<blocks, kThreads, 0, StreamOf(d)>>>(g, total, coef, rows, plan.dim, group,
                                                              idx, values);
    }
  }
};

template struct FusedLookup<GpuDevice, int32_t>;
template struct FusedLookup<GpuDevice, int64_t>;
template struct LookupGrad<GpuDevice, int32_t>;
template struct LookupGrad<GpuDevice, int64_t>;

}  // namespace impl
}  // namespace tf_sok
