// Kernels of the find ops of dynamic tables (TfSokDynamicFind, TfSokDynamicFindMany) and of the
// row-splits check: keys to rows, inserting, evicting and admitting, the arrays kept in step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "tf_sok/cc/kernels/dynamic_rows.h"

namespace tf_sok {
namespace dynamic_kernels {
namespace {

absl::Status EvictedOutputs(tf::OpKernelContext* ctx, const IndexResource& res, int64_t n, tf::Tensor** keys,
                            tf::Tensor** values) {
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, tf::TensorShape({n}), keys));
  return ctx->allocate_output(2, tf::TensorShape({n, res.dim}), values);
}

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
#endif

// A hybrid table's evicted outputs: the keys its host tier's bound dropped in the call (with_evicted:
// else none) and their values, read from the tier's rows (after the call's moves into them).
absl::Status DroppedOutputs(tf::OpKernelContext* ctx, const impl::CpuDevice&, const IndexResource& res,
                            const StorePlan& plan, bool with_evicted) {
  const int64_t n = with_evicted ? static_cast<int64_t>(plan.dropped_keys.size()) : 0;
  tf::Tensor *keys = nullptr, *values = nullptr;
  TF_RETURN_IF_ERROR(EvictedOutputs(ctx, res, n, &keys, &values));
  std::copy(plan.dropped_keys.begin(), plan.dropped_keys.begin() + n, keys->flat<int64_t>().data());
  impl::GatherRows(res.store->base(0), res.store->stride(), res.dim, plan.dropped_rows.data(), n,
                   values->flat<float>().data());
  return absl::OkStatus();
}
#if TF_SOK_WITH_CUDA
absl::Status DroppedOutputs(tf::OpKernelContext* ctx, const impl::GpuDevice& d, const IndexResource& res,
                            const StorePlan& plan, bool with_evicted) {
  const int64_t n = with_evicted ? static_cast<int64_t>(plan.dropped_keys.size()) : 0;
  tf::Tensor *keys = nullptr, *values = nullptr;
  TF_RETURN_IF_ERROR(EvictedOutputs(ctx, res, n, &keys, &values));
  if (n == 0) return absl::OkStatus();
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  auto* rows = static_cast<int64_t*>(d.scratch->Allocate(8 * n));
  if (!rows) return absl::ResourceExhaustedError("dynamic table '" + res.table + "': out of GPU memory");
  // (from pageable memory: the copies have read their sources when they return)
  cudaMemcpyAsync(keys->flat<int64_t>().data(), plan.dropped_keys.data(), 8 * n, cudaMemcpyHostToDevice, stream);
  cudaMemcpyAsync(rows, plan.dropped_rows.data(), 8 * n, cudaMemcpyHostToDevice, stream);
  impl::GpuGatherRows(d, res.store->base(0), res.store->stride(), res.dim, rows, n, values->flat<float>().data());
  return absl::OkStatus();
}
#endif

// Under the low-frequency filter, a hybrid table's cache takes back the keys its host tier holds
// whatever the filter draws (the filter is for keys new to the table); no hook otherwise.
impl::HeldKeys HeldOnHost(IndexResource* res, float insert_ratio) {
  if (!res->store || insert_ratio >= 1.0f) return {};
  return [res](const int64_t* keys, int64_t n, uint8_t* flags) {
    std::vector<int64_t> rows(n);
    res->store->Rows(keys, n, rows.data());
    for (int64_t j = 0; j < n; ++j) flags[j] = rows[j] >= 0;
    return std::string();
  };
}

#if TF_SOK_WITH_CUDA
// As HeldOnHost for an index on the GPU: the keys come to the host (a wait) and the flags go back;
// where the tier's keys are on the GPU too, they are looked up there (no wait).
impl::HeldKeys HeldOnGpu(const impl::GpuDevice& d, IndexResource* res, float insert_ratio) {
  if (!res->store || insert_ratio >= 1.0f) return {};
  if (DeviceMapReady(d, res, 0))   // (current until the call that uses the hook changes the tier)
    return [&d, res](const int64_t* keys, int64_t n, uint8_t* flags) {
      return res->gpu->StoreMapHeld(d, keys, n, flags);
    };
  return [&d, res](const int64_t* keys, int64_t n, uint8_t* flags) {
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    uint8_t* staging = res->Staging(17 * static_cast<size_t>(n));   // [keys | rows | flags]
    if (!staging) return std::string("ran out of host memory");
    auto* host_keys = reinterpret_cast<int64_t*>(staging);
    cudaMemcpyAsync(host_keys, keys, 8 * n, cudaMemcpyDeviceToHost, stream);
    absl::Status status = CudaWait(stream);
    if (!status.ok()) return std::string(status.message());
    auto* rows = host_keys + n;
    res->store->Rows(host_keys, n, rows);
    uint8_t* host_flags = staging + 16 * n;
    for (int64_t j = 0; j < n; ++j) host_flags[j] = rows[j] >= 0;
    cudaMemcpyAsync(flags, host_flags, n, cudaMemcpyHostToDevice, stream);
    status = CudaWait(stream);   // the staging buffer is reused (and may be reallocated) later in the call
    return status.ok() ? std::string() : std::string(status.message());
  };
}
#endif

class FindOp : public tf::OpKernel {
 public:
  explicit FindOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("insert", &insert_));
    OP_REQUIRES_OK(c, c->GetAttr("with_evicted", &with_evicted_));
    OP_REQUIRES_OK(c, c->GetAttr("admit_all", &admit_all_));
    OP_REQUIRES_OK(c, c->GetAttr("insert_ratio", &insert_ratio_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    const tf::Tensor& keys = ctx->input(1);
    OP_REQUIRES(ctx, keys.dims() == 1, Failed(*res, ": ", "keys must be a vector, got shape " + keys.shape().DebugString()));
#if TF_SOK_WITH_CUDA
    if (res->gpu) {
      ComputeGpu(ctx, res.get(), keys);
      return;
    }
#endif
    OP_REQUIRES(ctx, res->host != nullptr, Failed(*res, ": ", "its index lives on a GPU; look it up there"));
    tf::Tensor* slots = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &slots));
    impl::FindChanges ch;
    TensorScratch scratch(ctx);
    const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
    tf::mutex_lock l(res->mu);
    const std::string error = res->host->Find(keys.flat<int64_t>().data(), keys.NumElements(), insert_,
                                              slots->flat<int64_t>().data(), &ch, admit_all_, insert_ratio_,
                                              HeldOnHost(res.get(), insert_ratio_), &d.parallel_for);
    OP_REQUIRES(ctx, error.empty(), Failed(*res, " ", error));
    if (res->store) {   // the keys its cache evicts stay in the host tier; those its bound drops leave
      StorePlan plan;
      if (insert_) OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, res.get(), HostChanges(ch, keys.NumElements()),
                                                        nullptr, &plan));
      OP_REQUIRES_OK(ctx, DroppedOutputs(ctx, d, *res, plan, with_evicted_));
      return;
    }
    const int64_t evicted = with_evicted_ ? static_cast<int64_t>(ch.evicted_keys.size()) : 0;
    tf::Tensor *ev_keys = nullptr, *ev_values = nullptr;
    OP_REQUIRES_OK(ctx, EvictedOutputs(ctx, *res, evicted, &ev_keys, &ev_values));
    std::copy(ch.evicted_keys.begin(), ch.evicted_keys.begin() + evicted, ev_keys->flat<int64_t>().data());
    if (!insert_) return;
    OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, res.get(), HostChanges(ch, keys.NumElements()),
                                         evicted > 0 ? ev_values->flat<float>().data() : nullptr));
  }

 private:
