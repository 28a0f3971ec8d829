// The key index of a dynamic table on the GPU (dynamic_index_gpu.h): its storage and growth, export
// and import, and the map of a host tier's keys; its finds (inserts, admission, eviction) are in
// dynamic_find_gpu.cu, the device pieces both use in dynamic_index_gpu.cuh, the host tier's rows and
// the row utilities in host_tier_gpu.cu.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tf_sok/cc/impl/dynamic_index_gpu.cuh"

namespace tf_sok {
namespace impl {
namespace {

// A host tier's keys on the device (GpuDynamicIndex::StoreMapRows): the store row of each of the
// distinct keys[n]; a key the map lacks is added with the next row from `base` on (ClaimRow: listed
// at added_keys / added_rows[*count]) and marked fresh. The map has no tombstones (no key leaves it).
__global__ void StoreRowsOrAddKernel(int64_t* tkeys, unsigned long long* tstate, int64_t mask, const int64_t* keys,
                                     int64_t n, int64_t base, int64_t* rows, uint8_t* fresh, int64_t* added_keys,
                                     int64_t* added_rows, unsigned long long* count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t key = keys[i];
  const int64_t s = HeldWhileClaiming(tkeys, tstate, mask, key);
  if (s >= 0) {
    rows[i] = s;
    fresh[i] = 0;
    return;
  }
  rows[i] = ClaimRow(tkeys, tstate, mask, key, nullptr, 0, base, added_keys, added_rows, count, NewRowMarks());
  fresh[i] = 1;
}

// rows[j]: the store row of keys[j] where slots[j] < 0 (-1: the map lacks it), -1 where the key is
// cached; *held (device) += the keys found.
__global__ void StoreRowsOfMissingKernel(const int64_t* tkeys, const int64_t* tstate, int64_t mask,
                                         const int64_t* keys, const int64_t* slots, int64_t n, int64_t* rows,
                                         unsigned long long* held) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int found = 0;
  if (i < n) {
    int64_t r = -1, where;
    if (slots == nullptr || slots[i] < 0) r = Probe(tkeys, tstate, mask, keys[i], &where);
    rows[i] = r;
    found = r >= 0;
  }
  const int block = __syncthreads_count(found);
  if (held != nullptr && threadIdx.x == 0 && block > 0) atomicAdd(held, static_cast<unsigned long long>(block));
}

// flags[j]: whether the map holds keys[j]
__global__ void HeldFlagsKernel(const int64_t* tkeys, const int64_t* tstate, int64_t mask, const int64_t* keys,
                                int64_t n, uint8_t* flags) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t where;
  if (i < n) flags[i] = Probe(tkeys, tstate, mask, keys[i], &where) >= 0;
}

// live entries of a table (state >= 0) compacted: flags
__global__ void LiveFlagsKernel(const int64_t* state, int64_t n, uint8_t* flags) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) flags[i] = state[i] >= 0;
}

// a cache's LFU scores carried over its host tier (DynamicIndex::AddStoreScores)
__global__ void AddStoreScoresKernel(const int64_t* cache_rows, const int64_t* store_rows, const uint8_t* fresh,
                                     const int64_t* store_scores, int64_t stride, int64_t n, int64_t cap,
                                     int64_t* score) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= n || (fresh != nullptr && fresh[j])) return;
  int64_t& s = score[cache_rows[j]];
  s = min(cap, s + store_scores[store_rows[j] * stride]);
}

}  // namespace

GpuDynamicIndex::GpuDynamicIndex(const DynamicIndexConfig& config, DeviceMemory* memory)
    : config_(config), memory_(memory) {
  reserved_ = 1;  // row 0: what keys not inserted (not admitted, filtered) read
  next_free_ = reserved_;
  int64_t rows = std::max<int64_t>(config_.init_rows, reserved_ + 1);
  if (config_.bounded()) rows = std::max(reserved_ + 1, std::min(rows, config_.max_keys + reserved_));
  init_error_ = NewTable(&keys_, PowerOfTwoAtLeast(2 * rows), nullptr);
  if (init_error_.empty()) init_error_ = NewTable(&candidates_, 1024, nullptr);
  if (init_error_.empty()) {
    GpuDevice none{nullptr, nullptr};
    init_error_ = EnsureRows(none, rows);
    cudaDeviceSynchronize();
  }
}

