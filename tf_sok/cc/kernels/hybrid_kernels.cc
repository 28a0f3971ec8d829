// Kernels of a hybrid table's host tier: its rows written back (Flush) and relinked after a
// restore, its cache counters, the host link's bandwidth, and the tier's export, touched keys and
// import (checkpoints read through the cache).
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "tf_sok/cc/kernels/dynamic_rows.h"

namespace tf_sok {
namespace dynamic_kernels {
namespace {

// Host lists of n int64 each where device `d` reads them, in `out`: on the host as they are; on a
// GPU copied into the call's scratch memory (ordered before the work queued after them).
absl::Status ListsForDevice(const impl::CpuDevice&, const IndexResource&, const std::vector<const int64_t*>& lists,
                            int64_t, std::vector<const int64_t*>* out) {
  *out = lists;
  return absl::OkStatus();
}
int64_t IndexRows(const impl::CpuDevice&, const IndexResource& res) { return res.host->rows(); }
absl::Status Done(const impl::CpuDevice&) { return absl::OkStatus(); }
#if TF_SOK_WITH_CUDA
absl::Status ListsForDevice(const impl::GpuDevice& d, const IndexResource& res,
                            const std::vector<const int64_t*>& lists, int64_t n, std::vector<const int64_t*>* out) {
  auto* buffer = static_cast<int64_t*>(d.scratch->Allocate(8 * lists.size() * std::max<int64_t>(n, 1)));
  if (!buffer) return absl::ResourceExhaustedError("dynamic table '" + res.table + "': out of GPU memory");
  out->clear();
  for (size_t i = 0; i < lists.size(); ++i) {
    if (n > 0)
      cudaMemcpyAsync(buffer + i * n, lists[i], 8 * n, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(d.stream));
    out->push_back(buffer + i * n);
  }
  return absl::OkStatus();
}
int64_t IndexRows(const impl::GpuDevice&, const IndexResource& res) { return res.gpu->rows(); }
absl::Status Done(const impl::GpuDevice& d) { return CudaWait(static_cast<cudaStream_t>(d.stream)); }
#endif

// Writes the cached rows of a hybrid table (snapshot `snap` of its cache) back to its host store.
template <typename Device>
absl::Status WriteCacheBack(tf::OpKernelContext* ctx, const Device& d, IndexResource* res,
                            const impl::DynamicIndexSnapshot& snap) {
  const int64_t n = static_cast<int64_t>(snap.keys.size());
  int64_t* store_row_of = nullptr;
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, IndexRows(d, *res), &store_row_of));
  std::vector<const int64_t*> slots;
  TF_RETURN_IF_ERROR(ListsForDevice(d, *res, {snap.slots.data()}, n, &slots));
  for (size_t i = 0; i < res->arrays.size(); ++i) {
    tf::mutex_lock l(*res->arrays[i].var->mu());
    const tf::Tensor* t = res->arrays[i].var->tensor();
    StoreWrite(d, t->flat<float>().data(), res->store->width(i), slots[0], store_row_of, n, res->store->base(i),
               res->store->stride());
  }
  return Done(d);
}

// Every cached key's store row (`rows`, per snapshot key) recorded for its cache row.
template <typename Device>
absl::Status SetCacheStoreRows(tf::OpKernelContext* ctx, const Device& d, IndexResource* res,
                               const impl::DynamicIndexSnapshot& snap, const int64_t* rows) {
  const int64_t n = static_cast<int64_t>(snap.keys.size());
  int64_t* store_row_of = nullptr;
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, IndexRows(d, *res), &store_row_of));
  std::vector<const int64_t*> lists;
  TF_RETURN_IF_ERROR(ListsForDevice(d, *res, {snap.slots.data(), rows}, n, &lists));
  SetStoreRows(d, store_row_of, lists[0], lists[1], n);
  return Done(d);
}

// Writes every cached row of a hybrid table back to its host store (the rows stay cached).
absl::Status Flush(tf::OpKernelContext* ctx, IndexResource* res) {
  impl::DynamicIndexSnapshot snap;
  TF_RETURN_IF_ERROR(ExportIndex(ctx, res, &snap));
  TensorScratch scratch(ctx);
#if TF_SOK_WITH_CUDA
  if (res->gpu) return WriteCacheBack(ctx, MakeDevice<impl::GpuDevice>(ctx, &scratch), res, snap);
#endif
  return WriteCacheBack(ctx, MakeDevice<impl::CpuDevice>(ctx, &scratch), res, snap);
}

}  // namespace