#if TF_SOK_WITH_CUDA
  void ComputeGpu(tf::OpKernelContext* ctx, IndexResource* res, const tf::Tensor& keys) {
    TensorScratch scratch(ctx);
    const impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    tf::Tensor* slots = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &slots));
    impl::GpuFindResult r;
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, SettleStore(res));
    StageClock clock(stream, StageClock::kFind, insert_);   // finds that insert
    const std::string error = res->gpu->Find(d, keys.flat<int64_t>().data(), keys.NumElements(), insert_, &r,
                                             admit_all_, insert_ratio_, [&clock](int stage) { clock.Mark(stage); },
                                             HeldOnGpu(d, res, insert_ratio_));
    OP_REQUIRES(ctx, error.empty(), Failed(*res, " ", error));
    if (keys.NumElements() > 0)
      cudaMemcpyAsync(slots->flat<int64_t>().data(), r.slots, 8 * keys.NumElements(), cudaMemcpyDeviceToDevice,
                      stream);
    if (res->store) {   // (as on the host)
      StorePlan plan;
      if (insert_) OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, res, DeviceChanges(r, keys.NumElements()), nullptr,
                                                        &plan));
      OP_REQUIRES_OK(ctx, DroppedOutputs(ctx, d, *res, plan, with_evicted_));
      if (insert_) res->RecordFind(stream);
      clock.Mark(7);
      return;
    }
    const int64_t evicted = with_evicted_ ? r.num_evicted : 0;
    tf::Tensor *ev_keys = nullptr, *ev_values = nullptr;
    OP_REQUIRES_OK(ctx, EvictedOutputs(ctx, *res, evicted, &ev_keys, &ev_values));
    if (evicted > 0)
      cudaMemcpyAsync(ev_keys->flat<int64_t>().data(), r.evicted_keys, 8 * evicted, cudaMemcpyDeviceToDevice, stream);
    if (!insert_) return;
    // stream-ordered: the scratch these read is reused only by work queued after them
    OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, res, DeviceChanges(r, keys.NumElements()),
                                         evicted > 0 ? ev_values->flat<float>().data() : nullptr));
    res->RecordFind(stream);
    clock.Mark(7);
  }
#endif
  bool insert_ = true, with_evicted_ = false, admit_all_ = false;
  float insert_ratio_ = 1.0f;
};


// Locks the indices of the inputs [0, n) of an op over several dynamic tables, in address order (no
// deadlock with other ops); an index given twice is an error.
absl::Status LockIndices(tf::OpKernelContext* ctx, int n, const char* op,
                         std::vector<tf::core::RefCountPtr<IndexResource>>* res,
                         std::vector<std::unique_ptr<tf::mutex_lock>>* locks) {
  res->resize(n);
  std::vector<IndexResource*> order;
  for (int i = 0; i < n; ++i) {
    TF_RETURN_IF_ERROR(tf::LookupResource(ctx, tf::HandleFromInput(ctx, i), &(*res)[i]));
    const tf::Tensor& keys = ctx->input(n + i);
    if (keys.dims() != 1)
      return Failed(*(*res)[i], ": ", "keys must be a vector, got shape " + keys.shape().DebugString());
    order.push_back((*res)[i].get());
  }
  std::sort(order.begin(), order.end());
  if (std::adjacent_find(order.begin(), order.end()) != order.end())
    return absl::InvalidArgumentError(std::string(op) + ": a dynamic table's index is given twice");
  for (IndexResource* r : order) locks->push_back(std::make_unique<tf::mutex_lock>(r->mu));
  for (IndexResource* r : order) TF_RETURN_IF_ERROR(SettleMoves(r));
  return absl::OkStatus();
}

#if TF_SOK_WITH_CUDA
// For a prefetch: per table, whether its host tier holds each of its distinct missing keys (n[i] of
// them at missing[i], device memory) and their store rows (-1: not held), for all tables with one
// wait, looked up on the host's threads.
absl::Status HeldByTiers(tf::OpKernelContext* ctx, cudaStream_t stream, const std::vector<IndexResource*>& res,
                         const std::vector<const int64_t*>& missing, const std::vector<int64_t>& n,
                         std::vector<std::vector<uint8_t>>* flags, std::vector<std::vector<int64_t>>* store_rows) {
  const size_t tables = res.size();
  std::vector<std::vector<int64_t>> keys(tables);
  std::vector<const int64_t*> key_lists(tables);
  std::vector<int64_t*> row_lists(tables);
  for (size_t i = 0; i < tables; ++i) {
    keys[i].resize(n[i]);
    (*store_rows)[i].resize(n[i]);
    key_lists[i] = keys[i].data();
    row_lists[i] = (*store_rows)[i].data();
    if (n[i] > 0) cudaMemcpyAsync(keys[i].data(), missing[i], 8 * n[i], cudaMemcpyDeviceToHost, stream);
  }
  TF_RETURN_IF_ERROR(CudaWait(stream));
  StoreRowsOfTables(ctx, res, key_lists, n, row_lists);
  for (size_t i = 0; i < tables; ++i) {
    (*flags)[i].resize(n[i]);
    for (int64_t j = 0; j < n[i]; ++j) (*flags)[i][j] = (*store_rows)[i][j] >= 0;
  }
  return absl::OkStatus();
}

// A prefetch's store plan: the keys it took in are the first c.num_new of the distinct missing keys
// its host tier holds (flags), whose store rows HeldByTiers found: no second lookup, no wait.
// taken: [their store rows | fresh flags (none)] (the caller marks the rows cached).
absl::Status PrefetchPlan(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* r, const Changes& c,
                          const std::vector<uint8_t>& flags, const std::vector<int64_t>& rows, StorePlan* p,
                          std::vector<int64_t>* taken_rows) {
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, r, c.rows, &p->store_row_of));
  p->planned = true;
  const int64_t n = c.num_new;
  std::vector<int64_t>& taken = *taken_rows;
  taken.reserve(n + (n + 7) / 8);
  for (size_t j = 0; j < flags.size() && static_cast<int64_t>(taken.size()) < n; ++j)
    if (flags[j]) taken.push_back(rows[j]);
  if (static_cast<int64_t>(taken.size()) != n)
    return absl::InternalError("dynamic table '" + r->table + "': a prefetch lost count of the keys it took in");
  if (n > 0) {
    taken.resize(n + (n + 7) / 8, 0);
    p->on_device = static_cast<uint8_t*>(d.scratch->Allocate(9 * n));
    if (p->on_device == nullptr)
      return absl::ResourceExhaustedError("dynamic table '" + r->table + "': out of GPU memory");
    // (from pageable memory: the copy has read its source when it returns)
    cudaMemcpyAsync(p->on_device, taken.data(), 9 * n, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(d.stream));
    p->new_rows = reinterpret_cast<const int64_t*>(p->on_device);
    p->fresh = p->on_device + 8 * n;
  }
  return absl::OkStatus();
}

