// The shared upkeep of dynamic tables' row arrays and host tiers (dynamic_rows.h; the records'
// moves over the host link are in dynamic_tier_moves.cc), and the index resource's helpers
// (dynamic_resource.h).
#include "tf_sok/cc/kernels/dynamic_rows.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace tf_sok {
namespace dynamic_kernels {

absl::Status GetIndex(tf::OpKernelContext* ctx, tf::core::RefCountPtr<IndexResource>* out) {
  return tf::LookupResource(ctx, tf::HandleFromInput(ctx, 0), out);
}

absl::Status Failed(const IndexResource& res, const std::string& what, const std::string& error) {
  return absl::InvalidArgumentError("dynamic table '" + res.table + "'" + what + error);
}

std::vector<std::unique_ptr<tf::mutex_lock>> LockArrays(const std::vector<IndexResource*>& tables) {
  std::vector<tf::mutex*> mus;
  for (IndexResource* r : tables)
    for (auto& a : r->arrays) mus.push_back(a.var->mu());
  std::sort(mus.begin(), mus.end());
  mus.erase(std::unique(mus.begin(), mus.end()), mus.end());
  std::vector<std::unique_ptr<tf::mutex_lock>> locks;
  for (tf::mutex* m : mus) locks.push_back(std::make_unique<tf::mutex_lock>(*m));
  return locks;
}

absl::Status GetHybridIndex(tf::OpKernelContext* ctx, tf::core::RefCountPtr<IndexResource>* out) {
  TF_RETURN_IF_ERROR(GetIndex(ctx, out));
  if ((*out)->store == nullptr) return Failed(**out, ": ", "has no host tier (it is not a hybrid table)");
  return absl::OkStatus();
}

void HostVector(tf::OpKernelContext* ctx, int output, const std::vector<int64_t>& v, absl::Status* s) {
  tf::Tensor* t = nullptr;
  *s = ctx->allocate_output(output, tf::TensorShape({static_cast<int64_t>(v.size())}), &t);
  if (s->ok()) std::copy(v.begin(), v.end(), t->flat<int64_t>().data());
}

bool PlanReadsBack(const IndexResource& r, const Changes& c) {
  return c.num_new > 0 || (r.store->max_keys() > 0 && c.num_evicted > 0);
}

// After a call's new keys have store rows and were marked cached (HostStore::Loaded): the keys
// written back are not, and the bound drops the least recently (LFU: often) used others (with
// admission, the cache forgets that it saw them: forget(keys, n) -> "" or an error).
template <typename Forget>
absl::Status TrackCache(IndexResource* res, StorePlan* p, Forget forget) {
  impl::HostStore& store = *res->store;
  if (store.max_keys() <= 0) return absl::OkStatus();
  store.WrittenBack(p->written_back, p->written_back_calls, p->written_back_scores, p->num_written_back);
  std::string error = store.Bound(&p->dropped_keys, &p->dropped_rows);
  if (error.empty() && res->min_frequency > 1 && !p->dropped_keys.empty())
    error = forget(p->dropped_keys.data(), static_cast<int64_t>(p->dropped_keys.size()));
  return error.empty() ? absl::OkStatus() : Failed(*res, " ", error);
}

// The store rows of distinct keys (inserted when absent) into staging [keys | rows | fresh flags].
absl::Status StoreRowsOnHost(tf::OpKernelContext* ctx, IndexResource* res, const int64_t* keys, int64_t n,
                             uint8_t* staging, int64_t* fresh_count) {
  int64_t* rows = reinterpret_cast<int64_t*>(staging + 8 * n);
  uint8_t* fresh = staging + 16 * n;
  TensorScratch scratch(ctx);
  const impl::CpuDevice host = MakeDevice<impl::CpuDevice>(ctx, &scratch);
  const std::string error = res->store->Insert(keys, n, rows, fresh, &host.parallel_for);
  if (!error.empty()) return Failed(*res, ": ", error);
  *fresh_count = 0;
  for (int64_t j = 0; j < n; ++j) *fresh_count += fresh[j];
  return absl::OkStatus();
}

absl::Status StoreRowArray(tf::OpKernelContext*, const impl::CpuDevice&, IndexResource* res, int64_t rows,
                           int64_t** out) {
  if (static_cast<int64_t>(res->store_row_host.size()) < rows) res->store_row_host.resize(rows, 0);
  *out = res->store_row_host.data();
  return absl::OkStatus();
}

absl::Status PlanStore(tf::OpKernelContext* ctx, const impl::CpuDevice& d, IndexResource* res, const Changes& c,
                       StorePlan* p) {
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, c.rows, &p->store_row_of));
  const int64_t n = c.num_new;
  p->written_back = c.evicted_keys;
  p->written_back_calls = c.evicted_touched;
  p->written_back_scores = res->lfu ? c.evicted_scores : nullptr;
  p->num_written_back = c.num_evicted;
  if (!PlanReadsBack(*res, c)) return absl::OkStatus();
  uint8_t* staging = res->Staging(17 * std::max<int64_t>(n, 1));
  std::copy(c.new_keys, c.new_keys + n, reinterpret_cast<int64_t*>(staging));
  TF_RETURN_IF_ERROR(StoreRowsOnHost(ctx, res, reinterpret_cast<int64_t*>(staging), n, staging, &p->fresh_count));
  p->new_rows = reinterpret_cast<const int64_t*>(staging + 8 * n);
  p->fresh = staging + 16 * n;
  res->store->Loaded(p->new_rows, n, res->host->calls());
  return TrackCache(res, p, [res](const int64_t* keys, int64_t k) {
    res->host->ForgetCandidates(keys, k);
    return std::string();
  });
}

