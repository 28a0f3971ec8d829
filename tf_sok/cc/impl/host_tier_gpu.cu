// The host tier's rows on the GPU (dynamic_index_gpu.h): a hybrid table's records moved between its
// cache and pinned host memory (gathered for the copies back, written and read in place), reads of
// rows from either, the pinned host memory itself (growing in place), the link's measured rates,
// and the row utilities and input checks the dynamic-table kernels share.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>
#include <vector>

#include "tf_sok/cc/impl/dynamic_index_gpu.h"
#include "tf_sok/cc/impl/env.h"
#include "tf_sok/cc/impl/gpu_util.cuh"

namespace tf_sok {
namespace impl {
namespace {

using gpu::StreamOf;

constexpr int kThreads = 256;
inline int Blocks(int64_t n) { return static_cast<int>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads)); }
// a grid striding over scattered rows in host memory: a few blocks per SM read them fastest
// (benchmarks/host_link_rows.cu: grids of 132-1,056 blocks read at 36 GB/s, the best of its forms)
constexpr int64_t kStrideBlocks = 1056;
// Moves beside other work (StoreRecordLayout::beside, a prefetch's): TF_SOK_PREFETCH_BLOCKS_PER_SM blocks
// (read at each call, 1 to 64; default 1) per SM of the current device. Fewer leave the step's kernels
// room; more read the host link faster.
int64_t MoveGrid() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const auto per_sm = static_cast<int64_t>(EnvNumber("TF_SOK_PREFETCH_BLOCKS_PER_SM", 1, 64, true).value_or(1));
  return std::max(sms, 1) * per_sm;
}
// 2^lanes_log2 consecutive threads per new row (up to a warp): the key's bits once per thread,
// then the row's columns, consecutive threads writing consecutive floats
__global__ void InitialRowsAtKernel(int kind, float a, float b, int64_t seed, const int64_t* keys,
                                    const int64_t* rows, int64_t n, int64_t width, int lanes_log2, float* base) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t j = i >> lanes_log2;
  if (j >= n) return;
  const int lanes = 1 << lanes_log2;
  const uint64_t bits = InitialKeyBits(seed, keys[j]);
  float* row = base + rows[j] * width;
  for (int64_t c = i & (lanes - 1); c < width; c += lanes) row[c] = InitialValue(kind, a, b, bits, c);
}

// one thread per float (or float4, when rows are whole float4s) of the moved rows; the store side is
// pinned host memory, read or written in place over the host link, consecutive threads touching
// consecutive words of a row (the store's rows `stride` words apart)
template <typename V>
__global__ void StoreWriteKernel(const V* cache, int64_t width, const int64_t* cache_rows,
                                 const int64_t* store_row_of, int64_t n, V* store, int64_t stride) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * width) return;
  const int64_t j = i / width, c = i - j * width;
  const int64_t r = cache_rows[j];
  store[store_row_of[r] * stride + c] = cache[r * width + c];
}

// The array of a word of a store record (its arrays side by side, words between them padding: -1).
__device__ int RecordArray(const StoreRecordLayout& l, int64_t w) {
  for (int a = 0; a < l.arrays; ++a)
    if (w >= l.offset[a] && w < l.offset[a] + l.width[a]) return a;
  return -1;
}

// word w of record j of store rows store_rows[j] read into cache row cache_rows[j] of its array
template <typename V>
__device__ void ReadRecordWord(const StoreRecordLayout& l, int64_t i, const int64_t* store_rows, const uint8_t* fresh,
                               const int64_t* cache_rows, const V* store) {
  const int64_t j = i / l.stride, w = i - j * l.stride;
  if (fresh != nullptr && fresh[j]) return;
  const int a = RecordArray(l, w);
  if (a >= 0)
    reinterpret_cast<V*>(l.cache[a])[cache_rows[j] * l.width[a] + (w - l.offset[a])] =
        store[store_rows[j] * l.stride + w];
}