// Which of a prefetch's distinct missing keys (pending[i].missing, distinct[i] of them) the host
// tiers hold: a tier whose keys are on the GPU too (by_map) counts them there (held_on_map, one
// wait for all such tables); the others' keys go to the host (HeldByTiers: flags and store rows).
absl::Status PrefetchHeld(tf::OpKernelContext* ctx, const impl::GpuDevice& d, const std::vector<IndexResource*>& res,
                          const std::vector<impl::GpuFindPending>& pending, const std::vector<int64_t>& distinct,
                          int64_t* counts, std::vector<bool>* by_map, std::vector<int64_t>* held_on_map,
                          std::vector<std::vector<uint8_t>>* held, std::vector<std::vector<int64_t>>* held_rows) {
  const size_t n = res.size();
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  std::vector<const int64_t*> lists(n);
  std::vector<int64_t> on_host(n, 0);
  bool host = false, device = false;
  cudaMemsetAsync(counts, 0, 8 * n, stream);
  for (size_t i = 0; i < n; ++i) {
    lists[i] = pending[i].missing;
    (*by_map)[i] = res[i]->store != nullptr && DeviceMapReady(d, res[i], 0);
    if (!(*by_map)[i]) {
      on_host[i] = distinct[i];
      host |= distinct[i] > 0;
    } else if (distinct[i] > 0) {
      auto* rows = static_cast<int64_t*>(d.scratch->Allocate(8 * static_cast<size_t>(distinct[i])));
      if (rows == nullptr) return absl::ResourceExhaustedError("TfSokDynamicPrefetch: out of GPU memory");
      const std::string error =
          res[i]->gpu->StoreMapRowsOfMissing(d, pending[i].missing, nullptr, distinct[i], rows, counts + i);
      if (!error.empty()) return Failed(*res[i], " prefetch: ", error);
      device = true;
    }
  }
  if (host) TF_RETURN_IF_ERROR(HeldByTiers(ctx, stream, res, lists, on_host, held, held_rows));
  if (device) TF_RETURN_IF_ERROR(ReadCounts(stream, counts, static_cast<int>(n), held_on_map->data()));
  for (size_t i = 0; i < n; ++i)
    if (!(*by_map)[i]) (*held_on_map)[i] = 0;
  return absl::OkStatus();
}

// PrefetchPlan for a tier whose keys are on the GPU too: the store rows of the keys taken in looked up
// there (they are all held), nothing read back.
absl::Status PrefetchPlanOnMap(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* r, const Changes& c,
                               StorePlan* p) {
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, r, c.rows, &p->store_row_of));
  p->planned = true;
  if (c.num_new == 0) return absl::OkStatus();
  auto* rows = static_cast<int64_t*>(d.scratch->Allocate(8 * static_cast<size_t>(c.num_new)));
  if (rows == nullptr) return absl::ResourceExhaustedError("dynamic table '" + r->table + "': out of GPU memory");
  const std::string error = r->gpu->StoreMapRowsOfMissing(d, c.new_keys, nullptr, c.num_new, rows, nullptr);
  if (!error.empty()) return Failed(*r, " prefetch: ", error);
  p->new_rows = rows;
  p->fresh = nullptr;
  return absl::OkStatus();
}

// A prefetch's row moves, on its own stream: queued with the tables' arrays locked, then left
// running with them unlocked, past the op's end, so that the step beside it (its lookups' gradients,
// the optimizer's update, on TensorFlow's stream) goes on meanwhile -- the moves write only rows no
// lookup since the last prefetch used. Until they are done, a copy of an array's buffer
// (copy-on-write) waits for them on the GPU, and the next op to lock one of the tables waits for them
// (SettleMoves: a find before it reads the rows, anything else before it touches the index, the
// arrays or the host tier).
absl::Status PrefetchMoves(tf::OpKernelContext* ctx, const impl::GpuDevice& d, const std::vector<IndexResource*>& res,
                           const std::vector<Changes>& changes, std::vector<StorePlan>* plans) {
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  cudaEvent_t event = nullptr;
  if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess)
    return absl::InternalError("TfSokDynamicPrefetch: cannot create a CUDA event");
  const std::shared_ptr<CUevent_st> moved(event, [](cudaEvent_t e) { cudaEventDestroy(e); });
  const auto locks = LockArrays(res);
  for (size_t i = 0; i < res.size(); ++i) {
    const absl::Status status = KeepArraysInStep(ctx, d, res[i], changes[i], nullptr, &(*plans)[i]);
    if (!status.ok()) {   // (what was queued is waited for: the tables stay as the index says)
      CudaWait(stream).IgnoreError();
      return status;
    }
  }
  const cudaError_t e = cudaEventRecord(event, stream);
  if (e != cudaSuccess) {
    CudaWait(stream).IgnoreError();
    return absl::InternalError(std::string("TfSokDynamicPrefetch: CUDA error ") + cudaGetErrorString(e));
  }
  for (IndexResource* r : res) {
    r->moves = moved;
    for (const auto& a : r->arrays) NoteSideWrites(a.var.get(), event);
  }
  return absl::OkStatus();
}

