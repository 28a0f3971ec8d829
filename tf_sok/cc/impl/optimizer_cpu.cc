// CPU functor for the sparse optimizers: check every table's indices, group
// each table's duplicate indices, then update every table's unique rows in one
// parallel pass.
#include <algorithm>
#include <cstring>
#include <vector>

#include "tf_sok/cc/impl/cpu_dedup.h"
#include "tf_sok/cc/impl/cpu_memory.h"
#include "tf_sok/cc/impl/optimizer.h"

namespace tf_sok {
namespace impl {

namespace {

// Updates grouped rows [begin, end) of one table: sum each row's gradient
// rows, then one pass over dim.
template <Algorithm A>
void ApplyRows(const Hyper& h, const SparseUpdate& u, const Groups& g, const float* grads, int64_t begin,
               int64_t end) {
  const int dim = u.dim;
  const int num_slots = NumDenseSlots(h);
  constexpr int64_t kAhead = 4;  // rows are scattered: prefetch a few ahead
  std::vector<float> sum(dim), unused(dim);
  for (int64_t k = begin; k < end; ++k) {
    if (k + kAhead < end) {
      const int64_t next = g.keys[k + kAhead] * dim;
      __builtin_prefetch(u.var + next, 1);
      for (int s = 0; s < num_slots; ++s) __builtin_prefetch(u.slots[s] + next, 1);
    }
    const int64_t row = g.keys[k];
    const float* __restrict grad;
    if (g.offsets[k + 1] - g.offsets[k] == 1) {
      grad = grads + g.order[g.offsets[k]] * dim;
    } else {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t p = g.offsets[k]; p < g.offsets[k + 1]; ++p) {
        const float* __restrict src = grads + g.order[p] * dim;
        for (int j = 0; j < dim; ++j) sum[j] += src[j];
      }
      grad = sum.data();
    }
    float* __restrict s0 = num_slots > 0 ? u.slots[0] + row * dim : unused.data();
    float* __restrict s1 = num_slots > 1 ? u.slots[1] + row * dim : unused.data();
    float* __restrict s2 = num_slots > 2 ? u.slots[2] + row * dim : unused.data();
    const RowScalars rs = RowConstants(h, u.step ? u.step[row] : 0.0f);
    if (u.step) u.step[row] += 1.0f;
    float* __restrict w = u.var + row * dim;
    for (int j = 0; j < dim; ++j) w[j] = UpdateElement<A>(h, rs, w[j], grad[j], s0[j], s1[j], s2[j]);
  }
}

// Checks one table's indices; the first bad one becomes the error.
template <typename Id>
Error CheckIndices(const TableUpdate<Id>& t, int32_t table, bool ascending) {
  Error e;
  for (int64_t i = 0; i < t.n; ++i) {
    const int64_t r = static_cast<int64_t>(t.indices[i]);
    if (r < 0 || r >= t.u.rows) {
      e.kind = ErrorKind::kIdOutOfRange;
    } else if (ascending && i > 0 && r < static_cast<int64_t>(t.indices[i - 1])) {
      e.kind = ErrorKind::kNotAscending;
    } else {
      continue;
    }
    e.group = table, e.item = i, e.value = r;
    return e;
  }
  return e;
}

}  // namespace

template <typename Id>
struct FusedSparseApply<CpuDevice, Id> {
  Error operator()(const CpuDevice& d, const Hyper& h, const std::vector<TableUpdate<Id>>& tables,
                   bool indices_unique, bool /*report: the CPU checks synchronously*/) {
    const int64_t T = static_cast<int64_t>(tables.size());
    for (int64_t t = 0; t < T; ++t) {
      Error e = CheckIndices(tables[t], static_cast<int32_t>(t), indices_unique);
      if (!e.ok()) return e;
    }
    // Group each table's indices (tables in parallel), then update all tables'
    // rows in ONE parallel pass, so small tables do not leave threads idle.
    std::vector<Groups> groups(T);
    d.parallel_for(T, 1 << 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const TableUpdate<Id>& in = tables[t];
        if (in.n == 0) continue;
        const size_t table_bytes = sizeof(float) * static_cast<size_t>(in.u.rows) * in.u.dim;
        AdviseHugePages(in.u.var, table_bytes);
        for (int s = 0; s < NumDenseSlots(h); ++s) AdviseHugePages(in.u.slots[s], table_bytes);
        const Id* indices = in.indices;
        auto key_at = [indices](int64_t i) { return static_cast<int64_t>(indices[i]); };
        if (indices_unique) {
          FirstOfRuns(in.n, key_at, &groups[t]);     // the lookup gradient's rows: its padding skipped
        } else if (StrictlyAscending(in.n, key_at)) {
          IdentityGroups(in.n, key_at, &groups[t]);  // already unique
        } else {
          GroupByKey(in.n, key_at, &groups[t]);
        }
      }
    });
    std::vector<int64_t> start(T + 1, 0);
    int max_dim = 1;
    for (int64_t t = 0; t < T; ++t) {
      start[t + 1] = start[t] + (tables[t].n ? groups[t].size() : 0);
      max_dim = std::max<int>(max_dim, tables[t].u.dim);
    }
    DispatchAlgorithm(h.algorithm, [&](auto algo) {
      constexpr Algorithm A = decltype(algo)::value;
      d.parallel_for(start[T], (A == Algorithm::kSgd ? 4 : 24) * max_dim, [&](int64_t begin, int64_t end) {
        int64_t t = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
        for (int64_t k = begin; k < end; ++t) {
          const int64_t stop = std::min(end, start[t + 1]);
          if (stop > k) ApplyRows<A>(h, tables[t].u, groups[t], tables[t].grads, k - start[t], stop - start[t]);
          k = std::max(k, stop);
        }
      });
      return 0;
    });
    return Error();
  }
};

template <>
void DeviceCopy<CpuDevice>(const CpuDevice&, void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}

template struct FusedSparseApply<CpuDevice, int32_t>;
template struct FusedSparseApply<CpuDevice, int64_t>;

}  // namespace impl
}  // namespace tf_sok