GpuDynamicIndex::~GpuDynamicIndex() {
  FreeTable(&keys_);
  FreeTable(&candidates_);
  FreeTable(&store_);
  for (void* p : {static_cast<void*>(slot_key_), static_cast<void*>(score_), static_cast<void*>(generation_),
                  static_cast<void*>(touched_), static_cast<void*>(free_), static_cast<void*>(live_row_)})
    if (p) memory_->Free(p);
}

std::string GpuDynamicIndex::NewTable(Table* t, int64_t buckets, void* stream) {
  t->keys = static_cast<int64_t*>(memory_->Allocate(sizeof(int64_t) * buckets));
  t->state = static_cast<int64_t*>(memory_->Allocate(sizeof(int64_t) * buckets));
  if (!t->keys || !t->state) return "ran out of GPU memory for a hash table of " + std::to_string(buckets) + " buckets";
  cudaMemsetAsync(t->state, 0xFF, sizeof(int64_t) * buckets, static_cast<cudaStream_t>(stream));  // -1: empty
  t->buckets = buckets;
  t->used = 0;
  return "";
}

void GpuDynamicIndex::FreeTable(Table* t) {
  if (t->keys) memory_->Free(t->keys);
  if (t->state) memory_->Free(t->state);
  t->keys = t->state = nullptr;
}

// The live entries of `t` moved into a fresh table of `buckets` (tombstones dropped).
std::string GpuDynamicIndex::Rebuild(const GpuDevice& d, Table* t, int64_t live, int64_t buckets) {
  cudaStream_t s = StreamOf(d);
  auto* flags = gpu::Alloc<uint8_t>(d, t->buckets);
  auto* keys = gpu::Alloc<int64_t>(d, live);
  auto* values = gpu::Alloc<int64_t>(d, live);
  if (!flags || !keys || !values) return "ran out of GPU memory";
  LiveFlagsKernel<<<Blocks(t->buckets), kThreads, 0, s>>>(t->state, t->buckets, flags);
  std::string error;
  const int64_t n = Compact(d, t->keys, flags, t->buckets, keys, &error);
  Compact(d, t->state, flags, t->buckets, values, &error);
  if (!error.empty()) return error;
  Table fresh;
  error = NewTable(&fresh, buckets, d.stream);
  if (!error.empty()) {
    FreeTable(&fresh);
    return error;
  }
  InsertKernel<<<Blocks(n), kThreads, 0, s>>>(fresh.keys, reinterpret_cast<unsigned long long*>(fresh.state),
                                              fresh.buckets - 1, keys, values, n);
  cudaStreamSynchronize(s);
  FreeTable(t);
  *t = fresh;
  t->used = n;
  return "";
}

// Makes room in `t` for `adding` more entries: rebuilt when entries + tombstones would pass half the buckets.
std::string GpuDynamicIndex::Room(const GpuDevice& d, Table* t, int64_t live, int64_t adding) {
  if ((t->used + adding) * 2 <= t->buckets) return "";
  return Rebuild(d, t, live, PowerOfTwoAtLeast(4 * (live + adding)));
}

std::string GpuDynamicIndex::EnsureRows(const GpuDevice& d, int64_t needed) {
  if (needed <= rows_) return "";
  int64_t rows = std::max(needed, rows_ * 2);
  if (config_.bounded()) rows = std::max(needed, std::min(rows, config_.max_keys + reserved_));
  cudaStream_t s = d.stream ? StreamOf(d) : nullptr;
  auto grow = [&](auto*& p, size_t width) -> bool {
    void* fresh = memory_->Allocate(width * rows);
    if (!fresh) return false;
    cudaMemsetAsync(fresh, 0, width * rows, s);
    if (p) {
      cudaMemcpyAsync(fresh, p, width * rows_, cudaMemcpyDeviceToDevice, s);
      cudaStreamSynchronize(s);
      memory_->Free(p);
    }
    p = static_cast<std::remove_reference_t<decltype(p)>>(fresh);
    return true;
  };
  if (!grow(slot_key_, 8) || !grow(score_, 8) || !grow(generation_, 8) || !grow(touched_, 8) || !grow(free_, 8) ||
      !grow(live_row_, 1))
    return "ran out of GPU memory growing to " + std::to_string(rows) + " rows";
  rows_ = rows;
  return "";
}

