// Host-side dedup: groups positions 0..n-1 by key. Unique keys come out
// ascending and positions keep their order inside each group, so results are
// deterministic and match the CUDA path, which also sorts.
#ifndef TF_SOK_CC_IMPL_CPU_DEDUP_H_
#define TF_SOK_CC_IMPL_CPU_DEDUP_H_

#include <algorithm>
#include <cstdint>
#include <vector>


namespace tf_sok {
namespace impl {

struct Groups {
  std::vector<int64_t> keys;     // [U] unique keys
  std::vector<int64_t> offsets;  // [U + 1] into order
  std::vector<int64_t> order;    // [n] positions grouped by key
  int64_t size() const { return static_cast<int64_t>(keys.size()); }
};

// Groups by key with an LSD radix sort of (key, position) pairs over the bits
// the largest key needs: O(n) per 11-bit digit, stable, so positions keep their
// order inside each group. Keys must be non-negative.
template <typename KeyAt>
void GroupByKey(int64_t n, KeyAt key_at, Groups* g) {
  constexpr int kDigitBits = 11;
  constexpr int64_t kBuckets = int64_t{1} << kDigitBits;
  std::vector<int64_t> keys(static_cast<size_t>(n)), keys_tmp(static_cast<size_t>(n));
  std::vector<int64_t> pos(static_cast<size_t>(n)), pos_tmp(static_cast<size_t>(n));
  int64_t max_key = 0;
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = key_at(i);
    pos[i] = i;
    max_key = std::max(max_key, keys[i]);
  }
  int bits = 0;
  while (bits < 63 && (max_key >> bits) != 0) ++bits;
  std::vector<int64_t> count(static_cast<size_t>(kBuckets));
  for (int shift = 0; shift < bits; shift += kDigitBits) {
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[(keys[i] >> shift) & (kBuckets - 1)];
    int64_t sum = 0;
    for (auto& c : count) {
      const int64_t here = c;
      c = sum;
      sum += here;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t dst = count[(keys[i] >> shift) & (kBuckets - 1)]++;
      keys_tmp[dst] = keys[i];
      pos_tmp[dst] = pos[i];
    }
    keys.swap(keys_tmp);
    pos.swap(pos_tmp);
  }
  g->keys.clear();
  g->offsets.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || keys[i] != keys[i - 1]) {
      g->keys.push_back(keys[i]);
      g->offsets.push_back(i);
    }
  }
  g->offsets.push_back(n);
  g->order.swap(pos);
}

// True when keys are strictly ascending: already unique and sorted, so every
// position is its own group (the lookup gradient produces such indices).
template <typename KeyAt>
bool StrictlyAscending(int64_t n, KeyAt key_at) {
  for (int64_t i = 1; i < n; ++i)
    if (!(key_at(i - 1) < key_at(i))) return false;
  return true;
}

template <typename KeyAt>
void IdentityGroups(int64_t n, KeyAt key_at, Groups* g) {
  g->keys.resize(static_cast<size_t>(n));
  g->offsets.resize(static_cast<size_t>(n + 1));
  g->order.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    g->keys[i] = key_at(i);
    g->offsets[i] = g->order[i] = i;
  }
  g->offsets[n] = n;
}

// Non-decreasing keys whose repeats are padding (zero rows): one group per
// distinct key, its first position only.
template <typename KeyAt>
void FirstOfRuns(int64_t n, KeyAt key_at, Groups* g) {
  g->keys.clear(), g->offsets.clear(), g->order.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = key_at(i);
    if (i > 0 && k == g->keys.back()) continue;
    g->offsets.push_back(static_cast<int64_t>(g->order.size()));
    g->keys.push_back(k);
    g->order.push_back(i);
  }
  g->offsets.push_back(static_cast<int64_t>(g->order.size()));
}

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_CPU_DEDUP_H_
