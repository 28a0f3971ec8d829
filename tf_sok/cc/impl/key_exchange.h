// The multi-rank lookup's first exchange on the GPU, in one op with one host
// wait: every feature's ids become keys (table << kTableShift) | row and are
// checked against their tables; the distinct keys are grouped by owning rank
// (Route); every rank's counts per owner and its check's verdict travel by one
// NCCL all-gather; after the wait the caller raises the same error on every
// rank if any rank disagrees or found a bad id, else the keys move by one NCCL
// all-to-all. Without it the same work takes a check (all-gather + a wait), a
// routing op (a wait), a size exchange (a wait) and the all-to-all.
#ifndef TF_SOK_CC_IMPL_KEY_EXCHANGE_H_
#define TF_SOK_CC_IMPL_KEY_EXCHANGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tf_sok/cc/impl/common.h"
#include "tf_sok/cc/impl/route.h"

namespace tf_sok {
namespace impl {
namespace key_exchange {

struct Spec {
  int64_t comm = 0;               // NCCL communicator key
  int64_t signature = 0;          // the lookup's description, equal on every rank
  int num_features = 0;
  const int64_t* features = nullptr;  // device [num_features, 2]: table, rows
  RouteSpec route;                // num_buckets = ranks; table_owner per table
};

// What one rank reported: its signature and its first bad id (found = 0: none),
// with that id's feature and the row count of the feature's table.
struct RankStatus {
  int64_t signature = 0, found = 0, feature = -1, id = -1, rows = 0;
};

struct Plan {
  int rank = 0, size = 0;
  std::vector<int32_t> send_splits, recv_splits;  // host, per rank
  std::vector<RankStatus> status;                 // per rank, identical on every rank
  RoutePlan route;
};

// ids[n] and feature_of[n] (device, int64): every feature's ids, concatenated,
// and the feature of each. Enqueues the keys, their grouping and the all-gather,
// then waits once. Returns "" or why it failed (a failure of the machinery, not a
// bad id: those are in plan->status for the caller to report).
std::string Prepare(const GpuDevice& d, const int64_t* ids, const int64_t* feature_of, int64_t n,
                    const Spec& spec, Plan* plan);

// After a healthy Prepare: send_keys [sum send_splits] (distinct keys, by owner,
// row-local), position [n] (each id's place in send_keys), recv_keys
// [sum recv_splits] (what each rank sends here, in rank order). Asynchronous.
std::string Finish(const GpuDevice& d, const Plan& plan, const Spec& spec, int64_t* send_keys, int64_t* position,
                   int64_t* recv_keys);

}  // namespace key_exchange
}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_KEY_EXCHANGE_H_