// The evicted records (their meta: the marks and scores given; every array's cache row
// evicted_slots[j]; padding zero) gathered into device memory, `out` [n, stride], before new keys
// take the rows.
// (rows_out, when given: store_row_of[cache_rows[j]], each record's store row)
template <typename V>
__global__ void GatherRecordsKernel(StoreRecordLayout l, const int64_t* cache_rows, int64_t n, V* out,
                                    const int64_t* store_row_of, int64_t* rows_out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * l.stride) return;
  const int64_t j = i / l.stride, w = i - j * l.stride;
  if (w < l.meta) {   // (its first word's thread writes both int64, and the store row)
    if (w == 0) {
      int64_t* meta = reinterpret_cast<int64_t*>(out + i);
      meta[0] = l.touched[j];
      meta[1] = l.scores != nullptr ? l.scores[j] : 0;
      if (rows_out != nullptr) rows_out[j] = store_row_of[cache_rows[j]];
    }
    return;
  }
  const int a = RecordArray(l, w);
  out[i] = a >= 0 ? reinterpret_cast<const V*>(l.cache[a])[cache_rows[j] * l.width[a] + (w - l.offset[a])] : V{};
}

// The gathered evicted records written to their store rows and the new keys' records read in, in one
// grid, blocks of writes and reads alternating (then the rest of the larger), so that writes to and
// reads from host memory are in flight together; each record one contiguous run of host memory.
template <typename V>
__global__ void MoveRecordsKernel(StoreRecordLayout l, const V* evicted, const int64_t* evicted_slots,
                                  const int64_t* store_row_of, int64_t n_out, const int64_t* store_rows,
                                  const uint8_t* fresh, const int64_t* cache_rows, int64_t n_in, V* store) {
  const int64_t per = blockDim.x, words_out = n_out * l.stride, words_in = n_in * l.stride;
  const int64_t blocks_out = (words_out + per - 1) / per, blocks_in = (words_in + per - 1) / per;
  const int64_t paired = 2 * (blocks_out < blocks_in ? blocks_out : blocks_in);
  // (a grid smaller than the words' blocks strides over them: MoveGrid)
  for (int64_t b = blockIdx.x; b < blocks_out + blocks_in; b += gridDim.x) {
    const bool out = b < paired ? b % 2 == 0 : blocks_out > blocks_in;
    const int64_t i = (b < paired ? b / 2 : b - paired / 2) * per + threadIdx.x;
    if (out) {
      if (i >= words_out) continue;
      const int64_t j = i / l.stride, w = i - j * l.stride;
      store[store_row_of[evicted_slots[j]] * l.stride + w] = evicted[i];
    } else if (i < words_in) {
      ReadRecordWord<V>(l, i, store_rows, fresh, cache_rows, store);
    }
  }
}

// MoveRecordsKernel's reads alone (a call that evicts nothing): a grid of kStrideBlocks that strides
// over the words
template <typename V>
__global__ void ReadRecordsKernel(StoreRecordLayout l, const int64_t* store_rows, const uint8_t* fresh,
                                  const int64_t* cache_rows, int64_t n, const V* store) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n * l.stride;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    ReadRecordWord<V>(l, i, store_rows, fresh, cache_rows, store);
}

__global__ void StoreFreshKernel(int64_t width, const uint8_t* fresh, const int64_t* keys, const int64_t* cache_rows,
                                 int64_t n, int init_kind, float a, float b, int64_t seed, float fill, float* cache) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * width) return;
  const int64_t j = i / width, c = i - j * width;
  if (fresh[j])
    cache[cache_rows[j] * width + c] =
        init_kind >= 0 ? InitialValue(init_kind, a, b, InitialKeyBits(seed, keys[j]), c) : fill;
}

// ReadRows (host_store.h) on the device, one thread per word of the out rows (V: float, or float4 when
// the rows are whole float4s: width and stride in words), striding over them: a cached key's word from
// device memory, a key of the host tier's read over the host link in place, others computed
template <typename V>
__global__ void ReadRowsKernel(const int64_t* keys, const int64_t* slots, const int64_t* store_rows, int64_t n,
                               const V* cache, int64_t width, const V* store, int64_t stride, int init_kind, float a,
                               float b, int64_t seed, V* out) {
  constexpr int kFloats = sizeof(V) / sizeof(float);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n * width;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i / width, c = i - j * width;
    const int64_t s = slots[j], r = store_rows != nullptr ? store_rows[j] : -1;
    if (s >= 0) {
      out[i] = cache[s * width + c];
    } else if (r >= 0) {
      out[i] = store[r * stride + c];
    } else {
      float v[kFloats];
      const uint64_t bits = init_kind >= 0 ? InitialKeyBits(seed, keys[j]) : 0;
      for (int k = 0; k < kFloats; ++k)
        v[k] = init_kind >= 0 ? InitialValue(init_kind, a, b, bits, c * kFloats + k) : 0.0f;
      out[i] = *reinterpret_cast<const V*>(v);
    }
  }
}