void SetStoreRows(const impl::CpuDevice&, int64_t* store_row_of, const int64_t* cache_rows, const int64_t* rows,
                  int64_t n) {
  for (int64_t j = 0; j < n; ++j) store_row_of[cache_rows[j]] = rows[j];
}

// f(i, at, count) over the items [at, at + count) of table i, for every table's n[i] items, on the
// host's threads when they are many (each item random memory accesses in a large map or array).
template <typename F>
void ForItemsOfTables(tf::OpKernelContext* ctx, const std::vector<int64_t>& n, F f) {
  const size_t tables = n.size();
  std::vector<int64_t> start(tables + 1, 0);   // table i's items: [start[i], start[i + 1]) of all
  for (size_t i = 0; i < tables; ++i) start[i + 1] = start[i] + n[i];
  auto run = [&](int64_t begin, int64_t end) {
    for (size_t i = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1; begin < end; ++i) {
      const int64_t stop = std::min(end, start[i + 1]);
      if (stop > begin) f(i, begin - start[i], stop - begin);
      begin = stop;
    }
  };
  TensorScratch scratch(ctx);
  const impl::CpuDevice host = MakeDevice<impl::CpuDevice>(ctx, &scratch);
  if (start.back() > 4096)
    host.parallel_for(start.back(), 200, run);
  else if (start.back() > 0)
    run(0, start.back());
}

// (each chunk of a table's keys: those not cached gathered, looked up in one batch, scattered back)
std::vector<int64_t> StoreRowsOfMissing(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& res,
                                        const std::vector<const int64_t*>& keys,
                                        const std::vector<const int64_t*>& slots, const std::vector<int64_t>& n,
                                        const std::vector<int64_t*>& rows) {
  std::vector<std::atomic<int64_t>> held(res.size());
  for (auto& h : held) h.store(0);
  ForItemsOfTables(ctx, n, [&](size_t i, int64_t at, int64_t count) {
    std::vector<int64_t> missing, where, found;
    for (int64_t j = at; j < at + count; ++j) {
      rows[i][j] = -1;
      if (slots[i][j] >= 0) continue;
      missing.push_back(keys[i][j]);
      where.push_back(j);
    }
    found.resize(missing.size());
    res[i]->store->Rows(missing.data(), static_cast<int64_t>(missing.size()), found.data());
    int64_t in_tier = 0;
    for (size_t m = 0; m < found.size(); ++m) {
      rows[i][where[m]] = found[m];
      in_tier += found[m] >= 0;
    }
    held[i] += in_tier;
  });
  std::vector<int64_t> out(res.size());
  for (size_t i = 0; i < res.size(); ++i) out[i] = held[i].load();
  return out;
}

#if TF_SOK_WITH_CUDA
absl::Status CudaWait(cudaStream_t stream) {
  const cudaError_t e = cudaStreamSynchronize(stream);
  return e == cudaSuccess ? absl::OkStatus() : absl::InternalError(std::string("CUDA error ") + cudaGetErrorString(e));
}

