// CUDA functors for the fused lookup and its gradient. One launch covers up to
// kChunk features of any tables: a group of G threads per (feature, row), each
// thread holding VEC floats of the accumulator (16-byte loads when VEC == 4).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "tf_sok/cc/impl/gpu_util.cuh"
#include "tf_sok/cc/impl/lookup.h"

namespace tf_sok {
namespace impl {
namespace gpu {
namespace {

constexpr int kChunk = 32;     // features per launch (kernel parameter space)
constexpr int kThreads = 256;
constexpr int kUnroll = 4;     // ids of a multi-hot row whose loads ForwardKernel issues together

template <typename Id>
struct Batch {
  int num_features;
  long long row_start[kChunk + 1];  // prefix of batch sizes
  const Id* ids[kChunk];
  const long long* splits[kChunk];
  const float* weights[kChunk];
  void* rows_out[kChunk];           // forward: outputs; backward: output gradients (of type Out / In)
  const float* table[kChunk];
  long long table_rows[kChunk];
  long long num_ids[kChunk];
  long long id_base[kChunk];        // backward: offset of the feature's ids in the table's list
  int dim[kChunk];
  int combiner[kChunk];
  int feature_index[kChunk];        // index in the op's feature list (for errors)
  int key_table[kChunk];            // backward: the feature's table within its group
};

template <int VEC>
struct Vec;
template <>
struct Vec<1> {
  using T = float;
  __device__ static T Zero() { return 0.0f; }
  __device__ static T Load(const float* p) { return *p; }
  __device__ static void Store(float* p, T v) { *p = v; }
  __device__ static void StoreStream(float* p, T v) { __stcs(p, v); }
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
  // outputs written once and read by a later op: marked evict-first, so they do
  // not push hot table rows out of L2
  __device__ static void StoreStream(float* p, T v) { __stcs(reinterpret_cast<float4*>(p), v); }
  __device__ static void Fma(T& a, float w, T x) {
    a.x += w * x.x, a.y += w * x.y, a.z += w * x.z, a.w += w * x.w;
  }
  __device__ static T Scale(T v, float s) { return make_float4(v.x * s, v.y * s, v.z * s, v.w * s); }
  // one 16-byte atomic on Hopper and later (hot ids' rows take many: a Zipf id
  // can hold most of a table's positions), four scalar ones before
  __device__ static void AtomicAdd(float* p, T v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(p), v);
#else
    atomicAdd(p, v.x), atomicAdd(p + 1, v.y), atomicAdd(p + 2, v.z), atomicAdd(p + 3, v.w);
#endif
  }
};

// Pooled rows stored or loaded VEC elements at once as float32, float16 or
// bfloat16 (converted from float32 to nearest even; sums stay float32).
template <typename T>
struct Half;
template <>
struct Half<__half> {
  using T2 = __half2;
  __device__ static T2 Pack(float a, float b) { return __floats2half2_rn(a, b); }
  __device__ static float2 Unpack(T2 h) { return __half22float2(h); }
  __device__ static __half One(float v) { return __float2half_rn(v); }
  __device__ static float Float(__half h) { return __half2float(h); }
};
template <>
struct Half<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  __device__ static T2 Pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  __device__ static float2 Unpack(T2 h) { return __bfloat1622float2(h); }
  __device__ static __nv_bfloat16 One(float v) { return __float2bfloat16_rn(v); }
  __device__ static float Float(__nv_bfloat16 h) { return __bfloat162float(h); }
};

template <typename T, int VEC>
struct Elems {  // float16 / bfloat16, one at a time
  __device__ static float Load(const T* p) { return Half<T>::Float(*p); }
  __device__ static void StoreStream(T* p, float v) { *p = Half<T>::One(v); }
};
template <typename T>
struct Elems<T, 4> {  // float16 / bfloat16, four (8 bytes) at a time
  using H = Half<T>;
  __device__ static float4 Load(const T* p) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    const float2 a = H::Unpack(*reinterpret_cast<const typename H::T2*>(&u.x));
    const float2 b = H::Unpack(*reinterpret_cast<const typename H::T2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }
  __device__ static void StoreStream(T* p, float4 v) {
    const typename H::T2 a = H::Pack(v.x, v.y), b = H::Pack(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<const unsigned*>(&a);
    u.y = *reinterpret_cast<const unsigned*>(&b);
    __stcs(reinterpret_cast<uint2*>(p), u);
  }
};
template <int VEC>
struct FloatElems {
  __device__ static typename Vec<VEC>::T Load(const float* p) { return Vec<VEC>::Load(p); }
  __device__ static void StoreStream(float* p, typename Vec<VEC>::T v) { Vec<VEC>::StoreStream(p, v); }
};
template <>
struct Elems<float, 1> : FloatElems<1> {};
template <>
struct Elems<float, 4> : FloatElems<4> {};

// Calls fn(Type<T>()) with T the C++ type of a precision.
template <typename T>
struct Type {
  using type = T;
};
template <typename Fn>
void WithElement(Precision p, Fn fn) {
  switch (p) {
    case Precision::kFloat16:
      fn(Type<__half>());
      break;
    case Precision::kBFloat16:
      fn(Type<__nv_bfloat16>());
      break;
    default:
      fn(Type<float>());
  }
}

template <typename Id>
__device__ __forceinline__ int FindFeature(const Batch<Id>& b, long long r) {
  int f = 0;
  while (f + 1 < b.num_features && r >= b.row_start[f + 1]) ++f;
  return f;
}

// Checks one row's splits s = splits[row], e = splits[row + 1]; reports the
// first problem it sees.
template <typename Id>
__device__ __forceinline__ bool CheckRow(const Batch<Id>& b, int f, long long row, long long s, long long e,
                                         DeviceError* err) {
  const int fi = b.feature_index[f];
  if (row == 0 && s != 0) {
    Raise(err, ErrorKind::kBadSplits, fi, 0, s);
    return false;
  }
  if (e < s || e > b.num_ids[f]) {
    Raise(err, ErrorKind::kBadSplits, fi, row + 1, e);
    return false;
  }
  if (row + 1 == b.row_start[f + 1] - b.row_start[f] && e != b.num_ids[f]) {
    Raise(err, ErrorKind::kBadSplits, fi, row + 1, e);
    return false;
  }
  return true;
}

// One row's pooled output (lanes lane, lane + group, ... of it). kMulti (rows
// of several ids on average): kUnroll ids of a row at a time, their
// loads and then their rows' loads issued together, instead of a chain of
// dependent loads per id; sums run in the same order either way.
template <typename Id, int VEC, bool kMulti, typename Out>
__device__ __forceinline__ void PoolRow(const Batch<Id>& b, int f, long long row, long long s, long long e,
                                        int lane, int group, DeviceError* err) {
  using V = Vec<VEC>;
  const int dim = b.dim[f];
  const float* table = b.table[f];
  const float* weights = b.weights[f];
  const Id* ids = b.ids[f];
  Out* out = static_cast<Out*>(b.rows_out[f]) + row * dim;
  const long long rows = b.table_rows[f];
  for (int j0 = lane * VEC; j0 < dim; j0 += group * VEC) {
    typename V::T acc = V::Zero();
    float wsum = 0.0f, wsq = 0.0f;
    long long i = s;
    if (kMulti) {
      for (; i + kUnroll <= e; i += kUnroll) {
        long long id[kUnroll];
        float w[kUnroll];
        typename V::T x[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          id[u] = static_cast<long long>(ids[i + u]);
          w[u] = weights ? weights[i + u] : 1.0f;
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          x[u] = id[u] >= 0 && id[u] < rows ? V::Load(table + id[u] * dim + j0) : V::Zero();
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          wsum += w[u];
          wsq += w[u] * w[u];
          if (id[u] < 0 || id[u] >= rows) {
            Raise(err, ErrorKind::kIdOutOfRange, b.feature_index[f], i + u, id[u], rows);
            continue;
          }
          V::Fma(acc, w[u], x[u]);
        }
      }
    }
    for (; i < e; ++i) {
      const long long id = static_cast<long long>(ids[i]);
      const float w = weights ? weights[i] : 1.0f;
      wsum += w;
      wsq += w * w;
      if (id < 0 || id >= b.table_rows[f]) {
        Raise(err, ErrorKind::kIdOutOfRange, b.feature_index[f], i, id, b.table_rows[f]);
        continue;
      }
      V::Fma(acc, w, V::Load(table + id * dim + j0));
    }
    Elems<Out, VEC>::StoreStream(out + j0,
                                 V::Scale(acc, CombinerScale(static_cast<Combiner>(b.combiner[f]), wsum, wsq)));
  }
}

template <typename Id, int VEC, bool kMulti, typename Out>
__global__ void ForwardKernel(const Batch<Id> b, int group, DeviceError* err) {
  const long long r = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
  const int lane = threadIdx.x % group;
  if (r >= b.row_start[b.num_features]) return;
  const int f = FindFeature(b, r);
  const long long row = r - b.row_start[f];
  const long long s = b.splits[f][row], e = b.splits[f][row + 1];
  if (CheckRow(b, f, row, s, e, err)) PoolRow<Id, VEC, kMulti, Out>(b, f, row, s, e, lane, group, err);
}

// Rows of about one id each, when one pass of the group covers every width
// (dim <= group * VEC). A warp takes 32 consecutive rows: lane i loads row i's
// splits, id and weight (one coalesced load each, instead of a chain of three
// dependent loads per row), then the warp's thread groups take the one-id rows
// kRows at a time, handed round by shuffles, their table rows' loads issued
// together. Empty and several-id rows take PoolRow afterwards. Same sums as
// ForwardKernel. (On an H200, 26 features x 65,536 one-id rows of width 128:
// 396 -> 271 us against 4 rows per thread group with their own loads.)
constexpr int kRows = 4;

template <typename Id, int VEC, typename Out>
__global__ void ForwardRowsKernel(const Batch<Id> b, int group, DeviceError* err) {
  using V = Vec<VEC>;
  constexpr unsigned kAll = 0xffffffffu;
  const long long r0 = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32 * 32;
  const int wl = threadIdx.x % 32, lane = wl % group, g = wl / group, groups = 32 / group;
  const int j0 = lane * VEC;
  const long long total = b.row_start[b.num_features];
  if (r0 >= total) return;  // the whole warp
  // this lane's row: kind 0 nothing to do, 1 one id (id < 0: out of range, zeros stored), 2 PoolRow
  int f = 0, kind = 0;
  long long row = -1, s = 0, e = 0, id = -1;
  float w = 1.0f, scale = 0.0f;
  if (r0 + wl < total) {
    f = FindFeature(b, r0 + wl);
    row = r0 + wl - b.row_start[f];
    s = b.splits[f][row], e = b.splits[f][row + 1];
    if (CheckRow(b, f, row, s, e, err)) {
      kind = e - s == 1 ? 1 : 2;
      if (kind == 1) {
        id = static_cast<long long>(b.ids[f][s]);
        w = b.weights[f] ? b.weights[f][s] : 1.0f;
        scale = CombinerScale(static_cast<Combiner>(b.combiner[f]), w, w * w);
        if (id < 0 || id >= b.table_rows[f]) {
          Raise(err, ErrorKind::kIdOutOfRange, b.feature_index[f], s, id, b.table_rows[f]);
          id = -1;
        }
      }
    }
  }
  for (int t = 0; t < 32; t += groups * kRows) {
    int fk[kRows];
    long long rk[kRows];
    float wk[kRows], ck[kRows];
    typename V::T x[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int src = t + k * groups + g;
      fk[k] = __shfl_sync(kAll, f, src & 31);
      rk[k] = __shfl_sync(kAll, kind == 1 ? row : -1LL, src & 31);
      const long long idk = __shfl_sync(kAll, id, src & 31);
      wk[k] = __shfl_sync(kAll, w, src & 31);
      ck[k] = __shfl_sync(kAll, scale, src & 31);
      if (src >= 32 || j0 >= b.dim[fk[k]]) rk[k] = -1;
      x[k] = rk[k] >= 0 && idk >= 0 ? V::Load(b.table[fk[k]] + idk * b.dim[fk[k]] + j0) : V::Zero();
    }
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (rk[k] < 0) continue;
      typename V::T acc = V::Zero();
      V::Fma(acc, wk[k], x[k]);
      Elems<Out, VEC>::StoreStream(static_cast<Out*>(b.rows_out[fk[k]]) + rk[k] * b.dim[fk[k]] + j0,
                                   V::Scale(acc, ck[k]));
    }
  }
  // the (here few) empty and several-id rows, one per thread group
  const unsigned others = __ballot_sync(kAll, kind == 2);
  for (int n = 0, k = 0; k < 32; ++k) {
    if (!((others >> k) & 1u)) continue;
    const int fo = __shfl_sync(kAll, f, k);
    const long long ro = __shfl_sync(kAll, row, k), so = __shfl_sync(kAll, s, k), eo = __shfl_sync(kAll, e, k);
    if (n++ % groups == g) PoolRow<Id, VEC, false, Out>(b, fo, ro, so, eo, lane, group, err);
  }
}

// Backward, per id: its key (table << shift) | id, the output-gradient row it
// reads, its coefficient. shift holds the largest table's ids (a shorter sort key
// than kTableShift where the tables' rows are known). An id outside
// [0, table_rows[f]) is keyed past every table of the group (table index
// num_tables), so it sorts after them and no output receives it.
template <typename Id, typename In>
__global__ void ExpandKernel(const Batch<Id> b, int shift, int num_tables, long long* keys, float* coef,
                             const void** grad_rows) {
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
  const In* grow = static_cast<const In*>(b.rows_out[f]) + row * b.dim[f];
  const long long table = static_cast<long long>(b.key_table[f]) << shift;
  const long long limit = b.table_rows[f];
  for (long long i = s; i < e; ++i) {
    const long long p = b.id_base[f] + i;
    const long long id = static_cast<long long>(b.ids[f][i]);
    const bool bad = id < 0 || id >= limit;
    keys[p] = bad ? static_cast<long long>(num_tables) << shift : table | id;
    coef[p] = bad ? 0.0f : (weights ? weights[i] : 1.0f) * scale;
    grad_rows[p] = grow;
  }
}

// Where each table's distinct keys start among a group's sorted distinct keys:
// starts[t] = first k with unique_keys[k] >= t << shift, for t = 0..T (keys
// from starts[T] on are dropped ids).
__global__ void TableStartsKernel(Groups g, int num_tables, int shift, int* starts) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t > num_tables) return;
  const int n = *g.num_unique;
  const long long want = static_cast<long long>(t) << shift;
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (g.unique_keys[mid] < want) lo = mid + 1; else hi = mid;
  }
  starts[t] = lo;
}