__global__ void Scatter64Kernel(const int64_t* at, const int64_t* values, int64_t n, int64_t* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[at[i]] = values[i];
}

bool Float4Rows(int64_t width, const void* a, const void* b) {
  return width % 4 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

__global__ void FillRowsKernel(float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * width) return;
  const int64_t j = i / width;
  base[rows[j] * width + (i - j * width)] = fill;
}

__global__ void GatherRowsKernel(const float* base, int64_t stride, int64_t width, const int64_t* rows, int64_t n,
                                 float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * width) return;
  const int64_t j = i / width;
  out[i] = base[rows[j] * stride + (i - j * width)];
}

__global__ void FillKernel(float* p, int64_t count, float value) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < count) p[i] = value;
}

// features' row_splits checked at once: block (x, f) looks at a span of feature f's splits and
// clears valid[f] (set beforehand) when they decrease there; block (0, f) also checks the ends
struct SplitsChecks {
  static constexpr int kMax = 32;
  const int64_t* splits[kMax];
  int64_t n[kMax];
  int64_t count[kMax];
};
constexpr int kSplitsPerBlock = kThreads * 4;

__global__ void RowSplitsValidKernel(SplitsChecks c, bool* valid) {
  const int f = blockIdx.y;
  const int64_t* splits = c.splits[f];
  const int64_t n = c.n[f];
  const int64_t begin = 1 + blockIdx.x * static_cast<int64_t>(kSplitsPerBlock);
  const int64_t end = begin + kSplitsPerBlock < n ? begin + kSplitsPerBlock : n;
  int bad = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) bad |= splits[i] < splits[i - 1];
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0 && blockIdx.x == 0) bad |= n < 1 || splits[0] != 0 || splits[n - 1] != c.count[f];
  if (threadIdx.x == 0 && bad) valid[f] = false;
}

// ids' bounds checked at once: block (x, f) takes the min and max of a span of feature f's values
// into bounds[2f], bounds[2f + 1] (set to LLONG_MAX, LLONG_MIN beforehand); then one block gives each
// feature its verdict
struct RangeChecks {
  static constexpr int kMax = 32;
  const long long* values[kMax];
  int64_t count[kMax];
  int64_t rows[kMax];
};
constexpr int kIdsPerBlock = kThreads * 8;

__global__ void InitBoundsKernel(long long* bounds, int features) {
  const int f = threadIdx.x;
  if (f < features) {
    bounds[2 * f] = LLONG_MAX;
    bounds[2 * f + 1] = LLONG_MIN;
  }
}

__global__ void IdsBoundsKernel(RangeChecks c, long long* bounds) {
  const int f = blockIdx.y;
  const int64_t begin = blockIdx.x * static_cast<int64_t>(kIdsPerBlock);
  if (c.values[f] == nullptr || begin >= c.count[f]) return;   // (the whole block)
  const int64_t end = begin + kIdsPerBlock < c.count[f] ? begin + kIdsPerBlock : c.count[f];
  long long lo = LLONG_MAX, hi = LLONG_MIN;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const long long v = c.values[f][i];
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const long long l = __shfl_xor_sync(0xffffffffu, lo, o), h = __shfl_xor_sync(0xffffffffu, hi, o);
    lo = l < lo ? l : lo;
    hi = h > hi ? h : hi;
  }
  if ((threadIdx.x & 31) == 0 && lo <= hi) {
    atomicMin(&bounds[2 * f], lo);
    atomicMax(&bounds[2 * f + 1], hi);
  }
}

