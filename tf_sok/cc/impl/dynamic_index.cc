#include "tf_sok/cc/impl/dynamic_index.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <tuple>

namespace tf_sok {
namespace impl {
namespace {

inline uint64_t Mix(uint64_t x) { return MixBits(x); }

int64_t PowerOfTwoAtLeast(int64_t n) {
  int64_t p = 8;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

// ---------------------------------------------------------------- KeyMap

KeyMap::KeyMap(int64_t expected) {
  const int64_t buckets = PowerOfTwoAtLeast(expected * 2);
  buckets_.assign(buckets, Bucket{0, kEmpty});
  mask_ = buckets - 1;
}

int64_t KeyMap::Home(int64_t key) const {
  return static_cast<int64_t>(Mix(static_cast<uint64_t>(key)) & static_cast<uint64_t>(mask_));
}

int64_t KeyMap::Position(int64_t key) const {
  int64_t pos = Home(key);
  while (buckets_[pos].value != kEmpty && buckets_[pos].key != key) pos = (pos + 1) & mask_;
  return pos;
}

int64_t KeyMap::Get(int64_t key, int64_t missing) const {
  const Bucket& b = buckets_[Position(key)];
  return b.value != kEmpty ? b.value : missing;
}

void KeyMap::GetMany(const int64_t* keys, int64_t n, int64_t missing, int64_t* out) const {
  constexpr int64_t kAhead = 16;   // keys whose first bucket is on its way from memory
  int64_t home[kAhead];
  const int64_t first = std::min(n, kAhead);
  for (int64_t j = 0; j < first; ++j) {
    home[j] = Home(keys[j]);
    __builtin_prefetch(&buckets_[home[j]]);
  }
  for (int64_t j = 0; j < n; ++j) {
    int64_t pos = home[j % kAhead];
    if (j + kAhead < n) {
      const int64_t next = Home(keys[j + kAhead]);
      home[j % kAhead] = next;
      __builtin_prefetch(&buckets_[next]);
    }
    while (buckets_[pos].value != kEmpty && buckets_[pos].key != keys[j]) pos = (pos + 1) & mask_;
    out[j] = buckets_[pos].value != kEmpty ? buckets_[pos].value : missing;
  }
}

void KeyMap::Grow() {
  HugePageVector<Bucket> old;
  old.swap(buckets_);
  buckets_.assign(old.size() * 2, Bucket{0, kEmpty});
  mask_ = static_cast<int64_t>(buckets_.size()) - 1;
  count_ = 0;
  for (const Bucket& b : old)
    if (b.value != kEmpty) Put(b.key, b.value);
}

void KeyMap::Put(int64_t key, int64_t value) {
  int64_t pos = Position(key);
  if (buckets_[pos].value != kEmpty) {
    buckets_[pos].value = value;
    return;
  }
  if ((count_ + 1) * 4 > static_cast<int64_t>(buckets_.size()) * 3) {  // load factor bound 0.75
    Grow();
    pos = Position(key);
  }
  buckets_[pos] = Bucket{key, value};
  ++count_;
}

void KeyMap::Erase(int64_t key) {
  int64_t hole = Position(key);
  if (buckets_[hole].value == kEmpty) return;
  // backward shift: move later members of the run into the hole when their home allows it
  int64_t j = hole;
  while (true) {
    j = (j + 1) & mask_;
    if (buckets_[j].value == kEmpty) break;
    const int64_t home = Home(buckets_[j].key);
    // j's entry may move to `hole` unless its home lies cyclically in (hole, j]
    const bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (stays) continue;
    buckets_[hole] = buckets_[j];
    hole = j;
  }
  buckets_[hole].value = kEmpty;
  --count_;
}

// ---------------------------------------------------------------- DynamicIndex

DynamicIndex::DynamicIndex(const DynamicIndexConfig& config)
    : config_(config), slot_of_key_(std::max<int64_t>(config.init_rows, 8)), candidates_(8) {
  reserved_ = 1;  // row 0: what keys not inserted (not admitted, filtered) read
  next_free_ = reserved_;
  lru_in_order_ = config_.bounded() && config_.evict == Evict::kLru;
  int64_t rows = std::max<int64_t>(config_.init_rows, reserved_ + 1);
  if (config_.bounded()) rows = std::max(reserved_ + 1, std::min(rows, config_.max_keys + reserved_));
  rows_ = 0;
  EnsureRows(rows);
}

void DynamicIndex::EnsureRows(int64_t needed) {
  if (needed <= rows_) return;
  int64_t rows = std::max(needed, rows_ * 2);
  if (config_.bounded()) rows = std::max(needed, std::min(rows, config_.max_keys + reserved_));
  row_.resize(rows);
  rows_ = rows;
}

std::string DynamicIndex::Find(const int64_t* keys, int64_t n, bool insert, int64_t* slots, FindChanges* ch,
                               bool admit_all, float insert_ratio, const HeldKeys& held,
                               const ParallelFor* parallel_for) {
  return Run(keys, n, insert, slots, ch, admit_all, insert_ratio, held, parallel_for, false);
}

std::string DynamicIndex::Prefetch(const int64_t* keys, int64_t n, int64_t* slots, FindChanges* ch,
                                   const HeldKeys& held, const ParallelFor* parallel_for) {
  if (!config_.cache || !held) return "prefetch is for the cache of a host tier";
  return Run(keys, n, true, slots, ch, false, 0.0f, held, parallel_for, true);
}

std::string DynamicIndex::Run(const int64_t* keys, int64_t n, bool insert, int64_t* slots, FindChanges* ch,
                              bool admit_all, float insert_ratio, const HeldKeys& held,
                              const ParallelFor* parallel_for, bool prefetch) {
  auto lookup = [&](int64_t begin, int64_t end) { slot_of_key_.GetMany(keys + begin, end - begin, -1, slots + begin); };
  if (parallel_for != nullptr && n > 16384)
    (*parallel_for)(n, 100, lookup);   // lookups only: the map is not changed while they run
  else
    lookup(0, n);
  if (!insert) {
    ch->rows = rows_;
    return "";
  }
  // marks rows this call touched; a prefetch extends the last call (its rows count as that call's)
  const int64_t call = prefetch ? call_ : ++call_;
  if (!prefetch) call_times_.Record(call);
  // rows touched at or after `floor` are not evicted: the call's own and, for a prefetch, those of
  // every call since the last prefetch (steps whose updates may still be under way)
  const int64_t floor = prefetch ? std::min(last_prefetch_, call) : call;
  CallKeys k;   // 1. found keys (their distinct rows) and distinct missing keys
  SortOutKeys(keys, n, slots, call, &k, ch);
  std::vector<uint8_t> admit;   // 2. admission
  int64_t admitted = 0;
  std::string error = Admit(k.missing, admit_all, insert_ratio, held, prefetch, &admit, &admitted);
  if (!error.empty()) return error;
  std::vector<int64_t> victims;   // 3. room
  error = MakeRoom(static_cast<int64_t>(k.found_rows.size()), admitted, floor, &victims);
  if (!error.empty()) return error;
  if (prefetch) FitPrefetch(call, &admit, &admitted, &victims);
  Commit(keys, n, slots, k, admit, victims, call, prefetch, ch);   // 4. commit
  ch->rows = rows_;
  TrimLruOrder();
  return "";
}

namespace {
constexpr int64_t kRowsAhead = 16;   // rows fetched ahead
}  // namespace

void DynamicIndex::SortOutKeys(const int64_t* keys, int64_t n, const int64_t* slots, int64_t call, CallKeys* k,
                               FindChanges* ch) {
  const int64_t missing_positions = std::count_if(slots, slots + n, [](int64_t s) { return s < 0; });
  k->missing_index = KeyMap(std::max<int64_t>(missing_positions, 8));
  for (int64_t i = 0; i < n; ++i) {
    if (i + kRowsAhead < n) {
      if (slots[i + kRowsAhead] >= 0) {
        __builtin_prefetch(&row_[slots[i + kRowsAhead]]);
      } else {
        k->missing_index.Prefetch(keys[i + kRowsAhead]);
      }
    }
    const int64_t s = slots[i];
    if (s >= 0) {
      if (row_[s].touched != call) {
        row_[s].touched = call;
        k->found_rows.push_back(s);
      }
    } else if (++ch->missing_positions, k->missing_index.Get(keys[i], -1) < 0) {
      k->missing_index.Put(keys[i], static_cast<int64_t>(k->missing.size()));
      k->missing.push_back(keys[i]);
    }
  }
}

std::string DynamicIndex::Admit(const std::vector<int64_t>& missing, bool admit_all, float insert_ratio,
                                const HeldKeys& held, bool prefetch, std::vector<uint8_t>* admit,
                                int64_t* admitted) {
  admit->assign(missing.size(), 1);
  *admitted = static_cast<int64_t>(missing.size());
  if ((config_.min_frequency <= 1 && insert_ratio >= 1.0f) || admit_all) return "";
  std::vector<uint8_t> in_tier(missing.size(), 0);
  if (held && insert_ratio < 1.0f && !missing.empty()) {
    const std::string error = held(missing.data(), static_cast<int64_t>(missing.size()), in_tier.data());
    if (!error.empty()) return error;
  }
  *admitted = 0;
  for (size_t j = 0; j < missing.size(); ++j) {   // (a prefetch: the keys the tier holds, no others)
    (*admit)[j] = in_tier[j] ||
                  (!prefetch &&
                   (config_.min_frequency <= 1 || candidates_.Get(missing[j], 0) + 1 >= config_.min_frequency) &&
                   KeepNewKey(missing[j], clock_ + 1, insert_ratio));
    *admitted += (*admit)[j];
  }
  return "";
}

// evicts the lowest-scored rows this call did not touch (score, then key, ascending)
std::string DynamicIndex::MakeRoom(int64_t found, int64_t admitted, int64_t floor, std::vector<int64_t>* victims) {
  if (config_.cache && config_.table_max_keys > 0 && found + admitted > config_.table_max_keys) {
    return "cannot hold this batch's keys: it uses " + std::to_string(found + admitted) +
           " distinct keys and max_capacity is " + std::to_string(config_.table_max_keys);
  }
  if (!config_.bounded() || live_ + admitted <= config_.max_keys) return "";
  int64_t need = live_ + admitted - config_.max_keys;
  if (config_.evict == Evict::kNone) {
    return "is full: " + std::to_string(live_) + " of max_capacity " + std::to_string(config_.max_keys) +
           " keys held and this batch brings " + std::to_string(admitted) +
           " new ones; give evict_strategy (\"lru\" or \"lfu\") or a larger max_capacity";
  }
  const int64_t available = Victims(floor, need, victims);
  if (config_.cache) need = std::min(need, available);
  if (available < need) {
    return "cannot hold this batch's keys: it uses " + std::to_string(found + admitted) +
           " distinct keys and max_capacity is " + std::to_string(config_.max_keys);
  }
  victims->resize(need);
  return "";
}

void DynamicIndex::FitPrefetch(int64_t call, std::vector<uint8_t>* admit, int64_t* admitted,
                               std::vector<int64_t>* victims) {
  const int64_t unused = static_cast<int64_t>(free_.size()) + rows_ - next_free_;
  const int64_t fit = std::max<int64_t>(0, std::min(*admitted, static_cast<int64_t>(victims->size()) +
                                                                  std::min(config_.max_keys - live_, unused)));
  int64_t kept = 0;
  for (uint8_t& a : *admit) {
    if (!a) continue;
    if (kept < fit) {
      ++kept;
    } else {
      a = 0;
    }
  }
  *admitted = fit;
  victims->resize(std::min<int64_t>(victims->size(), std::max<int64_t>(0, live_ + fit - config_.max_keys)));
  last_prefetch_ = call;
}

void DynamicIndex::Commit(const int64_t* keys, int64_t n, int64_t* slots, const CallKeys& k,
                          const std::vector<uint8_t>& admit, const std::vector<int64_t>& victims, int64_t call,
                          bool prefetch, FindChanges* ch) {
  if (!prefetch) ++clock_;
  const int64_t found = prefetch ? 0 : static_cast<int64_t>(k.found_rows.size());   // (a prefetch scores nothing)
  for (int64_t j = 0; j < found; ++j) {
    if (j + kRowsAhead < found) __builtin_prefetch(&row_[k.found_rows[j + kRowsAhead]], 1);
    const int64_t s = k.found_rows[j];
    row_[s].score = config_.evict == Evict::kLfu ? row_[s].score + 1 : clock_;
    if (lru_in_order_) lru_.emplace_back(clock_, s);
  }
  const int64_t out = static_cast<int64_t>(victims.size());
  for (int64_t v = 0; v < out; ++v) {
    // (the victims' rows two strides ahead, their keys' buckets one stride ahead)
    if (v + 2 * kRowsAhead < out) {
      __builtin_prefetch(&row_[victims[v + 2 * kRowsAhead]], 1);
    }
    if (v + kRowsAhead < out) slot_of_key_.PrefetchRun(row_[victims[v + kRowsAhead]].key);
    const int64_t s = victims[v];
    ch->evicted_keys.push_back(row_[s].key);
    ch->evicted_slots.push_back(s);
    ch->evicted_touched.push_back(row_[s].touched);
    if (config_.cache && config_.evict == Evict::kLfu) ch->evicted_scores.push_back(row_[s].score);   // (for the tier)
    slot_of_key_.Erase(row_[s].key);
    // a cache's key goes back to the host tier, still in the table: admitted at its next sighting
    if (config_.cache && config_.min_frequency > 1) candidates_.Put(row_[s].key, kHeldCount);
    row_[s].live = 0;
    --live_;
    free_.push_back(s);
  }
  std::vector<int64_t> slot_of_missing(k.missing.size(), 0);  // not admitted: row 0, which reads zeros
  for (size_t j = 0; j < k.missing.size(); ++j) {
    const int64_t key = k.missing[j];
    if (j + kRowsAhead < k.missing.size()) slot_of_key_.Prefetch(k.missing[j + kRowsAhead]);
    // (the freed rows these keys take come from free_'s back: the one a stride on)
    if (free_.size() > static_cast<size_t>(kRowsAhead))
      __builtin_prefetch(&row_[free_[free_.size() - 1 - kRowsAhead]], 1);
    if (!admit[j]) {
      if (config_.min_frequency > 1 && !prefetch) candidates_.Put(key, candidates_.Get(key, 0) + 1);
      continue;
    }
    if (config_.min_frequency > 1) candidates_.Erase(key);
    int64_t s;
    if (!free_.empty()) {
      s = free_.back();
      free_.pop_back();
    } else {
      s = next_free_++;
      EnsureRows(next_free_);
    }
    slot_of_key_.Put(key, s);
    row_[s].key = key;
    row_[s].live = 1;
    ++live_;
    ++row_[s].generation;
    // LFU: this call's count (a prefetch's keys get theirs from the find that uses them)
    row_[s].score = config_.evict == Evict::kLfu ? (prefetch ? 0 : 1) : clock_;
    if (lru_in_order_) lru_.emplace_back(clock_, s);
    row_[s].touched = call;
    slot_of_missing[j] = s;
    ch->new_slots.push_back(s);
    ch->new_keys.push_back(key);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (i + kRowsAhead < n && slots[i + kRowsAhead] < 0) k.missing_index.Prefetch(keys[i + kRowsAhead]);
    if (slots[i] < 0) slots[i] = slot_of_missing[k.missing_index.Get(keys[i], 0)];
  }
}

bool DynamicIndex::LruEntryLive(const std::pair<int64_t, int64_t>& e) const {
  return row_[e.second].live && row_[e.second].score == e.first;
}

int64_t DynamicIndex::Victims(int64_t floor, int64_t need, std::vector<int64_t>* victims) const {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> candidates;  // (score, key, row)
  if (lru_in_order_) {
    // the untouched live rows in score order, up to the need-th and those tied with it
    // (entries before lru_sorted_ are in (score, key) order: the need-th of them ends the scan)
    for (size_t i = lru_head_; i < lru_.size(); ++i) {
      if (i + kRowsAhead < lru_.size()) __builtin_prefetch(&row_[lru_[i + kRowsAhead].second]);
      const int64_t row = lru_[i].second;
      if (!LruEntryLive(lru_[i]) || row_[row].touched >= floor) continue;
      if (static_cast<int64_t>(candidates.size()) >= need && lru_[i].first != std::get<0>(candidates[need - 1]))
        break;
      candidates.emplace_back(lru_[i].first, row_[row].key, row);
      if (static_cast<int64_t>(candidates.size()) == need && i < lru_sorted_) break;
    }
  } else {
    candidates.reserve(live_);
    for (int64_t s = reserved_; s < next_free_; ++s)
      if (row_[s].live && row_[s].touched < floor) candidates.emplace_back(row_[s].score, row_[s].key, s);
  }
  const int64_t take = std::min(need, static_cast<int64_t>(candidates.size()));
  if (take > 0) {
    std::nth_element(candidates.begin(), candidates.begin() + (take - 1), candidates.end());
    std::sort(candidates.begin(), candidates.begin() + take);
  }
  for (int64_t v = 0; v < take; ++v) victims->push_back(std::get<2>(candidates[v]));
  return static_cast<int64_t>(candidates.size());
}

void DynamicIndex::TrimLruOrder() {
  if (!lru_in_order_) return;
  while (lru_head_ < lru_.size() && !LruEntryLive(lru_[lru_head_])) ++lru_head_;
  const size_t held = lru_.size() - lru_head_;
  if (lru_head_ * 2 >= lru_.size() || held > 2 * static_cast<size_t>(live_) + 4096) {
    size_t kept = 0, sorted = 0;   // the live entries, in order
    for (size_t i = lru_head_; i < lru_.size(); ++i) {
      if (i + kRowsAhead < lru_.size()) __builtin_prefetch(&row_[lru_[i + kRowsAhead].second]);
      if (i == lru_sorted_) sorted = kept;
      if (LruEntryLive(lru_[i])) lru_[kept++] = lru_[i];
    }
    lru_sorted_ = lru_sorted_ >= lru_.size() ? kept : (lru_sorted_ <= lru_head_ ? 0 : sorted);
    lru_.resize(kept);
    lru_head_ = 0;
  }
  if (lru_sorted_ > lru_head_ || lru_head_ == lru_.size()) return;
  // the front score's live entries sorted by key, once: the victims of the next calls in order
  const int64_t score = lru_[lru_head_].first;
  size_t end = lru_head_;
  std::vector<std::pair<int64_t, int64_t>> group;   // (key, row)
  for (; end < lru_.size() && lru_[end].first == score; ++end) {
    if (end + kRowsAhead < lru_.size()) __builtin_prefetch(&row_[lru_[end + kRowsAhead].second]);
    if (LruEntryLive(lru_[end])) group.emplace_back(row_[lru_[end].second].key, lru_[end].second);
  }
  std::sort(group.begin(), group.end());
  lru_head_ = end - group.size();
  for (size_t j = 0; j < group.size(); ++j) lru_[lru_head_ + j] = {score, group[j].second};
  lru_sorted_ = end;
}

void CallTimes::Record(int64_t call) {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::system_clock::now().time_since_epoch()).count();
  calls_.emplace_back(call, calls_.empty() ? now : std::max(now, calls_.back().second));
}

int64_t CallTimes::FirstAtOrAfter(int64_t unix_ns) const {
  const auto it = std::lower_bound(calls_.begin(), calls_.end(), unix_ns,
                                   [](const std::pair<int64_t, int64_t>& c, int64_t t) { return c.second < t; });
  return it == calls_.end() ? (calls_.empty() ? 1 : calls_.back().first + 1) : it->first;
}

void DynamicIndex::TouchedSince(int64_t unix_ns, std::vector<int64_t>* keys, std::vector<int64_t>* rows) const {
  const int64_t first = call_times_.FirstAtOrAfter(unix_ns);
  for (int64_t r = reserved_; r < next_free_; ++r) {
    if (!row_[r].live || row_[r].touched < first) continue;
    keys->push_back(row_[r].key);
    rows->push_back(r);
  }
}

void DynamicIndex::AddStoreScores(const int64_t* cache_rows, const int64_t* store_rows, const uint8_t* fresh,
                                  const int64_t* store_scores, int64_t stride, int64_t n) {
  const int64_t cap = ScoreCap();
  for (int64_t j = 0; j < n; ++j) {
    if (fresh != nullptr && fresh[j]) continue;
    int64_t& score = row_[cache_rows[j]].score;
    score = std::min(cap, score + store_scores[store_rows[j] * stride]);
  }
}

void DynamicIndex::ForgetCandidates(const int64_t* keys, int64_t n) {
  for (int64_t j = 0; j < n; ++j) candidates_.Erase(keys[j]);
}

DynamicIndexSnapshot DynamicIndex::Export() const {
  DynamicIndexSnapshot s;
  for (int64_t r = reserved_; r < next_free_; ++r) {
    if (!row_[r].live) continue;
    s.keys.push_back(row_[r].key);
    s.slots.push_back(r);
    s.scores.push_back(row_[r].score);
  }
  s.generations.resize(next_free_);
  for (int64_t r = 0; r < next_free_; ++r) s.generations[r] = static_cast<int64_t>(row_[r].generation);
  candidates_.ForEach([&](int64_t k, int64_t c) {
    s.candidate_keys.push_back(k);
    s.candidate_counts.push_back(c);
  });
  s.clock = clock_;
  s.rows = rows_;
  s.next_free = next_free_;
  return s;
}

std::string DynamicIndex::Import(const DynamicIndexSnapshot& s) {
  const size_t n = s.keys.size();
  if (s.slots.size() != n || s.scores.size() != n || s.candidate_keys.size() != s.candidate_counts.size())
    return "the saved index is inconsistent (keys, rows and scores differ in length)";
  if (s.next_free < reserved_ || s.rows < s.next_free || static_cast<int64_t>(s.generations.size()) != s.next_free)
    return "the saved index is inconsistent (row counts); was it saved with another min_frequency?";
  if (!config_.cache && config_.max_keys > 0 && static_cast<int64_t>(n) > config_.max_keys)
    return "the saved index holds " + std::to_string(n) + " keys, more than max_capacity " +
           std::to_string(config_.max_keys);
  DynamicIndexConfig config = config_;
  config.init_rows = s.rows;
  DynamicIndex fresh(config);
  fresh.EnsureRows(s.rows);
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = s.slots[i];
    if (r < reserved_ || r >= s.next_free || fresh.row_[r].live)
      return "the saved index is inconsistent (row " + std::to_string(r) + " out of range or repeated)";
    if (fresh.slot_of_key_.Get(s.keys[i], -1) >= 0)
      return "the saved index is inconsistent (key " + std::to_string(s.keys[i]) + " repeated)";
    fresh.slot_of_key_.Put(s.keys[i], r);
    fresh.row_[r].key = s.keys[i];
    fresh.row_[r].score = s.scores[i];
    fresh.row_[r].live = 1;
  }
  for (int64_t r = 0; r < s.next_free; ++r) fresh.row_[r].generation = s.generations[r];
  for (int64_t r = s.next_free - 1; r >= reserved_; --r)
    if (!fresh.row_[r].live) fresh.free_.push_back(r);
  for (size_t i = 0; i < s.candidate_keys.size(); ++i)
    fresh.candidates_.Put(s.candidate_keys[i], s.candidate_counts[i]);
  fresh.live_ = static_cast<int64_t>(n);
  fresh.next_free_ = s.next_free;
  fresh.call_ = call_;   // touch marks of the import start clean, calls keep counting
  fresh.clock_ = s.clock;
  for (int64_t v : s.scores) fresh.imported_score_ = std::max(fresh.imported_score_, v);
  if (fresh.lru_in_order_) {
    for (size_t i = 0; i < n; ++i) fresh.lru_.emplace_back(s.scores[i], s.slots[i]);
    std::sort(fresh.lru_.begin(), fresh.lru_.end());
    fresh.TrimLruOrder();
    // later touches append their clock: in order only while no imported score is above it
    if (!fresh.lru_.empty() && fresh.lru_.back().first > s.clock) {
      fresh.lru_in_order_ = false;
      fresh.lru_.clear();
    }
  }
  *this = std::move(fresh);
  return "";
}

// ---------------------------------------------------------------- initial values

void InitialRows(int kind, float a, float b, int64_t seed, const int64_t* keys, int64_t n, int64_t dim,
                 float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t bits = InitialKeyBits(seed, keys[i]);
    for (int64_t c = 0; c < dim; ++c) out[i * dim + c] = InitialValue(kind, a, b, bits, c);
  }
}

void InitialRowsAt(int kind, float a, float b, int64_t seed, const int64_t* keys, const int64_t* rows, int64_t n,
                   int64_t width, float* base) {
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t bits = InitialKeyBits(seed, keys[j]);
    for (int64_t c = 0; c < width; ++c) base[rows[j] * width + c] = InitialValue(kind, a, b, bits, c);
  }
}

void FillRows(float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  for (int64_t j = 0; j < n; ++j) std::fill(base + rows[j] * width, base + (rows[j] + 1) * width, fill);
}

void GatherRows(const float* base, int64_t stride, int64_t width, const int64_t* rows, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) std::copy(base + rows[j] * stride, base + rows[j] * stride + width, out + j * width);
}

void Fill(float* p, int64_t count, float value) { std::fill(p, p + count, value); }

bool RowSplitsValid(const int64_t* splits, int64_t n, int64_t count) {
  if (n < 1 || splits[0] != 0 || splits[n - 1] != count) return false;
  for (int64_t i = 1; i < n; ++i)
    if (splits[i] < splits[i - 1]) return false;
  return true;
}

}  // namespace impl
}  // namespace tf_sok