// The finds of several tables on a GPU (TfSokDynamicFindMany, or with `prefetch` TfSokDynamicPrefetch
// on a stream of its own): each stage of every table's index call, then the counts of all tables
// read back with one wait (none when no table has missing keys / must evict); then the hybrid
// tables' new keys back to the host with one wait for all, then every table's arrays. Finds write
// output i (the rows of keys[i]); prefetches the keys each table took in.
absl::Status FindManyOnGpu(tf::OpKernelContext* ctx, const impl::GpuDevice& d,
                           const std::vector<IndexResource*>& res, const std::vector<const tf::Tensor*>& key_lists,
                           float insert_ratio, bool prefetch, std::vector<int64_t>* taken_in) {
  const int n = static_cast<int>(res.size());
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  auto* counts = static_cast<int64_t*>(d.scratch->Allocate(8 * static_cast<size_t>(n)));
  if (counts == nullptr) return absl::ResourceExhaustedError("TfSokDynamicFindMany: out of GPU memory");
  std::vector<impl::GpuFindResult> found(n);
  std::vector<impl::GpuFindPending> pending(n);
  auto check = [&](int i, const std::string& error) {
    return error.empty() ? absl::OkStatus() : Failed(*res[i], prefetch ? " prefetch: " : " ", error);
  };
  // a prefetch admits the keys the host tier holds, no others
  const float ratio = prefetch ? 0.0f : insert_ratio;
  StageClock clock(stream, prefetch ? StageClock::kPrefetch : StageClock::kFindMany);
  for (int i = 0; i < n; ++i) {
    if (res[i]->gpu == nullptr) return Failed(*res[i], ": ", "its index is on the host; look it up there");
    const tf::Tensor& keys = *key_lists[i];
    TF_RETURN_IF_ERROR(check(i, res[i]->gpu->Probe(d, keys.flat<int64_t>().data(), keys.NumElements(), &found[i],
                                                   &pending[i], counts + i, ratio, prefetch)));
  }
  std::vector<int64_t> missing(n), distinct(n), evictable(n);
  clock.Mark(0);
  TF_RETURN_IF_ERROR(ReadCounts(stream, counts, n, missing.data()));
  // (the last find's device work is done now: what it left for the host costs no wait)
  for (IndexResource* r : res) TF_RETURN_IF_ERROR(SettleStore(r));
  clock.Mark(1);
  bool any = false;
  for (int i = 0; i < n; ++i) {
    TF_RETURN_IF_ERROR(check(i, res[i]->gpu->FinishDistinct(d, &pending[i], missing[i], &found[i], counts + i,
                                                            ratio)));
    any |= missing[i] > 0 && !pending[i].fused;
  }
  clock.Mark(2);
  if (any) TF_RETURN_IF_ERROR(ReadCounts(stream, counts, n, distinct.data()));
  for (int i = 0; i < n; ++i)
    if (pending[i].fused) distinct[i] = missing[i];   // the probe inserted: its count was of the new keys
  clock.Mark(3);
  // a prefetch takes in the keys the host tiers hold: asked of all tiers at once (a find under the
  // low-frequency filter asks table by table)
  std::vector<std::vector<uint8_t>> held(n);
  std::vector<std::vector<int64_t>> held_rows(n);
  std::vector<int64_t> held_on_map(n, 0);   // a tier whose keys are on the GPU too: its count of held keys
  std::vector<bool> by_map(n, false);
  if (prefetch) TF_RETURN_IF_ERROR(PrefetchHeld(ctx, d, res, pending, distinct, counts, &by_map, &held_on_map,
                                                &held, &held_rows));
  any = false;
  for (int i = 0; i < n; ++i) {
    bool evicts = false;
    impl::HeldKeys hook = HeldOnGpu(d, res[i], ratio);
    if (prefetch && by_map[i]) {
      pending[i].held_count = held_on_map[i];
      hook = [&d, r = res[i]](const int64_t* keys, int64_t count, uint8_t* out) {
        return r->gpu->StoreMapHeld(d, keys, count, out);
      };
    } else if (prefetch) {
      pending[i].held_count = std::count(held[i].begin(), held[i].end(), uint8_t{1});
      hook = [&flags = held[i], stream](const int64_t*, int64_t count, uint8_t* out) {
        // (from pageable memory: the copy has read its source when it returns)
        if (count > 0) cudaMemcpyAsync(out, flags.data(), count, cudaMemcpyHostToDevice, stream);
        return std::string();
      };
    }
    TF_RETURN_IF_ERROR(check(i, res[i]->gpu->FinishRoom(d, &pending[i], distinct[i], false, ratio, counts + i,
                                                        &evicts, hook)));
    if (!evicts) cudaMemsetAsync(counts + i, 0, 8, stream);
    any |= evicts;
  }
  clock.Mark(4);
  if (any) TF_RETURN_IF_ERROR(ReadCounts(stream, counts, n, evictable.data()));
  clock.Mark(5);
  std::vector<StorePlan> plans(n);
  std::vector<Changes> changes(n);
  std::vector<std::vector<int64_t>> taken(prefetch ? n : 0);
  bool wait = false;
  for (int i = 0; i < n; ++i) {
    IndexResource* r = res[i];
    const tf::Tensor& keys = *key_lists[i];
    TF_RETURN_IF_ERROR(check(i, r->gpu->FinishCommit(d, &pending[i], evictable[i], &found[i])));
    changes[i] = DeviceChanges(found[i], keys.NumElements());
    changes[i].prefetch = prefetch;
    if (prefetch) {
      (*taken_in)[i] = found[i].num_new;
    } else {
      tf::Tensor* slots = nullptr;
      TF_RETURN_IF_ERROR(ctx->allocate_output(i, keys.shape(), &slots));
      if (keys.NumElements() > 0)
        cudaMemcpyAsync(slots->flat<int64_t>().data(), found[i].slots, 8 * keys.NumElements(),
                        cudaMemcpyDeviceToDevice, stream);
    }
    if (prefetch && by_map[i]) {
      TF_RETURN_IF_ERROR(PrefetchPlanOnMap(ctx, d, r, changes[i], &plans[i]));
    } else if (prefetch) {   // (the keys taken in: the first num_new held ones, whose store rows are known)
      TF_RETURN_IF_ERROR(PrefetchPlan(ctx, d, r, changes[i], held[i], held_rows[i], &plans[i], &taken[i]));
    } else if (r->store && DeviceMapReady(d, r, changes[i].num_new)) {
      TF_RETURN_IF_ERROR(DeviceMapStorePlan(ctx, d, r, changes[i], &plans[i]));
    } else if (r->store) {
      TF_RETURN_IF_ERROR(StartStorePlan(ctx, d, r, changes[i], &plans[i]));
      plans[i].planned = true;
      wait |= PlanReadsBack(*r, changes[i]);
    }
  }
  if (wait) TF_RETURN_IF_ERROR(CudaWait(stream));
  clock.Mark(6);
  std::vector<int64_t> num_new(n);
  for (int i = 0; i < n; ++i) num_new[i] = found[i].num_new;
  if (prefetch) {   // (a prefetched tier has no bound to keep; one whose keys are on the GPU tracks no rows)
    std::vector<const int64_t*> rows(n);
    std::vector<int64_t> marked(n);
    for (int i = 0; i < n; ++i) {
      rows[i] = taken[i].data();
      marked[i] = by_map[i] ? 0 : num_new[i];
    }
    LoadedOfTables(ctx, res, rows, marked);
  } else {
    TF_RETURN_IF_ERROR(FinishStorePlans(ctx, d, res, num_new, &plans));
  }
  clock.Mark(7);
  if (prefetch) return PrefetchMoves(ctx, d, res, changes, &plans);
  for (int i = 0; i < n; ++i) TF_RETURN_IF_ERROR(KeepArraysInStep(ctx, d, res[i], changes[i], nullptr, &plans[i]));
  for (IndexResource* r : res) r->RecordFind(stream);
  return absl::OkStatus();
}
#endif

// The tables `at` of an op over several dynamic tables (indices, then keys), and their keys.
void TablesAt(tf::OpKernelContext* ctx, const std::vector<tf::core::RefCountPtr<IndexResource>>& res,
              const std::vector<int>& at, std::vector<IndexResource*>* tables, std::vector<const tf::Tensor*>* keys) {
  for (int i : at) {
    tables->push_back(res[i].get());
    keys->push_back(&ctx->input(static_cast<int>(res.size()) + i));
  }
}

