// The host tier of a hybrid dynamic table: the row of every key the table holds, for
// each of its arrays (the values, then every optimizer slot), in host memory. A key's rows
// are one record (its arrays side by side, each at a 16-byte boundary): a row moved between
// the cache and the store is one contiguous run of host memory, however many arrays it has.
//
// A hybrid table's key index (dynamic_index.h, or its GPU form) is a cache of at most
// max_keys rows in front of this store: a key the cache evicts has its rows written
// here, a key the cache takes in has its rows read from here (or, the first time the
// table sees it, set to its initial value / the slot's fill). Every key of the table
// has a store row (the store is a superset of the cache); a cached key's store row is
// current after the cache wrote it back (eviction, or Flush before a checkpoint).
//
// On GPU builds the memory is pinned and mapped into the device's address space, so
// CUDA kernels read rows in place (zero-copy); evicted rows come back by copies, which the
// host writes into their records (Pending / Settle). Not thread safe: the caller holds the
// index's lock.
#ifndef TF_SOK_CC_IMPL_HOST_STORE_H_
#define TF_SOK_CC_IMPL_HOST_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <queue>
#include <string>
#include <tuple>
#include <vector>

#include "tf_sok/cc/impl/dynamic_index.h"

namespace tf_sok {
namespace impl {

// The arrays of a call's moves between a cache and its store (on a GPU, moved in one launch): array
// a's rows are the width[a] floats at offset[a] of the store's records (stride floats each), and at
// cache[a] (width[a] floats apart) in the cache.
constexpr int kMaxRecordArrays = 8;
// the floats a record's meta (HostStore::meta) takes before its arrays
constexpr int64_t kMetaFloats = 4;
struct StoreRecordLayout {
  int arrays = 0;
  int64_t stride = 0;
  int64_t meta = kMetaFloats;   // (in words of the moves)
  // written back with each evicted record: its mark (the call that last touched it) and LFU score
  // (none: 0), per evicted key
  const int64_t* touched = nullptr;
  const int64_t* scores = nullptr;
  // the moves run beside other work (a prefetch's stream): on a GPU, a grid of one block per SM,
  // which reads and writes host memory as fast as a full grid and leaves the SMs' room to the step
  bool beside = false;
  int64_t offset[kMaxRecordArrays] = {};
  int64_t width[kMaxRecordArrays] = {};
  float* cache[kMaxRecordArrays] = {};
};

// Where a store's rows live (plain host memory, or pinned and device-mapped memory).
class HostMemory {
 public:
  virtual ~HostMemory() = default;
  virtual void* Allocate(size_t bytes) = 0;  // nullptr when out of memory
  virtual void Free(void* p) = 0;
  // Extends the allocation at p (of `bytes` so far) to `to` bytes where it is, its contents and
  // address kept; false when it cannot (the caller then allocates anew and copies).
  virtual bool Grow(void* /*p*/, size_t /*bytes*/, size_t /*to*/) { return false; }
};

std::unique_ptr<HostMemory> NewPlainHostMemory();

class HostStore {
 public:
  explicit HostStore(std::unique_ptr<HostMemory> memory);
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // A new array of `width` floats per row (kMaxRecordArrays at most); rows already held get `fill`.
  // "" or an error.
  std::string AddArray(int64_t width, float fill);
  int num_arrays() const { return static_cast<int>(arrays_.size()); }
  int64_t width(int a) const { return arrays_[a].width; }
  // The bytes of a record's arrays (values and optimizer state, not its marks): what a move of the
  // record counts (cache statistics).
  int64_t row_bytes() const {
    int64_t bytes = 0;
    for (const auto& a : arrays_) bytes += static_cast<int64_t>(sizeof(float)) * a.width;
    return bytes;
  }
  // Row r of array a is the `width(a)` floats at base(a) + r * stride(); base(a) = records() + offset(a).
  float* base(int a) {
    Settle();
    return records_ + arrays_[a].offset;
  }
  const float* base(int a) const {
    Settle();
    return records_ + arrays_[a].offset;
  }
  int64_t offset(int a) const { return arrays_[a].offset; }
  int64_t stride() const { return stride_; }
  float* records() {   // record r at records() + r * stride()
    Settle();
    return records_;
  }
  // records() without waiting for pending writes: for device work queued after them (its stream waits
  // for them itself)
  float* device_records() { return records_; }
  // Writes into the records still under way that the store does not make itself (a GPU's evicted
  // records copied back and written by the host after the call that evicted them): Pending() says
  // there are, and `settle` waits for all of them to end. Every access to the records (the accessors
  // here, growth, Insert's fills) settles first. Settle may be called from several threads at once.
  void set_settle(std::function<void()> settle) { settle_ = std::move(settle); }
  void Pending() { pending_.store(true, std::memory_order_release); }
  void Settle() const {
    if (pending_.load(std::memory_order_acquire)) {
      if (settle_) settle_();
      pending_.store(false, std::memory_order_release);
    }
  }
  int64_t size() const { return count_ - static_cast<int64_t>(free_rows_.size() + freed_.size()); }
  // Rows [0, rows_used()) hold a key each, except rows a bound dropped (alive(r) false).
  int64_t rows_used() const { return count_; }
  bool alive(int64_t r) const { return alive_[r] != 0; }
  // A row's place in the order a bound drops keys not cached (lowest first).
  int64_t order(int64_t r) const { return order_[r]; }
  // The key of each row, rows [0, rows_used()).
  const HugePageVector<int64_t>& keys() const { return key_of_row_; }
  // Per row, two int64 at the start of its record (kMetaFloats), written back with its rows: [0] its
  // mark, the index call that last touched its key as of the key's last move between cache and store
  // (the call that brought it in, or the last to touch it before it was written back): with the
  // cache's own marks, the keys touched since a time; [1] an LFU cache's score of its key as of its
  // last write-back (the calls that touched it since the index was made or imported), carried over
  // while the key is not cached. Row r's at meta() + r * meta_stride(); 0 for rows added since.
  int64_t* meta() { return reinterpret_cast<int64_t*>(records()); }
  int64_t meta_stride() const { return stride_ / 2; }
  int64_t mark(int64_t r) const {
    Settle();
    return reinterpret_cast<const int64_t*>(records_)[r * meta_stride()];
  }
  int64_t score(int64_t r) const {
    Settle();
    return reinterpret_cast<const int64_t*>(records_)[r * meta_stride() + 1];
  }
  void set_mark(int64_t r, int64_t mark) { meta()[r * meta_stride()] = mark; }
  void set_score(int64_t r, int64_t score) { meta()[r * meta_stride() + 1] = score; }
  void ClearMarks();   // marks and scores (after the index was replaced)

