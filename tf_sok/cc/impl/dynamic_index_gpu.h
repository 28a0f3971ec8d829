// The key -> row index of a dynamic table in GPU memory: the same function as
// DynamicIndex (dynamic_index.h) — insertion, LRU/LFU eviction of the untouched
// keys of lowest (score, key), admission after min_frequency sightings, row
// generations — computed by CUDA kernels over an open-addressing table in HBM
// (linear probing, tombstones, claimed by atomicCAS; rebuilt when keys plus
// tombstones pass half the buckets). Rows are handed out in another order than
// on the host; what a caller sees (values per key, evicted keys) is the same.
//
// A call reads a few counts back to the host (distinct keys, new keys, admitted
// keys) to size its outputs and the arrays' growth. Not thread safe: the caller
// holds a lock and passes the stream it runs on.
#ifndef TF_SOK_CC_IMPL_DYNAMIC_INDEX_GPU_H_
#define TF_SOK_CC_IMPL_DYNAMIC_INDEX_GPU_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tf_sok/cc/impl/common.h"
#include "tf_sok/cc/impl/dynamic_index.h"
#include "tf_sok/cc/impl/host_store.h"

namespace tf_sok {
namespace impl {

// Device memory that outlives a call (the caller's allocator, e.g. TensorFlow's).
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual void* Allocate(size_t bytes) = 0;  // nullptr when out of memory
  virtual void Free(void* p) = 0;
};

// Where a Find call left its results, in scratch device memory of the call.
struct GpuFindResult {
  int64_t* slots = nullptr;          // [n], per key
  int64_t* new_slots = nullptr;      // [num_new]
  int64_t* new_keys = nullptr;       // [num_new]
  int64_t* evicted_keys = nullptr;   // [num_evicted]
  int64_t* evicted_slots = nullptr;  // [num_evicted]
  int64_t* evicted_touched = nullptr;  // [num_evicted]: the call that last touched each
  int64_t* evicted_scores = nullptr;   // [num_evicted]: the score of each
  int64_t num_new = 0, num_evicted = 0, rows = 0;
  int64_t missing_positions = 0;     // positions whose key was not held (cache statistics)
};

// A find in stages (GpuDynamicIndex::Probe, then Finish or its three parts), each but the last
// ending in a count on the device that the next needs on the host: a caller with many indices
// reads each stage's counts back once for all of them.
struct GpuFindPending {
  const int64_t* keys = nullptr;
  int64_t n = 0, call = 0;
  int64_t* missing_at = nullptr;  // [n]: the keys of the positions not found, compacted
  int64_t mp = 0;                 // their number
  int64_t* missing = nullptr;     // the distinct missing keys (in the order they were told apart)
  int64_t m = 0;                  // their number
  // admission: the keys let in (a) and those still waiting, with their sightings and buckets
  int64_t *admitted = nullptr, *admitted_where = nullptr;
  int64_t *waiting = nullptr, *waiting_seen = nullptr, *waiting_where = nullptr;
  int64_t a = 0, waiting_count = 0;
  int64_t k = 0;                  // keys to evict (before a cache's bound by the evictable rows)
  int64_t* evictable = nullptr;   // rows this call did not touch, compacted
  bool direct = false;            // the missing keys were inserted as they were told apart
  bool fused = false;             // ... by the probe itself: Probe's count is that of the new keys
  bool prefetch = false;          // a prefetch (see DynamicIndex::Prefetch)
  int64_t held_count = 0;         // ... the distinct missing keys the host tier holds (the caller's count)
  int64_t floor = 0;              // rows touched at or after this call are not evicted
};

class GpuDynamicIndex {
 public:
  GpuDynamicIndex(const DynamicIndexConfig& config, DeviceMemory* memory);
  ~GpuDynamicIndex();
  GpuDynamicIndex(const GpuDynamicIndex&) = delete;
  GpuDynamicIndex& operator=(const GpuDynamicIndex&) = delete;