// After the store or the cache was replaced: the store row of every cached key (added to the store
// when absent, at its fills: the cache's rows are written back there before they are read);
// store_replaced, with admission: the store's keys not cached are counted as held.
absl::Status RelinkCache(tf::OpKernelContext* ctx, IndexResource* res, bool store_replaced) {
  impl::DynamicIndexSnapshot snap;
  TF_RETURN_IF_ERROR(ExportIndex(ctx, res, &snap));
  const int64_t n = static_cast<int64_t>(snap.keys.size());
  uint8_t* staging = res->Staging(17 * std::max<int64_t>(n, 1));
  if (!staging) return absl::ResourceExhaustedError("dynamic table '" + res->table + "': out of host memory");
  int64_t fresh = 0;
  TF_RETURN_IF_ERROR(StoreRowsOnHost(ctx, res, snap.keys.data(), n, staging, &fresh));
  const auto* rows = reinterpret_cast<const int64_t*>(staging + 8 * n);
  const impl::HostStore& store = *res->store;
  res->store->SetCached(rows, n);
  if (res->min_frequency > 1 && store_replaced) {
    // admission: the keys of the host tier not cached are held (admitted at once when they come
    // back); keys still waiting keep their counts
    std::vector<uint8_t> cached(store.rows_used(), 0);
    for (int64_t j = 0; j < n; ++j) cached[rows[j]] = 1;
    impl::KeyMap held(1024);
    std::vector<int64_t> keys, counts;
    for (int64_t r = 0; r < store.rows_used(); ++r) {
      if (!store.alive(r) || cached[r]) continue;
      held.Put(store.keys()[r], 1);
      keys.push_back(store.keys()[r]);
      counts.push_back(impl::kHeldCount);
    }
    for (size_t j = 0; j < snap.candidate_keys.size(); ++j) {
      if (snap.candidate_counts[j] >= impl::kHeldCount || held.Get(snap.candidate_keys[j], 0)) continue;
      keys.push_back(snap.candidate_keys[j]);
      counts.push_back(snap.candidate_counts[j]);
    }
    if (keys != snap.candidate_keys || counts != snap.candidate_counts) {
      snap.candidate_keys = std::move(keys);
      snap.candidate_counts = std::move(counts);
      TF_RETURN_IF_ERROR(ImportIndex(ctx, res, snap));
    }
  }
  TensorScratch scratch(ctx);
#if TF_SOK_WITH_CUDA
  if (res->gpu) return SetCacheStoreRows(ctx, MakeDevice<impl::GpuDevice>(ctx, &scratch), res, snap, rows);
#endif
  return SetCacheStoreRows(ctx, MakeDevice<impl::CpuDevice>(ctx, &scratch), res, snap, rows);
}

namespace {

class CacheStatsOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetHybridIndex(ctx, &res));
    tf::Tensor* out = nullptr;
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, SettleStore(res.get()));
#if TF_SOK_WITH_CUDA
    if (res->gpu && ctx->op_device_context() != nullptr) {   // (placed on the table's GPU)
      TensorScratch scratch(ctx);
      OP_REQUIRES_OK(ctx, CollectReadCounts(MakeDevice<impl::GpuDevice>(ctx, &scratch), res.get()));
    }
#endif
    const IndexResource::Stats& st = res->stats;
    const int64_t v[] = {st.calls,   st.lookups,  st.misses,    st.loaded,  st.fresh,      st.evicted,
                         st.bytes_in, st.bytes_out, st.dropped, st.prefetched, st.reads, st.reads_from_host,
                         st.bytes_read_in_place, st.bytes_read_gathered, st.bytes_in_gathered};
    constexpr int64_t kCount = sizeof(v) / sizeof(v[0]);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({kCount}), &out));
    std::copy(v, v + kCount, out->flat<int64_t>().data());
  }
};