absl::Status ReadCounts(cudaStream_t stream, const int64_t* counts, int n, int64_t* host) {
  cudaMemcpyAsync(host, counts, 8 * static_cast<size_t>(n), cudaMemcpyDeviceToHost, stream);
  return CudaWait(stream);
}

absl::Status StoreRowArray(tf::OpKernelContext*, const impl::GpuDevice& d, IndexResource* res, int64_t rows,
                           int64_t** out) {
  if (rows > res->store_row_capacity) {
    const int64_t capacity = std::max(rows, 2 * res->store_row_capacity);
    auto* fresh = static_cast<int64_t*>(res->memory->Allocate(8 * capacity));
    if (!fresh) return absl::ResourceExhaustedError("dynamic table '" + res->table + "': out of GPU memory");
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    cudaMemsetAsync(fresh, 0, 8 * capacity, stream);
    if (res->store_row_dev) {
      cudaMemcpyAsync(fresh, res->store_row_dev, 8 * res->store_row_capacity, cudaMemcpyDeviceToDevice, stream);
      TF_RETURN_IF_ERROR(CudaWait(stream));   // before the old array goes back to the allocator
      res->memory->Free(res->store_row_dev);
    }
    res->store_row_dev = fresh;
    res->store_row_capacity = capacity;
  }
  *out = res->store_row_dev;
  return absl::OkStatus();
}

// The new keys start back to the host (with a bound on the host tier, the keys written back, their
// last touching calls and LFU scores too); once they are there (the caller waits), FinishStorePlan
// has the host store give their rows (looked up on the host's threads), which go to the device.
// Evicted rows need no lookup (store_row_of has them).
absl::Status StartStorePlan(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res,
                            const Changes& c, StorePlan* p) {
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, c.rows, &p->store_row_of));
  const int64_t n = c.num_new, k = res->store->max_keys() > 0 ? c.num_evicted : 0;
  if (n == 0 && k == 0) return absl::OkStatus();
  const int64_t at = (17 * n + 7) / 8 * 8;   // the written-back lists, 8-byte aligned
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  p->staging = res->Staging(at + 24 * k);
  p->on_device = static_cast<uint8_t*>(d.scratch->Allocate(9 * std::max<int64_t>(n, 1)));
  if (!p->staging || !p->on_device)
    return absl::ResourceExhaustedError("dynamic table '" + res->table + "': out of memory");
  if (n > 0) cudaMemcpyAsync(p->staging, c.new_keys, 8 * n, cudaMemcpyDeviceToHost, stream);
  if (k > 0) {
    auto* lists = reinterpret_cast<int64_t*>(p->staging + at);
    cudaMemcpyAsync(lists, c.evicted_keys, 8 * k, cudaMemcpyDeviceToHost, stream);
    cudaMemcpyAsync(lists + k, c.evicted_touched, 8 * k, cudaMemcpyDeviceToHost, stream);
    if (res->lfu) cudaMemcpyAsync(lists + 2 * k, c.evicted_scores, 8 * k, cudaMemcpyDeviceToHost, stream);
    p->written_back = lists;
    p->written_back_calls = lists + k;
    p->written_back_scores = res->lfu ? lists + 2 * k : nullptr;
    p->num_written_back = k;
  }
  return absl::OkStatus();
}

void StoreRowsOfTables(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& res,
                       const std::vector<const int64_t*>& keys, const std::vector<int64_t>& n,
                       const std::vector<int64_t*>& rows) {
  ForItemsOfTables(ctx, n, [&](size_t i, int64_t at, int64_t count) {
    res[i]->store->Rows(keys[i] + at, count, rows[i] + at);
  });
}

void LoadedOfTables(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& res,
                    const std::vector<const int64_t*>& rows, const std::vector<int64_t>& n) {
  std::vector<std::atomic<int64_t>> added(res.size());
  for (auto& a : added) a.store(0);
  ForItemsOfTables(ctx, n, [&](size_t i, int64_t at, int64_t count) {
    added[i] += res[i]->store->MarkLoaded(rows[i] + at, count, res[i]->gpu->calls());
  });
  for (size_t i = 0; i < res.size(); ++i)
    if (n[i] > 0) res[i]->store->AddCached(added[i].load());   // (tables without a tier have none)
}