// A group's tables' outputs: distinct key k of table t goes to row
// k - starts[t] of indices[t] / values[t] (row_start: prefix of their rows,
// an upper bound on the distinct keys); or, dense (indices[t] == nullptr), to
// row `id` of the zeroed [rows[t], dim] values[t] (ids past it are skipped).
struct GradOutputs {
  int num_tables;
  long long* indices[kChunk];
  float* values[kChunk];
  int dim[kChunk];
  long long rows[kChunk];
  long long row_start[kChunk + 1];
};

// Sums each id group's scaled output-gradient rows. Work is cut into chunks
// of kSegChunk sorted positions (hot ids make very long groups): a group that
// lies inside one chunk is stored directly; one that spans chunks is added
// atomically into the zeroed output. With Zipf ids most positions belong to a
// few hot ids, so those atomics on the same rows, not the reads, bound the sum
// at short chunks: 64 positions per chunk halve them against 32 (measured on an
// H200: 2.30 -> 1.63 ms for 17 M positions, 0.33 -> 0.32 ms for 1.7 M), while
// longer chunks leave too few thread groups for the cold ids.
constexpr int kSegChunk = 64;

template <int VEC, typename In>
__global__ void SegmentSumKernel(Groups g, int total, const float* coef,
                                 const void* const* grad_rows, const GradOutputs o,
                                 const int* starts, int shift, int group) {
  using V = Vec<VEC>;
  const long long chunk = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
  const int lane = threadIdx.x % group;
  const long long start = chunk * kSegChunk;
  if (start >= total) return;
  const int stop = static_cast<int>(start + kSegChunk < total ? start + kSegChunk : total);
  // the group holding position `start`: the last u with offsets[u] <= start
  int u = SegmentOf(g.offsets, *g.num_unique, start);
  for (int k = static_cast<int>(start); k < stop; ++u) {
    const int seg_begin = g.offsets[u], seg_end = g.offsets[u + 1];
    const int end = seg_end < stop ? seg_end : stop;
    const long long key = g.unique_keys[u];
    const int t = static_cast<int>(key >> shift);
    if (t >= o.num_tables) break;  // dropped ids: sorted last
    const long long id = key & ((1LL << shift) - 1);
    const int dim = o.dim[t];
    const bool dense = o.indices[t] == nullptr;
    const long long local = dense ? id : u - starts[t];
    if (dense && local >= o.rows[t]) {
      k = end;
      continue;
    }
    float* out = o.values[t] + local * dim;
    const bool whole = seg_begin >= start && seg_end <= stop;
    for (int j0 = lane * VEC; j0 < dim; j0 += group * VEC) {
      typename V::T acc = V::Zero();
      for (int q = k; q < end; ++q) {
        const int p = g.order[q];
        V::Fma(acc, coef[p], Elems<In, VEC>::Load(static_cast<const In*>(grad_rows[p]) + j0));
      }
      if (whole) {
        V::Store(out + j0, acc);
      } else {
        V::AtomicAdd(out + j0, acc);
      }
    }
    if (!dense && lane == 0 && seg_begin >= start) o.indices[t][local] = id;
    k = end;
  }
}

