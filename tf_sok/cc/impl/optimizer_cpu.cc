// CPU functor for the sparse optimizers: group duplicate indices, check the
// range of every index, then update each unique row once (in parallel).
#include <cstring>
#include <vector>

#include "tf_sok/cc/impl/cpu_dedup.h"
#include "tf_sok/cc/impl/optimizer.h"

namespace tf_sok {
namespace impl {

template <typename Id>
struct SparseApply<CpuDevice, Id> {
  Error operator()(const CpuDevice& d, const Hyper& h, const SparseUpdate& u,
                   const Id* indices, const float* grads, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = static_cast<int64_t>(indices[i]);
      if (r < 0 || r >= u.rows) {
        Error e;
        e.kind = ErrorKind::kIdOutOfRange;
        e.item = i, e.value = r;
        return e;
      }
    }
    Groups g;
    auto key_at = [indices](int64_t i) { return static_cast<int64_t>(indices[i]); };
    if (StrictlyAscending(n, key_at)) {
      IdentityGroups(n, key_at, &g);  // already unique (e.g. from the lookup gradient)
    } else {
      GroupByKey(n, key_at, &g);
    }
    const int dim = u.dim;
    const int num_slots = NumDenseSlots(h);
    d.parallel_for(g.size(), 16 * dim, [&](int64_t begin, int64_t end) {
      std::vector<float> sum(dim);
      for (int64_t k = begin; k < end; ++k) {
        const int64_t row = g.keys[k];
        const float* grad;
        if (g.offsets[k + 1] - g.offsets[k] == 1) {
          grad = grads + g.order[g.offsets[k]] * dim;
        } else {
          std::fill(sum.begin(), sum.end(), 0.0f);
          for (int64_t p = g.offsets[k]; p < g.offsets[k + 1]; ++p) {
            const float* src = grads + g.order[p] * dim;
            for (int j = 0; j < dim; ++j) sum[j] += src[j];
          }
          grad = sum.data();
        }
        float* slot[3] = {nullptr, nullptr, nullptr};
        for (int s = 0; s < num_slots; ++s) slot[s] = u.slots[s] + row * dim;
        const RowScalars rs = RowConstants(h, u.step ? u.step[row] : 0.0f);
        if (u.step) u.step[row] += 1.0f;
        float* w = u.var + row * dim;
        for (int j = 0; j < dim; ++j) w[j] = UpdateElement(h, rs, w[j], grad[j], slot, j);
      }
    });
    return Error();
  }
};

template <>
void DeviceCopy<CpuDevice>(const CpuDevice&, void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}

template struct SparseApply<CpuDevice, int32_t>;
template struct SparseApply<CpuDevice, int64_t>;

}  // namespace impl
}  // namespace tf_sok
