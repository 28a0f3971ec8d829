// CPU functors for the fused lookup and its gradient.
#include <algorithm>
#include <memory>
#include <mutex>

#include "tf_sok/cc/impl/cpu_dedup.h"
#include "tf_sok/cc/impl/cpu_memory.h"
#include "tf_sok/cc/impl/lookup.h"

namespace tf_sok {
namespace impl {
namespace {

constexpr int64_t kPrefetch = 4;

// A precision the CPU functors do not take (the CPU kernels convert to float32).
Error Unsupported() {
  Error e;
  e.kind = ErrorKind::kUnsupported;
  return e;
}

// Keeps the error with the smallest (feature, position) seen by any thread.
class FirstError {
 public:
  void Offer(const Error& e) {
    std::lock_guard<std::mutex> l(mu_);
    if (err_.ok() || e.group < err_.group || (e.group == err_.group && e.item < err_.item)) err_ = e;
  }
  Error get() {
    std::lock_guard<std::mutex> l(mu_);
    return err_;
  }

 private:
  std::mutex mu_;
  Error err_;
};

// Checks the splits of every feature: start at 0, never decrease, end at num_ids.
template <typename Id>
Error CheckSplits(const std::vector<FeatureView<Id>>& features) {
  for (size_t f = 0; f < features.size(); ++f) {
    const auto& ft = features[f];
    Error e;
    e.kind = ErrorKind::kBadSplits;
    e.group = static_cast<int32_t>(f);
    if (ft.splits[0] != 0) {
      e.item = 0, e.value = ft.splits[0];
      return e;
    }
    for (int64_t b = 0; b < ft.batch; ++b) {
      if (ft.splits[b + 1] < ft.splits[b] || ft.splits[b + 1] > ft.num_ids) {
        e.item = b + 1, e.value = ft.splits[b + 1];
        return e;
      }
    }
    if (ft.splits[ft.batch] != ft.num_ids) {
      e.item = ft.batch, e.value = ft.splits[ft.batch];
      return e;
    }
  }
  return Error();
}

// Calls fn(i, coefficient) for each id i of row b: its weight times the row's combiner scale.
template <typename Id, typename Fn>
void ForEachCoefficient(const FeatureView<Id>& ft, int64_t b, Fn fn) {
  float wsum = 0.0f, wsq = 0.0f;
  for (int64_t i = ft.splits[b]; i < ft.splits[b + 1]; ++i) {
    const float w = ft.weights ? ft.weights[i] : 1.0f;
    wsum += w;
    wsq += w * w;
  }
  const float scale = CombinerScale(ft.combiner, wsum, wsq);
  for (int64_t i = ft.splits[b]; i < ft.splits[b + 1]; ++i) fn(i, (ft.weights ? ft.weights[i] : 1.0f) * scale);
}

// Per id of one feature: its coefficient and the output-gradient row it reads.
template <typename Id>
void ExpandFeature(const FeatureView<Id>& ft, const float* dout, int dim, int64_t b0, int64_t b1,
                   int64_t base, float* coef, const float** rows, int64_t* keys) {
  for (int64_t b = b0; b < b1; ++b) {
    ForEachCoefficient(ft, b, [&](int64_t i, float c) {
      coef[base + i] = c;
      rows[base + i] = dout + b * dim;
      keys[base + i] = static_cast<int64_t>(ft.ids[i]);
    });
  }
}

}  // namespace

template <typename Id>
struct FusedLookup<CpuDevice, Id> {
  Error operator()(const CpuDevice& d, const std::vector<TableView>& tables,
                   const std::vector<FeatureView<Id>>& features,
                   const std::vector<void*>& outputs, ErrorRecord* /*the CPU returns errors*/,
                   Precision precision) {
    if (precision != Precision::kFloat32) return Unsupported();
    Error e = CheckSplits(features);
    if (!e.ok()) return e;
    for (const auto& t : tables) AdviseHugePages(t.data, sizeof(float) * static_cast<size_t>(t.rows) * t.dim);
    // One flat index space over all (feature, row) pairs.
    std::vector<int64_t> start(features.size() + 1, 0);
    for (size_t f = 0; f < features.size(); ++f) start[f + 1] = start[f] + features[f].batch;
    int64_t max_dim = 1;
    for (const auto& t : tables) max_dim = std::max<int64_t>(max_dim, t.dim);
    FirstError first;
    d.parallel_for(start.back(), 12 * max_dim, [&](int64_t begin, int64_t end) {
      size_t f = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
      for (int64_t r = begin; r < end; ++r) {
        while (r >= start[f + 1]) ++f;
        const auto& ft = features[f];
        const TableView& t = tables[ft.table];
        const int64_t b = r - start[f];
        const int dim = t.dim;
        float* __restrict out = static_cast<float*>(outputs[f]) + b * dim;
        std::fill(out, out + dim, 0.0f);
        float wsum = 0.0f, wsq = 0.0f;
        for (int64_t i = ft.splits[b]; i < ft.splits[b + 1]; ++i) {
          const int64_t id = static_cast<int64_t>(ft.ids[i]);
          if (id < 0 || id >= t.rows) {
            Error bad;
            bad.kind = ErrorKind::kIdOutOfRange;
            bad.group = static_cast<int32_t>(f), bad.item = i, bad.value = id;
            first.Offer(bad);
            continue;
          }
          if (i + kPrefetch < ft.num_ids) {  // rows are random: fetch a few ids ahead
            const int64_t ahead = static_cast<int64_t>(ft.ids[i + kPrefetch]);
            if (ahead >= 0 && ahead < t.rows) __builtin_prefetch(t.data + ahead * dim);
          }
          const float w = ft.weights ? ft.weights[i] : 1.0f;
          const float* __restrict row = t.data + id * dim;
          for (int j = 0; j < dim; ++j) out[j] += w * row[j];
          wsum += w;
          wsq += w * w;
        }
        const float scale = CombinerScale(ft.combiner, wsum, wsq);
        if (scale != 1.0f) {
          for (int j = 0; j < dim; ++j) out[j] *= scale;
        }
      }
    });
    return first.get();
  }
};

// One table's expanded gradient: per id its coefficient and output-gradient
// row, and the ids grouped.
struct TableGradPlan {
  int32_t dim = 0;
  int64_t rows_out = 0;
  const float* coef = nullptr;
  const float* const* rows = nullptr;
  std::shared_ptr<Groups> groups;
};

template <typename Id>
struct LookupGrad<CpuDevice, Id> {
  Error Prepare(const CpuDevice& d, const std::vector<TableGradInput<Id>>& tables, GradPlan* plan) {
    const int64_t T = static_cast<int64_t>(tables.size());
    for (const auto& t : tables) {
      const int64_t limit = IdLimit(t.rows);
      for (const auto& ft : t.features) {
        for (int64_t i = 0; i < ft.num_ids; ++i) {
          const int64_t id = static_cast<int64_t>(ft.ids[i]);
          if (id < 0 || id >= limit) {
            Error e;
            e.kind = ErrorKind::kIdOutOfRange;
            e.item = i, e.value = id, e.limit = limit;
            return e;
          }
        }
      }
    }
    auto state = std::make_shared<std::vector<TableGradPlan>>(T);
    plan->rows_out.assign(T, 0);
    plan->state = state;
    int busy = 0;
    for (const auto& t : tables) busy += t.features.empty() ? 0 : 1;
    // Several tables: one table per thread. One table: threads share its features.
    const bool per_table = busy > 1;
    const CpuDevice serial{[](int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& fn) {
                             if (n > 0) fn(0, n);
                           },
                           d.scratch};
    const CpuDevice& inner = per_table ? serial : d;
    std::vector<Error> errors(T);
    auto plan_table = [&](int64_t t) {
      const auto& in = tables[t];
      TableGradPlan& tp = (*state)[t];
      int64_t total = 0;
      for (const auto& ft : in.features) total += ft.num_ids;
      tp.dim = in.dim;
      if (in.precision != Precision::kFloat32) {
        errors[t] = Unsupported();
        return;
      }
      tp.rows_out = plan->rows_out[t] = GradRowsBound(total, in.rows);
      if (total == 0) return;
      auto* coef = static_cast<float*>(d.scratch->Allocate(sizeof(float) * total));
      auto* rows = static_cast<const float**>(d.scratch->Allocate(sizeof(float*) * total));
      auto* keys = static_cast<int64_t*>(d.scratch->Allocate(sizeof(int64_t) * total));
      if (!coef || !rows || !keys) {
        errors[t].kind = ErrorKind::kOutOfMemory;
        return;
      }
      int64_t base = 0;
      for (size_t f = 0; f < in.features.size(); ++f) {
        const auto& ft = in.features[f];
        inner.parallel_for(ft.batch, 16, [&, base](int64_t b0, int64_t b1) {
          ExpandFeature(ft, static_cast<const float*>(in.out_grads[f]), in.dim, b0, b1, base, coef, rows, keys);
        });
        base += ft.num_ids;
      }
      tp.groups = std::make_shared<Groups>();
      GroupByKey(total, [keys](int64_t p) { return keys[p]; }, tp.groups.get());
      tp.coef = coef;
      tp.rows = rows;
    };
    if (per_table) {
      d.parallel_for(T, 1 << 20, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) plan_table(t);
      });
    } else {
      for (int64_t t = 0; t < T; ++t) plan_table(t);
    }
    for (const auto& e : errors)
      if (!e.ok()) return e;
    return Error();
  }

