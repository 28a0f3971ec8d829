// Kernels of the find ops of dynamic tables (TfSokDynamicFind, TfSokDynamicFindMany) and of the
// row-splits check: keys to rows, inserting, evicting and admitting, the arrays kept in step.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tf_sok/cc/kernels/dynamic_find.h"

namespace tf_sok {
namespace dynamic_kernels {

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

void TablesAt(tf::OpKernelContext* ctx, const std::vector<tf::core::RefCountPtr<IndexResource>>& res,
              const std::vector<int>& at, std::vector<IndexResource*>* tables, std::vector<const tf::Tensor*>* keys) {
  for (int i : at) {
    tables->push_back(res[i].get());
    keys->push_back(&ctx->input(static_cast<int>(res.size()) + i));
  }
}

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
namespace {
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
}  // namespace

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

namespace {

absl::Status EvictedOutputs(tf::OpKernelContext* ctx, const IndexResource& res, int64_t n, tf::Tensor** keys,
                            tf::Tensor** values) {
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, tf::TensorShape({n}), keys));
  return ctx->allocate_output(2, tf::TensorShape({n, res.dim}), values);
}

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


class FindOp : public tf::OpKernel {
 public:
  explicit FindOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("insert", &insert_));
    OP_REQUIRES_OK(c, c->GetAttr("with_evicted", &with_evicted_));
    OP_REQUIRES_OK(c, c->GetAttr("admit_all", &admit_all_));
    OP_REQUIRES_OK(c, c->GetAttr("insert_ratio", &insert_ratio_));
    OP_REQUIRES_OK(c, c->GetAttr("values_given", &values_given_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    const tf::Tensor& keys = ctx->input(1);
    OP_REQUIRES(ctx, keys.dims() == 1,
                Failed(*res, ": ", "keys must be a vector, got shape " + keys.shape().DebugString()));
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
    Changes changes = HostChanges(ch, keys.NumElements());
    changes.values_given = values_given_;
    OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, res.get(), changes,
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
    Changes changes = DeviceChanges(r, keys.NumElements());
    changes.values_given = values_given_;
    OP_REQUIRES_OK(ctx,
                   KeepArraysInStep(ctx, d, res, changes, evicted > 0 ? ev_values->flat<float>().data() : nullptr));
    res->RecordFind(stream);
    clock.Mark(7);
  }
#endif
  bool insert_ = true, with_evicted_ = false, admit_all_ = false, values_given_ = false;
  float insert_ratio_ = 1.0f;
};


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
REGISTER_KERNEL_BUILDER(Name("TfSokRowSplitsValid").Device(tf::DEVICE_CPU), RowSplitsValidOp<impl::CpuDevice>);
#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_GPU).HostMemory("index"), FindOp);
// (the find waits for the device once: on a thread of its own, so that the step's ops that do not
// need its rows -- other tables' lookups, the dense layers -- are launched meanwhile)
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFindMany").Device(tf::DEVICE_GPU).HostMemory("indices"),
                        Detached<FindManyOp, true>);
REGISTER_KERNEL_BUILDER(Name("TfSokRowSplitsValid").Device(tf::DEVICE_GPU), RowSplitsValidOp<impl::GpuDevice>);
#endif

}  // namespace
}  // namespace dynamic_kernels
}  // namespace tf_sok