  // As DynamicIndex::Find, with keys and outputs on the device. "" or an error
  // message; an error changes nothing a later call can see.
  // mark(i), when given, is called after each stage i (0 probe, 1 missing count read back, 2
  // distinct, 3 its count read back, 4 room, 5 its count read back, 6 commit queued): a profiler's hook.
  std::string Find(const GpuDevice& d, const int64_t* keys, int64_t n, bool insert, GpuFindResult* out,
                   bool admit_all = false, float insert_ratio = 1.0f, const std::function<void(int)>& mark = {},
                   const HeldKeys& held = {});
  // Find with insert, in two halves: Probe queues the work up to the count of positions whose key
  // is missing (written to the device's *count, not waited for); Finish, given that count read
  // back, does the rest. Nothing else may use the index in between.
  // When every key is let in (`insert_ratio` 1, no admission, not a cache) and the table has room and
  // rows for n new keys as it is, Probe inserts them itself (p->fused) and *count is the count of
  // new keys: FinishDistinct then leaves it, and the distinct count is the one read back.
  // prefetch: DynamicIndex::Prefetch in stages (with insert_ratio 0 and `held` given to FinishRoom).
  std::string Probe(const GpuDevice& d, const int64_t* keys, int64_t n, GpuFindResult* out, GpuFindPending* p,
                    int64_t* count, float insert_ratio = 1.0f, bool prefetch = false);
  std::string Finish(const GpuDevice& d, GpuFindPending* p, int64_t missing, GpuFindResult* out,
                     bool admit_all = false, float insert_ratio = 1.0f, const std::function<void(int)>& mark = {},
                     const HeldKeys& held = {});
  // Finish in three parts, for many indices at once: FinishDistinct, given the missing count,
  // leaves the count of distinct missing keys at *count (and inserts them there when all of them
  // are let in without evicting: no admission, `insert_ratio` 1, room for every one); FinishRoom,
  // given that, admits keys and, when the call must evict (*evicts), leaves the count of evictable
  // rows at *count; FinishCommit, given that (or 0), evicts, inserts and writes the rows of the
  // call's positions. No waits, except admission's and growth's (and `held`'s: see DynamicIndex::Find).
  std::string FinishDistinct(const GpuDevice& d, GpuFindPending* p, int64_t missing, GpuFindResult* out,
                             int64_t* count, float insert_ratio = 1.0f);
  std::string FinishRoom(const GpuDevice& d, GpuFindPending* p, int64_t distinct, bool admit_all,
                         float insert_ratio, int64_t* count, bool* evicts, const HeldKeys& held = {});
  std::string FinishCommit(const GpuDevice& d, GpuFindPending* p, int64_t evictable, GpuFindResult* out);
  int64_t size() const { return live_; }
  int64_t rows() const { return rows_; }
  // As DynamicIndex's: the last find with insert, the first at or after a time.
  int64_t calls() const { return call_; }
  int64_t FirstCallAtOrAfter(int64_t unix_ns) const { return call_times_.FirstAtOrAfter(unix_ns); }
  // As DynamicIndex's (keys in host memory).
  std::string ForgetCandidates(const GpuDevice& d, const int64_t* keys, int64_t n);
  // A cache's bound (hybrid tables: the HBM budget over the bytes of a row of every array); the
  // next find evicts down to it.
  void set_max_keys(int64_t max_keys) { config_.max_keys = max_keys; }
  // The memory of later allocations (a prefetch on a stream of its own wraps TensorFlow's).
  void set_memory(DeviceMemory* memory) { memory_ = memory; }

  // As DynamicIndex's (rows, flags and the store's scores where the device reads them).
  void AddStoreScores(const GpuDevice& d, const int64_t* cache_rows, const int64_t* store_rows, const uint8_t* fresh,
                      const int64_t* store_scores, int64_t stride, int64_t n);
  int64_t ScoreCap() const { return imported_score_ + clock_ + 1; }