class HostLinkBandwidthOp : public tf::OpKernel {
 public:
  explicit HostLinkBandwidthOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("bytes", &bytes_));
    OP_REQUIRES_OK(c, c->GetAttr("repeats", &repeats_));
    gpu_ = c->device_type() == tf::DeviceType(tf::DEVICE_GPU);
  }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({4}), &out));
#if TF_SOK_WITH_CUDA
    if (gpu_) {
      tf::Tensor buffer;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_FLOAT, tf::TensorShape({bytes_ / 4}), &buffer));
      TensorScratch scratch(ctx);
      const std::string error = impl::GpuHostLinkBandwidth(MakeDevice<impl::GpuDevice>(ctx, &scratch),
                                                           buffer.flat<float>().data(), bytes_, repeats_,
                                                           out->flat<double>().data());
      OP_REQUIRES(ctx, error.empty(), absl::InternalError("host link measurement: " + error));
      return;
    }
#endif
    ctx->CtxFailure(absl::InvalidArgumentError(
        "TfSokHostLinkBandwidth measures the link between host memory and a GPU: place it on a GPU"));
  }

 private:
  int64_t bytes_ = 0;
  int repeats_ = 3;
  bool gpu_ = false;
};

// A hybrid table's store rows `picked` (every key's when null) as outputs keys [n], rows [n, sum of
// the arrays' widths] and widths, after the cached rows were written back (Flush); and, where the op
// has a fourth output, scores [n]: score_of_row[r] of each (0 without score_of_row).
absl::Status StoreRowsOut(tf::OpKernelContext* ctx, const impl::HostStore& store, const std::vector<int64_t>* picked,
                          const std::vector<int64_t>* score_of_row = nullptr) {
  std::vector<int64_t> every;
  if (!picked) {
    for (int64_t r = 0; r < store.rows_used(); ++r)
      if (store.alive(r)) every.push_back(r);
    picked = &every;
  }
  const int64_t n = static_cast<int64_t>(picked->size());
  int64_t total = 0;
  for (int i = 0; i < store.num_arrays(); ++i) total += store.width(i);
  tf::Tensor *keys = nullptr, *rows = nullptr, *widths = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, tf::TensorShape({n}), &keys));
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, tf::TensorShape({n, total}), &rows));
  TF_RETURN_IF_ERROR(ctx->allocate_output(2, tf::TensorShape({store.num_arrays()}), &widths));
  auto row = [&](int64_t j) { return (*picked)[j]; };
  for (int64_t j = 0; j < n; ++j) keys->flat<int64_t>()(j) = store.keys()[row(j)];
  if (ctx->num_outputs() > 3) {
    tf::Tensor* scores = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(3, tf::TensorShape({n}), &scores));
    for (int64_t j = 0; j < n; ++j) scores->flat<int64_t>()(j) = score_of_row ? (*score_of_row)[row(j)] : 0;
  }
  float* out = rows->flat<float>().data();
  for (int i = 0, at = 0; i < store.num_arrays(); at += store.width(i), ++i) {
    widths->flat<int64_t>()(i) = store.width(i);
    const int64_t w = store.width(i);
    const float* base = store.base(i);
    const int64_t stride = store.stride();
    for (int64_t j = 0; j < n; ++j) std::copy(base + row(j) * stride, base + row(j) * stride + w, out + j * total + at);
  }
  return absl::OkStatus();
}

class StoreExportOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetHybridIndex(ctx, &res));
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, SettleStore(res.get()));
    OP_REQUIRES_OK(ctx, Flush(ctx, res.get()));
    const impl::HostStore& store = *res->store;
    const bool bounded = store.max_keys() > 0;
    if (!bounded && !res->lfu) {
      OP_REQUIRES_OK(ctx, StoreRowsOut(ctx, store, nullptr));
      return;
    }
    impl::DynamicIndexSnapshot snap;
    OP_REQUIRES_OK(ctx, ExportIndex(ctx, res.get(), &snap));
    std::vector<int64_t> cached_rows(snap.keys.size());
    store.Rows(snap.keys.data(), static_cast<int64_t>(snap.keys.size()), cached_rows.data());
    // an LFU table's counts: the cache's of the keys cached, those the others were written back with
    std::vector<int64_t> score_of_row;
    if (res->lfu) {
      score_of_row.resize(store.rows_used());
      for (int64_t r = 0; r < store.rows_used(); ++r) score_of_row[r] = store.score(r);
      for (size_t j = 0; j < snap.keys.size(); ++j)
        if (cached_rows[j] >= 0) score_of_row[cached_rows[j]] = snap.scores[j];
    }
    const std::vector<int64_t>* scores = res->lfu ? &score_of_row : nullptr;
    if (!bounded) {
      OP_REQUIRES_OK(ctx, StoreRowsOut(ctx, store, nullptr, scores));
      return;
    }
    // a bounded store's keys in the order its bound drops them (restored so): those not cached in
    // that order, then the cached ones by (cache score, key)
    std::vector<uint8_t> cached(store.rows_used(), 0);
    std::vector<std::tuple<int64_t, int64_t, int64_t>> hot;   // (score, key, row)
    for (size_t j = 0; j < snap.keys.size(); ++j) {
      if (cached_rows[j] < 0) continue;
      cached[cached_rows[j]] = 1;
      hot.emplace_back(snap.scores[j], snap.keys[j], cached_rows[j]);
    }
    std::vector<std::tuple<int64_t, int64_t, int64_t>> cold;  // (mark, key, row)
    for (int64_t r = 0; r < store.rows_used(); ++r)
      if (store.alive(r) && !cached[r]) cold.emplace_back(store.order(r), store.keys()[r], r);
    std::sort(cold.begin(), cold.end());
    std::sort(hot.begin(), hot.end());
    std::vector<int64_t> picked;
    for (const auto& c : cold) picked.push_back(std::get<2>(c));
    for (const auto& h : hot) picked.push_back(std::get<2>(h));
    OP_REQUIRES_OK(ctx, StoreRowsOut(ctx, store, &picked, scores));
  }
};

class StoreTouchedSinceOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetHybridIndex(ctx, &res));
    const tf::Tensor& since = ctx->input(1);
    OP_REQUIRES(ctx, since.dims() == 0, Failed(*res, ": ", "since must be a scalar (ns since the epoch)"));
    const int64_t unix_ns = since.scalar<int64_t>()();
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, SettleStore(res.get()));
    OP_REQUIRES_OK(ctx, Flush(ctx, res.get()));   // (on a GPU: waits, so the kernels' marks are in)
    std::vector<int64_t> cached_keys, cache_rows;
    int64_t first = 0;
#if TF_SOK_WITH_CUDA
    if (res->gpu) {
      TensorScratch scratch(ctx);
      const std::string error = res->gpu->TouchedSince(MakeDevice<impl::GpuDevice>(ctx, &scratch), unix_ns,
                                                       &cached_keys, &cache_rows);
      OP_REQUIRES(ctx, error.empty(), Failed(*res, ": reading its touched keys: ", error));
      first = res->gpu->FirstCallAtOrAfter(unix_ns);
    }
#endif
    if (res->host) {
      res->host->TouchedSince(unix_ns, &cached_keys, &cache_rows);
      first = res->host->FirstCallAtOrAfter(unix_ns);
    }
    const impl::HostStore& store = *res->store;
    std::vector<uint8_t> pick(store.rows_used(), 0);
    for (int64_t r = 0; r < store.rows_used(); ++r) pick[r] = store.alive(r) && store.mark(r) >= first;
    std::vector<int64_t> rows(cached_keys.size());
    store.Rows(cached_keys.data(), static_cast<int64_t>(cached_keys.size()), rows.data());
    for (int64_t r : rows)
      if (r >= 0) pick[r] = 1;
    std::vector<int64_t> picked;
    for (int64_t r = 0; r < store.rows_used(); ++r)
      if (pick[r]) picked.push_back(r);
    OP_REQUIRES_OK(ctx, StoreRowsOut(ctx, store, &picked));
  }
};

