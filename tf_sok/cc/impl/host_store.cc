#include "tf_sok/cc/impl/host_store.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace tf_sok {
namespace impl {
namespace {

class PlainHostMemory : public HostMemory {
 public:
  void* Allocate(size_t bytes) override { return AllocateForRandomAccess(bytes); }
  void Free(void* p) override { std::free(p); }
};

}  // namespace

std::unique_ptr<HostMemory> NewPlainHostMemory() { return std::make_unique<PlainHostMemory>(); }

HostStore::HostStore(std::unique_ptr<HostMemory> memory) : memory_(std::move(memory)), row_of_key_(1024) {}

HostStore::~HostStore() {
  Settle();
  if (records_) memory_->Free(records_);
}

namespace {
int64_t RoundUp4(int64_t n) { return (n + 3) / 4 * 4; }
}  // namespace

std::string HostStore::Reserve(int64_t rows) {
  Settle();
  if (rows <= capacity_) return "";
  if (records_ != nullptr) {
    // grown in place where the memory can: only the new rows are allocated (pinned), nothing copied or
    // freed (a pinned copy of a large store, and the free's wait for the device, stalled the steps that
    // brought new keys); growth by a quarter keeps each extension's pinning short
    const int64_t capacity = std::max<int64_t>(rows, capacity_ + capacity_ / 4);
    const size_t row_bytes = sizeof(float) * static_cast<size_t>(stride_);
    if (memory_->Grow(records_, row_bytes * capacity_, row_bytes * capacity)) {
      capacity_ = capacity;
      return "";
    }
  }
  const int64_t capacity = std::max<int64_t>({rows, 2 * capacity_, 1024});
  auto* records = static_cast<float*>(memory_->Allocate(sizeof(float) * capacity * stride_));
  if (records == nullptr) return "ran out of host memory for its host tier (" + std::to_string(capacity) + " rows)";
  if (records_) {
    std::memcpy(records, records_, sizeof(float) * count_ * stride_);
    memory_->Free(records_);
  }
  records_ = records;
  capacity_ = capacity;
  return "";
}

std::string HostStore::AddArray(int64_t width, float fill) {
  if (num_arrays() >= kMaxRecordArrays)
    return "its host tier holds at most " + std::to_string(kMaxRecordArrays) + " arrays (values and optimizer slots)";
  Settle();
  Array a;
  a.offset = arrays_.empty() ? kMetaFloats : RoundUp4(arrays_.back().offset + arrays_.back().width);
  a.width = width;
  a.fill = fill;
  const int64_t stride = RoundUp4(a.offset + width), rows = std::max<int64_t>(capacity_, 1);
  auto* records = static_cast<float*>(memory_->Allocate(sizeof(float) * rows * stride));
  if (records == nullptr) return "ran out of host memory for its host tier";
  std::fill(records, records + rows * stride, 0.0f);
  for (int64_t r = 0; r < count_; ++r) {   // every record widened: its meta and arrays, then the new one at its fill
    std::copy(records_ + r * stride_, records_ + (r + 1) * stride_, records + r * stride);
    std::fill(records + r * stride + a.offset, records + r * stride + a.offset + width, fill);
  }
  if (records_) memory_->Free(records_);
  records_ = records;
  stride_ = stride;
  arrays_.push_back(a);
  return "";
}

std::string HostStore::Insert(const int64_t* keys, int64_t n, int64_t* rows, uint8_t* fresh,
                              const ParallelFor* parallel_for) {
  auto find = [&](int64_t begin, int64_t end) { Rows(keys + begin, end - begin, rows + begin); };
  if (parallel_for != nullptr && n > 4096)
    (*parallel_for)(n, 200, find);   // lookups only: the map is not changed while they run
  else
    find(0, n);
  return AddAbsent(keys, n, rows, fresh);
}

std::string HostStore::AddAbsent(const int64_t* keys, int64_t n, int64_t* rows, uint8_t* fresh) {
  // rows the last Bound dropped are free now: the device is done with them (the caller waited)
  free_rows_.insert(free_rows_.end(), freed_.begin(), freed_.end());
  freed_.clear();
  int64_t added = 0;
  for (int64_t j = 0; j < n; ++j) added += rows[j] < 0;
  if (added > 0) ++version_;
  const std::string error = Reserve(count_ + std::max<int64_t>(0, added - static_cast<int64_t>(free_rows_.size())));
  if (!error.empty()) return error;
  for (int64_t j = 0; j < n; ++j) {
    fresh[j] = rows[j] < 0;
    if (rows[j] >= 0) continue;
    int64_t r;
    if (!free_rows_.empty()) {
      r = free_rows_.back();
      free_rows_.pop_back();
      key_of_row_[r] = keys[j];
    } else {
      r = count_++;
      key_of_row_.push_back(keys[j]);
      alive_.push_back(0);
      cached_.push_back(0);
      order_.push_back(0);
    }
    row_of_key_.Put(keys[j], r);
    alive_[r] = 1;
    cached_[r] = 0;
    order_[r] = 0;
    std::fill(records_ + r * stride_, records_ + (r + 1) * stride_, 0.0f);   // (meta 0, with the padding)
    for (const Array& a : arrays_) {
      float* row = records_ + r * stride_ + a.offset;
      std::fill(row, row + a.width, a.fill);
    }
    rows[j] = r;
  }
  return "";
}

void HostStore::AddedOnDevice(const int64_t* keys, const int64_t* rows, int64_t n) {
  if (n <= 0) return;
  ++version_;
  const int64_t count = count_ + n;
  key_of_row_.resize(count);
  alive_.resize(count);
  cached_.resize(count);
  order_.resize(count);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = rows[j];
    row_of_key_.Put(keys[j], r);
    key_of_row_[r] = keys[j];
    alive_[r] = 1;
    cached_[r] = 1;
    order_[r] = 0;
    set_mark(r, 0);
    set_score(r, 0);
  }
  count_ = count;
  cached_count_ += n;
}