// Zeroes the rows of distinct keys whose positions span several chunks of
// SegmentSumKernel (it adds into them atomically).
__global__ void ZeroSplitRowsKernel(Groups g, const GradOutputs o, const int* starts, int shift, int group) {
  const long long u = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
  const int lane = threadIdx.x % group;
  if (u >= *g.num_unique) return;
  const int seg_begin = g.offsets[u], seg_end = g.offsets[u + 1];
  if (seg_begin / kSegChunk == (seg_end - 1) / kSegChunk) return;  // inside one chunk
  const long long key = g.unique_keys[u];
  const int t = static_cast<int>(key >> shift);
  if (t >= o.num_tables) return;
  float* out = o.values[t] + (u - starts[t]) * o.dim[t];
  for (int j = lane; j < o.dim[t]; j += group) out[j] = 0.0f;
}

// Rows past each table's distinct keys: the last distinct id again, a zero row.
__global__ void PadKernel(Groups g, const GradOutputs o, const int* starts, int shift, int group) {
  const long long r = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / group;
  const int lane = threadIdx.x % group;
  if (r >= o.row_start[o.num_tables]) return;
  const int t = SegmentOf(o.row_start, o.num_tables, r);
  const long long p = r - o.row_start[t];
  const int count = starts[t + 1] - starts[t];
  if (p < count) return;
  float* out = o.values[t] + p * o.dim[t];
  for (int j = lane; j < o.dim[t]; j += group) out[j] = 0.0f;
  if (lane == 0) o.indices[t][p] = count > 0 ? g.unique_keys[starts[t + 1] - 1] & ((1LL << shift) - 1) : 0;
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
                   const std::vector<void*>& outputs, ErrorRecord* record, Precision precision) {
    using namespace gpu;
    DeviceError* err = record ? record : NewError(d);
    if (!err) return OutOfMemory();
    if (record) cudaMemsetAsync(record, 0, sizeof(ErrorRecord), StreamOf(d));
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
      long long ids_in_launch = 0;
      for (size_t k = 0; k < count; ++k) ids_in_launch += b.num_ids[k];
      const bool multi = ids_in_launch >= kUnroll * total;  // kUnroll ids per row or more on average
      WithElement(precision, [&](auto type) {
        using Out = typename decltype(type)::type;
        if (!multi && max_dim <= group * (vec4 ? 4 : 1)) {  // rows of about one id, one pass per row
          const long long row_blocks = ((total + 31) / 32 * 32 + kThreads - 1) / kThreads;
          auto rows_kernel = vec4 ? ForwardRowsKernel<Id, 4, Out> : ForwardRowsKernel<Id, 1, Out>;
          rows_kernel<<<row_blocks, kThreads, 0, StreamOf(d)>>>(b, group, err);
          return;
        }
        auto kernel = vec4 ? (multi ? ForwardKernel<Id, 4, true, Out> : ForwardKernel<Id, 4, false, Out>)
                           : (multi ? ForwardKernel<Id, 1, true, Out> : ForwardKernel<Id, 1, false, Out>);
        kernel<<<blocks, kThreads, 0, StreamOf(d)>>>(b, group, err);
      });
    }
    cudaError_t c = cudaGetLastError();
    return c == cudaSuccess ? Error() : CudaFailure(c);
  }
};

