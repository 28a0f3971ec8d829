// The key -> row index of a dynamic (hash-keyed) table, on the host.
//
// A dynamic table keeps its values and every optimizer slot in row arrays, like a
// static table; this index maps any int64 key to a row ("slot") of those arrays,
// inserting missing keys, growing the arrays' row count by doubling, evicting by
// score when a bounded table is full (LRU: the call that last touched the key;
// LFU: the number of calls that touched it), admitting a key only after it was
// seen min_frequency times and, on request, only a share of new keys (a
// low-frequency filter). A key not inserted maps to row 0, never a key's row,
// which reads zeros.
// Each insertion into a row bumps the row's generation (how many keys it held).
//
// Open addressing with linear probing and backward-shift deletion: every int64
// is a valid key (emptiness is kept apart from the key). Not thread safe: the
// caller holds a lock.
#ifndef TF_SOK_CC_IMPL_DYNAMIC_INDEX_H_
#define TF_SOK_CC_IMPL_DYNAMIC_INDEX_H_

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tf_sok/cc/impl/common.h"
#include "tf_sok/cc/impl/cpu_memory.h"

namespace tf_sok {
namespace impl {

enum class Evict : int { kNone = 0, kLru = 1, kLfu = 2 };

struct DynamicIndexConfig {
  int64_t init_rows = 1024;   // rows of the arrays at first (reserved row included)
  int64_t max_keys = 0;       // at most this many keys; 0: unbounded
  Evict evict = Evict::kNone;
  int64_t min_frequency = 1;  // > 1: admission on (row 0, reserved, stands for keys not inserted)
  // a cache over a host store (hybrid tables): max_keys bounds the keys held between calls (0: none),
  // but a call whose own keys exceed it holds them all (evicting every other key) instead of failing
  bool cache = false;
  // a cache of a bounded table (max_capacity on a hybrid table): a call's own keys may not exceed it
  int64_t table_max_keys = 0;
  bool bounded() const { return cache || max_keys > 0; }
};

// The admission count of a cache's key written back to its host tier (still in the table): admitted
// at its next sighting, and told apart from the counts of keys waiting for admission.
constexpr int64_t kHeldCount = int64_t{1} << 40;

// For a cache over a host tier (hybrid tables) under the low-frequency filter: flags[j] = 1 where
// keys[j] is held by the tier, 0 elsewhere, so that a key the cache wrote back is taken in again
// whatever the filter draws (the filter is for keys new to the table). The arrays live where the
// index does (host memory for DynamicIndex, device memory for GpuDynamicIndex). "" or an error.
using HeldKeys = std::function<std::string(const int64_t* keys, int64_t n, uint8_t* flags)>;

// What one Find call changed, for the caller to apply to the arrays.
struct FindChanges {
  std::vector<int64_t> new_slots, new_keys;          // rows that received a key (to initialise)
  std::vector<int64_t> evicted_keys, evicted_slots;  // keys removed to make room, and their rows
  std::vector<int64_t> evicted_touched;              // the call that last touched each of them
  std::vector<int64_t> evicted_scores;               // an LFU cache's: each one's score
  int64_t rows = 0;                                  // the row count the arrays must have now
  int64_t missing_positions = 0;                     // positions whose key was not held (cache statistics)
};

// A copy of the index, for checkpoints.
struct DynamicIndexSnapshot {
  std::vector<int64_t> keys, slots, scores;  // live keys
  std::vector<int64_t> generations;          // per row, rows [0, next_free)
  std::vector<int64_t> candidate_keys, candidate_counts;  // seen, not yet admitted
  int64_t clock = 0, rows = 0, next_free = 0;
};

// An open-addressing map int64 -> int64 (linear probing, backward-shift deletion). A bucket holds
// its key and value side by side (one cache line per probe); INT64_MIN marks an empty bucket, so
// it is the one value a map cannot hold.
class KeyMap {
 public:
  static constexpr int64_t kEmpty = std::numeric_limits<int64_t>::min();
  explicit KeyMap(int64_t expected = 8);
  int64_t Get(int64_t key, int64_t missing) const;
  // out[j] = Get(keys[j], missing) for j < n, the buckets of later keys fetched ahead (a large map's
  // lookups wait on memory, not on the probe).
  void GetMany(const int64_t* keys, int64_t n, int64_t missing, int64_t* out) const;
  void Put(int64_t key, int64_t value);  // inserts or overwrites; value != kEmpty
  void Erase(int64_t key);               // no-op when absent
  // asks for key's first bucket ahead of a Get, Put or Erase of it (a large map's wait on memory)
  void Prefetch(int64_t key) const { __builtin_prefetch(&buckets_[Home(key)]); }
  // ... and the next cache line's buckets too, ahead of an Erase (which reads on to its run's end)
  void PrefetchRun(int64_t key) const {
    const int64_t home = Home(key);
    __builtin_prefetch(&buckets_[home], 1);
    __builtin_prefetch(&buckets_[((home | (kBucketsPerLine - 1)) + 1) & mask_], 1);
  }
  int64_t size() const { return count_; }
  template <typename F>
  void ForEach(F f) const {
    for (const Bucket& b : buckets_)
      if (b.value != kEmpty) f(b.key, b.value);
  }

