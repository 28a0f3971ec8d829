// The multi-rank lookup's exchange plan on the GPU, made in one op with one
// host wait. Every feature's ids become keys (table << kTableShift) | row and
// are checked against their tables; the distinct keys are grouped by owning
// rank (Route) and counted per owner and table; one NCCL all-gather gives every
// rank all ranks' counts and check verdicts; after the wait the caller raises
// the same error on every rank if any rank disagrees or found a bad id, else the
// keys move by one NCCL all-to-all and everything the rest of the step needs is
// laid out on the device, sized by counts every rank now holds: the owners' rows
// table by table (each table's lookup), where each row's vector goes in the
// vectors returned per embedding width, and where each id finds its vector in
// what comes back. Nothing after it waits on the stream.
#ifndef TF_SOK_CC_IMPL_KEY_EXCHANGE_H_
#define TF_SOK_CC_IMPL_KEY_EXCHANGE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tf_sok/cc/impl/common.h"
#include "tf_sok/cc/impl/route.h"

namespace tf_sok {
namespace impl {

// Embedding widths one planned exchange handles (its layout kernel keeps
// per-width arrays); the Python side (comm/nccl.py MAX_WIDTHS) falls back to
// the routed exchange above it.
constexpr int kMaxExchangeWidths = 64;

namespace key_exchange {

struct Spec {
  int64_t comm = 0;               // NCCL communicator key
  int64_t signature = 0;          // the lookup's description, equal on every rank
  int num_features = 0;
  const int64_t* const* ids = nullptr;     // host [num_features]: each feature's ids (device)
  const int64_t* sizes = nullptr;          // host [num_features]: how many
  const int32_t* feature_table = nullptr;  // host [num_features]
  const int64_t* feature_rows = nullptr;   // host [num_features]: rows of the feature's table
  const int32_t* table_group = nullptr;    // host [num_tables]: the table's width group
  int num_groups = 1;
  // page-locked host memory of StagingSize(...) int64, alive until Prepare
  // returns: per-feature and per-table facts reach the device through it without a wait
  int64_t* staging = nullptr;
  RouteSpec route;                // num_buckets = ranks; num_tables; table_owner per table
};

inline int64_t StagingSize(int num_features, int num_tables) { return 3 * num_features + 1 + num_tables; }

// What one rank reported: its signature and its first bad id (found = 0: none),
// with that id's feature and the row count of the feature's table.
struct RankStatus {
  int64_t signature = 0, found = 0, feature = -1, id = -1, rows = 0;
};

struct Plan {
  int rank = 0, size = 0;
  int64_t n = 0;                                    // ids of this rank
  std::vector<RankStatus> status;                   // per rank, identical on every rank
  std::vector<int32_t> send_splits, recv_splits;    // distinct keys to / from each rank
  std::vector<int32_t> table_counts;                // keys received per table (all senders)
  std::vector<std::vector<int32_t>> group_send;     // [group][rank]: vectors this rank returns to rank
  std::vector<std::vector<int32_t>> group_recv;     // [group][rank]: vectors rank returns here
  std::vector<int32_t> group_totals;                // [group]: vectors this rank returns in all
  int64_t received = 0;                             // keys received in all
  RoutePlan route;
  std::shared_ptr<void> device;                     // Prepare's device buffers, for Finish
};

// Enqueues the keys (features concatenated in order), their grouping, the
// counts and the all-gather, then waits once. Returns "" or why it failed (a
// failure of the machinery, not a bad id: those are in plan->status for the
// caller to report; Finish must not run then).
std::string Prepare(const GpuDevice& d, const Spec& spec, Plan* plan);

// After a healthy Prepare, asynchronously:
//   table_rows [received]: the received keys' local rows, table by table (then by
//     sender, ascending): split by table_counts, each table's lookup;
//   unit_splits [received + num_tables]: table by table 0, 1, ..., its count;
//   group_gather [received]: group after group (sizes group_totals), the vectors
//     this rank returns, in the order of the all-to-all (by receiver, then table,
//     then key), as rows of the group's tables' lookups concatenated in table order;
//   group_scatter [received]: group after group, the inverse of group_gather's
//     permutation of the group: for each row of the group's lookups, its place
//     among the vectors returned (the return trip's gradient gathers by it);
//   slot [n]: for each id, the row of its vector among those its width group's
//     all-to-all brings back.
std::string Finish(const GpuDevice& d, const Plan& plan, const Spec& spec, int64_t* table_rows, int64_t* unit_splits,
                   int64_t* group_gather, int64_t* group_scatter, int64_t* slot);

}  // namespace key_exchange
}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_KEY_EXCHANGE_H_
