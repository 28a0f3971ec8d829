// Route on the host: the radix grouping of cpu_dedup.h, then a counting sort
// of the distinct keys by bucket (stable, so ascending inside a bucket).
#include <vector>

#include "tf_sok/cc/impl/cpu_dedup.h"
#include "tf_sok/cc/impl/route.h"

namespace tf_sok {
namespace impl {

template <>
Error Route<CpuDevice>::Prepare(const CpuDevice& d, const int64_t* keys, int64_t n, const RouteSpec& spec,
                                RoutePlan* plan) {
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] < 0 || (keys[i] >> kTableShift) >= spec.num_tables) {
      Error e;
      e.kind = ErrorKind::kIdOutOfRange;
      e.item = i;
      e.value = keys[i];
      return e;
    }
  }
  auto groups = std::make_shared<Groups>();
  GroupByKey(n, [keys](int64_t i) { return keys[i]; }, groups.get());
  plan->n = n;
  plan->num_unique = groups->size();
  plan->state = groups;
  return Error();
}

template <>
Error Route<CpuDevice>::Finish(const CpuDevice& d, const RoutePlan& plan, const RouteSpec& spec,
                               int64_t* unique_keys, int32_t* splits, int64_t* position, int64_t* unit_splits) {
  const Groups& g = *static_cast<const Groups*>(plan.state.get());
  const int64_t U = g.size();
  const int B = spec.num_buckets;
  std::vector<int> bucket(static_cast<size_t>(U));
  std::vector<long long> out(static_cast<size_t>(U));
  std::vector<int64_t> next(static_cast<size_t>(B), 0);
  for (int64_t u = 0; u < U; ++u) {
    const int owner = spec.by_table ? 0 : spec.table_owner[g.keys[u] >> kTableShift];
    BucketOf(g.keys[u], B, spec.by_table, owner, &bucket[u], &out[u]);
    ++next[bucket[u]];
  }
  int64_t start = 0;
  for (int b = 0; b < B; ++b) {
    splits[b] = static_cast<int32_t>(next[b]);
    const int64_t count = next[b];
    next[b] = start;
    start += count;
  }
  std::vector<int64_t> place(static_cast<size_t>(U));
  for (int64_t u = 0; u < U; ++u) {
    place[u] = next[bucket[u]]++;
    unique_keys[place[u]] = out[u];
  }
  int64_t k = 0;
  for (int b = 0; unit_splits && b < B; ++b) {
    for (int32_t j = 0; j <= splits[b]; ++j) unit_splits[k++] = j;
  }
  d.parallel_for(U, 20, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      for (int64_t j = g.offsets[u]; j < g.offsets[u + 1]; ++j) position[g.order[j]] = place[u];
  });
  return Error();
}

}  // namespace impl
}  // namespace tf_sok
