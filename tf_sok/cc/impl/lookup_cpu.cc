// CPU functors for the fused lookup and its gradient.
#include <algorithm>
#include <atomic>
#include <mutex>

#include "tf_sok/cc/impl/cpu_dedup.h"
#include "tf_sok/cc/impl/lookup.h"

namespace tf_sok {
namespace impl {
namespace {

// Keeps the error with the smallest (feature, position) seen by any thread.
class FirstError {
 public:
  void Offer(const Error& e) {
    std::lock_guard<std::mutex> l(mu_);
    if (err_.ok() || e.group < err_.group ||
        (e.group == err_.group && e.item < err_.item)) {
      err_ = e;
    }
  }
  Error get() const { return err_; }

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

template <typename Id>
Error CheckIds(const CpuDevice& d, const std::vector<TableView>& tables,
               const std::vector<FeatureView<Id>>& features) {
  FirstError first;
  for (size_t f = 0; f < features.size(); ++f) {
    const auto& ft = features[f];
    const int64_t rows = tables[ft.table].rows;
    std::atomic<bool> bad{false};
    d.parallel_for(ft.num_ids, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t id = static_cast<int64_t>(ft.ids[i]);
        if (id < 0 || id >= rows) {
          Error e;
          e.kind = ErrorKind::kIdOutOfRange;
          e.group = static_cast<int32_t>(f), e.item = i, e.value = id;
          first.Offer(e);
          bad = true;
          return;
        }
      }
    });
    if (bad) return first.get();
  }
  return Error();
}

}  // namespace

template <typename Id>
struct FusedLookup<CpuDevice, Id> {
  Error operator()(const CpuDevice& d, const std::vector<TableView>& tables,
                   const std::vector<FeatureView<Id>>& features,
                   const std::vector<float*>& outputs) {
    Error e = CheckSplits(features);
    if (e.ok()) e = CheckIds(d, tables, features);
    if (!e.ok()) return e;
    // One flat index space over all (feature, row) pairs.
    std::vector<int64_t> start(features.size() + 1, 0);
    for (size_t f = 0; f < features.size(); ++f) start[f + 1] = start[f] + features[f].batch;
    int64_t avg_dim = 0;
    for (const auto& t : tables) avg_dim = std::max<int64_t>(avg_dim, t.dim);
    d.parallel_for(start.back(), 8 * avg_dim, [&](int64_t begin, int64_t end) {
      size_t f = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
      for (int64_t r = begin; r < end; ++r) {
        while (r >= start[f + 1]) ++f;
        const auto& ft = features[f];
        const TableView& t = tables[ft.table];
        const int64_t b = r - start[f];
        const int dim = t.dim;
        float* out = outputs[f] + b * dim;
        std::fill(out, out + dim, 0.0f);
        float wsum = 0.0f, wsq = 0.0f;
        for (int64_t i = ft.splits[b]; i < ft.splits[b + 1]; ++i) {
          const float w = ft.weights ? ft.weights[i] : 1.0f;
          const float* row = t.data + static_cast<int64_t>(ft.ids[i]) * dim;
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
    return Error();
  }
};

template <typename Id>
struct LookupGrad<CpuDevice, Id> {
  Error Prepare(const CpuDevice& d, int32_t dim, const std::vector<FeatureView<Id>>& features,
                const std::vector<const float*>& out_grads, GradPlan<Id>* plan) {
    int64_t total = 0;
    for (const auto& ft : features) total += ft.num_ids;
    auto* coef = static_cast<float*>(d.scratch->Allocate(sizeof(float) * total));
    auto* grad_rows = static_cast<const float**>(d.scratch->Allocate(sizeof(float*) * total));
    auto* keys = static_cast<int64_t*>(d.scratch->Allocate(sizeof(int64_t) * total));
    if (total > 0 && (coef == nullptr || grad_rows == nullptr || keys == nullptr)) {
      Error e;
      e.kind = ErrorKind::kOutOfMemory;
      return e;
    }
    // Per id: the output-gradient row it reads and its weight times the
    // combiner scale of its row.
    int64_t base = 0;
    for (size_t f = 0; f < features.size(); ++f) {
      const auto& ft = features[f];
      const float* dout = out_grads[f];
      d.parallel_for(ft.batch, 16, [&, base](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          float wsum = 0.0f, wsq = 0.0f;
          for (int64_t i = ft.splits[b]; i < ft.splits[b + 1]; ++i) {
            const float w = ft.weights ? ft.weights[i] : 1.0f;
            wsum += w;
            wsq += w * w;
          }
          const float scale = CombinerScale(ft.combiner, wsum, wsq);
          for (int64_t i = ft.splits[b]; i < ft.splits[b + 1]; ++i) {
            coef[base + i] = (ft.weights ? ft.weights[i] : 1.0f) * scale;
            keys[base + i] = static_cast<int64_t>(ft.ids[i]);
            grad_rows[base + i] = dout + b * dim;
          }
        }
      });
      base += ft.num_ids;
    }
    auto groups = std::make_shared<Groups>();
    GroupByKey(total, [keys](int64_t p) { return keys[p]; }, groups.get());
    plan->total_ids = total;
    plan->num_unique = groups->size();
    plan->dim = dim;
    plan->coef = coef;
    plan->grad_rows = grad_rows;
    plan->host_state = groups;
    return Error();
  }

  void Finish(const CpuDevice& d, const GradPlan<Id>& plan, int64_t* indices, float* values) {
    const Groups* g = static_cast<const Groups*>(plan.host_state.get());
    const auto* coef = static_cast<const float*>(plan.coef);
    const auto* rows = static_cast<const float* const*>(plan.grad_rows);
    const int dim = plan.dim;
    d.parallel_for(g->size(), 4 * dim, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        indices[u] = g->keys[u];
        float* out = values + u * dim;
        std::fill(out, out + dim, 0.0f);
        for (int64_t k = g->offsets[u]; k < g->offsets[u + 1]; ++k) {
          const int64_t p = g->order[k];
          const float c = coef[p];
          const float* src = rows[p];
          for (int j = 0; j < dim; ++j) out[j] += c * src[j];
        }
      }
    });
  }
};

template struct FusedLookup<CpuDevice, int32_t>;
template struct FusedLookup<CpuDevice, int64_t>;
template struct LookupGrad<CpuDevice, int32_t>;
template struct LookupGrad<CpuDevice, int64_t>;

}  // namespace impl
}  // namespace tf_sok
