// Routing of the multi-rank lookup, TensorFlow-free. Keys are
// (table << kTableShift) | row. Route groups equal keys, gives each distinct key
// a bucket (the rank owning its row, or its table) and lays the distinct keys
// out bucket by bucket, ascending inside a bucket; every input position learns
// where its key went. CPU (route_cpu.cc) and CUDA (route_gpu.cu) compute the
// same function.
#ifndef TF_SOK_CC_IMPL_ROUTE_H_
#define TF_SOK_CC_IMPL_ROUTE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "tf_sok/cc/impl/common.h"

namespace tf_sok {
namespace impl {

struct RouteSpec {
  int num_buckets = 1;
  // false: bucket = owning rank of the row (table_owner[table] < 0: row-wise,
  // rank row % num_buckets, local row row / num_buckets; else that rank, row
  // unchanged). true: bucket = table, key unchanged.
  bool by_table = false;
  int num_tables = 0;
  const int32_t* table_owner = nullptr;  // [num_tables], host memory
};

// Bucket and outgoing key of one distinct key; owner = table_owner[table].
TF_SOK_HD void BucketOf(long long key, int num_buckets, bool by_table, int owner, int* bucket,
                        long long* out) {
  const long long table = key >> kTableShift, row = key & kRowMask;
  if (by_table) {
    *bucket = static_cast<int>(table);
    *out = key;
  } else if (owner < 0) {
    *bucket = static_cast<int>(row % num_buckets);
    *out = (table << kTableShift) | (row / num_buckets);
  } else {
    *bucket = owner;
    *out = key;
  }
}

struct RoutePlan {
  int64_t n = 0;
  int64_t num_unique = 0;
  std::vector<int32_t> splits;  // keys per bucket, where Prepare already knows them (GPU)
  std::shared_ptr<void> state;  // the device's grouping, alive until Finish
};

// Prepare groups the keys (and checks each names one of num_tables tables:
// kIdOutOfRange with item = position, value = key); then the caller allocates
// the outputs and Finish fills them: unique_keys [num_unique], splits
// [num_buckets] (keys per bucket; host memory on every device), position [n],
// and unless null unit_splits [num_unique + num_buckets]: bucket after bucket,
// 0, 1, ..., its key count (the row splits of a lookup of one key per row).
template <typename Device>
struct Route {
  Error Prepare(const Device& d, const int64_t* keys, int64_t n, const RouteSpec& spec, RoutePlan* plan);
  Error Finish(const Device& d, const RoutePlan& plan, const RouteSpec& spec, int64_t* unique_keys,
               int32_t* splits, int64_t* position, int64_t* unit_splits = nullptr);
};

// GPU only (route_gpu.cu): Prepare's work without its check and its wait, for
// a caller that reads the counts back together with its own (one wait in all).
// The keys must be valid. *num_unique and counts[num_buckets] are device memory,
// set once the stream reaches them (zeros when n = 0); so is, unless null,
// bucket_table_counts[num_buckets * num_tables] (distinct keys per bucket and
// table, zeroed by the caller). The caller then fills plan->num_unique and
// plan->splits before Finish.
Error RouteOnStream(const GpuDevice& d, const int64_t* keys, int64_t n, const RouteSpec& spec, RoutePlan* plan,
                    const int** num_unique, const int** counts, int* bucket_table_counts = nullptr);

// GPU only: unit_splits as Route::Finish writes them, from counts[num_buckets]
// in device memory (total = sum of counts + num_buckets).
Error UnitSplitsOnStream(const GpuDevice& d, const int* counts, int num_buckets, int64_t total, int64_t* unit_splits);

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_ROUTE_H_
