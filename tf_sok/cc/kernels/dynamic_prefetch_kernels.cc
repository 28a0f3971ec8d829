// Kernels of the prefetch op of dynamic tables (TfSokDynamicPrefetch): the rows of keys a later find
// will use brought into hybrid tables' caches, on the GPU on a stream of the op's own beside the step.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tf_sok/cc/kernels/dynamic_find.h"

namespace tf_sok {
namespace dynamic_kernels {

#if TF_SOK_WITH_CUDA
namespace {
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

}  // namespace

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

#endif

namespace {

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

REGISTER_KERNEL_BUILDER(Name("TfSokDynamicPrefetch").Device(tf::DEVICE_CPU), PrefetchOp);
#if TF_SOK_WITH_CUDA
// (on a thread of its own: TensorFlow runs a GPU op's Compute in line with the step's others, which
// would wait for the prefetch's waits)
REGISTER_KERNEL_BUILDER(
    Name("TfSokDynamicPrefetch").Device(tf::DEVICE_GPU).HostMemory("indices").HostMemory("prefetched"),
    Detached<PrefetchOp, true>);
#endif

}  // namespace
}  // namespace dynamic_kernels
}  // namespace tf_sok