// TfSokDynamicFindMany: one find (insert) per table; on a GPU the missing-key counts of all
// tables come back in one wait, which Detached lets the step's other ops run beside.
class FindManyOp : public tf::OpKernel {
 public:
  explicit FindManyOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("insert_ratio", &insert_ratio_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    std::vector<tf::core::RefCountPtr<IndexResource>> res;
    std::vector<std::unique_ptr<tf::mutex_lock>> locks;
    TF_SOK_REQUIRES_OK(ctx, LockIndices(ctx, n, "TfSokDynamicFindMany", &res, &locks));
    TensorScratch scratch(ctx);
#if TF_SOK_WITH_CUDA
    if (res[0]->gpu) {
      std::vector<int> all(n);
      for (int i = 0; i < n; ++i) all[i] = i;
      std::vector<IndexResource*> tables;
      std::vector<const tf::Tensor*> keys;
      TablesAt(ctx, res, all, &tables, &keys);
      TF_SOK_REQUIRES_OK(ctx, FindManyOnGpu(ctx, MakeDevice<impl::GpuDevice>(ctx, &scratch), tables, keys,
                                            insert_ratio_, false, nullptr));
      return;
    }
#endif
    const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i].get();
      TF_SOK_REQUIRES(ctx, r->host != nullptr, Failed(*r, ": ", "its index lives on a GPU; look it up there"));
      const tf::Tensor& keys = ctx->input(n + i);
      tf::Tensor* slots = nullptr;
      TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(i, keys.shape(), &slots));
      impl::FindChanges ch;
      const std::string error = r->host->Find(keys.flat<int64_t>().data(), keys.NumElements(), true,
                                              slots->flat<int64_t>().data(), &ch, false, insert_ratio_,
                                              HeldOnHost(r, insert_ratio_), &d.parallel_for);
      TF_SOK_REQUIRES(ctx, error.empty(), Failed(*r, " ", error));
      TF_SOK_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, r, HostChanges(ch, keys.NumElements()), nullptr));
    }
  }

 private:
  float insert_ratio_ = 1.0f;
};

#if TF_SOK_WITH_CUDA
// A stream of a prefetch op's own, with the memory its work uses. TensorFlow's allocator hands out
// memory in the order of its own stream: a block freed by an op whose kernels are still queued there
// is safe for work queued after them on that stream, not for this one. So this stream waits for
// TensorFlow's after each allocation from that allocator (WaitForCompute), scratch comes from an
// arena of this stream's (allocated rarely), and memory is freed only once this stream is idle.
class SideStream : public impl::ScratchAllocator {
 public:
  ~SideStream() override {
    if (stream_ == nullptr) return;
    cudaStreamSynchronize(stream_);
    for (const Chunk& c : chunks_) allocator_->DeallocateRaw(c.base);
    cudaEventDestroy(event_);
    cudaStreamDestroy(stream_);
  }
  // Ready for a call on ctx's device over `tables`: this stream has waited for their last finds (and
  // so for every step queued before them), or, when some other op changed an index since, or this
  // stream's arena is new, for all the work queued on TensorFlow's stream. Not for the step running
  // now: its lookups and updates use rows the prefetch leaves alone.
  absl::Status Begin(tf::OpKernelContext* ctx, cudaStream_t compute, const std::vector<IndexResource*>& tables) {
    if (stream_ == nullptr) {
      allocator_ = ctx->device()->GetAllocator(tf::AllocatorAttributes());
      // the highest priority: the prefetch is a chain of small kernels, each waited for, beside the
      // step's large ones (which its blocks then go ahead of)
      int lowest = 0, highest = 0;
      cudaDeviceGetStreamPriorityRange(&lowest, &highest);
      if (cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, highest) != cudaSuccess ||
          cudaEventCreateWithFlags(&event_, cudaEventDisableTiming) != cudaSuccess)
        return absl::InternalError("TfSokDynamicPrefetch: cannot create a CUDA stream");
    }
    compute_ = compute;
    bool all_found = true;
    for (IndexResource* r : tables) {
      if (r->found_event != nullptr && r->found_call == r->gpu->calls()) {
        cudaStreamWaitEvent(stream_, r->found_event, 0);
      } else {
        all_found = false;
      }
    }
    if (!all_found || fresh_memory_) WaitForCompute();
    fresh_memory_ = false;
    return CudaWait(stream_);   // (the host lists of the last finds, which their copies read, are free too)
  }
  cudaStream_t stream() const { return stream_; }
  void WaitForCompute() {
    cudaEventRecord(event_, compute_);
    cudaStreamWaitEvent(stream_, event_, 0);
  }
  void* Allocate(size_t bytes) override {
    bytes = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    if (!chunks_.empty() && chunks_.back().used + bytes <= chunks_.back().size) {
      Chunk& c = chunks_.back();
      c.used += bytes;
      return static_cast<char*>(c.base) + c.used - bytes;
    }
    const size_t size = std::max(bytes, chunks_.empty() ? size_t{64} << 20 : 2 * chunks_.back().size);
    void* p = allocator_->AllocateRaw(256, size);
    if (p == nullptr) return nullptr;
    WaitForCompute();
    chunks_.push_back({p, size, bytes});
    return p;
  }
  // After a call: the arena is one chunk again, as large as the call needed, for the next call, which
  // waits for this stream before it hands out any of it (Begin): work still queued here (a prefetch's
  // row moves) may go on using it until then. Waits for this stream only to free chunks.
  absl::Status End() {
    absl::Status status;
    if (chunks_.size() > 1) {
      status = CudaWait(stream_);
      size_t total = 0;
      for (const Chunk& c : chunks_) {
        total += c.size;
        allocator_->DeallocateRaw(c.base);
      }
      chunks_.clear();
      void* p = allocator_->AllocateRaw(256, total);
      if (p != nullptr) chunks_.push_back({p, total, 0});
      fresh_memory_ = true;   // (the next Begin waits for TensorFlow's stream)
    }
    for (Chunk& c : chunks_) c.used = 0;
    return status;
  }

 private:
  struct Chunk {
    void* base;
    size_t size, used;
  };
  tf::Allocator* allocator_ = nullptr;
  cudaStream_t stream_ = nullptr, compute_ = nullptr;
  cudaEvent_t event_ = nullptr;
  std::vector<Chunk> chunks_;
  bool fresh_memory_ = false;
};

// An index's persistent memory while a prefetch runs on a SideStream (see there).
class SideStreamMemory : public impl::DeviceMemory {
 public:
  SideStreamMemory(impl::DeviceMemory* inner, SideStream* side) : inner_(inner), side_(side) {}
  void* Allocate(size_t bytes) override {
    void* p = inner_->Allocate(bytes);
    side_->WaitForCompute();
    return p;
  }
  void Free(void* p) override {
    cudaStreamSynchronize(side_->stream());
    inner_->Free(p);
  }

 private:
  impl::DeviceMemory* inner_;
  SideStream* side_;
};
#endif