  void Finish(const CpuDevice& d, const GradPlan& plan, const std::vector<int64_t*>& indices,
              const std::vector<float*>& values) {
    const auto& state = *static_cast<const std::vector<TableGradPlan>*>(plan.state.get());
    for (size_t t = 0; t < state.size(); ++t) {
      const TableGradPlan& tp = state[t];
      if (!tp.groups || tp.groups->size() == 0) continue;
      const Groups* g = tp.groups.get();
      const int dim = tp.dim;
      const int64_t unique = g->size();
      int64_t* idx = indices[t];
      float* vals = values[t];
      d.parallel_for(tp.rows_out, 4 * dim, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
          float* __restrict out = vals + u * dim;
          std::fill(out, out + dim, 0.0f);
          if (u >= unique) {  // padding: the last distinct id again, with a zero row
            idx[u] = g->keys[unique - 1];
            continue;
          }
          idx[u] = g->keys[u];
          for (int64_t k = g->offsets[u]; k < g->offsets[u + 1]; ++k) {
            const int64_t p = g->order[k];
            const float c = tp.coef[p];
            const float* __restrict src = tp.rows[p];
            for (int j = 0; j < dim; ++j) out[j] += c * src[j];
          }
        }
      });
    }
  }
};

template <typename Id>
struct CombineGrad<CpuDevice, Id> {
  Error operator()(const CpuDevice& d, const std::vector<TableView>& tables,
                   const std::vector<FeatureView<Id>>& features,
                   const std::vector<const float*>& out_grads, const std::vector<float*>& grads) {
    Error e = CheckSplits(features);
    if (!e.ok()) return e;
    int64_t total = 0, max_dim = 1;
    for (size_t f = 0; f < features.size(); ++f) {
      const auto& ft = features[f];
      for (int64_t i = 0; i < ft.num_ids; ++i) {
        const int64_t id = static_cast<int64_t>(ft.ids[i]);
        if (id < 0 || id >= tables[ft.table].rows) {
          e.kind = ErrorKind::kIdOutOfRange;
          e.group = static_cast<int32_t>(f), e.item = i, e.value = id;
          return e;
        }
      }
      total += ft.num_ids;
    }
    for (size_t t = 0; t < tables.size(); ++t) {
      const int64_t dim = tables[t].dim;
      max_dim = std::max(max_dim, dim);
      float* g = grads[t];
      d.parallel_for(tables[t].rows, dim, [&](int64_t r0, int64_t r1) {
        std::fill(g + r0 * dim, g + r1 * dim, 0.0f);
      });
    }
    // Every position's coefficient (its weight times its row's combiner scale), once.
    auto* coef = static_cast<float*>(d.scratch->Allocate(sizeof(float) * std::max<int64_t>(total, 1)));
    if (!coef) {
      e.kind = ErrorKind::kOutOfMemory;
      return e;
    }
    std::vector<int64_t> base(features.size() + 1, 0);
    for (size_t f = 0; f < features.size(); ++f) {
      const auto& ft = features[f];
      base[f + 1] = base[f] + ft.num_ids;
      float* c = coef + base[f];
      d.parallel_for(ft.batch, 16, [&ft, c](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) ForEachCoefficient(ft, b, [c](int64_t i, float v) { c[i] = v; });
      });
    }
    // Each thread owns blocks of kColumns columns of every table: no two threads add to one
    // element, and the order of additions is fixed (deterministic).
    constexpr int64_t kColumns = 16;
    d.parallel_for((max_dim + kColumns - 1) / kColumns, 2 * kColumns * total + 1, [&](int64_t k0, int64_t k1) {
      const int64_t j0 = k0 * kColumns, j1 = k1 * kColumns;
      for (size_t f = 0; f < features.size(); ++f) {
        const auto& ft = features[f];
        const int64_t dim = tables[ft.table].dim;
        if (j0 >= dim) continue;
        const int64_t hi = std::min(j1, dim);
        float* __restrict g = grads[ft.table];
        const float* c = coef + base[f];
        for (int64_t b = 0; b < ft.batch; ++b) {
          const float* __restrict src = out_grads[f] + b * dim;
          for (int64_t i = ft.splits[b]; i < ft.splits[b + 1]; ++i) {
            float* __restrict row = g + static_cast<int64_t>(ft.ids[i]) * dim;
            for (int64_t j = j0; j < hi; ++j) row[j] += c[i] * src[j];
          }
        }
      }
    });
    return Error();
  }
};

template struct CombineGrad<CpuDevice, int32_t>;
template struct CombineGrad<CpuDevice, int64_t>;
template struct FusedLookup<CpuDevice, int32_t>;
template struct FusedLookup<CpuDevice, int64_t>;
template struct LookupGrad<CpuDevice, int32_t>;
template struct LookupGrad<CpuDevice, int64_t>;

}  // namespace impl
}  // namespace tf_sok