std::string GpuDynamicIndex::Export(const GpuDevice& d, DynamicIndexSnapshot* snap) {
  cudaStream_t s = StreamOf(d);
  std::vector<int64_t> slot_key(next_free_), score(next_free_);
  std::vector<uint8_t> live(next_free_);
  snap->generations.resize(next_free_);
  cudaMemcpyAsync(slot_key.data(), slot_key_, 8 * next_free_, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(score.data(), score_, 8 * next_free_, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(live.data(), live_row_, next_free_, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(snap->generations.data(), generation_, 8 * next_free_, cudaMemcpyDeviceToHost, s);
  std::vector<int64_t> ckeys(candidates_.buckets), cstate(candidates_.buckets);
  cudaMemcpyAsync(ckeys.data(), candidates_.keys, 8 * candidates_.buckets, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(cstate.data(), candidates_.state, 8 * candidates_.buckets, cudaMemcpyDeviceToHost, s);
  const cudaError_t c = cudaStreamSynchronize(s);
  if (c != cudaSuccess) return std::string("CUDA error ") + cudaGetErrorString(c);
  for (int64_t r = reserved_; r < next_free_; ++r) {
    if (!live[r]) continue;
    snap->keys.push_back(slot_key[r]);
    snap->slots.push_back(r);
    snap->scores.push_back(score[r]);
  }
  for (int64_t b = 0; b < candidates_.buckets; ++b) {
    if (cstate[b] < 0) continue;
    snap->candidate_keys.push_back(ckeys[b]);
    snap->candidate_counts.push_back(cstate[b]);
  }
  snap->clock = clock_;
  snap->rows = rows_;
  snap->next_free = next_free_;
  return "";
}

std::string GpuDynamicIndex::Import(const GpuDevice& d, const DynamicIndexSnapshot& snap) {
  // checked and laid out by the host index, then copied over
  DynamicIndex host(config_);
  std::string error = host.Import(snap);
  if (!error.empty()) return error;
  cudaStream_t s = StreamOf(d);
  const int64_t n = static_cast<int64_t>(snap.keys.size());
  error = EnsureRows(d, snap.rows);
  if (!error.empty()) return error;
  std::vector<int64_t> slot_key(rows_, 0), score(rows_, 0), generation(rows_, 0), touched(rows_, 0);
  std::vector<uint8_t> live(rows_, 0);
  for (int64_t i = 0; i < n; ++i) {
    slot_key[snap.slots[i]] = snap.keys[i];
    score[snap.slots[i]] = snap.scores[i];
    live[snap.slots[i]] = 1;
  }
  std::copy(snap.generations.begin(), snap.generations.end(), generation.begin());
  std::vector<int64_t> free_rows;
  for (int64_t r = snap.next_free - 1; r >= reserved_; --r)
    if (!live[r]) free_rows.push_back(r);
  Table fresh_keys, fresh_candidates;
  error = NewTable(&fresh_keys, PowerOfTwoAtLeast(4 * std::max<int64_t>(n, rows_ / 2)), d.stream);
  if (error.empty())
    error = NewTable(&fresh_candidates, PowerOfTwoAtLeast(4 * static_cast<int64_t>(snap.candidate_keys.size())),
                     d.stream);
  auto* dkeys = gpu::Alloc<int64_t>(d, n + snap.candidate_keys.size());
  auto* dvalues = gpu::Alloc<int64_t>(d, n + snap.candidate_keys.size());
  if (!error.empty() || !dkeys || !dvalues) {
    FreeTable(&fresh_keys);
    FreeTable(&fresh_candidates);
    return error.empty() ? "ran out of GPU memory" : error;
  }
  const int64_t cn = static_cast<int64_t>(snap.candidate_keys.size());
  cudaMemcpyAsync(dkeys, snap.keys.data(), 8 * n, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(dvalues, snap.slots.data(), 8 * n, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(dkeys + n, snap.candidate_keys.data(), 8 * cn, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(dvalues + n, snap.candidate_counts.data(), 8 * cn, cudaMemcpyHostToDevice, s);
  InsertKernel<<<Blocks(n), kThreads, 0, s>>>(fresh_keys.keys, reinterpret_cast<unsigned long long*>(fresh_keys.state),
                                              fresh_keys.buckets - 1, dkeys, dvalues, n);
  InsertKernel<<<Blocks(cn), kThreads, 0, s>>>(
      fresh_candidates.keys, reinterpret_cast<unsigned long long*>(fresh_candidates.state),
      fresh_candidates.buckets - 1, dkeys + n, dvalues + n, cn);
  cudaMemcpyAsync(slot_key_, slot_key.data(), 8 * rows_, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(score_, score.data(), 8 * rows_, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(generation_, generation.data(), 8 * rows_, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(touched_, touched.data(), 8 * rows_, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(live_row_, live.data(), rows_, cudaMemcpyHostToDevice, s);
  if (!free_rows.empty()) cudaMemcpyAsync(free_, free_rows.data(), 8 * free_rows.size(), cudaMemcpyHostToDevice, s);
  const cudaError_t c = cudaStreamSynchronize(s);
  if (c != cudaSuccess) {
    FreeTable(&fresh_keys);
    FreeTable(&fresh_candidates);
    return std::string("CUDA error ") + cudaGetErrorString(c);
  }
  FreeTable(&keys_);
  FreeTable(&candidates_);
  keys_ = fresh_keys;
  keys_.used = n;
  candidates_ = fresh_candidates;
  candidates_.used = cn;
  candidates_live_ = cn;
  live_ = n;
  free_count_ = static_cast<int64_t>(free_rows.size());
  next_free_ = snap.next_free;
  clock_ = snap.clock;
  imported_score_ = 0;   // FinishCommit sorts scores by the bits of the larger of it and the clock
  for (int64_t v : snap.scores) imported_score_ = std::max(imported_score_, v);
  call_ = 0;
  call_times_.Clear();
  return "";
}

void GpuDynamicIndex::AddStoreScores(const GpuDevice& d, const int64_t* cache_rows, const int64_t* store_rows,
                                     const uint8_t* fresh, const int64_t* store_scores, int64_t stride, int64_t n) {
  if (n > 0)
    AddStoreScoresKernel<<<Blocks(n), kThreads, 0, StreamOf(d)>>>(cache_rows, store_rows, fresh, store_scores, stride,
                                                                   n, ScoreCap(), score_);
}

std::string GpuDynamicIndex::StoreMapBuild(const GpuDevice& d, const int64_t* keys, const int64_t* rows, int64_t n,
                                           int64_t room) {
  StoreMapDrop();
  std::string error = NewTable(&store_, PowerOfTwoAtLeast(2 * (n + room)), d.stream);
  if (!error.empty()) {
    StoreMapDrop();
    return error;
  }
  store_live_ = n;
  if (n == 0) return "";
  cudaStream_t s = StreamOf(d);
  auto* dkeys = gpu::Alloc<int64_t>(d, n);
  auto* drows = gpu::Alloc<int64_t>(d, n);
  if (!dkeys || !drows) {
    StoreMapDrop();
    return "ran out of GPU memory for its host tier's keys";
  }
  cudaMemcpyAsync(dkeys, keys, 8 * n, cudaMemcpyHostToDevice, s);   // (pageable: read when it returns)
  cudaMemcpyAsync(drows, rows, 8 * n, cudaMemcpyHostToDevice, s);
  InsertKernel<<<Blocks(n), kThreads, 0, s>>>(store_.keys, reinterpret_cast<unsigned long long*>(store_.state),
                                              store_.buckets - 1, dkeys, drows, n);
  store_.used = n;
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("CUDA error ") + cudaGetErrorString(e);
}

void GpuDynamicIndex::StoreMapDrop() {
  FreeTable(&store_);
  store_.buckets = store_.used = 0;
  store_live_ = 0;
}

std::string GpuDynamicIndex::StoreMapRows(const GpuDevice& d, const int64_t* keys, int64_t n, int64_t base,
                                          int64_t* rows, uint8_t* fresh, int64_t* added_keys, int64_t* added_rows,
                                          int64_t* count) {
  if (!store_map_built()) return "its host tier's keys are not on the device";
  cudaStream_t s = StreamOf(d);
  cudaMemsetAsync(count, 0, sizeof(int64_t), s);
  if (n <= 0) return "";
  std::string error = Room(d, &store_, store_live_, n);
  if (!error.empty()) return error;
  StoreRowsOrAddKernel<<<Blocks(n), kThreads, 0, s>>>(
      store_.keys, reinterpret_cast<unsigned long long*>(store_.state), store_.buckets - 1, keys, n, base, rows, fresh,
      added_keys, added_rows, reinterpret_cast<unsigned long long*>(count));
  store_.used += n;   // (upper bounds until StoreMapSize: the keys added are counted on the device)
  store_live_ += n;
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("CUDA error ") + cudaGetErrorString(e);
}

void GpuDynamicIndex::StoreMapSize(int64_t live) {
  store_live_ = live;
  store_.used = std::min(store_.used, live);   // (no tombstones)
}

std::string GpuDynamicIndex::StoreMapRowsOfMissing(const GpuDevice& d, const int64_t* keys, const int64_t* slots,
                                                   int64_t n, int64_t* rows, int64_t* held) {
  if (!store_map_built()) return "its host tier's keys are not on the device";
  if (n <= 0) return "";
  StoreRowsOfMissingKernel<<<Blocks(n), kThreads, 0, StreamOf(d)>>>(store_.keys, store_.state, store_.buckets - 1,
                                                                     keys, slots, n, rows,
                                                                     reinterpret_cast<unsigned long long*>(held));
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("CUDA error ") + cudaGetErrorString(e);
}

std::string GpuDynamicIndex::StoreMapHeld(const GpuDevice& d, const int64_t* keys, int64_t n, uint8_t* flags) {
  if (!store_map_built()) return "its host tier's keys are not on the device";
  if (n <= 0) return "";
  HeldFlagsKernel<<<Blocks(n), kThreads, 0, StreamOf(d)>>>(store_.keys, store_.state, store_.buckets - 1, keys, n,
                                                            flags);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("CUDA error ") + cudaGetErrorString(e);
}

std::string GpuDynamicIndex::ForgetCandidates(const GpuDevice& d, const int64_t* keys, int64_t n) {
  if (n <= 0) return "";
  cudaStream_t s = StreamOf(d);
  auto* dkeys = gpu::Alloc<int64_t>(d, n);
  auto* seen = gpu::Alloc<int64_t>(d, n);
  auto* where = gpu::Alloc<int64_t>(d, n);
  if (!dkeys || !seen || !where) return "ran out of GPU memory";
  cudaMemcpyAsync(dkeys, keys, 8 * n, cudaMemcpyHostToDevice, s);   // (pageable: read when it returns)
  FindKernel<<<Blocks(n), kThreads, 0, s>>>(candidates_.keys, candidates_.state, candidates_.buckets - 1, dkeys, n,
                                            seen, where);
  SetStateKernel<<<Blocks(n), kThreads, 0, s>>>(candidates_.state, where, nullptr, kTomb, n);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("CUDA error ") + cudaGetErrorString(e);
}

std::string GpuDynamicIndex::TouchedSince(const GpuDevice& d, int64_t unix_ns, std::vector<int64_t>* keys,
                                          std::vector<int64_t>* rows) {
  if (!init_error_.empty()) return init_error_;
  const int64_t first = call_times_.FirstAtOrAfter(unix_ns);
  const int64_t span = next_free_ - reserved_;
  if (span <= 0) return "";
  cudaStream_t s = StreamOf(d);
  std::vector<int64_t> touched(span), slot_key(span);
  std::vector<uint8_t> live(span);
  cudaMemcpyAsync(touched.data(), touched_ + reserved_, 8 * span, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(slot_key.data(), slot_key_ + reserved_, 8 * span, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(live.data(), live_row_ + reserved_, span, cudaMemcpyDeviceToHost, s);
  const cudaError_t c = cudaStreamSynchronize(s);
  if (c != cudaSuccess) return std::string("CUDA error ") + cudaGetErrorString(c);
  for (int64_t i = 0; i < span; ++i) {
    const int64_t t = touched[i] < 0 ? -touched[i] : touched[i];   // LFU marks a scored row -call
    if (!live[i] || t < first) continue;
    keys->push_back(slot_key[i]);
    rows->push_back(reserved_ + i);
  }
  return "";
}

}  // namespace impl
}  // namespace tf_sok