 private:
  struct Bucket {
    int64_t key, value;
  };
  static constexpr int64_t kBucketsPerLine = 64 / sizeof(Bucket);   // (the buckets start on a line)
  int64_t Home(int64_t key) const;
  int64_t Position(int64_t key) const;  // of key, or the empty bucket ending its run
  void Grow();
  HugePageVector<Bucket> buckets_;   // (huge pages: fewer TLB misses)
  int64_t mask_ = 0, count_ = 0;
};

// When each find with insert ran: (call number, ns since the epoch), in call order.
class CallTimes {
 public:
  void Record(int64_t call);
  // The first call that ran at or after `unix_ns` (past the last call when none did).
  int64_t FirstAtOrAfter(int64_t unix_ns) const;
  void Clear() { calls_.clear(); }

 private:
  std::vector<std::pair<int64_t, int64_t>> calls_;
};

class DynamicIndex {
 public:
  explicit DynamicIndex(const DynamicIndexConfig& config);

  // Maps keys[0..n) to rows in `slots`. With insert, missing keys are admitted
  // (or counted towards admission; admit_all: admitted whatever their count),
  // inserted and touched, found keys touched; without, nothing changes and
  // missing keys map to -1. Returns "" or an error message, in which case
  // nothing changed.
  // insert_ratio < 1: a new key that passes admission is inserted only if
  // KeepNewKey(key, call clock, insert_ratio) (else it counts as not admitted); `held` (a cache's):
  // keys its host tier holds are inserted whatever the draw.
  // parallel_for (optional): the keys are looked up on the host's threads.
  std::string Find(const int64_t* keys, int64_t n, bool insert, int64_t* slots, FindChanges* changes,
                   bool admit_all = false, float insert_ratio = 1.0f, const HeldKeys& held = {},
                   const ParallelFor* parallel_for = nullptr);

  // A cache's (hybrid tables') prefetch of the rows of keys a later call will use: the keys `held`
  // says its host tier holds are taken in as if the last find had used them too (touched by it, at
  // its score; new keys are left alone: no admission counts, no insertion), making room by evicting
  // rows no call since the last prefetch touched (a step whose find ran since may still be updating
  // its rows), and no more keys than the arrays' rows hold as they are (no growth). The values a
  // caller sees do not change; `changes` lists the moves (new_keys: the keys taken in).
  std::string Prefetch(const int64_t* keys, int64_t n, int64_t* slots, FindChanges* changes, const HeldKeys& held,
                       const ParallelFor* parallel_for = nullptr);

  int64_t size() const { return live_; }
  int64_t rows() const { return rows_; }
  int64_t reserved_rows() const { return reserved_; }
  // A cache's bound (hybrid tables: the HBM budget over the bytes of a row of every array); the
  // next find evicts down to it.
  void set_max_keys(int64_t max_keys) { config_.max_keys = max_keys; }

  DynamicIndexSnapshot Export() const;
  // Replaces the contents; "" or an error message (nothing changed then).
  std::string Import(const DynamicIndexSnapshot& s);