// TfSokDynamicPrefetch: the rows of keys a later find will use brought into hybrid tables' caches (see
// DynamicIndex::Prefetch). Tables without a host tier, or whose tier has a bound (max_capacity: the
// order in which it drops keys follows the cache's), are left alone. (TF_SOK_REQUIRES: Detached runs
// it on the GPU.)
class PrefetchOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;

  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    std::vector<tf::core::RefCountPtr<IndexResource>> res;
    std::vector<std::unique_ptr<tf::mutex_lock>> locks;
    TF_SOK_REQUIRES_OK(ctx, LockIndices(ctx, n, "TfSokDynamicPrefetch", &res, &locks));
    tf::Tensor* out = nullptr;
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({n}), &out));
    std::vector<int> at;
    for (int i = 0; i < n; ++i) {
      const IndexResource& r = *res[i];
      if (r.store && r.store->max_keys() == 0 && ctx->input(n + i).NumElements() > 0) at.push_back(i);
    }
    std::vector<IndexResource*> tables;
    std::vector<const tf::Tensor*> keys;
    TablesAt(ctx, res, at, &tables, &keys);
    std::vector<int64_t> taken(tables.size(), 0);
    if (!tables.empty()) {
#if TF_SOK_WITH_CUDA
      if (tables[0]->gpu) {
        ComputeGpu(ctx, tables, keys, &taken);
      } else  // NOLINT
#endif
        ComputeCpu(ctx, tables, keys, &taken);
    }
    auto counts = out->flat<int64_t>();
    counts.setZero();
    for (size_t t = 0; t < at.size(); ++t) counts(at[t]) = taken[t];
  }

 private:
  void ComputeCpu(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& tables,
                  const std::vector<const tf::Tensor*>& key_lists, std::vector<int64_t>* taken) {
    TensorScratch scratch(ctx);
    const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
    for (size_t t = 0; t < tables.size(); ++t) {
      IndexResource* r = tables[t];
      TF_SOK_REQUIRES(ctx, r->host != nullptr, Failed(*r, ": ", "its index lives on a GPU; prefetch there"));
      const tf::Tensor& keys = *key_lists[t];
      std::vector<int64_t> slots(keys.NumElements());
      impl::FindChanges ch;
      const std::string error = r->host->Prefetch(keys.flat<int64_t>().data(), keys.NumElements(), slots.data(),
                                                  &ch, HeldOnHost(r, 0.0f), &d.parallel_for);
      TF_SOK_REQUIRES(ctx, error.empty(), Failed(*r, " prefetch: ", error));
      Changes c = HostChanges(ch, keys.NumElements());
      c.prefetch = true;
      const auto arrays = LockArrays({r});
      TF_SOK_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, r, c, nullptr));
      (*taken)[t] = c.num_new;
    }
  }

#if TF_SOK_WITH_CUDA
  void ComputeGpu(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& tables,
                  const std::vector<const tf::Tensor*>& keys, std::vector<int64_t>* taken) {
    tf::mutex_lock l(mu_);   // (one stream and arena per kernel)
    const impl::GpuDevice compute = MakeDevice<impl::GpuDevice>(ctx, nullptr);
    TF_SOK_REQUIRES_OK(ctx, side_.Begin(ctx, static_cast<cudaStream_t>(compute.stream), tables));
    impl::GpuDevice d;
    d.stream = side_.stream();
    d.scratch = &side_;
    std::vector<std::unique_ptr<SideStreamMemory>> memory;
    for (IndexResource* r : tables) {
      memory.push_back(std::make_unique<SideStreamMemory>(r->memory.get(), &side_));
      r->gpu->set_memory(memory.back().get());
    }
    const absl::Status status = FindManyOnGpu(ctx, d, tables, keys, 1.0f, true, taken);
    const absl::Status done = side_.End();
    for (IndexResource* r : tables) r->gpu->set_memory(r->memory.get());
    TF_SOK_REQUIRES_OK(ctx, status);
    TF_SOK_REQUIRES_OK(ctx, done);
  }
  tf::mutex mu_;
  SideStream side_;
#endif
};

// TfSokDynamicRead: the values of keys in several dynamic tables, nothing changed: cached keys' rows
// from the arrays, the rest of a hybrid table's keys read from its host tier in place, keys not held
// their initial value (zeros for tables that admit keys after min_frequency > 1 sightings).
class ReadOp : public tf::OpKernel {
 public:
  explicit ReadOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("dims", &dims_)); }

  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    std::vector<tf::core::RefCountPtr<IndexResource>> res;
    std::vector<std::unique_ptr<tf::mutex_lock>> locks;
    OP_REQUIRES_OK(ctx, LockIndices(ctx, n, "TfSokDynamicRead", &res, &locks));
    std::vector<IndexResource*> tables;
    std::vector<tf::Tensor*> out(n);
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i].get();
      tables.push_back(r);
      OP_REQUIRES(ctx, !r->arrays.empty() && r->arrays[0].values,
                  Failed(*r, ": ", "has no value array attached to read"));
      OP_REQUIRES(ctx, dims_[i] == r->dim,
                  Failed(*r, ": ", "is " + std::to_string(r->dim) + " wide, read as " + std::to_string(dims_[i])));
      const tf::TensorShape shape({ctx->input(n + i).NumElements(), r->dim});
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shape, &out[i]));
    }
    const auto arrays = LockArrays(tables);
    TensorScratch scratch(ctx);
#if TF_SOK_WITH_CUDA
    if (tables[0]->gpu) {
      OP_REQUIRES_OK(ctx, ComputeGpu(ctx, MakeDevice<impl::GpuDevice>(ctx, &scratch), tables, out));
      return;
    }
#endif
    const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
    for (int i = 0; i < n; ++i) {
      IndexResource* r = tables[i];
      OP_REQUIRES(ctx, r->host != nullptr, Failed(*r, ": ", "its index lives on a GPU; read it there"));
      const tf::Tensor& keys = ctx->input(n + i);
      const int64_t count = keys.NumElements();
      const int64_t* k = keys.flat<int64_t>().data();
      std::vector<int64_t> slots(count), store_rows;
      impl::FindChanges ch;
      const std::string error = r->host->Find(k, count, false, slots.data(), &ch, false, 1.0f, {}, &d.parallel_for);
      OP_REQUIRES(ctx, error.empty(), Failed(*r, " ", error));
      if (r->store) {   // the keys not cached looked up in the host tier
        store_rows.resize(count);
        Count(r, count, StoreRowsOfMissing(ctx, {r}, {k}, {slots.data()}, {count}, {store_rows.data()})[0]);
      }
      const float* cache = r->arrays[0].var->tensor()->flat<float>().data();
      float* values = out[i]->flat<float>().data();
      // (on the host's threads: each row a random access into a large array)
      d.parallel_for(count, 50 + 4 * r->dim, [&](int64_t lo, int64_t hi) {
        impl::ReadRows(k + lo, slots.data() + lo, r->store ? store_rows.data() + lo : nullptr, hi - lo, cache, r->dim,
                       r->store ? r->store->base(0) : nullptr, r->store ? r->store->stride() : 0, InitKind(*r), r->a,
                       r->b, r->seed, values + lo * r->dim);
      });
    }
  }

 private:
  // keys not held read their initial value, or zeros when the table admits keys late (as serving does)
  static int InitKind(const IndexResource& r) { return r.min_frequency > 1 ? -1 : r.init_kind; }
  static void Count(IndexResource* r, int64_t reads, int64_t from_host) {
    r->stats.reads += reads;
    r->stats.reads_from_host += from_host;
    r->stats.bytes_read_in_place += from_host * r->dim * static_cast<int64_t>(sizeof(float));
  }