__global__ void RangeVerdictKernel(RangeChecks c, const long long* bounds, int features, bool* in_range,
                                   int64_t* offending) {
  const int f = threadIdx.x;
  if (f >= features) return;
  const long long lo = bounds[2 * f], hi = bounds[2 * f + 1];
  // no values (lo > hi) or no bound: in range
  const bool ok = c.values[f] == nullptr || lo > hi || (lo >= 0 && hi < c.rows[f]);
  in_range[f] = ok;
  offending[f] = ok ? 0 : (lo < 0 ? lo : hi);
}

}  // namespace

void GpuInitialRowsAt(const GpuDevice& d, int kind, float a, float b, int64_t seed, const int64_t* keys,
                      const int64_t* rows, int64_t n, int64_t width, float* base) {
  if (n * width <= 0) return;
  int lanes_log2 = 0;
  while (lanes_log2 < 5 && (int64_t{1} << lanes_log2) < width) ++lanes_log2;
  InitialRowsAtKernel<<<Blocks(n << lanes_log2), kThreads, 0, StreamOf(d)>>>(kind, a, b, seed, keys, rows, n, width,
                                                                            lanes_log2, base);
}

void GpuStoreWrite(const GpuDevice& d, const float* cache, int64_t width, const int64_t* cache_rows,
                   const int64_t* store_row_of, int64_t n, float* store, int64_t stride) {
  if (n * width == 0) return;
  if (Float4Rows(width, cache, store) && stride % 4 == 0) {
    const int64_t w = width / 4;
    StoreWriteKernel<<<Blocks(n * w), kThreads, 0, StreamOf(d)>>>(reinterpret_cast<const float4*>(cache), w,
                                                                   cache_rows, store_row_of, n,
                                                                   reinterpret_cast<float4*>(store), stride / 4);
  } else {
    StoreWriteKernel<<<Blocks(n * width), kThreads, 0, StreamOf(d)>>>(cache, width, cache_rows, store_row_of, n,
                                                                       store, stride);
  }
}

namespace {
// The layout in words of V (float4 when every array's rows, offsets and pointers allow it).
bool Float4Records(const StoreRecordLayout& l, const void* store, const void* evicted) {
  bool ok = l.stride % 4 == 0 && reinterpret_cast<uintptr_t>(store) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(evicted) % 16 == 0;
  for (int a = 0; a < l.arrays; ++a)
    ok = ok && l.offset[a] % 4 == 0 && Float4Rows(l.width[a], l.cache[a], store);
  return ok;
}

StoreRecordLayout InWords(StoreRecordLayout l, int64_t words) {
  l.stride /= words;
  l.meta /= words;
  for (int a = 0; a < l.arrays; ++a) {
    l.offset[a] /= words;
    l.width[a] /= words;
  }
  return l;
}

template <typename V>
void MoveRecords(const GpuDevice& d, const StoreRecordLayout& l, const float* evicted, const int64_t* evicted_slots,
                 const int64_t* store_row_of, int64_t n_out, const int64_t* store_rows, const uint8_t* fresh,
                 const int64_t* cache_rows, int64_t n_in, float* store) {
  const int64_t blocks = (n_out * l.stride + kThreads - 1) / kThreads + (n_in * l.stride + kThreads - 1) / kThreads;
  if (n_out == 0) {
    const int grid = static_cast<int>(std::min<int64_t>(blocks, l.beside ? MoveGrid() : kStrideBlocks));
    ReadRecordsKernel<V><<<grid, kThreads, 0, StreamOf(d)>>>(l, store_rows, fresh, cache_rows, n_in,
                                                              reinterpret_cast<const V*>(store));
  } else {
    const int grid = static_cast<int>(l.beside ? std::min<int64_t>(blocks, MoveGrid()) : blocks);
    MoveRecordsKernel<V><<<grid, kThreads, 0, StreamOf(d)>>>(l, reinterpret_cast<const V*>(evicted), evicted_slots,
                                                                store_row_of, n_out, store_rows, fresh, cache_rows,
                                                                n_in, reinterpret_cast<V*>(store));
  }
}
}  // namespace

