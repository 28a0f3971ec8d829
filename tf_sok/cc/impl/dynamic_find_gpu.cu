// The GPU key index's finds (dynamic_index_gpu.h): the probe of a call's keys, then the keys let in
// (admission), rows freed by eviction where the table is full, and the new keys' rows claimed; the
// index's storage and the rest of it are in dynamic_index_gpu.cu.
#include <algorithm>
#include <functional>
#include <string>

#include "tf_sok/cc/impl/dynamic_index_gpu.cuh"

namespace tf_sok {
namespace impl {
namespace {

// Inserts the keys of the positions the probe left without a row (slot < 0), one thread per
// position (ClaimRow). Every position's row is written.
__global__ void ClaimKernel(int64_t* tkeys, unsigned long long* tstate, int64_t mask, const int64_t* keys, int64_t n,
                            int64_t* slot, const int64_t* free_rows, int64_t free_count, int64_t next_free,
                            int64_t* new_keys, int64_t* new_rows, unsigned long long* count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n || slot[i] >= 0) return;
  slot[i] = ClaimRow(tkeys, tstate, mask, keys[i], free_rows, free_count, next_free, new_keys, new_rows, count,
                     NewRowMarks());
}

// The distinct keys of keys[0, n), listed at out[0, *count) in the order their first threads claimed
// them (ClaimRow in a scratch table of `mask` + 1 buckets, all empty, "rows" numbering the keys).
__global__ void DistinctKernel(int64_t* tkeys, unsigned long long* tstate, int64_t mask, const int64_t* keys,
                               int64_t n, int64_t* out, int64_t* numbers, unsigned long long* count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) ClaimRow(tkeys, tstate, mask, keys[i], nullptr, 0, 0, out, numbers, count, NewRowMarks());
}

// Find-or-insert in one pass, when every new key is let in and the table has room and rows for
// every position: a position whose key is held takes its row (marked touched by `call`); one whose
// probe reaches an empty bucket (the key is absent: tombstones are passed, so a key held beyond
// one is found) inserts it with ClaimRow, which also writes the new row's marks.
__global__ void FindOrClaimKernel(int64_t* tkeys, unsigned long long* tstate, int64_t mask, const int64_t* keys,
                                  int64_t n, int64_t* slot, int64_t* touched, int64_t call,
                                  const int64_t* free_rows, int64_t free_count, int64_t next_free, int64_t* new_keys,
                                  int64_t* new_rows, unsigned long long* count, NewRowMarks marks) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t key = keys[i];
  const int64_t s = HeldWhileClaiming(tkeys, tstate, mask, key);
  if (s >= 0) {
    slot[i] = s;
    touched[s] = call;
    return;
  }
  slot[i] = ClaimRow(tkeys, tstate, mask, key, free_rows, free_count, next_free, new_keys, new_rows, count, marks);
}

// Keys (distinct) given `value` in the table: set where held (the probe passes tombstones), else
// inserted at the first free bucket of their probe path.
__global__ void UpsertKernel(int64_t* tkeys, unsigned long long* tstate, int64_t mask, const int64_t* keys, int64_t n,
                             int64_t value) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t key = keys[i];
  int64_t p = Home(key, mask);
  while (true) {
    const long long s = static_cast<long long>(*reinterpret_cast<volatile unsigned long long*>(&tstate[p]));
    if (s == kEmpty) break;
    if (s >= 0 && *reinterpret_cast<volatile int64_t*>(&tkeys[p]) == key) {
      atomicExch(&tstate[p], static_cast<unsigned long long>(value));
      return;
    }
    p = (p + 1) & mask;
  }
  p = Home(key, mask);
  while (true) {
    const long long s = static_cast<long long>(*reinterpret_cast<volatile unsigned long long*>(&tstate[p]));
    if (s == kEmpty || s == kTomb) {
      if (atomicCAS(&tstate[p], static_cast<unsigned long long>(s), static_cast<unsigned long long>(kClaimed)) ==
          static_cast<unsigned long long>(s)) {
        tkeys[p] = key;
        __threadfence();
        atomicExch(&tstate[p], static_cast<unsigned long long>(value));
        return;
      }
      continue;
    }
    p = (p + 1) & mask;
  }
}