  // The keys held (and their rows) that a find with insert touched at or after `unix_ns`
  // (nanoseconds since the epoch), since this index was made or last imported.
  void TouchedSince(int64_t unix_ns, std::vector<int64_t>* keys, std::vector<int64_t>* rows) const;
  // The number of the last find with insert, and the first one that ran at or after `unix_ns`
  // (past the last when none did), numbered since this index was made or last imported.
  int64_t calls() const { return call_; }
  int64_t FirstCallAtOrAfter(int64_t unix_ns) const { return call_times_.FirstAtOrAfter(unix_ns); }
  // A cache's (hybrid tables') LFU scores carried over the host tier: the keys a call took in count
  // the calls that touched them while the tier held them too. score[cache_rows[j]] += store_scores
  // [store_rows[j] * stride] for j < n where fresh is null or fresh[j] == 0, at most ScoreCap().
  void AddStoreScores(const int64_t* cache_rows, const int64_t* store_rows, const uint8_t* fresh,
                      const int64_t* store_scores, int64_t stride, int64_t n);
  // Above any score a row can have: one count per call since the index was made or imported, on top
  // of the largest imported score.
  int64_t ScoreCap() const { return imported_score_ + clock_ + 1; }

  // Admission counts of `keys` dropped (a cache's: keys its host tier no longer holds; a cache
  // counts every key it wrote back as seen min_frequency - 1 times, so that it comes back at once).
  void ForgetCandidates(const int64_t* keys, int64_t n);

 private:
  std::string Run(const int64_t* keys, int64_t n, bool insert, int64_t* slots, FindChanges* changes, bool admit_all,
                  float insert_ratio, const HeldKeys& held, const ParallelFor* parallel_for, bool prefetch);
  // Run's stages. A call's keys: the distinct rows it found (marked touched by `call`) and its
  // distinct missing keys in order of first sight, with each one's place there.
  struct CallKeys {
    std::vector<int64_t> found_rows, missing;
    KeyMap missing_index{8};
  };
  void SortOutKeys(const int64_t* keys, int64_t n, const int64_t* slots, int64_t call, CallKeys* k,
                   FindChanges* changes);
  // Which missing keys are admitted (admit[j]; their count) -- nothing written yet.
  std::string Admit(const std::vector<int64_t>& missing, bool admit_all, float insert_ratio, const HeldKeys& held,
                    bool prefetch, std::vector<uint8_t>* admit, int64_t* admitted);
  // The rows to evict for `admitted` new keys beside `found` ones (untouched since `floor`).
  std::string MakeRoom(int64_t found, int64_t admitted, int64_t floor, std::vector<int64_t>* victims);
  // A prefetch takes only the keys that fit in the rows as they are (the arrays are in use).
  void FitPrefetch(int64_t call, std::vector<uint8_t>* admit, int64_t* admitted, std::vector<int64_t>* victims);
  // The commit: found rows scored, victims out, admitted keys in; every position's slot.
  void Commit(const int64_t* keys, int64_t n, int64_t* slots, const CallKeys& k, const std::vector<uint8_t>& admit,
              const std::vector<int64_t>& victims, int64_t call, bool prefetch, FindChanges* changes);
  void EnsureRows(int64_t needed);
  // Rows to evict for `need` keys: the live rows untouched since call `floor` of lowest (score, key), in
  // that order, into victims (fewer when fewer are untouched); returns how many untouched rows there
  // were (LRU tables in order: at least min(need, that count) of them).
  int64_t Victims(int64_t floor, int64_t need, std::vector<int64_t>* victims) const;
  bool LruEntryLive(const std::pair<int64_t, int64_t>& e) const;
  void TrimLruOrder();   // drops the entries of lru_ no longer live, sorts the front score's

