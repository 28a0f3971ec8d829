// The GPU key index's device pieces that both of its files use (dynamic_index_gpu.cu: the table's
// storage, export / import and the host tier's key map; dynamic_find_gpu.cu: the finds): the open-
// addressing table's probes, inserts and row claims, and stream helpers. Internal to those files.
#ifndef TF_SOK_CC_IMPL_DYNAMIC_INDEX_GPU_CUH_
#define TF_SOK_CC_IMPL_DYNAMIC_INDEX_GPU_CUH_

#include <algorithm>
#include <string>

#include <cooperative_groups.h>

#include "tf_sok/cc/impl/dynamic_index_gpu.h"
#include "tf_sok/cc/impl/gpu_util.cuh"

namespace tf_sok {
namespace impl {
namespace {

using gpu::StreamOf;

constexpr int64_t kEmpty = -1, kClaimed = -2, kTomb = -3;
constexpr int kThreads = 256;

inline int Blocks(int64_t n) { return static_cast<int>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads)); }

__device__ __forceinline__ int64_t Home(int64_t key, int64_t mask) {
  return static_cast<int64_t>(MixBits(static_cast<uint64_t>(key)) & static_cast<uint64_t>(mask));
}

// state of `key` in the table (-1 when absent); `where`: its bucket (or -1)
__device__ __forceinline__ int64_t Probe(const int64_t* keys, const int64_t* state, int64_t mask, int64_t key,
                                         int64_t* where) {
  int64_t p = Home(key, mask);
  while (true) {
    const int64_t s = state[p];
    if (s == kEmpty) {
      *where = -1;
      return -1;
    }
    if (s >= 0 && keys[p] == key) {
      *where = p;
      return s;
    }
    p = (p + 1) & mask;
  }
}

__global__ void FindKernel(const int64_t* tkeys, const int64_t* tstate, int64_t mask, const int64_t* keys, int64_t n,
                           int64_t* value, int64_t* where) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  int64_t w;
  value[i] = Probe(tkeys, tstate, mask, keys[i], &w);
  if (where) where[i] = w;
}

// Inserts keys absent from the table (distinct: one thread each) with their values.
__global__ void InsertKernel(int64_t* tkeys, unsigned long long* tstate, int64_t mask, const int64_t* keys,
                             const int64_t* values, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  int64_t p = Home(keys[i], mask);
  while (true) {
    const long long s = static_cast<long long>(*reinterpret_cast<volatile unsigned long long*>(&tstate[p]));
    if (s == kEmpty || s == kTomb) {
      if (atomicCAS(&tstate[p], static_cast<unsigned long long>(s), static_cast<unsigned long long>(kClaimed)) ==
          static_cast<unsigned long long>(s)) {
        tkeys[p] = keys[i];
        __threadfence();
        atomicExch(&tstate[p], static_cast<unsigned long long>(values[i]));
        return;
      }
      continue;  // lost the bucket: look at it again
    }
    p = (p + 1) & mask;
  }
}

// What a new key's row holds besides its values: written by the thread that takes the row.
struct NewRowMarks {
  int64_t* slot_key = nullptr;   // nullptr: NewRowsKernel writes them later
  uint8_t* live = nullptr;
  int64_t* generation = nullptr;
  int64_t* score = nullptr;
  int64_t* touched = nullptr;
  int64_t initial_score = 0, touched_mark = 0;
};