void HostStore::Rows(const int64_t* keys, int64_t n, int64_t* rows) const {
  row_of_key_.GetMany(keys, n, -1, rows);
}

std::string HostStore::Replace(const int64_t* keys, int64_t n, const std::vector<const float*>& data,
                               int64_t pitch, const int64_t* scores) {
  if (data.size() != arrays_.size())
    return "its host tier has " + std::to_string(arrays_.size()) + " arrays, " + std::to_string(data.size()) +
           " given";
  KeyMap seen(std::max<int64_t>(n, 8));
  for (int64_t j = 0; j < n; ++j) {
    if (seen.Get(keys[j], -1) >= 0) return "key " + std::to_string(keys[j]) + " is given twice";
    seen.Put(keys[j], j);
  }
  const std::string error = Reserve(n);   // (settles)
  if (!error.empty()) return error;
  for (size_t i = 0; i < arrays_.size(); ++i) {
    const Array& a = arrays_[i];
    for (int64_t j = 0; j < n; ++j) std::copy(data[i] + j * pitch, data[i] + j * pitch + a.width,
                                              records_ + j * stride_ + a.offset);
  }
  ++version_;
  row_of_key_ = std::move(seen);
  key_of_row_.assign(keys, keys + n);
  count_ = n;
  alive_.assign(n, 1);
  cached_.assign(n, 0);
  cached_count_ = 0;
  free_rows_.clear();
  freed_.clear();
  // keys come in the order a bound drops them (an export of a bounded store): before every key used
  // after this, in that order (marks below the first call's, so not touched since any time)
  ClearMarks();
  order_.resize(n);
  for (int64_t j = 0; j < n; ++j) order_[j] = j - n;
  for (int64_t j = 0; scores != nullptr && j < n; ++j) {
    set_score(j, scores[j]);
    order_[j] = scores[j];
  }
  Requeue();
  return "";
}

void HostStore::Loaded(const int64_t* rows, int64_t n, int64_t call) { AddCached(MarkLoaded(rows, n, call)); }

int64_t HostStore::MarkLoaded(const int64_t* rows, int64_t n, int64_t call) {
  int64_t added = 0;
  for (int64_t j = 0; j < n; ++j) {
    added += !cached_[rows[j]];
    cached_[rows[j]] = 1;
    set_mark(rows[j], call);
  }
  return added;
}

void HostStore::WrittenBack(const int64_t* keys, const int64_t* calls, const int64_t* scores, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = row_of_key_.Get(keys[j], -1);
    if (r < 0) continue;
    cached_count_ -= cached_[r];
    cached_[r] = 0;
    set_mark(r, calls[j]);
    // written back in order of last use (the cache's own eviction order, call after call), or by score
    order_[r] = scores ? scores[j] : ++written_back_;
    if (max_keys_ > 0) queue_.emplace(order_[r], keys[j], r);
  }
}