  DynamicIndexConfig config_;
  int64_t reserved_ = 0;
  KeyMap slot_of_key_;
  KeyMap candidates_;  // admission: times seen, for keys not admitted yet
  // Per row, what the index keeps of it, side by side: a find reads and writes a row's fields together
  // at a random place (one cache line a row, not one per field; huge pages: fewer TLB misses).
  struct alignas(32) Row {
    int64_t key = 0;       // the key it holds (while live)
    int64_t score = 0;     // LRU: the clock of the call that last touched it; LFU: the calls that did
    int64_t touched = 0;   // the last call (numbered by call_) that touched it
    uint64_t generation : 63;   // how many keys it held
    uint64_t live : 1;
    Row() : generation(0), live(0) {}
  };
  HugePageVector<Row> row_;
  std::vector<int64_t> free_;
  int64_t next_free_ = 0, rows_ = 0, live_ = 0, clock_ = 0, call_ = 0;
  int64_t last_prefetch_ = 0;   // the call the last prefetch extended
  int64_t imported_score_ = 0;  // the largest score the last import brought
  CallTimes call_times_;
  // A bounded LRU index's rows in the order of their scores: (score, row) appended as a call scores a
  // row (scores only grow), an entry live while its row is and has that score; eviction reads the
  // untouched live rows from the front instead of scanning every row. Off (every row scanned) after
  // an import whose scores exceed its clock.
  // The entries before lru_sorted_ (the front score's, sorted once it is at the front) are in
  // (score, key) order.
  bool lru_in_order_ = false;
  std::vector<std::pair<int64_t, int64_t>> lru_;
  size_t lru_head_ = 0, lru_sorted_ = 0;
};

// splitmix64's finaliser: the hash of keys and the initializer's random bits.
TF_SOK_HD uint64_t MixBits(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Initial values of a dynamic table's rows, a function of (key, column, seed)
// only, so ranks, restarts and devices agree: kind 0 uniform [a, b), 1 normal
// (mean a, stddev b), 2 truncated normal (within 2 stddev), 3 constant a.
TF_SOK_HD uint64_t InitialKeyBits(int64_t seed, int64_t key) {
  return MixBits(MixBits(static_cast<uint64_t>(seed) ^ 0x5DEECE66Dull) ^ MixBits(static_cast<uint64_t>(key)));
}

TF_SOK_HD float InitialValue(int kind, float a, float b, uint64_t key_bits, int64_t column) {
  if (kind == 3) return a;
  uint64_t x = MixBits(key_bits + static_cast<uint64_t>(column) * 0xD1B54A32D192ED03ull);
  if (kind == 0) return a + (b - a) * static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-53);
  while (true) {  // Box-Muller; truncated: draw again until within 2 stddev
    const double u1 = (static_cast<double>(x >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    x = MixBits(x);
    const double u2 = static_cast<double>(x >> 11) * 0x1.0p-53;
    const double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    x = MixBits(x);
    if (kind == 1 || fabs(z) <= 2.0) return static_cast<float>(a + b * z);
  }
}

// The low-frequency filter's draw: whether new key `key` is inserted by the call
// whose clock is `clock`, with probability `ratio` (a function of both only).
TF_SOK_HD bool KeepNewKey(int64_t key, int64_t clock, float ratio) {
  if (ratio >= 1.0f) return true;
  const uint64_t x = MixBits(static_cast<uint64_t>(key) ^ MixBits(static_cast<uint64_t>(clock) + 0x51ED27ull));
  return static_cast<double>(x >> 11) * 0x1.0p-53 < static_cast<double>(ratio);
}

void InitialRows(int kind, float a, float b, int64_t seed, const int64_t* keys, int64_t n, int64_t dim,
                 float* out);

// Upkeep of the row arrays an index serves (`width` floats per row), host memory.
// base[rows[j]] = the initial value of keys[j]:
void InitialRowsAt(int kind, float a, float b, int64_t seed, const int64_t* keys, const int64_t* rows, int64_t n,
                   int64_t width, float* base);
void FillRows(float* base, int64_t width, const int64_t* rows, int64_t n, float fill);
// out[j] = the width floats at base + rows[j] * stride (rows of an array: stride = width)
void GatherRows(const float* base, int64_t stride, int64_t width, const int64_t* rows, int64_t n, float* out);
void Fill(float* p, int64_t count, float value);

// Whether row_splits [n] start at 0, never decrease and end at `count`.
bool RowSplitsValid(const int64_t* splits, int64_t n, int64_t count);

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_DYNAMIC_INDEX_H_
