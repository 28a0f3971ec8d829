// What the find, prefetch and read kernels of dynamic tables share (dynamic_find_kernels.cc,
// dynamic_prefetch_kernels.cc, dynamic_read_kernels.cc): locking several tables' indices, the tables an
// op acts on, the finds of several tables on a GPU (which a prefetch runs too, on its own stream) and
// the stage timer of the GPU calls.
#ifndef TF_SOK_CC_KERNELS_DYNAMIC_FIND_H_
#define TF_SOK_CC_KERNELS_DYNAMIC_FIND_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "tf_sok/cc/kernels/dynamic_rows.h"

namespace tf_sok {
namespace dynamic_kernels {

// Locks the indices of the inputs [0, n) of an op over several dynamic tables, in address order (no
// deadlock with other ops); an index given twice is an error.
absl::Status LockIndices(tf::OpKernelContext* ctx, int n, const char* op,
                         std::vector<tf::core::RefCountPtr<IndexResource>>* res,
                         std::vector<std::unique_ptr<tf::mutex_lock>>* locks);

// The tables `at` of an op over several dynamic tables (indices, then keys), and their keys.
void TablesAt(tf::OpKernelContext* ctx, const std::vector<tf::core::RefCountPtr<IndexResource>>& res,
              const std::vector<int>& at, std::vector<IndexResource*>* tables, std::vector<const tf::Tensor*>* keys);

// Under the low-frequency filter, a hybrid table's cache takes back the keys its host tier holds
// whatever the filter draws (the filter is for keys new to the table); no hook otherwise.
impl::HeldKeys HeldOnHost(IndexResource* res, float insert_ratio);

#if TF_SOK_WITH_CUDA
// With TF_SOK_FIND_STAGES=1 in the environment, the GPU finds (one table, or many) and reads time their
// stages on the host (kernel launches, each wait for counts, the host store's lookups; a last wait
// takes the device's remaining work) and print their means to stderr every 20 calls of a kind: where a
// dynamic or hybrid table's step goes. The extra wait changes the overlap it measures; with
// TF_SOK_FIND_STAGES=2 the stages are timed without it (the device's tail then shows as 0). For
// profiling only; the variable is read at each call, so one process may compare the two.
class StageClock {
 public:
  static constexpr int kStages = 9;
  enum Kind { kFind = 0, kFindMany = 1, kPrefetch = 2, kRead = 3 };
  // a read's stages (its clock marks these, then the last stage takes the device's tail)
  enum ReadStage {
    kReadProbe = 0,
    kReadWait = 1,
    kReadHostLookups = 2,
    kReadLaunched = 3,
    kReadRowsWait = 4,
    kReadGather = 5,
    kReadGatheredLaunched = 6
  };
  StageClock(cudaStream_t stream, Kind kind, bool active = true)
      : stream_(stream), kind_(kind) {
    const int mode = active ? Mode() : 0;
    on_ = mode != 0;
    tail_ = mode == 1;
    if (on_) last_ = Now();
  }
  void Mark(int stage) {
    if (!on_) return;
    const double now = Now();
    Totals(kind_).ms[stage] += now - last_;
    last_ = now;
  }
  ~StageClock() {
    if (!on_) return;
    if (tail_) cudaStreamSynchronize(stream_);
    Mark(kStages - 1);
    Sums& t = Totals(kind_);
    if (++t.calls % 20 != 0) return;
    static const char* names[kStages] = {"probe",          "wait missing",           "distinct",
                                         "wait distinct",  "room",                   "wait evictable",
                                         "commit + wait new keys", "host store lookups / array upkeep launched",
                                         "arrays + device tail"};
    static const char* read_names[kStages] = {"probe + keys to the host launched", "wait", "host store lookups",
                                              "rows back + read kernels launched", "wait store rows",
                                              "host gather", "gathered rows sent + read kernels launched", "",
                                              "device tail"};
    static const char* kinds[4] = {"find", "find-many", "prefetch", "read"};
    std::fprintf(stderr, "tf_sok %s stages (ms per call, mean of 20%s):", kinds[kind_],
                 tail_ ? "" : ", the device's tail not waited for");
    for (int i = 0; i < kStages; ++i) {
      const char* name = kind_ == kRead ? read_names[i] : names[i];
      if (name[0] != 0) std::fprintf(stderr, " %s %.3f;", name, t.ms[i] / 20);
    }
    std::fprintf(stderr, "\n");
    t = Sums();
  }