  // A bound on the keys held (0: none). The cache's keys are tracked: Loaded marks rows taken into
  // the cache by a call, WrittenBack the keys it wrote back (with the call that last touched each, in
  // the cache's eviction order: least recently used first; an LFU cache's also with their scores);
  // Bound then drops the keys not cached in the order they were written back -- the order in which
  // an LRU table evicts -- or, given scores, in the order of (score, key): the least often used
  // first, as an LFU table evicts; until at most max_keys remain, and lists them (their rows keep
  // their contents until the next Insert / AddAbsent reuses them). It returns "" or, when the keys
  // cached exceed the bound, an error (the store then holds them all).
  void set_max_keys(int64_t max_keys) { max_keys_ = max_keys; }
  int64_t max_keys() const { return max_keys_; }
  void Loaded(const int64_t* rows, int64_t n, int64_t call);
  // Loaded in two parts, the first for several threads at once on disjoint rows: MarkLoaded marks
  // the rows and returns how many were not cached before; AddCached(the sum) after.
  int64_t MarkLoaded(const int64_t* rows, int64_t n, int64_t call);
  void AddCached(int64_t count) { cached_count_ += count; }
  void WrittenBack(const int64_t* keys, const int64_t* calls, const int64_t* scores, int64_t n);
  // Every key's cached mark cleared, then `rows` marked cached (after the cache was replaced).
  void SetCached(const int64_t* rows, int64_t n);
  std::string Bound(std::vector<int64_t>* keys, std::vector<int64_t>* rows);