void GpuGatherRecords(const GpuDevice& d, const StoreRecordLayout& l, const int64_t* cache_rows, int64_t n,
                      float* out, const int64_t* store_row_of, int64_t* rows_out) {
  if (n * l.stride == 0) return;
  if (Float4Records(l, out, out)) {
    const StoreRecordLayout w = InWords(l, 4);
    GatherRecordsKernel<float4><<<Blocks(n * w.stride), kThreads, 0, StreamOf(d)>>>(
        w, cache_rows, n, reinterpret_cast<float4*>(out), store_row_of, rows_out);
  } else {
    GatherRecordsKernel<float><<<Blocks(n * l.stride), kThreads, 0, StreamOf(d)>>>(l, cache_rows, n, out,
                                                                                    store_row_of, rows_out);
  }
}

void GpuMoveRecords(const GpuDevice& d, const StoreRecordLayout& l, const float* evicted, const int64_t* evicted_slots,
                    const int64_t* store_row_of, int64_t n_out, const int64_t* store_rows, const uint8_t* fresh,
                    const int64_t* cache_rows, int64_t n_in, float* store) {
  if ((n_out + n_in) * l.stride == 0) return;
  if (Float4Records(l, store, n_out > 0 ? evicted : store))
    MoveRecords<float4>(d, InWords(l, 4), evicted, evicted_slots, store_row_of, n_out, store_rows, fresh, cache_rows,
                        n_in, store);
  else
    MoveRecords<float>(d, l, evicted, evicted_slots, store_row_of, n_out, store_rows, fresh, cache_rows, n_in, store);
}

void GpuStoreFresh(const GpuDevice& d, int64_t width, const uint8_t* fresh, const int64_t* keys,
                   const int64_t* cache_rows, int64_t n, int init_kind, float a, float b, int64_t seed, float fill,
                   float* cache) {
  if (n * width > 0 && fresh != nullptr)
    StoreFreshKernel<<<Blocks(n * width), kThreads, 0, StreamOf(d)>>>(width, fresh, keys, cache_rows, n, init_kind, a,
                                                                       b, seed, fill, cache);
}

void GpuReadRows(const GpuDevice& d, const int64_t* keys, const int64_t* slots, const int64_t* store_rows, int64_t n,
                 const float* cache, int64_t width, const float* store, int64_t stride, int init_kind, float a,
                 float b, int64_t seed, float* out) {
  if (n * width == 0) return;
  const bool words4 = Float4Rows(width, cache, out) && (store == nullptr || (Float4Rows(stride, store, out)));
  const int64_t k = words4 ? 4 : 1;
  const int grid = static_cast<int>(std::min<int64_t>(Blocks(n * width / k), kStrideBlocks));
  if (words4)
    ReadRowsKernel<float4><<<grid, kThreads, 0, StreamOf(d)>>>(
        keys, slots, store_rows, n, reinterpret_cast<const float4*>(cache), width / 4,
        reinterpret_cast<const float4*>(store), stride / 4, init_kind, a, b, seed, reinterpret_cast<float4*>(out));
  else
    ReadRowsKernel<float><<<grid, kThreads, 0, StreamOf(d)>>>(keys, slots, store_rows, n, cache, width, store, stride,
                                                              init_kind, a, b, seed, out);
}

void GpuScatter64(const GpuDevice& d, const int64_t* at, const int64_t* values, int64_t n, int64_t* out) {
  if (n > 0) Scatter64Kernel<<<Blocks(n), kThreads, 0, StreamOf(d)>>>(at, values, n, out);
}

namespace {
__global__ void CopyWordsKernel(const float4* in, float4* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = in[i];
}
}  // namespace