// The plans of several tables (num_new[i] new keys each, their keys on the host now): every table's
// keys looked up in its store by the host's threads together (no store changes meanwhile), then each
// table's absent keys added and its store rows and fresh flags sent to the device.
absl::Status FinishStorePlans(tf::OpKernelContext* ctx, const impl::GpuDevice& d,
                              const std::vector<IndexResource*>& res, const std::vector<int64_t>& num_new,
                              std::vector<StorePlan>* plans) {
  const size_t tables = res.size();
  auto keys = [&](size_t i) { return reinterpret_cast<int64_t*>((*plans)[i].staging); };
  auto rows = [&](size_t i) { return reinterpret_cast<int64_t*>((*plans)[i].staging + 8 * num_new[i]); };
  std::vector<const int64_t*> key_lists(tables);
  std::vector<int64_t*> row_lists(tables);
  std::vector<int64_t> counts(tables);
  for (size_t i = 0; i < tables; ++i) {
    counts[i] = (*plans)[i].planned && !(*plans)[i].by_device_map ? num_new[i] : 0;
    key_lists[i] = keys(i);
    row_lists[i] = rows(i);
  }
  StoreRowsOfTables(ctx, res, key_lists, counts, row_lists);
  for (size_t i = 0; i < tables; ++i) {
    StorePlan* p = &(*plans)[i];
    const int64_t n = num_new[i];
    if (!p->planned || p->by_device_map || n == 0) continue;
    uint8_t* fresh = p->staging + 16 * n;
    const std::string error = res[i]->store->AddAbsent(keys(i), n, rows(i), fresh);
    if (!error.empty()) return Failed(*res[i], ": ", error);
    p->fresh_count = std::count(fresh, fresh + n, uint8_t{1});
    cudaMemcpyAsync(p->on_device, p->staging + 8 * n, 9 * n, cudaMemcpyHostToDevice,   // rows, then fresh flags
                    static_cast<cudaStream_t>(d.stream));
    p->new_rows = reinterpret_cast<const int64_t*>(p->on_device);
    p->fresh = p->on_device + 8 * n;
  }
  LoadedOfTables(ctx, res, std::vector<const int64_t*>(row_lists.begin(), row_lists.end()), counts);
  for (size_t i = 0; i < tables; ++i) {
    if (!(*plans)[i].planned || (*plans)[i].by_device_map) continue;   // (a device map's tier has no bound)
    TF_RETURN_IF_ERROR(TrackCache(res[i], &(*plans)[i], [&d, r = res[i]](const int64_t* keys, int64_t k) {
      return r->gpu->ForgetCandidates(d, keys, k);
    }));
  }
  return absl::OkStatus();
}

absl::Status CurrentStoreMap(const impl::GpuDevice& d, IndexResource* res, int64_t adding) {
  const impl::HostStore& store = *res->store;
  if (res->store_map_version == store.version() && res->gpu->store_map_built()) return absl::OkStatus();
  std::vector<int64_t> keys, rows;
  keys.reserve(store.size());
  rows.reserve(store.size());
  for (int64_t r = 0; r < store.rows_used(); ++r) {
    if (!store.alive(r)) continue;
    keys.push_back(store.keys()[r]);
    rows.push_back(r);
  }
  const std::string error =
      res->gpu->StoreMapBuild(d, keys.data(), rows.data(), static_cast<int64_t>(keys.size()), adding);
  if (!error.empty()) return Failed(*res, ": ", error);
  res->store_map_version = store.version();
  return absl::OkStatus();
}

bool DeviceMapReady(const impl::GpuDevice& d, IndexResource* res, int64_t adding) {
  if (!res->store_keys_on_gpu) return false;
  const absl::Status status = CurrentStoreMap(d, res, adding);
  const std::string error = status.ok() ? res->gpu->StoreMapRoom(d, adding) : std::string(status.message());
  if (error.empty()) return true;
  std::fprintf(stderr, "tf_sok: dynamic table '%s' looks its host tier's keys up on the host from now on: its map "
               "of them on the GPU failed (%s)\n", res->table.c_str(), error.c_str());
  res->gpu->StoreMapDrop();
  res->store_keys_on_gpu = false;
  res->store_map_version = -1;
  return false;
}

