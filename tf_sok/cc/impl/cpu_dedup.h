// Host-side dedup: groups positions 0..n-1 by key with a hash map, then
// orders the groups by key. Unique keys come out ascending and positions keep
// their order inside each group, so results are deterministic (and match the
// CUDA path, which sorts).
#ifndef TF_SOK_CC_IMPL_CPU_DEDUP_H_
#define TF_SOK_CC_IMPL_CPU_DEDUP_H_

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace tf_sok {
namespace impl {

struct Groups {
  std::vector<int64_t> keys;     // [U] unique keys
  std::vector<int64_t> offsets;  // [U + 1] into order
  std::vector<int64_t> order;    // [n] positions grouped by key
  int64_t size() const { return static_cast<int64_t>(keys.size()); }
};

template <typename KeyAt>
void GroupByKey(int64_t n, KeyAt key_at, Groups* g) {
  absl::flat_hash_map<int64_t, int64_t> uid;
  uid.reserve(static_cast<size_t>(n));
  std::vector<int64_t> slot(static_cast<size_t>(n));
  g->keys.clear();
  std::vector<int64_t> counts;
  for (int64_t i = 0; i < n; ++i) {
    auto ins = uid.try_emplace(key_at(i), static_cast<int64_t>(g->keys.size()));
    if (ins.second) {
      g->keys.push_back(ins.first->first);
      counts.push_back(0);
    }
    slot[i] = ins.first->second;
    ++counts[ins.first->second];
  }
  const int64_t u = g->size();
  // rank[k]: position of first-seen group k once groups are sorted by key.
  std::vector<int64_t> by_key(static_cast<size_t>(u)), rank(static_cast<size_t>(u));
  std::iota(by_key.begin(), by_key.end(), 0);
  std::sort(by_key.begin(), by_key.end(),
            [&](int64_t a, int64_t b) { return g->keys[a] < g->keys[b]; });
  std::vector<int64_t> sorted_keys(static_cast<size_t>(u));
  g->offsets.assign(static_cast<size_t>(u + 1), 0);
  for (int64_t r = 0; r < u; ++r) {
    rank[by_key[r]] = r;
    sorted_keys[r] = g->keys[by_key[r]];
    g->offsets[r + 1] = g->offsets[r] + counts[by_key[r]];
  }
  g->keys.swap(sorted_keys);
  g->order.resize(static_cast<size_t>(n));
  std::vector<int64_t> fill(g->offsets.begin(), g->offsets.end() - 1);
  for (int64_t i = 0; i < n; ++i) g->order[fill[rank[slot[i]]]++] = i;
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

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_CPU_DEDUP_H_