// per position: its row (-1 when absent), a flag for absent keys; found rows marked touched by `call`
__global__ void FindTouchKernel(const int64_t* tkeys, const int64_t* tstate, int64_t mask, const int64_t* keys,
                                int64_t n, int64_t* slot, uint8_t* missing, int64_t* touched, int64_t call) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  int64_t w;
  const int64_t r = Probe(tkeys, tstate, mask, keys[i], &w);
  slot[i] = r;
  missing[i] = r < 0;
  if (r >= 0) touched[r] = call;
}

// positions still without a row probed again (after the inserts); absent keys get `missing_row`
__global__ void RefindKernel(const int64_t* tkeys, const int64_t* tstate, int64_t mask, const int64_t* keys,
                             int64_t n, int64_t* slot, int64_t missing_row) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n || slot[i] >= 0) return;
  int64_t w;
  const int64_t r = Probe(tkeys, tstate, mask, keys[i], &w);
  slot[i] = r >= 0 ? r : missing_row;
}

__global__ void IotaKernel64(int64_t* out, int64_t n, int64_t start) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = start + i;
}

__global__ void MissingFlagsKernel(const int64_t* slot, int64_t n, uint8_t* flags) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) flags[i] = slot[i] < 0;
}

// in_tier (optional): keys a cache's host tier holds, admitted whatever the filter draws
__global__ void AdmitFlagsKernel(const int64_t* count, const int64_t* keys, const uint8_t* in_tier, int64_t n,
                                 int64_t min_frequency, float ratio, int64_t clock, uint8_t* admit, uint8_t* wait) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t seen = count[i] < 0 ? 0 : count[i];
  admit[i] = (in_tier && in_tier[i]) || (seen + 1 >= min_frequency && KeepNewKey(keys[i], clock, ratio));
  wait[i] = !admit[i];
}

__global__ void IncrementKernel(const int64_t* in, int64_t n, int64_t* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = (in[i] < 0 ? 0 : in[i]) + 1;
}

// live rows untouched since call `floor`
__global__ void EvictableFlagsKernel(const uint8_t* live, const int64_t* touched, int64_t floor, int64_t begin,
                                     int64_t end, uint8_t* flags) {
  const int64_t r = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r < end) flags[r - begin] = live[r] && touched[r] < floor;
}

__global__ void GatherKernel(const int64_t* from, const int64_t* index, int64_t n, int64_t* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = from[index[i]];
}

// found rows scored: LRU, the clock; LFU, +1 once per row however many positions hold its key (the
// first to turn touched[row] from `call` to -call; touched then differs from every later call)
__global__ void ScoreFoundKernel(const int64_t* slot, int64_t n, int64_t* touched, int64_t call, int64_t* score,
                                 int64_t clock, bool lfu) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n || slot[i] < 0) return;
  const int64_t r = slot[i];
  if (!lfu) {   // the same value from every position: no need to pick one
    score[r] = clock;
    return;
  }
  auto* t = reinterpret_cast<unsigned long long*>(&touched[r]);
  if (touched[r] == call &&
      atomicCAS(t, static_cast<unsigned long long>(call), static_cast<unsigned long long>(-call)) ==
          static_cast<unsigned long long>(call))
    score[r] += 1;
}

// victims leave: their buckets become tombstones, their rows free (pushed after free[free_count])
__global__ void EvictKernel(const int64_t* victims, int64_t n, const int64_t* tkeys, int64_t* tstate, int64_t mask,
                            const int64_t* slot_key, const int64_t* touched, uint8_t* live, int64_t* free_rows,
                            int64_t free_count, int64_t* evicted_keys, int64_t* evicted_slots,
                            int64_t* evicted_touched, const int64_t* score, int64_t* evicted_scores) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t r = victims[i], key = slot_key[r];
  int64_t w;
  Probe(tkeys, tstate, mask, key, &w);
  if (w >= 0) tstate[w] = kTomb;
  live[r] = 0;
  free_rows[free_count + i] = r;
  evicted_keys[i] = key;
  evicted_slots[i] = r;
  evicted_touched[i] = touched[r] < 0 ? -touched[r] : touched[r];   // LFU marks a scored row -call
  evicted_scores[i] = score[r];
}