absl::Status DeviceMapStorePlan(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res,
                                const Changes& c, StorePlan* p) {
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, c.rows, &p->store_row_of));
  p->planned = true;
  const int64_t n = c.num_new;
  if (n == 0) return absl::OkStatus();
  if (res->unsettled) return absl::InternalError("dynamic table '" + res->table + "': a find before it is unsettled");
  std::string error = res->store->ReserveRows(n);   // (the device's rows: [rows used, + n))
  if (!error.empty()) return Failed(*res, ": ", error);
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  const size_t bytes = 16 + 16 * static_cast<size_t>(n);   // [count, -, added keys, added rows]
  if (bytes > res->settle_bytes) {
    if (res->settle_host) res->pinned->Free(res->settle_host);
    res->settle_bytes = std::max(bytes, 2 * res->settle_bytes);
    res->settle_host = static_cast<int64_t*>(res->pinned->Allocate(res->settle_bytes));
    if (!res->settle_host) res->settle_bytes = 0;
  }
  if (res->settle_event == nullptr &&
      cudaEventCreateWithFlags(&res->settle_event, cudaEventDisableTiming) != cudaSuccess)
    res->settle_event = nullptr;
  p->on_device = static_cast<uint8_t*>(d.scratch->Allocate(9 * n));
  auto* lists = static_cast<int64_t*>(d.scratch->Allocate(8 + 16 * n));
  if (!res->settle_host || !res->settle_event || !p->on_device || !lists)
    return absl::ResourceExhaustedError("dynamic table '" + res->table + "': out of memory");
  auto* rows = reinterpret_cast<int64_t*>(p->on_device);
  uint8_t* fresh = p->on_device + 8 * n;
  error = res->gpu->StoreMapRows(d, c.new_keys, n, res->store->rows_used(), rows, fresh, lists + 1, lists + 1 + n,
                                 lists);
  if (!error.empty()) return Failed(*res, ": ", error);
  cudaMemcpyAsync(res->settle_host, lists, 8, cudaMemcpyDeviceToHost, stream);
  cudaMemcpyAsync(res->settle_host + 2, lists + 1, 16 * n, cudaMemcpyDeviceToHost, stream);
  cudaEventRecord(res->settle_event, stream);
  res->unsettled = true;
  res->unsettled_asked = n;
  res->unsettled_row_bytes = res->store->row_bytes();
  p->new_rows = rows;
  p->fresh = fresh;
  p->fresh_count = 0;
  p->by_device_map = true;
  return absl::OkStatus();
}

absl::Status CollectReadCounts(const impl::GpuDevice& d, IndexResource* res) {
  if (res->reads_from_host_dev == nullptr) return absl::OkStatus();
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  int64_t held = 0;
  cudaMemcpyAsync(&held, res->reads_from_host_dev, 8, cudaMemcpyDeviceToHost, stream);
  TF_RETURN_IF_ERROR(CudaWait(stream));
  cudaMemsetAsync(res->reads_from_host_dev, 0, 8, stream);
  res->stats.reads_from_host += held;
  res->stats.bytes_read_in_place += held * res->dim * static_cast<int64_t>(sizeof(float));
  return absl::OkStatus();
}

absl::Status PlanStore(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res, const Changes& c,
                       StorePlan* p) {
  if (DeviceMapReady(d, res, c.num_new)) return DeviceMapStorePlan(ctx, d, res, c, p);
  TF_RETURN_IF_ERROR(StartStorePlan(ctx, d, res, c, p));
  if (PlanReadsBack(*res, c)) TF_RETURN_IF_ERROR(CudaWait(static_cast<cudaStream_t>(d.stream)));
  p->planned = true;
  std::vector<StorePlan> one = {*p};
  TF_RETURN_IF_ERROR(FinishStorePlans(ctx, d, {res}, {c.num_new}, &one));
  *p = one[0];
  return absl::OkStatus();
}

void SetStoreRows(const impl::GpuDevice& d, int64_t* store_row_of, const int64_t* cache_rows, const int64_t* rows,
                  int64_t n) {
  impl::GpuScatter64(d, cache_rows, rows, n, store_row_of);
}
#endif

absl::Status SettleMoves(IndexResource* res) {
#if TF_SOK_WITH_CUDA
  if (!res->moves) return absl::OkStatus();
  const cudaError_t e = cudaEventSynchronize(res->moves.get());
  for (const auto& a : res->arrays) ClearSideWrites(a.var.get());
  res->moves.reset();
  if (e != cudaSuccess)
    return absl::InternalError("dynamic table '" + res->table + "': a prefetch's row moves failed: CUDA error " +
                               cudaGetErrorString(e));
#endif
  return absl::OkStatus();
}