// The row of `key`, which was not in the table when the call began: the first thread to claim a
// free bucket for it (buckets are taken in probe order, so all of a key's threads meet at that
// bucket) takes the next row -- free rows first, as AssignRowsKernel -- and lists key and row at
// new_keys / new_rows[*count]; the key's other threads wait for the claimed bucket's row.
__device__ int64_t ClaimRow(int64_t* tkeys, unsigned long long* tstate, int64_t mask, int64_t key,
                            const int64_t* free_rows, int64_t free_count, int64_t next_free, int64_t* new_keys,
                            int64_t* new_rows, unsigned long long* count, const NewRowMarks& marks) {
  int64_t p = Home(key, mask);
  while (true) {
    const long long s = static_cast<long long>(*reinterpret_cast<volatile unsigned long long*>(&tstate[p]));
    if (s == kClaimed) {   // another thread is writing this bucket: its key is known in a moment
      __nanosleep(20);
      continue;
    }
    if (s >= 0) {
      __threadfence();   // the key read below is the one written before the row was published
      if (*reinterpret_cast<volatile int64_t*>(&tkeys[p]) == key) return s;
      p = (p + 1) & mask;
      continue;
    }
    // empty or tombstone: the first free bucket on the key's probe path
    if (atomicCAS(&tstate[p], static_cast<unsigned long long>(s), static_cast<unsigned long long>(kClaimed)) !=
        static_cast<unsigned long long>(s))
      continue;  // lost the bucket: look at it again
    // the threads of a warp that claim together take their rows with one atomic
    const cooperative_groups::coalesced_group group = cooperative_groups::coalesced_threads();
    unsigned long long first = 0;
    if (group.thread_rank() == 0) first = atomicAdd(count, static_cast<unsigned long long>(group.size()));
    const int64_t j = static_cast<int64_t>(group.shfl(first, 0)) + group.thread_rank();
    const int64_t row = j < free_count ? free_rows[free_count - 1 - j] : next_free + (j - free_count);
    tkeys[p] = key;
    new_keys[j] = key;
    new_rows[j] = row;
    if (marks.slot_key) {
      marks.slot_key[row] = key;
      marks.live[row] = 1;
      marks.generation[row] += 1;
      marks.score[row] = marks.initial_score;
      marks.touched[row] = marks.touched_mark;
    }
    __threadfence();
    atomicExch(&tstate[p], static_cast<unsigned long long>(row));
    return row;
  }
}

// The row of `key` (-1: absent) while other threads may be claiming buckets: the probe reads each
// bucket's state before its key, passes tombstones and buckets being claimed (ClaimRow waits for
// those), and ends at the first empty bucket.
__device__ int64_t HeldWhileClaiming(const int64_t* tkeys, const unsigned long long* tstate, int64_t mask,
                                     int64_t key) {
  int64_t p = Home(key, mask);
  while (true) {
    const long long s = static_cast<long long>(*reinterpret_cast<const volatile unsigned long long*>(&tstate[p]));
    if (s == kEmpty) return -1;
    if (s >= 0) {
      __threadfence();
      if (*reinterpret_cast<const volatile int64_t*>(&tkeys[p]) == key) return s;
    }
    p = (p + 1) & mask;   // another key, a tombstone, or a bucket being claimed
  }
}

__global__ void SetStateKernel(int64_t* tstate, const int64_t* where, const int64_t* value, int64_t constant,
                               int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && where[i] >= 0) tstate[where[i]] = value ? value[i] : constant;
}

int64_t PowerOfTwoAtLeast(int64_t n) {
  int64_t p = 1024;
  while (p < n) p <<= 1;
  return p;
}

// flagged items of `in` (n) to `out`; returns the count (waits for the stream)
template <typename T>
int64_t Compact(const GpuDevice& d, const T* in, const uint8_t* flags, int64_t n, T* out, std::string* error) {
  cudaStream_t s = StreamOf(d);
  auto* count = gpu::Alloc<int64_t>(d, 1);
  size_t bytes = 0;
  cub::DeviceSelect::Flagged(nullptr, bytes, in, flags, out, count, n, s);
  void* temp = d.scratch->Allocate(std::max<size_t>(bytes, 1));
  if (!count || !temp) {
    *error = "ran out of GPU memory";
    return 0;
  }
  cub::DeviceSelect::Flagged(temp, bytes, in, flags, out, count, n, s);
  int64_t host = 0;
  cudaMemcpyAsync(&host, count, sizeof(host), cudaMemcpyDeviceToHost, s);
  const cudaError_t c = cudaStreamSynchronize(s);
  if (c != cudaSuccess) *error = std::string("CUDA error ") + cudaGetErrorString(c);
  return host;
}

}  // namespace
}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_DYNAMIC_INDEX_GPU_CUH_