class StoreImportOp : public tf::OpKernel {
 public:
  explicit StoreImportOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("clear_cache", &clear_cache_));
  }
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetHybridIndex(ctx, &res));
    const tf::Tensor& keys = ctx->input(1);
    const tf::Tensor& rows = ctx->input(2);
    const tf::Tensor& scores = ctx->input(3);
    const int64_t given = scores.NumElements();
    OP_REQUIRES(ctx, scores.dims() == 1 && (given == 0 || given == keys.NumElements()),
                Failed(*res, ": restoring its host tier: ", "expected scores [0] or [" +
                       std::to_string(keys.NumElements()) + "], got " + scores.shape().DebugString()));
    for (int64_t j = 0; j < given; ++j)
      OP_REQUIRES(ctx, scores.flat<int64_t>()(j) >= 0,
                  Failed(*res, ": restoring its host tier: ", "key " + std::to_string(keys.flat<int64_t>()(j)) +
                         " has the negative count " + std::to_string(scores.flat<int64_t>()(j))));
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, SettleStore(res.get()));
    impl::HostStore& store = *res->store;
    int64_t total = 0;
    for (int i = 0; i < store.num_arrays(); ++i) total += store.width(i);
    const int64_t n = keys.NumElements();
    OP_REQUIRES(ctx, keys.dims() == 1 && rows.dims() == 2 && rows.dim_size(0) == n && rows.dim_size(1) == total,
                Failed(*res, ": restoring its host tier: ", "expected keys [n] and rows [n, " + std::to_string(total) +
                       "], got " + keys.shape().DebugString() + " and " + rows.shape().DebugString()));
    if (clear_cache_) {
      impl::DynamicIndexSnapshot snap;
      OP_REQUIRES_OK(ctx, ExportIndex(ctx, res.get(), &snap));
      snap.keys.clear();
      snap.slots.clear();
      snap.scores.clear();
      OP_REQUIRES_OK(ctx, ImportIndex(ctx, res.get(), snap));
    }
#if TF_SOK_WITH_CUDA
    if (res->gpu) {   // the device is done with the store before it is rewritten
      TensorScratch scratch(ctx);
      OP_REQUIRES_OK(ctx, CudaWait(static_cast<cudaStream_t>(MakeDevice<impl::GpuDevice>(ctx, &scratch).stream)));
    }
#endif
    std::vector<const float*> data;   // array i's rows: `total` floats apart in the input
    for (int i = 0, at = 0; i < store.num_arrays(); at += store.width(i), ++i)
      data.push_back(rows.flat<float>().data() + at);
    const std::string error = store.Replace(keys.flat<int64_t>().data(), n, data, total,
                                            res->lfu && given > 0 ? scores.flat<int64_t>().data() : nullptr);
    OP_REQUIRES(ctx, error.empty(), Failed(*res, ": restoring its host tier: ", error));
    OP_REQUIRES_OK(ctx, RelinkCache(ctx, res.get(), true));
  }

 private:
  bool clear_cache_ = true;
};

REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreExport").Device(tf::DEVICE_CPU), StoreExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreTouchedSince").Device(tf::DEVICE_CPU), StoreTouchedSinceOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicCacheStats").Device(tf::DEVICE_CPU), CacheStatsOp);
REGISTER_KERNEL_BUILDER(Name("TfSokHostLinkBandwidth").Device(tf::DEVICE_CPU), HostLinkBandwidthOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreImport").Device(tf::DEVICE_CPU), StoreImportOp);

#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreExport")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("keys")
                            .HostMemory("rows")
                            .HostMemory("widths")
                            .HostMemory("scores"),
                        StoreExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreTouchedSince")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("since")
                            .HostMemory("keys")
                            .HostMemory("rows")
                            .HostMemory("widths"),
                        StoreTouchedSinceOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicCacheStats").Device(tf::DEVICE_GPU).HostMemory("index").HostMemory("stats"),
                        CacheStatsOp);
REGISTER_KERNEL_BUILDER(Name("TfSokHostLinkBandwidth").Device(tf::DEVICE_GPU).HostMemory("gbps"), HostLinkBandwidthOp);
REGISTER_KERNEL_BUILDER(
    Name("TfSokDynamicStoreImport").Device(tf::DEVICE_GPU).HostMemory("index").HostMemory("keys").HostMemory("rows")
        .HostMemory("scores"),
    StoreImportOp);
#endif

}  // namespace
}  // namespace dynamic_kernels
}  // namespace tf_sok