absl::Status SettleStore(IndexResource* res) {
  TF_RETURN_IF_ERROR(SettleMoves(res));
#if TF_SOK_WITH_CUDA
  if (!res->unsettled) return absl::OkStatus();
  const cudaError_t e = cudaEventSynchronize(res->settle_event);
  if (e != cudaSuccess) return absl::InternalError(std::string("CUDA error ") + cudaGetErrorString(e));
  res->unsettled = false;
  const int64_t added = res->settle_host[0], asked = res->unsettled_asked;
  if (added < 0 || added > asked)
    return absl::InternalError("dynamic table '" + res->table + "': its device map added " + std::to_string(added) +
                               " of " + std::to_string(asked) + " keys");
  const bool current = res->store_map_version == res->store->version();
  res->store->AddedOnDevice(res->settle_host + 2, res->settle_host + 2 + asked, added);
  if (current) res->store_map_version = res->store->version();
  res->gpu->StoreMapSize(res->store->size());
  res->stats.fresh += added;
  res->stats.bytes_in -= added * res->unsettled_row_bytes;
#endif
  return absl::OkStatus();
}

template <typename Device>
absl::Status KeepArraysInStep(tf::OpKernelContext* ctx, const Device& d, IndexResource* res, const Changes& c,
                              float* evicted_values, StorePlan* given) {
  StorePlan local;
  StorePlan& plan = given ? *given : local;
  const bool moves = res->store && (c.num_new > 0 || c.num_evicted > 0);
  if (res->store && !plan.planned) TF_RETURN_IF_ERROR(PlanStore(ctx, d, res, c, &plan));
  if (res->store) {
    const int64_t row_bytes = res->store->row_bytes();
    IndexResource::Stats& st = res->stats;
    if (c.prefetch) {
      st.prefetched += c.num_new;
    } else {
      ++st.calls;
      st.lookups += c.positions;
      st.misses += c.missing_positions;
    }
    st.loaded += c.num_new;
    st.fresh += plan.fresh_count;
    st.evicted += c.num_evicted;
    st.dropped += static_cast<int64_t>(plan.dropped_keys.size());
    st.bytes_in += (c.num_new - plan.fresh_count) * row_bytes;
    st.bytes_out += c.num_evicted * row_bytes;
  }
  // every array locked for the call (a prefetch's caller holds them)
  std::vector<std::unique_ptr<tf::mutex_lock>> locks;
  if (!c.prefetch) locks = LockArrays({res});
  impl::StoreRecordLayout layout;
  if (moves) {
    layout.arrays = static_cast<int>(res->arrays.size());
    layout.stride = res->store->stride();
    layout.touched = c.evicted_touched;   // (the evicted keys' store marks, and LFU's scores)
    layout.scores = res->lfu ? c.evicted_scores : nullptr;
    layout.beside = c.prefetch;
  }
  for (size_t i = 0; i < res->arrays.size(); ++i) {
    auto& a = res->arrays[i];
    tf::Tensor* t = a.var->tensor();
    const int64_t width = t->dims() == 2 ? t->dim_size(1) : 1;
    if (a.values && evicted_values != nullptr && c.num_evicted > 0)
      GatherRows(d, t->flat<float>().data(), width, c.evicted_slots, c.num_evicted, evicted_values);
    const bool unchanged = c.num_new == 0 && t->dim_size(0) >= c.rows && !a.values;
    // (a prefetch writes in place: its rows are none a running step reads or writes; grown arrays keep
    // the rows evicted keys leave, which the moves below write back)
    if (!unchanged && !c.prefetch) TF_RETURN_IF_ERROR(GrowArray(ctx, d, *res, a, c.rows));
    if (c.prefetch && t->dim_size(0) < c.rows)
      return absl::InternalError("dynamic table '" + res->table + "': a prefetch would grow the arrays");
    float* base = a.var->tensor()->flat<float>().data();
    // row 0, which keys not inserted read (an update may have moved it)
    if (a.values && !c.prefetch) Fill(d, base, width, 0.0f);
    if (moves) {
      if (width != res->store->width(static_cast<int>(i)))
        return absl::InternalError("dynamic table '" + res->table + "': an attached array's rows changed " +
                                          "width (" + std::to_string(res->store->width(static_cast<int>(i))) +
                                          " -> " + std::to_string(width) + ")");
      layout.offset[i] = res->store->offset(static_cast<int>(i));
      layout.width[i] = width;
      layout.cache[i] = base;
    } else if (unchanged) {
      continue;
    } else if (a.values && !c.values_given) {
      InitialRowsAt(d, *res, c.new_keys, c.new_slots, c.num_new, width, base);
    } else {
      FillRows(d, base, width, c.new_slots, c.num_new, a.values ? 0.0f : a.fill);
    }
  }
  if (moves) {
    const uint8_t* fresh = plan.fresh_count > 0 || plan.by_device_map ? plan.fresh : nullptr;
    TF_RETURN_IF_ERROR(MoveRecords(ctx, d, res, layout, c.evicted_slots, plan.store_row_of, c.num_evicted,
                                   plan.new_rows, fresh, c.new_slots, c.num_new, res->store->device_records()));
    for (size_t i = 0; fresh != nullptr && i < res->arrays.size(); ++i)
      StoreFresh(d, *res, res->arrays[i], layout.width[i], fresh, c.new_keys, c.new_slots, c.num_new,
                 layout.cache[i]);
  }
  // the keys taken in count on from the LFU scores they left with
  if (moves && res->lfu && plan.fresh_count < c.num_new)
    AddStoreScores(d, res, res->store->device_records(), c.new_slots, plan.new_rows,
                   plan.fresh_count > 0 || plan.by_device_map ? plan.fresh : nullptr, c.num_new);
  if (moves && c.num_new > 0) SetStoreRows(d, plan.store_row_of, c.new_slots, plan.new_rows, c.num_new);
  return absl::OkStatus();
}