#if TF_SOK_WITH_CUDA
  static void CountGathered(IndexResource* r, int64_t reads, int64_t from_host) {
    r->stats.reads += reads;
    r->stats.reads_from_host += from_host;
    r->stats.bytes_read_gathered += from_host * r->dim * static_cast<int64_t>(sizeof(float));
  }
  // Every table's index probed, the hybrid tables' keys and slots brought to the host (each table's
  // pinned staging: [keys | slots | store rows], then room for gathered rows) with one wait, the keys
  // not cached looked up in all host tiers together (or, the tier's keys on the device, in its map
  // there), their store rows sent back; one read kernel per table. The host link reads random rows in
  // place at a fraction of its copy rate (an access per row), so the rows of a read of many keys not
  // cached are gathered by the host's threads into the staging and copied over contiguous instead.
  absl::Status ComputeGpu(tf::OpKernelContext* ctx, const impl::GpuDevice& d, const std::vector<IndexResource*>& res,
                          const std::vector<tf::Tensor*>& out) {
    const int n = static_cast<int>(res.size());
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    StageClock clock(stream, StageClock::kRead);
    const int64_t gather_min = GatherMinRows();
    std::vector<impl::GpuFindResult> found(n);
    std::vector<int64_t*> staging(n, nullptr);
    std::vector<bool> on_gpu(n, false);   // the keys not cached found in the tier's map on the device
    std::vector<bool> may_gather(n, false);
    auto staging_bytes = [&](const IndexResource& r, int64_t count, bool gather) {
      return (24 + (gather ? 4 * r.dim : 0)) * static_cast<size_t>(count) + (gather ? 64 : 0);
    };
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i];
      if (r->gpu == nullptr) return Failed(*r, ": ", "its index is on the host; read it there");
      const tf::Tensor& keys = ctx->input(n + i);
      const int64_t count = keys.NumElements();
      const std::string error = r->gpu->Find(d, keys.flat<int64_t>().data(), count, false, &found[i]);
      if (!error.empty()) return Failed(*r, " ", error);
      on_gpu[i] = r->store && count > 0 && DeviceMapReady(d, r, 0);
      may_gather[i] = r->store && gather_min >= 0 && count > 0 && count >= gather_min;
      if (!r->store || count == 0 || on_gpu[i]) continue;
      staging[i] = reinterpret_cast<int64_t*>(r->Staging(staging_bytes(*r, count, may_gather[i])));
      if (staging[i] == nullptr) return Failed(*r, ": ", "ran out of host memory");
      cudaMemcpyAsync(staging[i], keys.flat<int64_t>().data(), 8 * count, cudaMemcpyDeviceToHost, stream);
      cudaMemcpyAsync(staging[i] + count, found[i].slots, 8 * count, cudaMemcpyDeviceToHost, stream);
    }
    clock.Mark(StageClock::kReadProbe);
    if (std::any_of(staging.begin(), staging.end(), [](int64_t* p) { return p != nullptr; }))
      TF_RETURN_IF_ERROR(CudaWait(stream));
    clock.Mark(StageClock::kReadWait);
    std::vector<const int64_t*> key_lists(n), slot_lists(n);
    std::vector<int64_t*> row_lists(n);   // each key's store row (-1: cached, or not held)
    std::vector<int64_t> counts(n, 0);
    for (int i = 0; i < n; ++i) {
      if (staging[i] == nullptr) continue;
      counts[i] = ctx->input(n + i).NumElements();
      key_lists[i] = staging[i];
      slot_lists[i] = staging[i] + counts[i];
      row_lists[i] = staging[i] + 2 * counts[i];
    }
    const std::vector<int64_t> held = StoreRowsOfMissing(ctx, res, key_lists, slot_lists, counts, row_lists);
    clock.Mark(StageClock::kReadHostLookups);
    std::vector<int64_t*> store_rows(n, nullptr);   // on the device
    auto read = [&](int i, const float* store, int64_t stride) {
      IndexResource* r = res[i];
      impl::GpuReadRows(d, ctx->input(n + i).flat<int64_t>().data(), found[i].slots, store_rows[i],
                        ctx->input(n + i).NumElements(), r->arrays[0].var->tensor()->flat<float>().data(), r->dim,
                        store, stride, InitKind(*r), r->a, r->b, r->seed, out[i]->flat<float>().data());
    };
    bool wait_rows = false;
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i];
      const tf::Tensor& keys = ctx->input(n + i);
      const int64_t count = keys.NumElements();
      if (on_gpu[i] || staging[i]) {
        store_rows[i] = static_cast<int64_t*>(d.scratch->Allocate(8 * count));
        if (store_rows[i] == nullptr) return Failed(*r, ": ", "out of GPU memory");
      }
      if (on_gpu[i]) {
        int64_t* held_dev = nullptr;   // (a read that may gather counts its rows on the host)
        if (may_gather[i]) {
          staging[i] = reinterpret_cast<int64_t*>(r->Staging(staging_bytes(*r, count, true)));
          if (staging[i] == nullptr) return Failed(*r, ": ", "ran out of host memory");
          row_lists[i] = staging[i] + 2 * count;
          counts[i] = count;
          wait_rows = true;
        } else {
          held_dev = r->reads_from_host_dev;
          if (held_dev == nullptr) {
            held_dev = r->reads_from_host_dev = static_cast<int64_t*>(r->memory->Allocate(8));
            if (held_dev == nullptr) return Failed(*r, ": ", "out of GPU memory");
            cudaMemsetAsync(held_dev, 0, 8, stream);
          }
        }
        const std::string error = r->gpu->StoreMapRowsOfMissing(d, keys.flat<int64_t>().data(), found[i].slots,
                                                                count, store_rows[i], held_dev);
        if (!error.empty()) return Failed(*r, ": ", error);
        if (may_gather[i]) {
          cudaMemcpyAsync(row_lists[i], store_rows[i], 8 * count, cudaMemcpyDeviceToHost, stream);
          continue;
        }
        Count(r, count, 0);
      } else if (staging[i]) {
        if (may_gather[i]) continue;
        // (pinned: the next call to use the staging waits for this stream first)
        cudaMemcpyAsync(store_rows[i], row_lists[i], 8 * count, cudaMemcpyHostToDevice, stream);
        Count(r, count, held[i]);
      }
      read(i, r->store ? r->store->base(0) : nullptr, r->store ? r->store->stride() : 0);
    }
    clock.Mark(StageClock::kReadLaunched);
    if (!std::any_of(may_gather.begin(), may_gather.end(), [](bool g) { return g; })) return absl::OkStatus();
    if (wait_rows) TF_RETURN_IF_ERROR(CudaWait(stream));
    clock.Mark(StageClock::kReadRowsWait);
    std::vector<IndexResource*> g_res;
    std::vector<int64_t> g_n;
    std::vector<int64_t*> g_rows;
    std::vector<float*> g_out;
    std::vector<int> g_table;
    for (int i = 0; i < n; ++i) {
      if (!may_gather[i]) continue;
      g_res.push_back(res[i]);
      g_n.push_back(counts[i]);
      g_rows.push_back(row_lists[i]);
      g_out.push_back(LineAligned(staging[i] + 3 * counts[i]));
      g_table.push_back(i);
    }
    // (each gathered table's rows sent over group by group, as the host's threads gather the rest; the
    // host thread that completes a group sends it, on this call's device)
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return Failed(*g_res[0], ": ", "no current CUDA device");
    std::vector<float*> rows_dev(g_res.size(), nullptr);
    size_t failed = 0;
    GatherHooks hooks;
    hooks.start = [&](size_t g, int64_t m) {
      rows_dev[g] = static_cast<float*>(d.scratch->Allocate(4 * m * g_res[g]->dim));
      failed = g;
      return rows_dev[g] != nullptr;
    };
    hooks.ready = [&](size_t g, int64_t first, int64_t m) {
      const int64_t dim = g_res[g]->dim;
      cudaSetDevice(device);
      cudaMemcpyAsync(rows_dev[g] + first * dim, g_out[g] + first * dim, 4 * m * dim, cudaMemcpyHostToDevice,
                      stream);
    };
    std::vector<bool> gathered;
    bool ok = true;
    const std::vector<int64_t> rows_held =
        GatherStoreRows(ctx, g_res, g_n, g_rows, gather_min, g_out, hooks, &gathered, &ok);
    if (!ok) return Failed(*g_res[failed], ": ", "out of GPU memory");
    clock.Mark(StageClock::kReadGather);
    for (size_t g = 0; g < g_res.size(); ++g) {
      const int i = g_table[g];
      IndexResource* r = res[i];
      const int64_t count = g_n[g], m = rows_held[g];
      // (the rows' places in the gathered rows; or, not gathered, the store rows a host lookup found)
      if (gathered[g] || !on_gpu[i])
        cudaMemcpyAsync(store_rows[i], row_lists[i], 8 * count, cudaMemcpyHostToDevice, stream);
      if (!gathered[g]) {
        Count(r, count, m);
        read(i, r->store->base(0), r->store->stride());
        continue;
      }
      CountGathered(r, count, m);
      read(i, rows_dev[g], r->dim);
    }
    clock.Mark(StageClock::kReadGatheredLaunched);
    return absl::OkStatus();
  }