  // A hybrid table's host tier's keys -> store rows, also kept on the device (a map of its own, 16
  // bytes per key at a load of at most a half), so that a find's new keys and a read's keys not
  // cached get their store rows without the host. StoreMapBuild makes it from the host store's
  // keys[n] -> rows[n] (host memory) with room for `room` more.
  std::string StoreMapBuild(const GpuDevice& d, const int64_t* keys, const int64_t* rows, int64_t n, int64_t room);
  bool store_map_built() const { return store_.keys != nullptr; }
  void StoreMapDrop();
  // Room in the built map for `adding` more keys (rebuilt into more buckets when needed). "" or an error.
  std::string StoreMapRoom(const GpuDevice& d, int64_t adding) { return Room(d, &store_, store_live_, adding); }
  // The store rows of distinct keys[n] (device memory, as the outputs): a key the map lacks is added
  // with the next row from `base` (the store's rows used) on, fresh[j] = 1, and listed at added_keys /
  // added_rows [*count] (n of room each; *count on the device, set here). No wait.
  std::string StoreMapRows(const GpuDevice& d, const int64_t* keys, int64_t n, int64_t base, int64_t* rows,
                           uint8_t* fresh, int64_t* added_keys, int64_t* added_rows, int64_t* count);
  // The map's size once the host knows how many keys StoreMapRows added (the store's size).
  void StoreMapSize(int64_t live);
  // rows[j]: the store row of keys[j] for slots[j] < 0 (-1: not in the tier; -1 for cached keys; slots
  // null: every key's), and *held (device; unless null) += the keys found. No wait.
  std::string StoreMapRowsOfMissing(const GpuDevice& d, const int64_t* keys, const int64_t* slots, int64_t n,
                                    int64_t* rows, int64_t* held);
  // flags[j] (device): whether the tier holds keys[j] (device). No wait.
  std::string StoreMapHeld(const GpuDevice& d, const int64_t* keys, int64_t n, uint8_t* flags);

  std::string Export(const GpuDevice& d, DynamicIndexSnapshot* s);
  // As DynamicIndex::TouchedSince (host vectors; reads the row marks back, one wait).
  std::string TouchedSince(const GpuDevice& d, int64_t unix_ns, std::vector<int64_t>* keys,
                           std::vector<int64_t>* rows);
  std::string Import(const GpuDevice& d, const DynamicIndexSnapshot& s);

 private:
  struct Table {  // open addressing: state -1 empty, -3 tombstone, else the value (row or count)
    int64_t* keys = nullptr;
    int64_t* state = nullptr;
    int64_t buckets = 0, used = 0;  // used: live entries + tombstones (an upper bound)
  };
  std::string NewTable(Table* t, int64_t buckets, void* stream);
  void FreeTable(Table* t);
  std::string Rebuild(const GpuDevice& d, Table* t, int64_t live, int64_t buckets);
  std::string EnsureRows(const GpuDevice& d, int64_t needed);
  std::string Room(const GpuDevice& d, Table* t, int64_t live, int64_t adding);

