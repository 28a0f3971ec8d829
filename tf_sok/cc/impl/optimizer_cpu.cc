// CPU functor for the sparse optimizers: check every table's indices, then per
// table group duplicate indices and update each unique row once (in parallel).
#include <cstring>
#include <vector>

#include "tf_sok/cc/impl/cpu_dedup.h"
#include "tf_sok/cc/impl/cpu_memory.h"
#include "tf_sok/cc/impl/optimizer.h"

namespace tf_sok {
namespace impl {

namespace {

// Updates every grouped row: sum its gradient rows, then one pass over dim.
template <Algorithm A>
void ApplyRows(const CpuDevice& d, const Hyper& h, const SparseUpdate& u, const Groups& g,
               const float* grads) {
  const int dim = u.dim;
  const int num_slots = NumDenseSlots(h);
  constexpr int64_t kAhead = 4;  // rows are scattered: prefetch a few ahead
  d.parallel_for(g.size(), (A == Algorithm::kSgd ? 4 : 24) * dim, [&](int64_t begin, int64_t end) {
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
  });
}

// Checks one table's indices; the first bad one becomes the error.
template <typename Id>
Error CheckIndices(const TableUpdate<Id>& t, int32_t table, bool ascending) {
  Error e;
  for (int64_t i = 0; i < t.n; ++i) {
    const int64_t r = static_cast<int64_t>(t.indices[i]);
    if (r < 0 || r >= t.u.rows) {
      e.kind = ErrorKind::kIdOutOfRange;
    } else if (ascending && i > 0 && r <= static_cast<int64_t>(t.indices[i - 1])) {
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
                   bool indices_unique) {
    for (size_t t = 0; t < tables.size(); ++t) {
      Error e = CheckIndices(tables[t], static_cast<int32_t>(t), indices_unique);
      if (!e.ok()) return e;
    }
    for (const auto& t : tables) {
      if (t.n == 0) continue;
      const SparseUpdate& u = t.u;
      const size_t table_bytes = sizeof(float) * static_cast<size_t>(u.rows) * u.dim;
      AdviseHugePages(u.var, table_bytes);
      for (int s = 0; s < NumDenseSlots(h); ++s) AdviseHugePages(u.slots[s], table_bytes);
      Groups g;
      const Id* indices = t.indices;
      auto key_at = [indices](int64_t i) { return static_cast<int64_t>(indices[i]); };
      if (indices_unique || StrictlyAscending(t.n, key_at)) {
        IdentityGroups(t.n, key_at, &g);  // already unique (e.g. from the lookup gradient)
      } else {
        GroupByKey(t.n, key_at, &g);
      }
      DispatchAlgorithm(h.algorithm, [&](auto algo) {
        ApplyRows<decltype(algo)::value>(d, h, u, g, t.grads);
        return 0;
      });
    }
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