std::string GpuHostLinkBandwidth(const GpuDevice& d, void* device_buffer, int64_t bytes, int repeats,
                                 double gbps[4]) {
  cudaStream_t s = StreamOf(d);
  bytes -= bytes % 16;
  void* host = nullptr;
  if (bytes <= 0) return "needs at least 16 bytes";
  if (cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return "could not pin " + std::to_string(bytes) + " bytes of host memory";
  }
  std::memset(host, 1, bytes);   // pages present before timing
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const int64_t words = bytes / 16;
  const int blocks = static_cast<int>(std::min<int64_t>(Blocks(words), 1 << 16));
  std::string error;
  for (int mode = 0; mode < 4 && error.empty(); ++mode) {
    float best = 0.0f;
    for (int r = 0; r <= repeats; ++r) {   // the first round warms up
      cudaEventRecord(start, s);
      if (mode == 0) cudaMemcpyAsync(device_buffer, host, bytes, cudaMemcpyHostToDevice, s);
      if (mode == 1) cudaMemcpyAsync(host, device_buffer, bytes, cudaMemcpyDeviceToHost, s);
      if (mode == 2)
        CopyWordsKernel<<<blocks, kThreads, 0, s>>>(static_cast<const float4*>(host),
                                                    static_cast<float4*>(device_buffer), words);
      if (mode == 3)
        CopyWordsKernel<<<blocks, kThreads, 0, s>>>(static_cast<const float4*>(device_buffer),
                                                    static_cast<float4*>(host), words);
      cudaEventRecord(stop, s);
      const cudaError_t c = cudaEventSynchronize(stop);
      if (c != cudaSuccess) {
        error = std::string("CUDA error ") + cudaGetErrorString(c);
        break;
      }
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, start, stop);
      if (r > 0 && (best == 0.0f || ms < best)) best = ms;
    }
    gbps[mode] = best > 0.0f ? static_cast<double>(bytes) / (best * 1e6) : 0.0;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFreeHost(host);
  return error;
}

namespace {
class PinnedHostMemory : public HostMemory {
 public:
  void* Allocate(size_t bytes) override {
    void* p = nullptr;
    if (cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error
      return nullptr;
    }
    return p;
  }
  void Free(void* p) override {
    if (p) cudaFreeHost(p);
  }
};
}  // namespace

std::unique_ptr<HostMemory> NewPinnedHostMemory() { return std::make_unique<PinnedHostMemory>(); }

namespace {
// Pinned memory that grows in place: a range of address space reserved (no memory behind it), its
// used front made readable and writable and registered with CUDA (pinned, mapped) piece by piece.
// Kernels use the host address as the device address (checked per piece), so every piece of a
// region is one contiguous array to them.
class GrowablePinnedHostMemory : public HostMemory {
 public:
  void* Allocate(size_t bytes) override {
    const size_t reserve = RoundUp(std::max(bytes, ReserveBytes()));
    void* p = mmap(nullptr, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return plain_.Allocate(bytes);
    Region r;
    r.reserved = reserve;
    if (!Commit(p, &r, bytes)) {
      munmap(p, reserve);
      return plain_.Allocate(bytes);   // (no host-pointer access to registered memory, or out of memory)
    }
    std::lock_guard<std::mutex> lock(mu_);
    regions_[p] = std::move(r);
    return p;
  }
  bool Grow(void* p, size_t, size_t to) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(p);
    return it != regions_.end() && Commit(p, &it->second, to);
  }
  void Free(void* p) override {
    if (p == nullptr) return;
    Region r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = regions_.find(p);
      if (it == regions_.end()) {
        plain_.Free(p);
        return;
      }
      r = std::move(it->second);
      regions_.erase(it);
    }
    for (const auto& piece : r.pieces) cudaHostUnregister(piece.first);
    munmap(p, r.reserved);
  }

 private:
  static constexpr size_t kPiece = size_t{2} << 20;   // pieces of whole 2 MiB (huge) pages
  struct Region {
    size_t reserved = 0, committed = 0;
    std::vector<std::pair<void*, size_t>> pieces;   // registered with CUDA
  };
  static size_t RoundUp(size_t n) { return (std::max<size_t>(n, 1) + kPiece - 1) / kPiece * kPiece; }
  // address space per region: the host's memory (pinned memory cannot exceed it)
  static size_t ReserveBytes() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : size_t{64} << 30;
  }
  // the region's first `bytes` usable (pinned, mapped at the same address); false: out of its range,
  // of memory, or the device would need another address
  static bool Commit(void* p, Region* r, size_t bytes) {
    const size_t to = RoundUp(bytes);
    if (to <= r->committed) return true;
    if (to > r->reserved) return false;
    char* at = static_cast<char*>(p) + r->committed;
    const size_t len = to - r->committed;
    if (mprotect(at, len, PROT_READ | PROT_WRITE) != 0) return false;
    madvise(at, len, MADV_HUGEPAGE);
    void* device = nullptr;
    if (cudaHostRegister(at, len, cudaHostRegisterPortable | cudaHostRegisterMapped) != cudaSuccess) {
      cudaGetLastError();
      mprotect(at, len, PROT_NONE);
      return false;
    }
    if (cudaHostGetDevicePointer(&device, at, 0) != cudaSuccess || device != at) {
      cudaGetLastError();
      cudaHostUnregister(at);
      mprotect(at, len, PROT_NONE);
      return false;
    }
    r->pieces.emplace_back(at, len);
    r->committed = to;
    return true;
  }
  PinnedHostMemory plain_;
  std::mutex mu_;
  std::unordered_map<void*, Region> regions_;
};
}  // namespace