Error CopyRecordToHost(const GpuDevice& d, const ErrorRecord* device_record, ErrorRecord* host) {
  cudaError_t c = cudaMemcpyAsync(host, device_record, sizeof(ErrorRecord), cudaMemcpyDeviceToHost,
                                  gpu::StreamOf(d));
  return c == cudaSuccess ? Error() : gpu::CudaFailure(c);
}

// The grouping of one group of up to kChunk tables (all of a step's ids of
// those tables sorted together).
struct GradGroup {
  int first_table = 0, num_tables = 0;
  long long total = 0;
  float* coef = nullptr;
  const void** grad_rows = nullptr;
  Precision precision = Precision::kFloat32;  // of the output gradients grad_rows point into
  gpu::Groups groups;
  int* starts = nullptr;  // device [num_tables + 1]
  int shift = kTableShift;  // keys: (table in group << shift) | id
};

// Sums each distinct key's scaled output-gradient rows of one group into `o`.
inline void SumGroups(const GpuDevice& d, const GradGroup& gg, const gpu::GradOutputs& o, int max_dim,
                      bool vec4) {
  using namespace gpu;
  const int total = static_cast<int>(gg.total);
  const int group = GroupWidth(max_dim, vec4 ? 4 : 1);
  const long long chunks = (total + kSegChunk - 1) / kSegChunk;
  const long long blocks = (chunks * group + kThreads - 1) / kThreads;
  const auto* rows = static_cast<const void* const*>(gg.grad_rows);
  WithElement(gg.precision, [&](auto type) {
    using In = typename decltype(type)::type;
    auto kernel = vec4 ? SegmentSumKernel<4, In> : SegmentSumKernel<1, In>;
    kernel<<<blocks, kThreads, 0, StreamOf(d)>>>(gg.groups, total, gg.coef, rows, o, gg.starts, gg.shift, group);
  });
}