  DynamicIndexConfig config_;
  DeviceMemory* memory_;
  int64_t reserved_ = 0;
  Table keys_, candidates_;
  int64_t candidates_live_ = 0;
  Table store_;   // StoreMap*: none until built
  int64_t store_live_ = 0;
  // per row
  int64_t *slot_key_ = nullptr, *score_ = nullptr, *generation_ = nullptr, *touched_ = nullptr;
  int64_t* free_ = nullptr;
  uint8_t* live_row_ = nullptr;
  int64_t free_count_ = 0, next_free_ = 0, rows_ = 0, live_ = 0, clock_ = 0, call_ = 0;
  int64_t last_prefetch_ = 0;   // the call the last prefetch extended
  int64_t imported_score_ = 0;  // the largest score an import brought
  CallTimes call_times_;
  std::string init_error_;
};

// The row upkeep of dynamic_index.h on the device (keys, rows and arrays in device memory).
void GpuInitialRowsAt(const GpuDevice& d, int kind, float a, float b, int64_t seed, const int64_t* keys,
                      const int64_t* rows, int64_t n, int64_t width, float* base);
void GpuFillRows(const GpuDevice& d, float* base, int64_t width, const int64_t* rows, int64_t n, float fill);
void GpuGatherRows(const GpuDevice& d, const float* base, int64_t stride, int64_t width, const int64_t* rows, int64_t n,
                   float* out);
void GpuFill(const GpuDevice& d, float* p, int64_t count, float value);
// Pinned host memory mapped into the GPUs' address space: a hybrid table's host tier, which the
// kernels below read and write in place.
std::unique_ptr<HostMemory> NewPinnedHostMemory();
// The same for a store that grows: each allocation reserves address space (the host's physical
// memory) and pins only what is asked for; Grow pins more right after it, at the same address.
// (Plain pinned allocations where the device cannot use host pointers of registered memory.)
std::unique_ptr<HostMemory> NewGrowablePinnedHostMemory();
// StoreWrite (host_store.h) as a CUDA kernel: cache rows in device memory, the store in pinned memory,
// row lists in either (device-accessible) memory; and the moves of a call below.
void GpuStoreWrite(const GpuDevice& d, const float* cache, int64_t width, const int64_t* cache_rows,
                   const int64_t* store_row_of, int64_t n, float* store, int64_t stride);
// out[at[j]] = values[j] for j < n (device memory)
void GpuScatter64(const GpuDevice& d, const int64_t* at, const int64_t* values, int64_t n, int64_t* out);
// The records of cache rows cache_rows[j] (meta: l.touched[j] and l.scores[j] or 0; every array of the
// layout; padding zero) into out [n, stride] (device memory): the rows a call evicts, before new keys
// take their cache rows. Given rows_out [n] (device memory), their store rows too:
// rows_out[j] = store_row_of[cache_rows[j]].
void GpuGatherRecords(const GpuDevice& d, const StoreRecordLayout& l, const int64_t* cache_rows, int64_t n,
                      float* out, const int64_t* store_row_of = nullptr, int64_t* rows_out = nullptr);
// Both directions in one launch: records evicted[j] (GpuGatherRecords) written to store rows
// store_row_of[evicted_slots[j]], j < n_out, while the records of keys not fresh are read from store
// rows store_rows[j] into cache rows cache_rows[j] of every array, j < n_in (fresh null: none is), so
// that the host link carries both at once, each record one contiguous run of host memory (store: the
// records' start, HostStore::records()). Store rows written and read must differ (other keys).
void GpuMoveRecords(const GpuDevice& d, const StoreRecordLayout& l, const float* evicted, const int64_t* evicted_slots,
                    const int64_t* store_row_of, int64_t n_out, const int64_t* store_rows, const uint8_t* fresh,
                    const int64_t* cache_rows, int64_t n_in, float* store);
// StoreFresh (host_store.h) as a CUDA kernel (fresh null: none is)
void GpuStoreFresh(const GpuDevice& d, int64_t width, const uint8_t* fresh, const int64_t* keys,
                   const int64_t* cache_rows, int64_t n, int init_kind, float a, float b, int64_t seed, float fill,
                   float* cache);
// ReadRows (host_store.h) as a CUDA kernel: keys, slots, store rows and out in device memory, the
// cache rows in device memory, the store in pinned host memory, read in place.
void GpuReadRows(const GpuDevice& d, const int64_t* keys, const int64_t* slots, const int64_t* store_rows, int64_t n,
                 const float* cache, int64_t width, const float* store, int64_t stride, int init_kind, float a,
                 float b, int64_t seed, float* out);
// The host link measured with `bytes` of pinned host memory and device_buffer (as many bytes), the
// best of `repeats` timings each (cudaEvents, after one round of warm-up), in GB/s: [0] copy to the
// device, [1] copy to the host (cudaMemcpyAsync), [2] a kernel reading the host memory in place into
// device memory, [3] a kernel writing it in place (how a hybrid table moves rows). Waits.
std::string GpuHostLinkBandwidth(const GpuDevice& d, void* device_buffer, int64_t bytes, int repeats,
                                 double gbps[4]);

// per feature f: whether splits[f] (n[f] entries, on the device) start at 0, never decrease and end
// at count[f]; one kernel for up to 32 features, the answers left in valid (device)
void GpuRowSplitsValid(const GpuDevice& d, const int64_t* const* splits, const int64_t* n, const int64_t* count,
                       int features, bool* valid);
// per feature f with values[f] (count[f] int64 on the device; nullptr: none to check) and rows[f] >= 0:
// whether they all lie in [0, rows[f]) (in_range[f]; true for the others), offending[f] the smallest if
// below 0, else the largest (0 where in range); a few kernels for up to 32 features, answers on the device
void GpuIdsInRange(const GpuDevice& d, const int64_t* const* values, const int64_t* count, const int64_t* rows,
                   int features, bool* in_range, int64_t* offending);

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_DYNAMIC_INDEX_GPU_H_
