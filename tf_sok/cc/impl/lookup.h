// Fused multi-table, multi-feature sparse lookup: forward (gather + combine)
// and backward (expand output gradients to ids, dedup, segment-sum per table).
#ifndef TF_SOK_CC_IMPL_LOOKUP_H_
#define TF_SOK_CC_IMPL_LOOKUP_H_

#include <cmath>
#include <memory>
#include <vector>

#include "tf_sok/cc/impl/common.h"

namespace tf_sok {
namespace impl {

enum class Combiner : int32_t { kSum = 0, kMean = 1, kSqrtn = 2 };

// The element type of pooled outputs and of their gradients. Sums run in
// float32 either way; float16 / bfloat16 outputs are rounded once, to nearest
// even. The CPU functors take float32 only (the CPU kernels convert).
enum class Precision : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct TableView {
  const float* data;  // [rows, dim] row-major
  int64_t rows;
  int32_t dim;
};

// One feature: a ragged batch of ids (values + row splits) read from one table.
template <typename Id>
struct FeatureView {
  const Id* ids;           // [num_ids]
  const int64_t* splits;   // [batch + 1]
  const float* weights;    // [num_ids] or nullptr (all ones)
  int64_t num_ids;
  int64_t batch;
  int32_t table;
  Combiner combiner;
};

// Forward: outputs[f] is [features[f].batch, tables[table].dim].
// Validates splits and ids; bad ids contribute nothing to their row. The CPU
// returns the first error. A GPU never waits on its stream for it: its kernels
// record the first error in `record` (device memory, zeroed here; nullptr: not
// recorded, for ids tf_sok produced and checked itself), which the caller
// reads later (see CopyRecordToHost) and the functor returns only launch errors.
template <typename Device, typename Id>
struct FusedLookup {
  Error operator()(const Device& d, const std::vector<TableView>& tables,
                   const std::vector<FeatureView<Id>>& features,
                   const std::vector<void*>& outputs, ErrorRecord* record,
                   Precision precision = Precision::kFloat32);
};

// GPU: copies a recorded error to host memory (pinned, for an asynchronous
// copy) in stream order; the caller learns when it has arrived from the stream.
Error CopyRecordToHost(const GpuDevice& d, const ErrorRecord* device_record, ErrorRecord* host);

// The dense gradient of the forward pooling with respect to the rows it read:
// grads[t] ([tables[t].rows, tables[t].dim], zeroed here) gets every id's
// coefficient times its row's output gradient, added at the id's row. For
// pooled rows that travel as a plain tensor (the exchange path's received
// vectors). Nothing is sized by the number of distinct ids, so a device never
// waits on its stream. Ids outside a table are skipped (kIdOutOfRange on the
// CPU; a device does not wait for it).
template <typename Device, typename Id>
struct CombineGrad {
  Error operator()(const Device& d, const std::vector<TableView>& tables,
                   const std::vector<FeatureView<Id>>& features,
                   const std::vector<const float*>& out_grads, const std::vector<float*>& grads);
};

// Backward, per table: the features reading it and their output gradients.
template <typename Id>
struct TableGradInput {
  int32_t dim = 0;
  int64_t rows = 0;  // 0: not known (ids then only need to fit kRowMask)
  std::vector<FeatureView<Id>> features;
  std::vector<const void*> out_grads;  // [batch_f, dim] per feature
  Precision precision = Precision::kFloat32;  // of out_grads
};

// Phase 1 (Prepare) expands the output gradients to ids and groups equal ids,
// for every table at once, and gives each table's output rows: an upper bound
// on its distinct ids known without waiting for the device (its ids' count, at
// most its rows). The caller allocates [rows_out] indices and [rows_out, dim]
// values per table and calls Finish once for all tables. Each table's output is
// its distinct ids, strictly ascending, with their summed gradients, then as
// padding repeats of the last distinct id with zero rows (summing repeats, as
// every consumer of row-sparse gradients does, changes nothing). The plan holds
// scratch valid until the kernel returns. An id outside [0, IdLimit(rows)):
// the CPU fails Prepare (kIdOutOfRange, item = its position in its feature,
// value = id, limit = that bound); a device drops it (no wait for a verdict:
// the lookup's own check, which the gradient runs after, has failed the step).
struct GradPlan {
  std::vector<int64_t> rows_out;  // per table
  std::shared_ptr<void> state;    // the device's grouping, alive until Finish
};

// The output rows of a table whose features hold `ids` ids: rows 0 = unknown.
inline int64_t GradRowsBound(int64_t ids, int64_t rows) { return rows > 0 && rows < ids ? rows : ids; }

template <typename Device, typename Id>
struct LookupGrad {
  Error Prepare(const Device& d, const std::vector<TableGradInput<Id>>& tables, GradPlan* plan);
  void Finish(const Device& d, const GradPlan& plan, const std::vector<int64_t*>& indices,
              const std::vector<float*>& values);
};

// Combiner denominator for a row: 1, sum(w) or sqrt(sum(w^2)); 0 means the row
// contributes zeros (empty row, or weights summing to zero), as div_no_nan.
TF_SOK_HD float CombinerScale(Combiner c, float wsum, float wsq) {
  float denom = c == Combiner::kSum ? 1.0f
                : c == Combiner::kMean ? wsum
                                       : sqrtf(wsq);
  return denom == 0.0f ? 0.0f : 1.0f / denom;
}

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_LOOKUP_H_