 private:
  struct Sums {
    double ms[kStages] = {};
    int64_t calls = 0;
  };
  static int Mode() {
    const char* v = std::getenv("TF_SOK_FIND_STAGES");
    return v != nullptr && (v[0] == '1' || v[0] == '2') && v[1] == 0 ? v[0] - '0' : 0;
  }
  static Sums& Totals(Kind kind) {
    static Sums sums[4];
    return sums[kind];
  }
  static double Now() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  cudaStream_t stream_;
  bool on_ = false;
  bool tail_ = false;
  Kind kind_;
  double last_ = 0;
};

// The finds of several tables on a GPU (TfSokDynamicFindMany, or with `prefetch` TfSokDynamicPrefetch
// on a stream of its own): each stage of every table's index call, then the counts of all tables
// read back with one wait (none when no table has missing keys / must evict); then the hybrid
// tables' new keys back to the host with one wait for all, then every table's arrays. Finds write
// output i (the rows of keys[i]); prefetches the keys each table took in.
absl::Status FindManyOnGpu(tf::OpKernelContext* ctx, const impl::GpuDevice& d,
                           const std::vector<IndexResource*>& res, const std::vector<const tf::Tensor*>& key_lists,
                           float insert_ratio, bool prefetch, std::vector<int64_t>* taken_in);

// A prefetch's stages within FindManyOnGpu (dynamic_prefetch_kernels.cc):
// Which of a prefetch's distinct missing keys (pending[i].missing, distinct[i] of them) the host
// tiers hold: a tier whose keys are on the GPU too (by_map) counts them there (held_on_map, one
// wait for all such tables); the others' keys go to the host (HeldByTiers: flags and store rows).
absl::Status PrefetchHeld(tf::OpKernelContext* ctx, const impl::GpuDevice& d, const std::vector<IndexResource*>& res,
                          const std::vector<impl::GpuFindPending>& pending, const std::vector<int64_t>& distinct,
                          int64_t* counts, std::vector<bool>* by_map, std::vector<int64_t>* held_on_map,
                          std::vector<std::vector<uint8_t>>* held, std::vector<std::vector<int64_t>>* held_rows);
// A prefetch's store plan: the keys it took in are the first c.num_new of the distinct missing keys
// its host tier holds (flags), whose store rows HeldByTiers found: no second lookup, no wait.
// taken: [their store rows | fresh flags (none)] (the caller marks the rows cached).
absl::Status PrefetchPlan(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* r, const Changes& c,
                          const std::vector<uint8_t>& flags, const std::vector<int64_t>& rows, StorePlan* p,
                          std::vector<int64_t>* taken_rows);
// PrefetchPlan for a tier whose keys are on the GPU too: the store rows of the keys taken in looked up
// there (they are all held), nothing read back.
absl::Status PrefetchPlanOnMap(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* r, const Changes& c,
                               StorePlan* p);
// A prefetch's row moves, on its own stream: queued with the tables' arrays locked, then left
// running with them unlocked, past the op's end, so that the step beside it (its lookups' gradients,
// the optimizer's update, on TensorFlow's stream) goes on meanwhile -- the moves write only rows no
// lookup since the last prefetch used. Until they are done, a copy of an array's buffer
// (copy-on-write) waits for them on the GPU, and the next op to lock one of the tables waits for them
// (SettleMoves: a find before it reads the rows, anything else before it touches the index, the
// arrays or the host tier).
absl::Status PrefetchMoves(tf::OpKernelContext* ctx, const impl::GpuDevice& d, const std::vector<IndexResource*>& res,
                           const std::vector<Changes>& changes, std::vector<StorePlan>* plans);
#endif

}  // namespace dynamic_kernels
}  // namespace tf_sok

#endif  // TF_SOK_CC_KERNELS_DYNAMIC_FIND_H_