// new key j gets the row free[free_count - 1 - j] while there are free rows, then next_free + ...
__global__ void AssignRowsKernel(const int64_t* free_rows, int64_t free_count, int64_t next_free, int64_t n,
                                 int64_t* rows) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j < n) rows[j] = j < free_count ? free_rows[free_count - 1 - j] : next_free + (j - free_count);
}

__global__ void NewRowsKernel(const int64_t* keys, const int64_t* rows, int64_t n, int64_t* slot_key, uint8_t* live,
                              int64_t* generation, int64_t* score, int64_t* touched, int64_t initial_score,
                              int64_t call) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= n) return;
  const int64_t r = rows[j];
  slot_key[r] = keys[j];
  live[r] = 1;
  generation[r] += 1;
  score[r] = initial_score;
  touched[r] = call;
}

// flagged items of `in` (n) to `out`, their count written to the device's `count` (no wait)
template <typename T>
bool CompactCount(const GpuDevice& d, const T* in, const uint8_t* flags, int64_t n, T* out, int64_t* count) {
  cudaStream_t s = StreamOf(d);
  size_t bytes = 0;
  cub::DeviceSelect::Flagged(nullptr, bytes, in, flags, out, count, n, s);
  void* temp = d.scratch->Allocate(std::max<size_t>(bytes, 1));
  if (!temp) return false;
  cub::DeviceSelect::Flagged(temp, bytes, in, flags, out, count, n, s);
  return true;
}

// sorted by the keys' bits [0, bits) (every bit by default; the keys must be >= 0 when fewer)
template <typename K, typename V>
bool SortPairs(const GpuDevice& d, const K* keys_in, K* keys_out, const V* values_in, V* values_out, int64_t n,
               int bits = static_cast<int>(sizeof(K) * 8)) {
  cudaStream_t s = StreamOf(d);
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys_in, keys_out, values_in, values_out, n, 0, bits, s);
  void* temp = d.scratch->Allocate(std::max<size_t>(bytes, 1));
  if (!temp) return false;
  cub::DeviceRadixSort::SortPairs(temp, bytes, keys_in, keys_out, values_in, values_out, n, 0, bits, s);
  return true;
}

}  // namespace

namespace {
// a count the device left at `count`, read back (waits for the stream)
int64_t ReadCount(const GpuDevice& d, const int64_t* count, std::string* error) {
  int64_t host = 0;
  cudaMemcpyAsync(&host, count, sizeof(host), cudaMemcpyDeviceToHost, StreamOf(d));
  const cudaError_t c = cudaStreamSynchronize(StreamOf(d));
  if (c != cudaSuccess) *error = std::string("CUDA error ") + cudaGetErrorString(c);
  return host;
}
}  // namespace

std::string GpuDynamicIndex::Find(const GpuDevice& d, const int64_t* keys, int64_t n, bool insert,
                                  GpuFindResult* out, bool admit_all, float insert_ratio,
                                  const std::function<void(int)>& mark, const HeldKeys& held) {
  if (!insert) {
    if (!init_error_.empty()) return init_error_;
    out->rows = rows_;
    out->slots = gpu::Alloc<int64_t>(d, n);
    if (!out->slots) return "ran out of GPU memory";
    if (n > 0)
      FindKernel<<<Blocks(n), kThreads, 0, StreamOf(d)>>>(keys_.keys, keys_.state, keys_.buckets - 1, keys, n,
                                                          out->slots, nullptr);
    return "";
  }
  GpuFindPending pending;
  auto* count = gpu::Alloc<int64_t>(d, 1);
  if (!count) return "ran out of GPU memory";
  std::string error = Probe(d, keys, n, out, &pending, count, admit_all ? 1.0f : insert_ratio);
  if (!error.empty() || n == 0) return error;
  if (mark) mark(0);
  const int64_t missing = ReadCount(d, count, &error);
  if (!error.empty()) return error;
  if (mark) mark(1);
  return Finish(d, &pending, missing, out, admit_all, insert_ratio, mark, held);
}