void HostStore::SetCached(const int64_t* rows, int64_t n) {
  std::fill(cached_.begin(), cached_.end(), uint8_t{0});
  cached_count_ = 0;
  for (int64_t j = 0; j < n; ++j) {
    cached_count_ += !cached_[rows[j]];
    cached_[rows[j]] = 1;
  }
  Requeue();
}

void HostStore::Requeue() {
  queue_ = decltype(queue_)();
  if (max_keys_ <= 0) return;
  for (int64_t r = 0; r < count_; ++r)
    if (alive_[r] && !cached_[r]) queue_.emplace(order_[r], key_of_row_[r], r);
}

std::string HostStore::Bound(std::vector<int64_t>* keys, std::vector<int64_t>* rows) {
  if (max_keys_ <= 0) return "";
  while (size() > max_keys_ && !queue_.empty()) {
    const auto [order, key, r] = queue_.top();
    queue_.pop();
    if (!alive_[r] || cached_[r] || key_of_row_[r] != key || order_[r] != order) continue;   // stale entry
    row_of_key_.Erase(key);
    ++version_;
    alive_[r] = 0;
    freed_.push_back(r);
    keys->push_back(key);
    rows->push_back(r);
  }
  if (static_cast<int64_t>(queue_.size()) > 2 * size() + 1024) Requeue();   // stale entries piled up
  if (size() <= max_keys_) return "";
  return "cannot hold this batch's keys: " + std::to_string(cached_count_) + " keys are cached for it and " +
         "max_capacity is " + std::to_string(max_keys_);
}

void HostStore::ClearMarks() {
  for (int64_t r = 0; r < count_; ++r) {
    set_mark(r, 0);
    set_score(r, 0);
  }
}

void StoreWrite(const float* cache, int64_t width, const int64_t* cache_rows, const int64_t* store_row_of, int64_t n,
                float* store, int64_t stride) {
  for (int64_t j = 0; j < n; ++j)
    std::memcpy(store + store_row_of[cache_rows[j]] * stride, cache + cache_rows[j] * width, sizeof(float) * width);
}

void StoreRead(const float* store, int64_t stride, int64_t width, const int64_t* store_rows, const uint8_t* fresh,
               const int64_t* cache_rows, int64_t n, float* cache) {
  for (int64_t j = 0; j < n; ++j)
    if (fresh == nullptr || !fresh[j])
      std::memcpy(cache + cache_rows[j] * width, store + store_rows[j] * stride, sizeof(float) * width);
}

namespace {
// out = the initial value of `key` (init_kind >= 0), else `fill`
void InitialRow(int init_kind, float a, float b, int64_t seed, int64_t key, int64_t width, float fill, float* out) {
  if (init_kind < 0) {
    std::fill(out, out + width, fill);
    return;
  }
  const uint64_t bits = InitialKeyBits(seed, key);
  for (int64_t c = 0; c < width; ++c) out[c] = InitialValue(init_kind, a, b, bits, c);
}
}  // namespace

void StoreFresh(int64_t width, const uint8_t* fresh, const int64_t* keys, const int64_t* cache_rows, int64_t n,
                int init_kind, float a, float b, int64_t seed, float fill, float* cache) {
  for (int64_t j = 0; j < n; ++j)
    if (fresh[j]) InitialRow(init_kind, a, b, seed, keys[j], width, fill, cache + cache_rows[j] * width);
}

void ReadRows(const int64_t* keys, const int64_t* slots, const int64_t* store_rows, int64_t n, const float* cache,
              int64_t width, const float* store, int64_t stride, int init_kind, float a, float b, int64_t seed,
              float* out) {
  for (int64_t j = 0; j < n; ++j, out += width) {
    const int64_t r = store_rows != nullptr ? store_rows[j] : -1;
    if (slots[j] >= 0) {
      std::memcpy(out, cache + slots[j] * width, sizeof(float) * width);
    } else if (r >= 0) {
      std::memcpy(out, store + r * stride, sizeof(float) * width);
    } else {
      InitialRow(init_kind, a, b, seed, keys[j], width, 0.0f, out);
    }
  }
}

}  // namespace impl
}  // namespace tf_sok