struct GradState {
  std::vector<GradGroup> groups;
  std::vector<int> dims;
};

template <typename Id>
struct LookupGrad<GpuDevice, Id> {
  // Queues every group's expand + sort; the output rows are bounds known on
  // the host, so nothing waits on the stream.
  Error Prepare(const GpuDevice& d, const std::vector<TableGradInput<Id>>& tables, GradPlan* plan) {
    using namespace gpu;
    const int T = static_cast<int>(tables.size());
    auto state = std::make_shared<GradState>();
    plan->rows_out.assign(T, 0);
    plan->state = state;
    int* starts = Alloc<int>(d, T + (T + kChunk - 1) / kChunk);
    if (!starts) return OutOfMemory();
    cudaMemsetAsync(starts, 0, sizeof(int) * (T + (T + kChunk - 1) / kChunk), StreamOf(d));
    for (int t = 0; t < T; ++t) {
      int64_t ids = 0;
      for (const auto& ft : tables[t].features) ids += ft.num_ids;
      plan->rows_out[t] = GradRowsBound(ids, tables[t].rows);
    }
    for (int first = 0, slot = 0; first < T; first += kChunk) {
      GradGroup gg;
      gg.first_table = first;
      gg.num_tables = std::min(kChunk, T - first);
      gg.starts = starts + slot;
      slot += gg.num_tables + 1;
      Error e = PrepareGroup(d, tables, &gg);
      if (!e.ok()) return e;
      state->groups.push_back(gg);
    }
    for (const auto& t : tables) state->dims.push_back(t.dim);
    cudaError_t c = cudaGetLastError();
    return c == cudaSuccess ? Error() : CudaFailure(c);
  }