std::string GpuDynamicIndex::Finish(const GpuDevice& d, GpuFindPending* p, int64_t missing, GpuFindResult* out,
                                    bool admit_all, float insert_ratio, const std::function<void(int)>& mark,
                                    const HeldKeys& held) {
  auto* count = gpu::Alloc<int64_t>(d, 1);
  if (!count) return "ran out of GPU memory";
  std::string error = FinishDistinct(d, p, missing, out, count, admit_all ? 1.0f : insert_ratio);
  if (!error.empty()) return error;
  if (mark) mark(2);
  const int64_t distinct = p->fused ? missing : p->n > 0 && missing > 0 ? ReadCount(d, count, &error) : 0;
  if (!error.empty()) return error;
  if (mark) mark(3);
  bool evicts = false;
  error = FinishRoom(d, p, distinct, admit_all, insert_ratio, count, &evicts, held);
  if (!error.empty()) return error;
  if (mark) mark(4);
  const int64_t evictable = evicts ? ReadCount(d, count, &error) : 0;
  if (!error.empty()) return error;
  if (mark) mark(5);
  error = FinishCommit(d, p, evictable, out);
  if (mark) mark(6);
  return error;
}

std::string GpuDynamicIndex::Probe(const GpuDevice& d, const int64_t* keys, int64_t n, GpuFindResult* out,
                                   GpuFindPending* p, int64_t* count, float insert_ratio, bool prefetch) {
  if (!init_error_.empty()) return init_error_;
  if (prefetch && !config_.cache) return "prefetch is for the cache of a host tier";
  p->prefetch = prefetch;
  cudaStream_t s = StreamOf(d);
  out->rows = rows_;
  out->slots = gpu::Alloc<int64_t>(d, n);
  if (!out->slots) return "ran out of GPU memory";
  p->keys = keys;
  p->n = n;
  if (n == 0) {
    cudaMemsetAsync(count, 0, sizeof(int64_t), s);
    return "";
  }
  // a prefetch extends the last call; rows touched since `floor` are not evicted (see DynamicIndex)
  p->call = prefetch ? call_ : ++call_;
  if (!prefetch) call_times_.Record(p->call);
  p->floor = prefetch ? std::min(last_prefetch_, call_) : p->call;
  // every key let in, and room and rows for every position without growing: found and inserted in
  // one pass; the count left at *count is then that of the new keys (no missing positions' count)
  p->fused = !prefetch && !config_.cache && config_.min_frequency <= 1 && insert_ratio >= 1.0f &&
             (!config_.bounded() || live_ + n <= config_.max_keys) && (keys_.used + n) * 2 <= keys_.buckets &&
             next_free_ + std::max<int64_t>(0, n - free_count_) <= rows_;
  if (p->fused) {
    p->direct = true;
    p->missing = gpu::Alloc<int64_t>(d, n);
    out->new_slots = gpu::Alloc<int64_t>(d, n);
    if (!p->missing || !out->new_slots) return "ran out of GPU memory";
    NewRowMarks marks;
    marks.slot_key = slot_key_;
    marks.live = live_row_;
    marks.generation = generation_;
    marks.score = score_;
    marks.touched = touched_;
    // LFU: 0, and the commit's scoring of the call's rows adds the key's one count (touched == call)
    marks.initial_score = config_.evict == Evict::kLfu ? 0 : clock_ + 1;
    marks.touched_mark = p->call;
    cudaMemsetAsync(count, 0, sizeof(int64_t), s);
    FindOrClaimKernel<<<Blocks(n), kThreads, 0, s>>>(
        keys_.keys, reinterpret_cast<unsigned long long*>(keys_.state), keys_.buckets - 1, keys, n, out->slots,
        touched_, p->call, free_, free_count_, next_free_, p->missing, out->new_slots,
        reinterpret_cast<unsigned long long*>(count), marks);
    return "";
  }
  // every position probed, found rows touched; the keys of the missing positions compacted, their
  // count left on the device (no sort, no wait: a batch whose keys are all held needs neither)
  auto* missing_flags = gpu::Alloc<uint8_t>(d, n);
  p->missing_at = gpu::Alloc<int64_t>(d, n);
  if (!missing_flags || !p->missing_at) return "ran out of GPU memory";
  FindTouchKernel<<<Blocks(n), kThreads, 0, s>>>(keys_.keys, keys_.state, keys_.buckets - 1, keys, n, out->slots,
                                                 missing_flags, touched_, p->call);
  if (!CompactCount(d, keys, missing_flags, n, p->missing_at, count)) return "ran out of GPU memory";
  return "";
}

