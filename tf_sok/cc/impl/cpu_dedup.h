// Host-side dedup: groups positions 0..n-1 by key in O(n) with a hash map.
// Unique keys come out in first-occurrence order and positions keep their
// order inside each group, so results are deterministic.
#ifndef TF_SOK_CC_IMPL_CPU_DEDUP_H_
#define TF_SOK_CC_IMPL_CPU_DEDUP_H_

#include <cstdint>
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
  g->offsets.assign(static_cast<size_t>(u + 1), 0);
  for (int64_t k = 0; k < u; ++k) g->offsets[k + 1] = g->offsets[k] + counts[k];
  g->order.resize(static_cast<size_t>(n));
  std::vector<int64_t> fill(g->offsets.begin(), g->offsets.end() - 1);
  for (int64_t i = 0; i < n; ++i) g->order[fill[slot[i]]++] = i;
}

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_CPU_DEDUP_H_