  // Queues one group's expand, sort and per-table starts.
  Error PrepareGroup(const GpuDevice& d, const std::vector<TableGradInput<Id>>& tables, GradGroup* gg) {
    using namespace gpu;
    std::vector<FeatureView<Id>> features;
    std::vector<const void*> out_grads;
    std::vector<int> key_table, dims;
    std::vector<long long> limits;
    long long max_limit = 1;
    for (int t = 0; t < gg->num_tables; ++t) {
      const auto& in = tables[gg->first_table + t];
      max_limit = std::max<long long>(max_limit, IdLimit(in.rows));
      gg->precision = in.precision;  // one type for all of an op's output gradients
      for (size_t f = 0; f < in.features.size(); ++f) {
        features.push_back(in.features[f]);
        out_grads.push_back(in.out_grads[f]);
        key_table.push_back(t);
        dims.push_back(in.dim);
        limits.push_back(IdLimit(in.rows));
        gg->total += in.features[f].num_ids;
      }
    }
    gg->shift = BitsFor(max_limit - 1);
    if (gg->total == 0) return Error();
    auto* keys = Alloc<long long>(d, gg->total);
    gg->coef = Alloc<float>(d, gg->total);
    gg->grad_rows = Alloc<const void*>(d, gg->total);
    if (!keys || !gg->coef || !gg->grad_rows) return OutOfMemory();
    long long base = 0;
    for (size_t first = 0; first < features.size(); first += kChunk) {
      const size_t count = std::min<size_t>(kChunk, features.size() - first);
      Batch<Id> b = MakeBatch(features, first, count);
      for (size_t k = 0; k < count; ++k) {
        b.rows_out[k] = const_cast<void*>(out_grads[first + k]);
        b.dim[k] = dims[first + k];
        b.key_table[k] = key_table[first + k];
        b.table_rows[k] = limits[first + k];
        b.id_base[k] = base;
        base += features[first + k].num_ids;
      }
      const long long rows = b.row_start[count];
      if (rows > 0) {
        WithElement(gg->precision, [&](auto type) {
          ExpandKernel<Id, typename decltype(type)::type><<<(rows + kThreads - 1) / kThreads, kThreads, 0,
                                                            StreamOf(d)>>>(b, gg->shift, gg->num_tables, keys,
                                                                           gg->coef, gg->grad_rows);
        });
      }
    }
    const int bits = gg->shift + BitsFor(gg->num_tables);  // table indices 0..num_tables (dropped ids)
    Error e = GroupByKey(d, keys, static_cast<int>(gg->total), bits, &gg->groups);
    if (!e.ok()) return e;
    TableStartsKernel<<<1, kChunk + 1, 0, StreamOf(d)>>>(gg->groups, gg->num_tables, gg->shift, gg->starts);
    return Error();
  }