// 2. the distinct missing keys, their count left at *count, in the order they were told apart; or,
// when every one of them is let in without evicting (no admission, room for all), inserted right away
// in first-come order with their rows (p->direct)
std::string GpuDynamicIndex::FinishDistinct(const GpuDevice& d, GpuFindPending* p, int64_t mp, GpuFindResult* out,
                                            int64_t* count, float insert_ratio) {
  cudaStream_t s = StreamOf(d);
  p->mp = mp;
  out->missing_positions = mp;
  if (p->fused) return "";   // mp: the new keys, inserted by the probe, their count left at *count
  p->missing = gpu::Alloc<int64_t>(d, std::max<int64_t>(mp, 1));
  if (!p->missing) return "ran out of GPU memory";
  if (mp == 0) {
    cudaMemsetAsync(count, 0, sizeof(int64_t), s);
    return "";
  }
  p->direct = !p->prefetch && config_.min_frequency <= 1 && insert_ratio >= 1.0f &&
              (!config_.bounded() || live_ + mp <= config_.max_keys);
  if (p->direct) {   // room and rows for every missing position: at least as many as new keys
    std::string error = Room(d, &keys_, live_, mp);
    if (error.empty()) error = EnsureRows(d, next_free_ + std::max<int64_t>(0, mp - free_count_));
    if (!error.empty()) return error;
    out->new_slots = gpu::Alloc<int64_t>(d, mp);
    if (!out->new_slots) return "ran out of GPU memory";
    cudaMemsetAsync(count, 0, sizeof(int64_t), s);
    ClaimKernel<<<Blocks(p->n), kThreads, 0, s>>>(keys_.keys, reinterpret_cast<unsigned long long*>(keys_.state),
                                                  keys_.buckets - 1, p->keys, p->n, out->slots, free_, free_count_,
                                                  next_free_, p->missing, out->new_slots,
                                                  reinterpret_cast<unsigned long long*>(count));
    return "";
  }
  // told apart in a scratch hash table (one launch: no sort)
  const int64_t buckets = PowerOfTwoAtLeast(2 * mp);
  auto* tkeys = gpu::Alloc<int64_t>(d, buckets);
  auto* tstate = gpu::Alloc<int64_t>(d, buckets);
  auto* numbers = gpu::Alloc<int64_t>(d, mp);
  if (!tkeys || !tstate || !numbers) return "ran out of GPU memory";
  cudaMemsetAsync(tstate, 0xFF, sizeof(int64_t) * buckets, s);   // -1: empty
  cudaMemsetAsync(count, 0, sizeof(int64_t), s);
  DistinctKernel<<<Blocks(mp), kThreads, 0, s>>>(tkeys, reinterpret_cast<unsigned long long*>(tstate), buckets - 1,
                                                 p->missing_at, mp, p->missing, numbers,
                                                 reinterpret_cast<unsigned long long*>(count));
  return "";
}