#endif
  std::vector<int64_t> dims_;
};

template <typename Device>
class RowSplitsValidOp : public tf::OpKernel {
 public:
  explicit RowSplitsValidOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    int n = 0;
    tf::DataType type;
    OP_REQUIRES_OK(c, c->GetAttr("N", &n));
    OP_REQUIRES_OK(c, c->GetAttr("T", &type));
    OP_REQUIRES_OK(c, c->GetAttr("rows", &rows_));
    OP_REQUIRES(c, rows_.empty() || static_cast<int>(rows_.size()) == n,
                absl::InvalidArgumentError(absl::StrCat("rows must be empty or give one bound per feature (", n,
                                                        "), got ", rows_.size())));
    const bool ranged = std::any_of(rows_.begin(), rows_.end(), [](int64_t r) { return r >= 0; });
    OP_REQUIRES(c, !ranged || type == tf::DT_INT64,
                absl::InvalidArgumentError("a range check (rows) needs int64 values, got " +
                                           tf::DataTypeString(type)));
    if (rows_.empty()) rows_.assign(n, -1);
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    tf::Tensor *valid = nullptr, *in_range = nullptr, *offending = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({n}), &valid));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({n}), &in_range));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, tf::TensorShape({n}), &offending));
    Checks c;
    c.splits.resize(n);
    c.values.assign(n, nullptr);
    c.entries.resize(n);
    c.counts.resize(n);
    for (int i = 0; i < n; ++i) {
      const tf::Tensor& s = ctx->input(i);
      OP_REQUIRES(ctx, s.dims() == 1,
                  absl::InvalidArgumentError("row_splits must be a vector, got " + s.shape().DebugString()));
      c.splits[i] = s.flat<int64_t>().data();
      c.entries[i] = s.NumElements();
      c.counts[i] = ctx->input(n + i).NumElements();
      if (rows_[i] >= 0) c.values[i] = ctx->input(n + i).flat<int64_t>().data();
    }
    Check(ctx, c, valid->flat<bool>().data(), in_range->flat<bool>().data(), offending->flat<int64_t>().data());
  }

 private:
  struct Checks {
    std::vector<const int64_t*> splits, values;   // values: of the features with a bound, else nullptr
    std::vector<int64_t> entries, counts;
  };
  void Check(tf::OpKernelContext* ctx, const Checks& c, bool* valid, bool* in_range, int64_t* offending);
  std::vector<int64_t> rows_;
};

template <>
void RowSplitsValidOp<impl::CpuDevice>::Check(tf::OpKernelContext*, const Checks& c, bool* valid, bool* in_range,
                                              int64_t* offending) {
  for (size_t i = 0; i < c.splits.size(); ++i) {
    valid[i] = impl::RowSplitsValid(c.splits[i], c.entries[i], c.counts[i]);
    int64_t lo = 0, hi = 0;
    if (c.values[i] != nullptr && c.counts[i] > 0) {
      const auto [min, max] = std::minmax_element(c.values[i], c.values[i] + c.counts[i]);
      lo = *min;
      hi = *max;
    }
    in_range[i] = lo >= 0 && (c.values[i] == nullptr || c.counts[i] == 0 || hi < rows_[i]);
    offending[i] = in_range[i] ? 0 : (lo < 0 ? lo : hi);
  }
}

#if TF_SOK_WITH_CUDA
template <>
void RowSplitsValidOp<impl::GpuDevice>::Check(tf::OpKernelContext* ctx, const Checks& c, bool* valid,
                                              bool* in_range, int64_t* offending) {
  TensorScratch scratch(ctx);
  const impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
  const int n = static_cast<int>(c.splits.size());
  impl::GpuRowSplitsValid(d, c.splits.data(), c.entries.data(), c.counts.data(), n, valid);
  impl::GpuIdsInRange(d, c.values.data(), c.counts.data(), rows_.data(), n, in_range, offending);
}
#endif

REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_CPU), FindOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFindMany").Device(tf::DEVICE_CPU), FindManyOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicPrefetch").Device(tf::DEVICE_CPU), PrefetchOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicRead").Device(tf::DEVICE_CPU), ReadOp);
REGISTER_KERNEL_BUILDER(Name("TfSokRowSplitsValid").Device(tf::DEVICE_CPU), RowSplitsValidOp<impl::CpuDevice>);
#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_GPU).HostMemory("index"), FindOp);
// (the find waits for the device once: on a thread of its own, so that the step's ops that do not
// need its rows -- other tables' lookups, the dense layers -- are launched meanwhile)
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFindMany").Device(tf::DEVICE_GPU).HostMemory("indices"),
                        Detached<FindManyOp, true>);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicRead").Device(tf::DEVICE_GPU).HostMemory("indices"), ReadOp);
// (on a thread of its own: TensorFlow runs a GPU op's Compute in line with the step's others, which
// would wait for the prefetch's waits)
REGISTER_KERNEL_BUILDER(
    Name("TfSokDynamicPrefetch").Device(tf::DEVICE_GPU).HostMemory("indices").HostMemory("prefetched"),
    Detached<PrefetchOp, true>);
REGISTER_KERNEL_BUILDER(Name("TfSokRowSplitsValid").Device(tf::DEVICE_GPU), RowSplitsValidOp<impl::GpuDevice>);
#endif

}  // namespace
}  // namespace dynamic_kernels
}  // namespace tf_sok