Changes HostChanges(const impl::FindChanges& ch, int64_t positions) {
  Changes c;
  c.positions = positions;
  c.rows = ch.rows;
  c.missing_positions = ch.missing_positions;
  c.new_keys = ch.new_keys.data();
  c.new_slots = ch.new_slots.data();
  c.num_new = static_cast<int64_t>(ch.new_slots.size());
  c.evicted_keys = ch.evicted_keys.data();
  c.evicted_slots = ch.evicted_slots.data();
  c.evicted_touched = ch.evicted_touched.data();
  c.evicted_scores = ch.evicted_scores.data();
  c.num_evicted = static_cast<int64_t>(ch.evicted_slots.size());
  return c;
}

#if TF_SOK_WITH_CUDA
Changes DeviceChanges(const impl::GpuFindResult& r, int64_t positions) {
  Changes c;
  c.positions = positions;
  c.rows = r.rows;
  c.missing_positions = r.missing_positions;
  c.new_keys = r.new_keys;
  c.new_slots = r.new_slots;
  c.num_new = r.num_new;
  c.evicted_keys = r.evicted_keys;
  c.evicted_slots = r.evicted_slots;
  c.evicted_touched = r.evicted_touched;
  c.evicted_scores = r.evicted_scores;
  c.num_evicted = r.num_evicted;
  return c;
}
#endif

absl::Status ExportIndex(tf::OpKernelContext* ctx, IndexResource* res, impl::DynamicIndexSnapshot* snap) {
#if TF_SOK_WITH_CUDA
  if (res->gpu) {
    TensorScratch scratch(ctx);
    const std::string error = res->gpu->Export(MakeDevice<impl::GpuDevice>(ctx, &scratch), snap);
    return error.empty() ? absl::OkStatus() : Failed(*res, ": exporting its index: ", error);
  }
#endif
  *snap = res->host->Export();
  return absl::OkStatus();
}

absl::Status ImportIndex(tf::OpKernelContext* ctx, IndexResource* res, const impl::DynamicIndexSnapshot& snap) {
  std::string error;
#if TF_SOK_WITH_CUDA
  if (res->gpu) {
    TensorScratch scratch(ctx);
    error = res->gpu->Import(MakeDevice<impl::GpuDevice>(ctx, &scratch), snap);
  } else {
    error = res->host->Import(snap);
  }
#else
  error = res->host->Import(snap);
#endif
  return error.empty() ? absl::OkStatus() : Failed(*res, ": restoring its index: ", error);
}

template absl::Status KeepArraysInStep<impl::CpuDevice>(tf::OpKernelContext*, const impl::CpuDevice&, IndexResource*,
                                                        const Changes&, float*, StorePlan*);
#if TF_SOK_WITH_CUDA
template absl::Status KeepArraysInStep<impl::GpuDevice>(tf::OpKernelContext*, const impl::GpuDevice&, IndexResource*,
                                                        const Changes&, float*, StorePlan*);
#endif

}  // namespace dynamic_kernels
}  // namespace tf_sok