std::unique_ptr<HostMemory> NewGrowablePinnedHostMemory() { return std::make_unique<GrowablePinnedHostMemory>(); }

void GpuFillRows(const GpuDevice& d, float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  if (n * width > 0) FillRowsKernel<<<Blocks(n * width), kThreads, 0, StreamOf(d)>>>(base, width, rows, n, fill);
}

void GpuGatherRows(const GpuDevice& d, const float* base, int64_t stride, int64_t width, const int64_t* rows, int64_t n,
                   float* out) {
  if (n * width > 0)
    GatherRowsKernel<<<Blocks(n * width), kThreads, 0, StreamOf(d)>>>(base, stride, width, rows, n, out);
}

void GpuRowSplitsValid(const GpuDevice& d, const int64_t* const* splits, const int64_t* n, const int64_t* count,
                       int features, bool* valid) {
  cudaStream_t s = StreamOf(d);
  if (features > 0) cudaMemsetAsync(valid, 1, features, s);
  for (int first = 0; first < features; first += SplitsChecks::kMax) {
    SplitsChecks c{};
    const int k = std::min(SplitsChecks::kMax, features - first);
    int64_t longest = 1;
    for (int f = 0; f < k; ++f) {
      c.splits[f] = splits[first + f];
      c.n[f] = n[first + f];
      c.count[f] = count[first + f];
      longest = std::max(longest, n[first + f]);
    }
    const dim3 grid(static_cast<unsigned>((longest + kSplitsPerBlock - 1) / kSplitsPerBlock), k);
    RowSplitsValidKernel<<<grid, kThreads, 0, s>>>(c, valid + first);
  }
}

void GpuIdsInRange(const GpuDevice& d, const int64_t* const* values, const int64_t* count, const int64_t* rows,
                   int features, bool* in_range, int64_t* offending) {
  cudaStream_t s = StreamOf(d);
  for (int first = 0; first < features; first += RangeChecks::kMax) {
    RangeChecks c{};
    const int k = std::min(RangeChecks::kMax, features - first);
    int64_t longest = 0;
    for (int f = 0; f < k; ++f) {
      const bool checked = values[first + f] != nullptr && rows[first + f] >= 0;
      c.values[f] = checked ? reinterpret_cast<const long long*>(values[first + f]) : nullptr;
      c.count[f] = checked ? count[first + f] : 0;
      c.rows[f] = rows[first + f];
      longest = std::max(longest, c.count[f]);
    }
    auto* bounds = gpu::Alloc<long long>(d, 2 * k);
    InitBoundsKernel<<<1, RangeChecks::kMax, 0, s>>>(bounds, k);
    if (longest > 0) {
      const dim3 grid(static_cast<unsigned>((longest + kIdsPerBlock - 1) / kIdsPerBlock), k);
      IdsBoundsKernel<<<grid, kThreads, 0, s>>>(c, bounds);
    }
    RangeVerdictKernel<<<1, RangeChecks::kMax, 0, s>>>(c, bounds, k, in_range + first, offending + first);
  }
}

void GpuFill(const GpuDevice& d, float* p, int64_t count, float value) {
  if (count > 0) FillKernel<<<Blocks(count), kThreads, 0, StreamOf(d)>>>(p, count, value);
}

}  // namespace impl
}  // namespace tf_sok