// 3. admission (nothing written yet); 4. when the call must evict: the untouched rows, their count
// left at *count (*evicts: whether it must)
std::string GpuDynamicIndex::FinishRoom(const GpuDevice& d, GpuFindPending* p, int64_t m, bool admit_all,
                                        float insert_ratio, int64_t* count, bool* evicts, const HeldKeys& held) {
  *evicts = false;
  p->m = m;
  if (p->n == 0) return "";
  cudaStream_t s = StreamOf(d);
  const int64_t call = p->call;
  int64_t* missing = p->missing;
  std::string error;
  int64_t* admitted = missing;
  int64_t a = m, waiting_count = 0;
  int64_t *waiting = nullptr, *waiting_seen = nullptr, *waiting_where = nullptr, *admitted_where = nullptr;
  if (config_.cache && config_.min_frequency > 1) {
    // room for the keys the commit may write back (counted as seen: see FinishCommit) with m more
    const int64_t k_max = std::max<int64_t>(0, live_ + m - config_.max_keys);
    error = Room(d, &candidates_, candidates_live_, m + k_max);
    if (!error.empty()) return error;
  }
  if (p->prefetch && m > 0) {
    // the keys the host tier holds, their count known on the host (p->held_count): no count read back,
    // the admission counts left as they are
    auto* in_tier = gpu::Alloc<uint8_t>(d, m);
    auto* count = gpu::Alloc<int64_t>(d, 1);
    admitted = gpu::Alloc<int64_t>(d, m);
    if (!in_tier || !count || !admitted) return "ran out of GPU memory";
    error = held(missing, m, in_tier);
    if (!error.empty()) return error;
    if (!CompactCount(d, missing, in_tier, m, admitted, count)) return "ran out of GPU memory";
    a = p->held_count;
  } else if ((config_.min_frequency > 1 || insert_ratio < 1.0f) && m > 0) {
    error = Room(d, &candidates_, candidates_live_, m);  // now: the bucket positions found below stay valid
    if (!error.empty()) return error;
    auto* seen = gpu::Alloc<int64_t>(d, m);
    auto* where = gpu::Alloc<int64_t>(d, m);
    auto* admit = gpu::Alloc<uint8_t>(d, m);
    auto* wait = gpu::Alloc<uint8_t>(d, m);
    admitted = gpu::Alloc<int64_t>(d, m);
    waiting = gpu::Alloc<int64_t>(d, m);
    waiting_seen = gpu::Alloc<int64_t>(d, m);
    waiting_where = gpu::Alloc<int64_t>(d, m);
    admitted_where = gpu::Alloc<int64_t>(d, m);
    if (!seen || !where || !admit || !wait || !admitted || !waiting || !waiting_seen || !waiting_where ||
        !admitted_where)
      return "ran out of GPU memory";
    uint8_t* in_tier = nullptr;
    if (held && insert_ratio < 1.0f && !admit_all) {
      in_tier = gpu::Alloc<uint8_t>(d, m);
      if (!in_tier) return "ran out of GPU memory";
      error = held(missing, m, in_tier);
      if (!error.empty()) return error;
    }
    FindKernel<<<Blocks(m), kThreads, 0, s>>>(candidates_.keys, candidates_.state, candidates_.buckets - 1, missing,
                                              m, seen, where);
    AdmitFlagsKernel<<<Blocks(m), kThreads, 0, s>>>(seen, missing, in_tier, m, admit_all ? 1 : config_.min_frequency,
                                                    admit_all ? 1.0f : insert_ratio, clock_ + 1, admit, wait);
    a = Compact(d, missing, admit, m, admitted, &error);
    Compact(d, where, admit, m, admitted_where, &error);
    waiting_count = Compact(d, missing, wait, m, waiting, &error);
    Compact(d, seen, wait, m, waiting_seen, &error);
    Compact(d, where, wait, m, waiting_where, &error);
    if (!error.empty()) return error;
  }
  if (p->prefetch) waiting_count = 0;   // (no sightings counted)
  p->admitted = admitted;
  p->a = a;
  p->waiting = waiting;
  p->waiting_seen = waiting_seen;
  p->waiting_where = waiting_where;
  p->admitted_where = admitted_where;
  p->waiting_count = waiting_count;
  p->k = 0;
  if (!config_.bounded() || live_ + a <= config_.max_keys) return "";
  p->k = live_ + a - config_.max_keys;
  if (config_.evict == Evict::kNone) {
    return "is full: " + std::to_string(live_) + " of max_capacity " + std::to_string(config_.max_keys) +
           " keys held and this batch brings " + std::to_string(a) +
           " new ones; give evict_strategy (\"lru\" or \"lfu\") or a larger max_capacity";
  }
  const int64_t span = next_free_ - reserved_;
  auto* flags = gpu::Alloc<uint8_t>(d, span);
  auto* all_rows = gpu::Alloc<int64_t>(d, span);
  p->evictable = gpu::Alloc<int64_t>(d, span);
  if (!flags || !all_rows || !p->evictable) return "ran out of GPU memory";
  EvictableFlagsKernel<<<Blocks(span), kThreads, 0, s>>>(live_row_, touched_, p->floor, reserved_, next_free_, flags);
  IotaKernel64<<<Blocks(span), kThreads, 0, s>>>(all_rows, span, reserved_);
  if (!CompactCount(d, all_rows, flags, span, p->evictable, count)) return "ran out of GPU memory";
  *evicts = true;
  return "";
}