  // rows[j]: the row of distinct keys[j], added (at the arrays' fills) when absent, in which case
  // fresh[j] = 1 (else 0). The arrays may move (grow); "" or an error (nothing added then).
  // parallel_for (optional): the lookups run on the host's threads.
  std::string Insert(const int64_t* keys, int64_t n, int64_t* rows, uint8_t* fresh,
                     const ParallelFor* parallel_for = nullptr);
  // The rows of keys (-1 when absent). Read only: several threads may call it at once.
  void Rows(const int64_t* keys, int64_t n, int64_t* rows) const;
  // Insert's second half, after Rows: distinct keys[j] with rows[j] < 0 are added (at the arrays'
  // fills) and get their row, fresh[j] = 1 (else 0). "" or an error (nothing added then).
  std::string AddAbsent(const int64_t* keys, int64_t n, int64_t* rows, uint8_t* fresh);
  // Keys a GPU map of the store gave rows without the host (an unbounded store only): rows
  // [rows_used(), rows_used() + n) in some order, one per key, taken now into the cache of a call
  // (their records are written when the cache writes them back). ReserveRows(n) comes first, before
  // the device knows the rows; AddedOnDevice, once it is done, takes them in as AddAbsent would.
  std::string ReserveRows(int64_t n) { return Reserve(count_ + n); }
  void AddedOnDevice(const int64_t* keys, const int64_t* rows, int64_t n);
  // Counts the changes of which key has which row (keys added, dropped, replaced): a copy of the
  // map made at one version is current while the version stays.
  int64_t version() const { return version_; }
  // Replaces the contents: keys[n] and, per array, its rows: row j of array a at data[a] + j * pitch.
  // A bound drops the keys not cached in the order given (before any key a later call touches) or,
  // given scores (an LFU table's counts, scores[n]: kept as the keys' scores), in the order of
  // (score, key), as WrittenBack orders them.
  std::string Replace(const int64_t* keys, int64_t n, const std::vector<const float*>& data, int64_t pitch,
                      const int64_t* scores = nullptr);

 private:
  std::string Reserve(int64_t rows);
  struct Array {
    int64_t offset = 0;   // in a record, floats
    int64_t width = 0;
    float fill = 0;
  };
  void Requeue();   // the queue rebuilt from the keys not cached
  std::unique_ptr<HostMemory> memory_;
  KeyMap row_of_key_;
  // per row, touched at random by calls' lookups (huge pages: fewer TLB misses)
  HugePageVector<int64_t> key_of_row_;
  HugePageVector<uint8_t> alive_, cached_;
  std::vector<int64_t> free_rows_, freed_;   // reusable rows; rows dropped by the last Bound
  // per row: restored keys -n..-1 in the order given, then each key written back the next number
  // (given scores: its score)
  std::vector<int64_t> order_;
  int64_t max_keys_ = 0, cached_count_ = 0, written_back_ = 0;
  // keys not cached as (order, key, row), lowest first; entries whose row changed since are skipped
  std::priority_queue<std::tuple<int64_t, int64_t, int64_t>, std::vector<std::tuple<int64_t, int64_t, int64_t>>,
                      std::greater<>>
      queue_;
  std::vector<Array> arrays_;
  float* records_ = nullptr;   // capacity_ records of stride_ floats: the meta, then the arrays
  std::function<void()> settle_;
  mutable std::atomic<bool> pending_{false};
  int64_t stride_ = kMetaFloats;
  int64_t count_ = 0, capacity_ = 0;
  int64_t version_ = 0;
};

// Row moves between a cache's arrays and the store's, on the host; the store's row r of an array is
// at store + r * stride (HostStore::stride).
// store[store_row_of[cache_rows[j]]] = cache[cache_rows[j]] (store_row_of: per cache row, its key's store row):
void StoreWrite(const float* cache, int64_t width, const int64_t* cache_rows, const int64_t* store_row_of, int64_t n,
                float* store, int64_t stride);
// cache[cache_rows[j]] = store[store_rows[j]] for the j not fresh (fresh null: none is):
void StoreRead(const float* store, int64_t stride, int64_t width, const int64_t* store_rows, const uint8_t* fresh,
               const int64_t* cache_rows, int64_t n, float* cache);
// cache[cache_rows[j]] = init_kind >= 0 ? the initial value of keys[j] : fill, for the j fresh:
void StoreFresh(int64_t width, const uint8_t* fresh, const int64_t* keys, const int64_t* cache_rows, int64_t n,
                int init_kind, float a, float b, int64_t seed, float fill, float* cache);
// A read-only lookup's rows, nothing moved: out[j] = cache row slots[j] when it is >= 0, else store
// row store_rows[j] read in place (store_rows null, or -1: the store does not hold the key), else
// the initial value of keys[j] (init_kind -1: zeros). Rows of `width` floats; the store's `stride` apart.
void ReadRows(const int64_t* keys, const int64_t* slots, const int64_t* store_rows, int64_t n, const float* cache,
              int64_t width, const float* store, int64_t stride, int init_kind, float a, float b, int64_t seed,
              float* out);

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_HOST_STORE_H_