  void Finish(const GpuDevice& d, const GradPlan& plan, const std::vector<int64_t*>& indices,
              const std::vector<float*>& values) {
    using namespace gpu;
    const auto& state = *static_cast<const GradState*>(plan.state.get());
    for (const auto& gg : state.groups) {
      if (gg.total == 0) continue;
      GradOutputs o{};
      o.num_tables = gg.num_tables;
      int max_dim = 1;
      bool vec4 = true;
      for (int t = 0; t < gg.num_tables; ++t) {
        const int dim = state.dims[gg.first_table + t];
        o.indices[t] = reinterpret_cast<long long*>(indices[gg.first_table + t]);
        o.values[t] = values[gg.first_table + t];
        o.dim[t] = dim;
        o.row_start[t + 1] = o.row_start[t] + plan.rows_out[gg.first_table + t];
        max_dim = std::max(max_dim, dim);
        vec4 = vec4 && dim % 4 == 0;
      }
      // one thread group per output row (a bound on the distinct keys), not per position
      const long long rows = o.row_start[gg.num_tables];
      const int zgroup = GroupWidth(max_dim, 1);
      if (rows > 0) {
        ZeroSplitRowsKernel<<<(rows * zgroup + kThreads - 1) / kThreads, kThreads, 0, StreamOf(d)>>>(
            gg.groups, o, gg.starts, gg.shift, zgroup);
      }
      SumGroups(d, gg, o, max_dim, vec4);
      if (rows > 0) {
        PadKernel<<<(rows * zgroup + kThreads - 1) / kThreads, kThreads, 0, StreamOf(d)>>>(
            gg.groups, o, gg.starts, gg.shift, zgroup);
      }
    }
  }
};