// 4. the victims: of the c untouched rows, the k of lowest (score, key), by two stable radix sorts;
// 5. commit; 6. the missing positions' rows
std::string GpuDynamicIndex::FinishCommit(const GpuDevice& d, GpuFindPending* p, int64_t c, GpuFindResult* out) {
  if (p->n == 0) return "";
  cudaStream_t s = StreamOf(d);
  const int64_t n = p->n, call = p->call, mp = p->mp, m = p->m, waiting_count = p->waiting_count;
  int64_t a = p->a;
  const int64_t* keys = p->keys;
  int64_t* slot = out->slots;
  int64_t *admitted = p->admitted, *waiting = p->waiting, *waiting_seen = p->waiting_seen;
  int64_t *waiting_where = p->waiting_where, *admitted_where = p->admitted_where;
  std::string error;
  int64_t* victims = nullptr;
  int64_t k = p->k;
  if (k > 0) {
    const int64_t* rows = p->evictable;
    if (config_.cache && config_.table_max_keys > 0 && live_ - c + a > config_.table_max_keys) {
      return "cannot hold this batch's keys: it uses " + std::to_string(live_ - c + a) +
             " distinct keys and max_capacity is " + std::to_string(config_.table_max_keys);
    }
    if (config_.cache) k = std::min(k, c);   // a cache holds this call's keys, whatever their number
    if (c < k) {  // live rows not evictable: the ones this batch found
      return "cannot hold this batch's keys: it uses " + std::to_string(live_ - c + a) +
             " distinct keys and max_capacity is " + std::to_string(config_.max_keys);
    }
    auto* rkeys = gpu::Alloc<int64_t>(d, c);
    auto* rkeys_sorted = gpu::Alloc<int64_t>(d, c);
    auto* rows_by_key = gpu::Alloc<int64_t>(d, c);
    auto* scores = gpu::Alloc<int64_t>(d, c);
    auto* scores_sorted = gpu::Alloc<int64_t>(d, c);
    victims = gpu::Alloc<int64_t>(d, c);
    if (!rkeys || !rkeys_sorted || !rows_by_key || !scores || !scores_sorted || !victims)
      return "ran out of GPU memory";
    GatherKernel<<<Blocks(c), kThreads, 0, s>>>(slot_key_, rows, c, rkeys);
    if (!SortPairs(d, rkeys, rkeys_sorted, rows, rows_by_key, c)) return "ran out of GPU memory";
    GatherKernel<<<Blocks(c), kThreads, 0, s>>>(score_, rows_by_key, c, scores);
    // scores lie in [0, clock_ + 1] (LRU: a clock value) or up to the largest imported one; LFU: a
    // count of calls, one per call at most, on top of an imported one (ScoreCap)
    const int64_t top = config_.evict == Evict::kLfu ? ScoreCap() : std::max(clock_ + 1, imported_score_);
    int bits = 1;
    while (bits < 63 && (int64_t{1} << bits) <= top) ++bits;
    if (!SortPairs(d, scores, scores_sorted, rows_by_key, victims, c, bits)) return "ran out of GPU memory";
  }
  if (p->prefetch) {   // no growth (the arrays are in use): the keys that fit in the rows as they are
    const int64_t unused = free_count_ + rows_ - next_free_;
    a = std::max<int64_t>(0, std::min(a, k + std::min(config_.max_keys - live_, unused)));
    k = std::min(k, std::max<int64_t>(0, live_ + a - config_.max_keys));   // (the first k victims: lowest first)
    last_prefetch_ = call;
  }
  // 5. commit
  error = Room(d, &keys_, live_, a);
  if (!error.empty()) return error;
  const int64_t taken = std::min(a, free_count_ + k);
  error = EnsureRows(d, next_free_ + (a - taken));
  if (!error.empty()) return error;
  const bool lfu = config_.evict == Evict::kLfu;
  if (!p->prefetch) {   // (a prefetch scores nothing: its keys take the last call's score)
    ++clock_;
    ScoreFoundKernel<<<Blocks(n), kThreads, 0, s>>>(slot, n, touched_, call, score_, clock_, lfu);
  }
  out->num_evicted = k;
  out->evicted_keys = gpu::Alloc<int64_t>(d, k);
  out->evicted_slots = gpu::Alloc<int64_t>(d, k);
  out->evicted_touched = gpu::Alloc<int64_t>(d, k);
  out->evicted_scores = gpu::Alloc<int64_t>(d, k);
  if (!p->direct) out->new_slots = gpu::Alloc<int64_t>(d, a);
  out->new_keys = admitted;
  if (!out->evicted_keys || !out->evicted_slots || !out->evicted_touched || !out->evicted_scores || !out->new_slots)
    return "ran out of GPU memory";
  if (k > 0) {
    EvictKernel<<<Blocks(k), kThreads, 0, s>>>(victims, k, keys_.keys, keys_.state, keys_.buckets - 1, slot_key_,
                                               touched_, live_row_, free_, free_count_, out->evicted_keys,
                                               out->evicted_slots, out->evicted_touched, score_,
                                               out->evicted_scores);
    free_count_ += k;
    live_ -= k;
  }
  if (!p->direct) {   // (direct: keys in and rows taken already)
    AssignRowsKernel<<<Blocks(a), kThreads, 0, s>>>(free_, free_count_, next_free_, a, out->new_slots);
    InsertKernel<<<Blocks(a), kThreads, 0, s>>>(keys_.keys, reinterpret_cast<unsigned long long*>(keys_.state),
                                                keys_.buckets - 1, admitted, out->new_slots, a);
  }
  if (!p->fused)   // (fused: the rows' marks written as they were taken)
    NewRowsKernel<<<Blocks(a), kThreads, 0, s>>>(admitted, out->new_slots, a, slot_key_, live_row_, generation_,
                                                 score_, touched_, lfu ? (p->prefetch ? 0 : 1) : clock_, call);
  keys_.used += a;
  live_ += a;
  next_free_ += a - std::min(a, free_count_);
  free_count_ -= std::min(a, free_count_);
  out->num_new = a;
  if (config_.min_frequency > 1 && m > 0 && !p->prefetch) {
    // admitted keys leave the candidates; waiting ones count one more sighting (found: in place)
    SetStateKernel<<<Blocks(a), kThreads, 0, s>>>(candidates_.state, admitted_where, nullptr, kTomb, a);
    auto* counts = gpu::Alloc<int64_t>(d, waiting_count);
    auto* fresh_flags = gpu::Alloc<uint8_t>(d, waiting_count);
    auto* fresh = gpu::Alloc<int64_t>(d, waiting_count);
    auto* fresh_counts = gpu::Alloc<int64_t>(d, waiting_count);
    if (!counts || !fresh_flags || !fresh || !fresh_counts) return "ran out of GPU memory";
    IncrementKernel<<<Blocks(waiting_count), kThreads, 0, s>>>(waiting_seen, waiting_count, counts);
    SetStateKernel<<<Blocks(waiting_count), kThreads, 0, s>>>(candidates_.state, waiting_where, counts, 0,
                                                              waiting_count);
    MissingFlagsKernel<<<Blocks(waiting_count), kThreads, 0, s>>>(waiting_where, waiting_count, fresh_flags);
    const int64_t f = Compact(d, waiting, fresh_flags, waiting_count, fresh, &error);
    Compact(d, counts, fresh_flags, waiting_count, fresh_counts, &error);
    if (!error.empty()) return error;
    InsertKernel<<<Blocks(f), kThreads, 0, s>>>(candidates_.keys,
                                                reinterpret_cast<unsigned long long*>(candidates_.state),
                                                candidates_.buckets - 1, fresh, fresh_counts, f);
    candidates_.used += f;
    candidates_live_ += f - a;
  }
  if (k > 0 && config_.cache && config_.min_frequency > 1) {
    // a cache's keys go back to the host tier, still in the table: admitted at their next sighting
    UpsertKernel<<<Blocks(k), kThreads, 0, s>>>(candidates_.keys,
                                                reinterpret_cast<unsigned long long*>(candidates_.state),
                                                candidates_.buckets - 1, out->evicted_keys, k, kHeldCount);
    candidates_.used += k;
    candidates_live_ += k;
  }
  // 6. the missing positions' rows, now that their keys are in (keys not admitted: row 0)
  if (mp > 0 && !p->direct)
    RefindKernel<<<Blocks(n), kThreads, 0, s>>>(keys_.keys, keys_.state, keys_.buckets - 1, keys, n, slot, 0);
  out->rows = rows_;
  // no wait: the call's scratch is stream-ordered memory (reused only by work queued after this)
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("CUDA error ") + cudaGetErrorString(e);
  return "";
}

}  // namespace impl
}  // namespace tf_sok