template <typename Id>
struct CombineGrad<GpuDevice, Id> {
  // The lookup gradient's expand + sort + segment sum, written densely at each id's row of the
  // zeroed gradients: nothing to allocate by count, so no wait on the stream.
  Error operator()(const GpuDevice& d, const std::vector<TableView>& tables,
                   const std::vector<FeatureView<Id>>& features,
                   const std::vector<const float*>& out_grads, const std::vector<float*>& grads) {
    using namespace gpu;
    const int T = static_cast<int>(tables.size());
    std::vector<TableGradInput<Id>> in(T);
    for (int t = 0; t < T; ++t) {
      in[t].dim = tables[t].dim;
      in[t].rows = tables[t].rows;
      cudaMemsetAsync(grads[t], 0, sizeof(float) * static_cast<size_t>(tables[t].rows) * tables[t].dim,
                      StreamOf(d));
    }
    for (size_t f = 0; f < features.size(); ++f) {
      in[features[f].table].features.push_back(features[f]);
      in[features[f].table].out_grads.push_back(out_grads[f]);
    }
    int* starts = Alloc<int>(d, T + (T + kChunk - 1) / kChunk);
    if (!starts) return OutOfMemory();
    LookupGrad<GpuDevice, Id> grad;
    for (int first = 0, slot = 0; first < T; first += kChunk) {
      GradGroup gg;
      gg.first_table = first;
      gg.num_tables = std::min(kChunk, T - first);
      gg.starts = starts + slot;
      slot += gg.num_tables + 1;
      Error e = grad.PrepareGroup(d, in, &gg);
      if (!e.ok()) return e;
      if (gg.total == 0) continue;
      GradOutputs o{};
      o.num_tables = gg.num_tables;
      int max_dim = 1;
      bool vec4 = true;
      for (int t = 0; t < gg.num_tables; ++t) {
        const TableView& tv = tables[first + t];
        o.indices[t] = nullptr;
        o.values[t] = grads[first + t];
        o.dim[t] = tv.dim;
        o.rows[t] = tv.rows;
        max_dim = std::max(max_dim, tv.dim);
        vec4 = vec4 && tv.dim % 4 == 0;
      }
      SumGroups(d, gg, o, max_dim, vec4);
    }
    cudaError_t c = cudaGetLastError();
    return c == cudaSuccess ? Error() : CudaFailure(c);
  }
};

template struct CombineGrad<GpuDevice, int32_t>;
template struct CombineGrad<GpuDevice, int64_t>;
template struct FusedLookup<GpuDevice, int32_t>;
template struct FusedLookup<GpuDevice, int64_t>;
template struct LookupGrad<GpuDevice, int32_t>;
template struct LookupGrad<GpuDevice, int64_t>;

}  // namespace impl
}  // namespace tf_sok
