// Kernels of the dynamic-table ops. The key -> row index is a resource in host
// memory (CPU kernels) or in GPU memory (GPU kernels: keys and rows stay on the
// device); the rows it hands out index the table's value and state arrays, which
// the lookup and optimizer kernels read and update like a static table's.
#include <algorithm>
#include <tuple>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/platform/mutex.h"
#include "tf_sok/cc/impl/dynamic_index.h"
#include "tf_sok/cc/impl/host_store.h"
#include "tf_sok/cc/impl/optimizer.h"
#include "tf_sok/cc/kernels/kernel_util.h"

#if TF_SOK_WITH_CUDA
#include <cuda_runtime.h>

#include "tf_sok/cc/impl/dynamic_index_gpu.h"
#endif

namespace tf_sok {
namespace {

namespace tf = ::tensorflow;

#if TF_SOK_WITH_CUDA
// Persistent GPU memory of an index, from TensorFlow's allocator of the device.
class AllocatorMemory : public impl::DeviceMemory {
 public:
  explicit AllocatorMemory(tf::Allocator* a) : a_(a) {}
  void* Allocate(size_t bytes) override { return a_->AllocateRaw(256, std::max<size_t>(bytes, 1)); }
  void Free(void* p) override { a_->DeallocateRaw(p); }

 private:
  tf::Allocator* a_;
};
#endif

class IndexResource : public tf::ResourceBase {
 public:
  IndexResource(const std::string& table, int64_t dim, int init_kind, float a, float b, int64_t seed)
      : table(table), dim(dim), init_kind(init_kind), a(a), b(b), seed(seed) {}
  std::string DebugString() const override { return "tf_sok dynamic index of table '" + table + "'"; }

  const std::string table;
  const int64_t dim;
  const int init_kind;
  const float a, b;
  const int64_t seed;
  tf::mutex mu;
  // the row arrays the index serves: the values, then optimizer state as optimizers attach it
  struct Array {
    tf::core::RefCountPtr<tf::Var> var;
    float fill;
    bool values;
  };
  std::vector<Array> arrays;
  std::unique_ptr<impl::DynamicIndex> host;  // one of the two
  // hybrid tables: the HBM budget of the arrays, and every key's rows of every array (one store
  // array per attached array, in the same order)
  int64_t cache_bytes = -1;
  int64_t min_frequency = 1;   // admission: sightings a key new to the table needs
  std::unique_ptr<impl::HostStore> store;
  // a hybrid table's counters since it was made: finds with insert, key positions looked up, those
  // not cached, keys taken into the cache, of them first seen, keys written back, bytes each way
  struct Stats {
    int64_t calls = 0, lookups = 0, misses = 0, loaded = 0, fresh = 0, evicted = 0, bytes_in = 0, bytes_out = 0;
    int64_t dropped = 0;   // keys the host tier's bound (max_capacity) dropped from the table
  } stats;
  std::vector<uint8_t> staging_host;  // key and row lists (pinned on a GPU: staging_pinned)
  // per cache row: the store row of the key it holds (a GPU index: store_row_dev, device memory)
  std::vector<int64_t> store_row_host;
  int64_t* store_row_dev = nullptr;
  int64_t store_row_capacity = 0;
#if TF_SOK_WITH_CUDA
  std::unique_ptr<impl::DeviceMemory> memory;
  std::unique_ptr<impl::GpuDynamicIndex> gpu;  // destroyed before `memory`
  std::unique_ptr<impl::HostMemory> pinned;
  void* staging_pinned = nullptr;
  size_t staging_bytes = 0;
  ~IndexResource() override {
    gpu.reset();
    if (staging_pinned) pinned->Free(staging_pinned);
    if (store_row_dev) memory->Free(store_row_dev);
  }
#endif
  // host memory for `bytes` of key / row lists, reused by the next call (which first waits for the
  // device's use of it to end)
  uint8_t* Staging(size_t bytes) {
#if TF_SOK_WITH_CUDA
    if (gpu) {
      if (bytes > staging_bytes) {
        if (staging_pinned) pinned->Free(staging_pinned);
        staging_bytes = std::max(bytes, 2 * staging_bytes);
        staging_pinned = pinned->Allocate(staging_bytes);
        if (!staging_pinned) staging_bytes = 0;
      }
      return static_cast<uint8_t*>(staging_pinned);
    }
#endif
    if (staging_host.size() < bytes) staging_host.resize(bytes);
    return staging_host.data();
  }
  // A hybrid table's bound on cached keys: the budget over the bytes of one row of every array.
  void UpdateCacheBound() {
    if (cache_bytes < 0) return;
    int64_t row_bytes = 0;
    for (const Array& a : arrays) {
      const tf::Tensor* t = a.var->tensor();
      row_bytes += 4 * (t->dims() == 2 ? t->dim_size(1) : 1);
    }
    int64_t max_keys = row_bytes > 0 ? cache_bytes / row_bytes : 0;
    // no more than the table may hold: its bound drops keys the cache wrote back
    if (store && store->max_keys() > 0) max_keys = std::min(max_keys, store->max_keys());
#if TF_SOK_WITH_CUDA
    if (gpu) {
      gpu->set_max_keys(max_keys);
      return;
    }
#endif
    host->set_max_keys(max_keys);
  }
};

class IndexOp : public tf::OpKernel {
 public:
  explicit IndexOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    std::string evict, init;
    OP_REQUIRES_OK(c, c->GetAttr("container", &container_));
    OP_REQUIRES_OK(c, c->GetAttr("shared_name", &shared_name_));
    OP_REQUIRES_OK(c, c->GetAttr("table_name", &table_));
    OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(c, c->GetAttr("init_rows", &config_.init_rows));
    OP_REQUIRES_OK(c, c->GetAttr("max_keys", &config_.max_keys));
    OP_REQUIRES_OK(c, c->GetAttr("min_frequency", &config_.min_frequency));
    OP_REQUIRES_OK(c, c->GetAttr("evict", &evict));
    OP_REQUIRES_OK(c, c->GetAttr("initializer", &init));
    OP_REQUIRES_OK(c, c->GetAttr("init_a", &a_));
    OP_REQUIRES_OK(c, c->GetAttr("init_b", &b_));
    OP_REQUIRES_OK(c, c->GetAttr("seed", &seed_));
    OP_REQUIRES_OK(c, c->GetAttr("cache_bytes", &cache_bytes_));
    config_.cache = cache_bytes_ >= 0;
    if (config_.cache) {   // a hybrid table's max_keys bounds its host tier; the cache's bound is its budget
      store_max_keys_ = config_.max_keys;
      config_.table_max_keys = config_.max_keys;
      config_.max_keys = 0;
    }
    config_.evict = evict == "lru" ? impl::Evict::kLru : evict == "lfu" ? impl::Evict::kLfu : impl::Evict::kNone;
    kind_ = init == "uniform" ? 0 : init == "normal" ? 1 : init == "truncated_normal" ? 2 : 3;
    if (shared_name_.empty()) shared_name_ = name();
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::ResourceHandle handle = tf::MakeResourceHandle<IndexResource>(ctx, container_, shared_name_);
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, tf::LookupOrCreateResource<IndexResource>(ctx, handle, &res, [&](IndexResource** out) {
      auto* r = new IndexResource(table_, dim_, kind_, a_, b_, seed_);
      r->cache_bytes = cache_bytes_;
      r->min_frequency = config_.min_frequency;
#if TF_SOK_WITH_CUDA
      if (ctx->device()->device_type() == tf::DEVICE_GPU) {
        r->memory = std::make_unique<AllocatorMemory>(ctx->device()->GetAllocator(tf::AllocatorAttributes()));
        r->gpu = std::make_unique<impl::GpuDynamicIndex>(config_, r->memory.get());
        r->pinned = impl::NewPinnedHostMemory();
        if (cache_bytes_ >= 0) {
          r->store = std::make_unique<impl::HostStore>(impl::NewPinnedHostMemory());
          r->store->set_max_keys(store_max_keys_);
        }
        *out = r;
        return absl::OkStatus();
      }
#endif
      if (cache_bytes_ >= 0) {
        r->store = std::make_unique<impl::HostStore>(impl::NewPlainHostMemory());
        r->store->set_max_keys(store_max_keys_);
      }
      r->host = std::make_unique<impl::DynamicIndex>(config_);
      *out = r;
      return absl::OkStatus();
    }));
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out));
    out->scalar<tf::ResourceHandle>()() = handle;
  }

 private:
  std::string container_, shared_name_, table_;
  impl::DynamicIndexConfig config_;
  int64_t dim_ = 0, seed_ = 0, cache_bytes_ = -1, store_max_keys_ = 0;
  int kind_ = 0;
  float a_ = 0, b_ = 0;
};

absl::Status GetIndex(tf::OpKernelContext* ctx, tf::core::RefCountPtr<IndexResource>* out) {
  return tf::LookupResource(ctx, tf::HandleFromInput(ctx, 0), out);
}

absl::Status Failed(const IndexResource& res, const std::string& what, const std::string& error) {
  return absl::InvalidArgumentError("dynamic table '" + res.table + "'" + what + error);
}

// The index of input 0, which must be a hybrid table's (one with a host tier).
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

// The row upkeep of impl, on the host or the device.
void InitialRowsAt(const impl::CpuDevice&, const IndexResource& r, const int64_t* keys, const int64_t* rows, int64_t n,
                   int64_t width, float* base) {
  impl::InitialRowsAt(r.init_kind, r.a, r.b, r.seed, keys, rows, n, width, base);
}
void FillRows(const impl::CpuDevice&, float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  impl::FillRows(base, width, rows, n, fill);
}
void GatherRows(const impl::CpuDevice&, const float* base, int64_t width, const int64_t* rows, int64_t n, float* out) {
  impl::GatherRows(base, width, rows, n, out);
}
void Fill(const impl::CpuDevice&, float* p, int64_t count, float value) { impl::Fill(p, count, value); }
void StoreWrite(const impl::CpuDevice&, const float* cache, int64_t width, const int64_t* cache_rows,
                const int64_t* store_row_of, int64_t n, float* store) {
  impl::StoreWrite(cache, width, cache_rows, store_row_of, n, store);
}
void StoreMarks(const impl::CpuDevice&, const int64_t* cache_rows, const int64_t* calls, const int64_t* store_row_of,
                int64_t n, int64_t* marks) {
  impl::StoreMarks(cache_rows, calls, store_row_of, n, marks);
}
// Evicted rows leave for the store: on the host written now (*out = nullptr); on a GPU gathered into
// device memory (*out), to be written by StoreRead's launch while it reads the new rows in.
absl::Status WriteBack(const impl::CpuDevice&, const float* cache, int64_t width, const int64_t* cache_rows,
                       const int64_t* store_row_of, int64_t n, float* store, float** out) {
  impl::StoreWrite(cache, width, cache_rows, store_row_of, n, store);
  *out = nullptr;
  return absl::OkStatus();
}
// The rows of new keys read from the store (or set to their initial value / fill when fresh); on a
// GPU, the rows WriteBack gathered (`evicted`, of cache rows evicted_slots) written back in the same
// launch, so that the host link carries both directions at once.
void StoreRead(const impl::CpuDevice&, const IndexResource& r, const IndexResource::Array& a, float* store,
               int64_t width, const int64_t* store_rows, const uint8_t* fresh, const int64_t* keys,
               const int64_t* cache_rows, int64_t n, float* cache, const float* /*evicted*/,
               const int64_t* /*evicted_slots*/, const int64_t* /*store_row_of*/, int64_t /*num_evicted*/) {
  impl::StoreRead(store, width, store_rows, fresh, keys, cache_rows, n, a.values ? r.init_kind : -1, r.a, r.b, r.seed,
                  a.fill, cache);
}
#if TF_SOK_WITH_CUDA
void StoreWrite(const impl::GpuDevice& d, const float* cache, int64_t width, const int64_t* cache_rows,
                const int64_t* store_row_of, int64_t n, float* store) {
  impl::GpuStoreWrite(d, cache, width, cache_rows, store_row_of, n, store);
}
void StoreMarks(const impl::GpuDevice& d, const int64_t* cache_rows, const int64_t* calls, const int64_t* store_row_of,
                int64_t n, int64_t* marks) {
  impl::GpuStoreMarks(d, cache_rows, calls, store_row_of, n, marks);
}
absl::Status WriteBack(const impl::GpuDevice& d, const float* cache, int64_t width, const int64_t* cache_rows,
                       const int64_t* store_row_of, int64_t n, float* store, float** out) {
  *out = static_cast<float*>(d.scratch->Allocate(sizeof(float) * static_cast<size_t>(n * width)));
  if (*out == nullptr) return absl::ResourceExhaustedError("out of GPU memory for the rows a hybrid table evicts");
  impl::GpuGatherRows(d, cache, width, cache_rows, n, *out);
  return absl::OkStatus();
}
void StoreRead(const impl::GpuDevice& d, const IndexResource& r, const IndexResource::Array& a, float* store,
               int64_t width, const int64_t* store_rows, const uint8_t* fresh, const int64_t* keys,
               const int64_t* cache_rows, int64_t n, float* cache, const float* evicted, const int64_t* evicted_slots,
               const int64_t* store_row_of, int64_t num_evicted) {
  impl::GpuStoreMove(d, evicted, evicted_slots, store_row_of, evicted != nullptr ? num_evicted : 0, store_rows, fresh,
                     keys, cache_rows, n, width, a.values ? r.init_kind : -1, r.a, r.b, r.seed, a.fill, store, cache);
}
void InitialRowsAt(const impl::GpuDevice& d, const IndexResource& r, const int64_t* keys, const int64_t* rows,
                   int64_t n, int64_t width, float* base) {
  impl::GpuInitialRowsAt(d, r.init_kind, r.a, r.b, r.seed, keys, rows, n, width, base);
}
void FillRows(const impl::GpuDevice& d, float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  impl::GpuFillRows(d, base, width, rows, n, fill);
}
void GatherRows(const impl::GpuDevice& d, const float* base, int64_t width, const int64_t* rows, int64_t n,
                float* out) {
  impl::GpuGatherRows(d, base, width, rows, n, out);
}
void Fill(const impl::GpuDevice& d, float* p, int64_t count, float value) { impl::GpuFill(d, p, count, value); }
#endif

// An attached array grown to `rows` rows (new rows at its fill; values: zeros until a key's row is set).
template <typename Device>
absl::Status GrowArray(tf::OpKernelContext* ctx, const Device& d, const IndexResource& res,
                       const IndexResource::Array& a, int64_t rows) {
  tf::Tensor* t = a.var->tensor();
  if (!a.var->is_initialized || t->dtype() != tf::DT_FLOAT || t->dims() < 1 || t->dims() > 2)
    return absl::InvalidArgumentError("dynamic table '" + res.table + "': an attached array must be an initialized "
                                      "float32 variable [rows] or [rows, width], got " + t->shape().DebugString());
  if (t->dim_size(0) >= rows) return MakeExclusive(ctx, d, a.var.get());
  tf::TensorShape shape = t->shape();
  shape.set_dim(0, rows);
  tf::Tensor fresh;
  tf::AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_FLOAT, shape, &fresh, attr));
  const int64_t old = t->NumElements();
  if (old > 0) impl::DeviceCopy<Device>(d, fresh.data(), t->data(), t->TotalBytes());
  Fill(d, fresh.flat<float>().data() + old, fresh.NumElements() - old, a.values ? 0.0f : a.fill);
  *t = fresh;
  return absl::OkStatus();
}

// What one index call changed (device memory for GPU indices, host memory for CPU ones).
struct Changes {
  int64_t rows = 0;  // the row count the arrays must have now
  int64_t positions = 0, missing_positions = 0;
  const int64_t* new_keys = nullptr;
  const int64_t* new_slots = nullptr;
  int64_t num_new = 0;
  const int64_t* evicted_keys = nullptr;
  const int64_t* evicted_slots = nullptr;
  const int64_t* evicted_touched = nullptr;
  int64_t num_evicted = 0;
};

// A hybrid table's store rows for a call's new keys (fresh: the store had no row for the key yet),
// in memory the call's device reads, and its per-cache-row store rows.
struct StorePlan {
  const int64_t* new_rows = nullptr;
  const uint8_t* fresh = nullptr;
  int64_t* store_row_of = nullptr;
  int64_t fresh_count = 0;
  bool planned = false;
  uint8_t* staging = nullptr;     // on a GPU: [new keys | their store rows | fresh flags] on the host
  uint8_t* on_device = nullptr;   // [store rows | fresh flags] on the device
  // a bounded host tier: the keys the cache wrote back and their last touching calls (on a GPU, in
  // staging after the new keys' lists), and the keys the bound dropped from the table, with their rows
  const int64_t* written_back = nullptr;
  const int64_t* written_back_calls = nullptr;
  int64_t num_written_back = 0;
  std::vector<int64_t> dropped_keys, dropped_rows;
};

// Whether the store plan of a call needs the device's lists on the host (new keys; with a bound,
// the keys written back too).
bool PlanReadsBack(const IndexResource& r, const Changes& c) {
  return c.num_new > 0 || (r.store->max_keys() > 0 && c.num_evicted > 0);
}

// After a call's new keys have store rows: they are cached, the keys written back are not, and the
// bound drops the least recently used others (with admission, the cache forgets that it saw them:
// forget(keys, n) -> "" or an error).
template <typename Forget>
absl::Status TrackCache(IndexResource* res, const int64_t* new_rows, int64_t n, int64_t call, StorePlan* p,
                        Forget forget) {
  impl::HostStore& store = *res->store;
  store.Loaded(new_rows, n, call);
  if (store.max_keys() <= 0) return absl::OkStatus();
  store.WrittenBack(p->written_back, p->written_back_calls, p->num_written_back);
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
  p->num_written_back = c.num_evicted;
  if (!PlanReadsBack(*res, c)) return absl::OkStatus();
  uint8_t* staging = res->Staging(17 * std::max<int64_t>(n, 1));
  std::copy(c.new_keys, c.new_keys + n, reinterpret_cast<int64_t*>(staging));
  TF_RETURN_IF_ERROR(StoreRowsOnHost(ctx, res, reinterpret_cast<int64_t*>(staging), n, staging, &p->fresh_count));
  p->new_rows = reinterpret_cast<const int64_t*>(staging + 8 * n);
  p->fresh = staging + 16 * n;
  return TrackCache(res, p->new_rows, n, res->host->calls(), p, [res](const int64_t* keys, int64_t k) {
    res->host->ForgetCandidates(keys, k);
    return std::string();
  });
}

void SetStoreRows(const impl::CpuDevice&, int64_t* store_row_of, const int64_t* cache_rows, const int64_t* rows,
                  int64_t n) {
  for (int64_t j = 0; j < n; ++j) store_row_of[cache_rows[j]] = rows[j];
}

#if TF_SOK_WITH_CUDA
absl::Status CudaWait(cudaStream_t stream) {
  const cudaError_t e = cudaStreamSynchronize(stream);
  return e == cudaSuccess ? absl::OkStatus() : absl::InternalError(std::string("CUDA error ") + cudaGetErrorString(e));
}

// n counts the device left at `counts`, read back (one wait)
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

// The new keys start back to the host (with a bound on the host tier, the keys written back and
// their last touching calls too); once they are there (the caller waits), FinishStorePlan has the
// host store give their rows (looked up on the host's threads), which go to the device. Evicted
// rows need no lookup (store_row_of has them).
absl::Status StartStorePlan(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res,
                            const Changes& c, StorePlan* p) {
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, c.rows, &p->store_row_of));
  const int64_t n = c.num_new, k = res->store->max_keys() > 0 ? c.num_evicted : 0;
  if (n == 0 && k == 0) return absl::OkStatus();
  const int64_t at = (17 * n + 7) / 8 * 8;   // the written-back lists, 8-byte aligned
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  p->staging = res->Staging(at + 16 * k);
  p->on_device = static_cast<uint8_t*>(d.scratch->Allocate(9 * std::max<int64_t>(n, 1)));
  if (!p->staging || !p->on_device)
    return absl::ResourceExhaustedError("dynamic table '" + res->table + "': out of memory");
  if (n > 0) cudaMemcpyAsync(p->staging, c.new_keys, 8 * n, cudaMemcpyDeviceToHost, stream);
  if (k > 0) {
    auto* lists = reinterpret_cast<int64_t*>(p->staging + at);
    cudaMemcpyAsync(lists, c.evicted_keys, 8 * k, cudaMemcpyDeviceToHost, stream);
    cudaMemcpyAsync(lists + k, c.evicted_touched, 8 * k, cudaMemcpyDeviceToHost, stream);
    p->written_back = lists;
    p->written_back_calls = lists + k;
    p->num_written_back = k;
  }
  return absl::OkStatus();
}

// The plans of several tables (num_new[i] new keys each, their keys on the host now): every table's
// keys looked up in its store by the host's threads together (no store changes meanwhile), then each
// table's absent keys added and its store rows and fresh flags sent to the device.
absl::Status FinishStorePlans(tf::OpKernelContext* ctx, const impl::GpuDevice& d,
                              const std::vector<IndexResource*>& res, const std::vector<int64_t>& num_new,
                              std::vector<StorePlan>* plans) {
  const size_t tables = res.size();
  std::vector<int64_t> start(tables + 1, 0);   // table i's keys: [start[i], start[i + 1]) of all
  for (size_t i = 0; i < tables; ++i) start[i + 1] = start[i] + ((*plans)[i].planned ? num_new[i] : 0);
  auto keys = [&](size_t i) { return reinterpret_cast<int64_t*>((*plans)[i].staging); };
  auto rows = [&](size_t i) { return reinterpret_cast<int64_t*>((*plans)[i].staging + 8 * num_new[i]); };
  auto lookup = [&](int64_t begin, int64_t end) {
    for (size_t i = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1; begin < end; ++i) {
      const int64_t stop = std::min(end, start[i + 1]), at = begin - start[i];
      if (stop > begin) res[i]->store->Rows(keys(i) + at, stop - begin, rows(i) + at);
      begin = stop;
    }
  };
  TensorScratch scratch(ctx);
  const impl::CpuDevice host = MakeDevice<impl::CpuDevice>(ctx, &scratch);
  if (start.back() > 4096)
    host.parallel_for(start.back(), 200, lookup);
  else if (start.back() > 0)
    lookup(0, start.back());
  for (size_t i = 0; i < tables; ++i) {
    StorePlan* p = &(*plans)[i];
    const int64_t n = num_new[i];
    if (!p->planned) continue;
    if (n > 0) {
      uint8_t* fresh = p->staging + 16 * n;
      const std::string error = res[i]->store->AddAbsent(keys(i), n, rows(i), fresh);
      if (!error.empty()) return Failed(*res[i], ": ", error);
      p->fresh_count = std::count(fresh, fresh + n, uint8_t{1});
      cudaMemcpyAsync(p->on_device, p->staging + 8 * n, 9 * n, cudaMemcpyHostToDevice,   // rows, then fresh flags
                      static_cast<cudaStream_t>(d.stream));
      p->new_rows = reinterpret_cast<const int64_t*>(p->on_device);
      p->fresh = p->on_device + 8 * n;
    }
    TF_RETURN_IF_ERROR(TrackCache(res[i], n > 0 ? rows(i) : nullptr, n, res[i]->gpu->calls(), p,
                                  [&d, r = res[i]](const int64_t* keys, int64_t k) {
                                    return r->gpu->ForgetCandidates(d, keys, k);
                                  }));
  }
  return absl::OkStatus();
}

absl::Status PlanStore(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res, const Changes& c,
                       StorePlan* p) {
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

// After an index call: every attached array grown to `c.rows` and the rows of new keys set (hybrid
// tables: evicted rows written to the host store first, new keys' rows read from it);
// evicted_values (when given): the evicted rows' values, read before anything is written.
// planned: the store plan when the caller made it (several tables' with one wait).
template <typename Device>
absl::Status KeepArraysInStep(tf::OpKernelContext* ctx, const Device& d, IndexResource* res, const Changes& c,
                              float* evicted_values, StorePlan* given = nullptr) {
  StorePlan local;
  StorePlan& plan = given ? *given : local;
  const bool moves = res->store && (c.num_new > 0 || c.num_evicted > 0);
  if (res->store && !plan.planned) TF_RETURN_IF_ERROR(PlanStore(ctx, d, res, c, &plan));
  if (res->store) {
    int64_t row_bytes = 0;
    for (int i = 0; i < res->store->num_arrays(); ++i) row_bytes += 4 * res->store->width(i);
    IndexResource::Stats& st = res->stats;
    ++st.calls;
    st.lookups += c.positions;
    st.misses += c.missing_positions;
    st.loaded += c.num_new;
    st.fresh += plan.fresh_count;
    st.evicted += c.num_evicted;
    st.dropped += static_cast<int64_t>(plan.dropped_keys.size());
    st.bytes_in += (c.num_new - plan.fresh_count) * row_bytes;
    st.bytes_out += c.num_evicted * row_bytes;
  }
  for (size_t i = 0; i < res->arrays.size(); ++i) {
    auto& a = res->arrays[i];
    tf::mutex_lock l(*a.var->mu());
    tf::Tensor* t = a.var->tensor();
    const int64_t width = t->dims() == 2 ? t->dim_size(1) : 1;
    if (a.values && evicted_values != nullptr && c.num_evicted > 0)
      GatherRows(d, t->flat<float>().data(), width, c.evicted_slots, c.num_evicted, evicted_values);
    float* evicted = nullptr;   // written back before new keys take the rows (on a GPU, as they are read in)
    if (moves && c.num_evicted > 0)
      TF_RETURN_IF_ERROR(WriteBack(d, t->flat<float>().data(), width, c.evicted_slots, plan.store_row_of,
                                   c.num_evicted, res->store->base(i), &evicted));
    const bool unchanged = c.num_new == 0 && t->dim_size(0) >= c.rows && !a.values;
    if (!unchanged) TF_RETURN_IF_ERROR(GrowArray(ctx, d, *res, a, c.rows));
    float* base = a.var->tensor()->flat<float>().data();
    if (a.values) Fill(d, base, width, 0.0f);   // row 0, which keys not inserted read (an update may have moved it)
    if (moves)
      StoreRead(d, *res, a, res->store->base(i), width, plan.new_rows, plan.fresh, c.new_keys, c.new_slots,
                unchanged ? 0 : c.num_new, base, evicted, c.evicted_slots, plan.store_row_of, c.num_evicted);
    else if (unchanged)
      continue;
    else if (a.values)
      InitialRowsAt(d, *res, c.new_keys, c.new_slots, c.num_new, width, base);
    else
      FillRows(d, base, width, c.new_slots, c.num_new, a.fill);
  }
  // the evicted keys' store marks: the call that last touched each (before their cache rows go to new keys)
  if (moves && c.num_evicted > 0)
    StoreMarks(d, c.evicted_slots, c.evicted_touched, plan.store_row_of, c.num_evicted, res->store->marks());
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
  c.num_evicted = r.num_evicted;
  return c;
}
#endif

absl::Status EvictedOutputs(tf::OpKernelContext* ctx, const IndexResource& res, int64_t n, tf::Tensor** keys,
                            tf::Tensor** values) {
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, tf::TensorShape({n}), keys));
  return ctx->allocate_output(2, tf::TensorShape({n, res.dim}), values);
}

#if TF_SOK_WITH_CUDA
// With TF_SOK_FIND_STAGES=1 in the environment, the GPU finds (one table, or many) time their
// stages on the host (kernel launches, each wait for counts, the host store's lookups; a last wait
// takes the device's remaining work) and print their means to stderr every 20 calls: where a
// dynamic or hybrid table's step goes. The extra wait changes the overlap it measures; for
// profiling only.
class StageClock {
 public:
  static constexpr int kStages = 9;
  StageClock(cudaStream_t stream, bool many, bool active = true)
      : stream_(stream), on_(active && Enabled()), many_(many) {
    if (on_) last_ = Now();
  }
  void Mark(int stage) {
    if (!on_) return;
    const double now = Now();
    Totals(many_).ms[stage] += now - last_;
    last_ = now;
  }
  ~StageClock() {
    if (!on_) return;
    cudaStreamSynchronize(stream_);
    Mark(kStages - 1);
    Sums& t = Totals(many_);
    if (++t.calls % 20 != 0) return;
    static const char* names[kStages] = {"probe",          "wait missing",           "distinct",
                                         "wait distinct",  "room",                   "wait evictable",
                                         "commit + wait new keys", "host store lookups / array upkeep launched",
                                         "arrays + device tail"};
    std::fprintf(stderr, "tf_sok %s stages (ms per call, mean of 20):", many_ ? "find-many" : "find");
    for (int i = 0; i < kStages; ++i) std::fprintf(stderr, " %s %.3f;", names[i], t.ms[i] / 20);
    std::fprintf(stderr, "\n");
    t = Sums();
  }

 private:
  struct Sums {
    double ms[kStages] = {};
    int64_t calls = 0;
  };
  static bool Enabled() {
    static const bool on = [] {
      const char* v = std::getenv("TF_SOK_FIND_STAGES");
      return v != nullptr && v[0] == '1';
    }();
    return on;
  }
  static Sums& Totals(bool many) {
    static Sums sums[2];
    return sums[many ? 1 : 0];
  }
  static double Now() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  cudaStream_t stream_;
  bool on_, many_;
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
  impl::GatherRows(res.store->base(0), res.dim, plan.dropped_rows.data(), n, values->flat<float>().data());
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
  impl::GpuGatherRows(d, res.store->base(0), res.dim, rows, n, values->flat<float>().data());
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
// As HeldOnHost for an index on the GPU: the keys come to the host (a wait) and the flags go back.
impl::HeldKeys HeldOnGpu(const impl::GpuDevice& d, IndexResource* res, float insert_ratio) {
  if (!res->store || insert_ratio >= 1.0f) return {};
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
    tf::mutex_lock l(res->mu);
    const std::string error = res->host->Find(keys.flat<int64_t>().data(), keys.NumElements(), insert_,
                                              slots->flat<int64_t>().data(), &ch, admit_all_, insert_ratio_,
                                              HeldOnHost(res.get(), insert_ratio_));
    OP_REQUIRES(ctx, error.empty(), Failed(*res, " ", error));
    TensorScratch scratch(ctx);
    const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
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
    StageClock clock(stream, false, insert_);   // finds that insert
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
    clock.Mark(7);
  }
#endif
  bool insert_ = true, with_evicted_ = false, admit_all_ = false;
  float insert_ratio_ = 1.0f;
};


// TfSokDynamicFindMany: one find (insert) per table; on a GPU the missing-key counts of all
// tables come back in one wait. Indices are locked in address order (no deadlock with other ops).
class FindManyOp : public tf::OpKernel {
 public:
  explicit FindManyOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("insert_ratio", &insert_ratio_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    std::vector<tf::core::RefCountPtr<IndexResource>> res(n);
    std::vector<IndexResource*> order;
    for (int i = 0; i < n; ++i) {
      OP_REQUIRES_OK(ctx, tf::LookupResource(ctx, tf::HandleFromInput(ctx, i), &res[i]));
      const tf::Tensor& keys = ctx->input(n + i);
      OP_REQUIRES(ctx, keys.dims() == 1,
                  Failed(*res[i], ": ", "keys must be a vector, got shape " + keys.shape().DebugString()));
      order.push_back(res[i].get());
    }
    std::sort(order.begin(), order.end());
    OP_REQUIRES(ctx, std::adjacent_find(order.begin(), order.end()) == order.end(),
                absl::InvalidArgumentError("TfSokDynamicFindMany: a dynamic table's index is given twice"));
    std::vector<std::unique_ptr<tf::mutex_lock>> locks;
    for (IndexResource* r : order) locks.push_back(std::make_unique<tf::mutex_lock>(r->mu));
#if TF_SOK_WITH_CUDA
    if (res[0]->gpu) {
      ComputeGpu(ctx, res);
      return;
    }
#endif
    TensorScratch scratch(ctx);
    const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i].get();
      OP_REQUIRES(ctx, r->host != nullptr, Failed(*r, ": ", "its index lives on a GPU; look it up there"));
      const tf::Tensor& keys = ctx->input(n + i);
      tf::Tensor* slots = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, keys.shape(), &slots));
      impl::FindChanges ch;
      const std::string error = r->host->Find(keys.flat<int64_t>().data(), keys.NumElements(), true,
                                              slots->flat<int64_t>().data(), &ch, false, insert_ratio_,
                                              HeldOnHost(r, insert_ratio_));
      OP_REQUIRES(ctx, error.empty(), Failed(*r, " ", error));
      OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, r, HostChanges(ch, keys.NumElements()), nullptr));
    }
  }

 private:
#if TF_SOK_WITH_CUDA
  void ComputeGpu(tf::OpKernelContext* ctx, const std::vector<tf::core::RefCountPtr<IndexResource>>& res) {
    const int n = static_cast<int>(res.size());
    TensorScratch scratch(ctx);
    const impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    auto* counts = static_cast<int64_t*>(d.scratch->Allocate(8 * static_cast<size_t>(n)));
    OP_REQUIRES(ctx, counts != nullptr, absl::ResourceExhaustedError("TfSokDynamicFindMany: out of GPU memory"));
    std::vector<impl::GpuFindResult> found(n);
    std::vector<impl::GpuFindPending> pending(n);
    StageClock clock(stream, true);
    for (int i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, res[i]->gpu != nullptr, Failed(*res[i], ": ", "its index is on the host; look it up there"));
      const tf::Tensor& keys = ctx->input(n + i);
      const std::string error = res[i]->gpu->Probe(d, keys.flat<int64_t>().data(), keys.NumElements(), &found[i],
                                                   &pending[i], counts + i, insert_ratio_);
      OP_REQUIRES(ctx, error.empty(), Failed(*res[i], " ", error));
    }
    // each stage of every table's index call, then the counts of all tables read back with one wait
    // (none when no table has missing keys / must evict); then the hybrid tables' new keys back to the
    // host with one wait for all, then every table's arrays
    std::vector<int64_t> missing(n), distinct(n), evictable(n);
    clock.Mark(0);
    OP_REQUIRES_OK(ctx, ReadCounts(stream, counts, n, missing.data()));
    clock.Mark(1);
    bool any = false;
    for (int i = 0; i < n; ++i) {
      const std::string error = res[i]->gpu->FinishDistinct(d, &pending[i], missing[i], &found[i], counts + i,
                                                                insert_ratio_);
      OP_REQUIRES(ctx, error.empty(), Failed(*res[i], " ", error));
      any |= missing[i] > 0 && !pending[i].fused;
    }
    clock.Mark(2);
    if (any) OP_REQUIRES_OK(ctx, ReadCounts(stream, counts, n, distinct.data()));
    for (int i = 0; i < n; ++i)
      if (pending[i].fused) distinct[i] = missing[i];   // the probe inserted: its count was of the new keys
    clock.Mark(3);
    any = false;
    for (int i = 0; i < n; ++i) {
      bool evicts = false;
      const std::string error =
          res[i]->gpu->FinishRoom(d, &pending[i], distinct[i], false, insert_ratio_, counts + i, &evicts,
                                  HeldOnGpu(d, res[i].get(), insert_ratio_));
      OP_REQUIRES(ctx, error.empty(), Failed(*res[i], " ", error));
      if (!evicts) cudaMemsetAsync(counts + i, 0, 8, stream);
      any |= evicts;
    }
    clock.Mark(4);
    if (any) OP_REQUIRES_OK(ctx, ReadCounts(stream, counts, n, evictable.data()));
    clock.Mark(5);
    std::vector<StorePlan> plans(n);
    bool wait = false;
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i].get();
      const tf::Tensor& keys = ctx->input(n + i);
      const std::string error = r->gpu->FinishCommit(d, &pending[i], evictable[i], &found[i]);
      OP_REQUIRES(ctx, error.empty(), Failed(*r, " ", error));
      tf::Tensor* slots = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, keys.shape(), &slots));
      if (keys.NumElements() > 0)
        cudaMemcpyAsync(slots->flat<int64_t>().data(), found[i].slots, 8 * keys.NumElements(),
                        cudaMemcpyDeviceToDevice, stream);
      if (r->store) {
        OP_REQUIRES_OK(ctx, StartStorePlan(ctx, d, r, DeviceChanges(found[i], keys.NumElements()), &plans[i]));
        plans[i].planned = true;
        wait |= PlanReadsBack(*r, DeviceChanges(found[i], keys.NumElements()));
      }
    }
    if (wait) OP_REQUIRES_OK(ctx, CudaWait(stream));
    clock.Mark(6);
    std::vector<IndexResource*> tables(n);
    std::vector<int64_t> num_new(n);
    for (int i = 0; i < n; ++i) {
      tables[i] = res[i].get();
      num_new[i] = found[i].num_new;
    }
    OP_REQUIRES_OK(ctx, FinishStorePlans(ctx, d, tables, num_new, &plans));
    clock.Mark(7);
    for (int i = 0; i < n; ++i) {
      const Changes c = DeviceChanges(found[i], ctx->input(n + i).NumElements());
      OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, res[i].get(), c, nullptr, &plans[i]));
    }
  }
#endif
  float insert_ratio_ = 1.0f;
};

template <typename Device>
class RowSplitsValidOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    tf::Tensor* valid = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({n}), &valid));
    std::vector<const int64_t*> splits(n);
    std::vector<int64_t> entries(n), counts(n);
    for (int i = 0; i < n; ++i) {
      const tf::Tensor& s = ctx->input(i);
      OP_REQUIRES(ctx, s.dims() == 1,
                  absl::InvalidArgumentError("row_splits must be a vector, got " + s.shape().DebugString()));
      splits[i] = s.flat<int64_t>().data();
      entries[i] = s.NumElements();
      counts[i] = ctx->input(n + i).NumElements();
    }
    Check(ctx, splits, entries, counts, valid->flat<bool>().data());
  }

 private:
  void Check(tf::OpKernelContext* ctx, const std::vector<const int64_t*>& splits, const std::vector<int64_t>& n,
             const std::vector<int64_t>& count, bool* valid);
};

template <>
void RowSplitsValidOp<impl::CpuDevice>::Check(tf::OpKernelContext*, const std::vector<const int64_t*>& splits,
                                              const std::vector<int64_t>& n, const std::vector<int64_t>& count,
                                              bool* valid) {
  for (size_t i = 0; i < splits.size(); ++i) valid[i] = impl::RowSplitsValid(splits[i], n[i], count[i]);
}

#if TF_SOK_WITH_CUDA
template <>
void RowSplitsValidOp<impl::GpuDevice>::Check(tf::OpKernelContext* ctx, const std::vector<const int64_t*>& splits,
                                              const std::vector<int64_t>& n, const std::vector<int64_t>& count,
                                              bool* valid) {
  TensorScratch scratch(ctx);
  impl::GpuRowSplitsValid(MakeDevice<impl::GpuDevice>(ctx, &scratch), splits.data(), n.data(), count.data(),
                          static_cast<int>(splits.size()), valid);
}
#endif

class AttachOp : public tf::OpKernel {
 public:
  explicit AttachOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("fill", &fill_));
    OP_REQUIRES_OK(c, c->GetAttr("values", &values_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    IndexResource::Array a;
    OP_REQUIRES_OK(ctx, tf::LookupResource(ctx, tf::HandleFromInput(ctx, 1), &a.var));
    a.fill = fill_;
    a.values = values_;
    tf::mutex_lock l(res->mu);
    TensorScratch scratch(ctx);
    {
      tf::mutex_lock vl(*a.var->mu());
#if TF_SOK_WITH_CUDA
      if (res->gpu)
        OP_REQUIRES_OK(ctx, GrowArray(ctx, MakeDevice<impl::GpuDevice>(ctx, &scratch), *res, a, res->gpu->rows()));
      else
#endif
        OP_REQUIRES_OK(ctx, GrowArray(ctx, MakeDevice<impl::CpuDevice>(ctx, &scratch), *res, a, res->host->rows()));
    }
    if (res->store) {   // a hybrid table: the array's rows in the host tier too
      const tf::Tensor* t = a.var->tensor();
      const std::string error = res->store->AddArray(t->dims() == 2 ? t->dim_size(1) : 1, a.values ? 0.0f : a.fill);
      OP_REQUIRES(ctx, error.empty(), Failed(*res, ": ", error));
    }
    res->arrays.push_back(std::move(a));
    res->UpdateCacheBound();
  }

 private:
  float fill_ = 0;
  bool values_ = false;
};

class SizeOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    tf::Tensor *size = nullptr, *rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &size));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({}), &rows));
    tf::mutex_lock l(res->mu);
    if (res->store) {   // every key of a hybrid table has a row in its host tier
      size->scalar<int64_t>()() = res->store->size();
      rows->scalar<int64_t>()() = res->store->size();
      return;
    }
#if TF_SOK_WITH_CUDA
    if (res->gpu) {
      size->scalar<int64_t>()() = res->gpu->size();
      rows->scalar<int64_t>()() = res->gpu->rows();
      return;
    }
#endif
    size->scalar<int64_t>()() = res->host->size();
    rows->scalar<int64_t>()() = res->host->rows();
  }
};

absl::Status RelinkCache(tf::OpKernelContext* ctx, IndexResource* res, bool store_replaced);

// The index's contents, on the host (the caller holds res->mu).
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

class ExportOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    impl::DynamicIndexSnapshot snap;
    {
      tf::mutex_lock l(res->mu);
      OP_REQUIRES_OK(ctx, ExportIndex(ctx, res.get(), &snap));
    }
    absl::Status s;
    const std::vector<int64_t>* parts[] = {&snap.keys,         &snap.slots,          &snap.scores,
                                           &snap.generations, &snap.candidate_keys, &snap.candidate_counts};
    for (int i = 0; i < 6; ++i) {
      HostVector(ctx, i, *parts[i], &s);
      OP_REQUIRES_OK(ctx, s);
    }
    HostVector(ctx, 6, {snap.clock, snap.rows, snap.next_free}, &s);
    OP_REQUIRES_OK(ctx, s);
  }
};

class TouchedSinceOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    const tf::Tensor& since = ctx->input(1);
    OP_REQUIRES(ctx, since.dims() == 0, Failed(*res, ": ", "since must be a scalar (ns since the epoch)"));
    std::vector<int64_t> keys, rows;
    {
      tf::mutex_lock l(res->mu);
#if TF_SOK_WITH_CUDA
      if (res->gpu) {
        TensorScratch scratch(ctx);
        const std::string error = res->gpu->TouchedSince(MakeDevice<impl::GpuDevice>(ctx, &scratch),
                                                         since.scalar<int64_t>()(), &keys, &rows);
        OP_REQUIRES(ctx, error.empty(), Failed(*res, ": reading its touched keys: ", error));
      } else {
        res->host->TouchedSince(since.scalar<int64_t>()(), &keys, &rows);
      }
#else
      res->host->TouchedSince(since.scalar<int64_t>()(), &keys, &rows);
#endif
    }
    absl::Status s;
    HostVector(ctx, 0, keys, &s);
    OP_REQUIRES_OK(ctx, s);
    HostVector(ctx, 1, rows, &s);
    OP_REQUIRES_OK(ctx, s);
  }
};

class ImportOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    impl::DynamicIndexSnapshot snap;
    std::vector<int64_t>* parts[] = {&snap.keys,         &snap.slots,          &snap.scores,
                                     &snap.generations, &snap.candidate_keys, &snap.candidate_counts};
    for (int i = 0; i < 6; ++i) {
      const tf::Tensor& t = ctx->input(1 + i);
      OP_REQUIRES(ctx, t.dims() == 1, Failed(*res, ": restoring its index: part ", std::to_string(i) + " is not a vector"));
      parts[i]->assign(t.flat<int64_t>().data(), t.flat<int64_t>().data() + t.NumElements());
    }
    const tf::Tensor& counters = ctx->input(7);
    OP_REQUIRES(ctx, counters.NumElements() == 3, Failed(*res, ": restoring its index: ", "3 counters expected"));
    snap.clock = counters.flat<int64_t>()(0);
    snap.rows = counters.flat<int64_t>()(1);
    snap.next_free = counters.flat<int64_t>()(2);
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, ImportIndex(ctx, res.get(), snap));
    if (res->store) {
      res->store->ClearMarks();   // touches count from the import on, as the index's own marks
      // (a restore replaces the host tier next, which then counts its keys for admission)
      OP_REQUIRES_OK(ctx, RelinkCache(ctx, res.get(), false));
    }
  }
};

// Writes every cached row of a hybrid table back to its host store (the rows stay cached).
absl::Status Flush(tf::OpKernelContext* ctx, IndexResource* res) {
  impl::DynamicIndexSnapshot snap;
  TF_RETURN_IF_ERROR(ExportIndex(ctx, res, &snap));
  const int64_t n = static_cast<int64_t>(snap.keys.size());
  TensorScratch scratch(ctx);
#if TF_SOK_WITH_CUDA
  if (res->gpu) {
    const impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    int64_t* store_row_of = nullptr;
    TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, res->gpu->rows(), &store_row_of));
    auto* slots = static_cast<int64_t*>(d.scratch->Allocate(8 * std::max<int64_t>(n, 1)));
    if (!slots) return absl::ResourceExhaustedError("dynamic table '" + res->table + "': out of GPU memory");
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    if (n > 0) cudaMemcpyAsync(slots, snap.slots.data(), 8 * n, cudaMemcpyHostToDevice, stream);
    for (size_t i = 0; i < res->arrays.size(); ++i) {
      tf::mutex_lock l(*res->arrays[i].var->mu());
      const tf::Tensor* t = res->arrays[i].var->tensor();
      StoreWrite(d, t->flat<float>().data(), res->store->width(i), slots, store_row_of, n, res->store->base(i));
    }
    return CudaWait(stream);
  }
#endif
  const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
  int64_t* store_row_of = nullptr;
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, res->host->rows(), &store_row_of));
  for (size_t i = 0; i < res->arrays.size(); ++i) {
    tf::mutex_lock l(*res->arrays[i].var->mu());
    const tf::Tensor* t = res->arrays[i].var->tensor();
    StoreWrite(d, t->flat<float>().data(), res->store->width(i), snap.slots.data(), store_row_of, n,
               res->store->base(i));
  }
  return absl::OkStatus();
}

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
  if (res->gpu) {
    const impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    int64_t* store_row_of = nullptr;
    TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, res->gpu->rows(), &store_row_of));
    auto* lists = static_cast<int64_t*>(d.scratch->Allocate(16 * std::max<int64_t>(n, 1)));
    if (!lists) return absl::ResourceExhaustedError("dynamic table '" + res->table + "': out of GPU memory");
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    if (n > 0) {
      cudaMemcpyAsync(lists, snap.slots.data(), 8 * n, cudaMemcpyHostToDevice, stream);
      cudaMemcpyAsync(lists + n, rows, 8 * n, cudaMemcpyHostToDevice, stream);
    }
    SetStoreRows(d, store_row_of, lists, lists + n, n);
    return CudaWait(stream);
  }
#endif
  const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
  int64_t* store_row_of = nullptr;
  TF_RETURN_IF_ERROR(StoreRowArray(ctx, d, res, res->host->rows(), &store_row_of));
  SetStoreRows(d, store_row_of, snap.slots.data(), rows, n);
  return absl::OkStatus();
}

class CacheStatsOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetHybridIndex(ctx, &res));
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({9}), &out));
    tf::mutex_lock l(res->mu);
    const IndexResource::Stats& st = res->stats;
    const int64_t v[9] = {st.calls,  st.lookups,  st.misses,    st.loaded, st.fresh,
                          st.evicted, st.bytes_in, st.bytes_out, st.dropped};
    std::copy(v, v + 9, out->flat<int64_t>().data());
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
// the arrays' widths] and widths, after the cached rows were written back (Flush).
absl::Status StoreRowsOut(tf::OpKernelContext* ctx, const impl::HostStore& store, const std::vector<int64_t>* picked) {
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
  float* out = rows->flat<float>().data();
  for (int i = 0, at = 0; i < store.num_arrays(); at += store.width(i), ++i) {
    widths->flat<int64_t>()(i) = store.width(i);
    const int64_t w = store.width(i);
    const float* base = store.base(i);
    for (int64_t j = 0; j < n; ++j) std::copy(base + row(j) * w, base + (row(j) + 1) * w, out + j * total + at);
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
    OP_REQUIRES_OK(ctx, Flush(ctx, res.get()));
    const impl::HostStore& store = *res->store;
    if (store.max_keys() <= 0) {
      OP_REQUIRES_OK(ctx, StoreRowsOut(ctx, store, nullptr));
      return;
    }
    // a bounded store's keys in the order its bound drops them (restored so): those not cached in
    // that order, then the cached ones by (cache score, key)
    impl::DynamicIndexSnapshot snap;
    OP_REQUIRES_OK(ctx, ExportIndex(ctx, res.get(), &snap));
    std::vector<int64_t> cached_rows(snap.keys.size());
    store.Rows(snap.keys.data(), static_cast<int64_t>(snap.keys.size()), cached_rows.data());
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
    OP_REQUIRES_OK(ctx, StoreRowsOut(ctx, store, &picked));
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
    const int64_t* marks = store.marks();
    for (int64_t r = 0; r < store.rows_used(); ++r) pick[r] = store.alive(r) && marks[r] >= first;
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
    tf::mutex_lock l(res->mu);
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
    std::vector<std::vector<float>> split(store.num_arrays());
    std::vector<const float*> data;
    const float* in = rows.flat<float>().data();
    for (int i = 0, at = 0; i < store.num_arrays(); at += store.width(i), ++i) {
      const int64_t w = store.width(i);
      split[i].resize(n * w);
      for (int64_t r = 0; r < n; ++r) std::copy(in + r * total + at, in + r * total + at + w, split[i].data() + r * w);
      data.push_back(split[i].data());
    }
    const std::string error = store.Replace(keys.flat<int64_t>().data(), n, data);
    OP_REQUIRES(ctx, error.empty(), Failed(*res, ": restoring its host tier: ", error));
    OP_REQUIRES_OK(ctx, RelinkCache(ctx, res.get(), true));
  }

 private:
  bool clear_cache_ = true;
};

REGISTER_KERNEL_BUILDER(Name("TfSokDynamicIndex").Device(tf::DEVICE_CPU), IndexOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_CPU), FindOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFindMany").Device(tf::DEVICE_CPU), FindManyOp);
REGISTER_KERNEL_BUILDER(Name("TfSokRowSplitsValid").Device(tf::DEVICE_CPU), RowSplitsValidOp<impl::CpuDevice>);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicAttach").Device(tf::DEVICE_CPU), AttachOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicSize").Device(tf::DEVICE_CPU), SizeOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicExport").Device(tf::DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicTouchedSince").Device(tf::DEVICE_CPU), TouchedSinceOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicImport").Device(tf::DEVICE_CPU), ImportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreExport").Device(tf::DEVICE_CPU), StoreExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreTouchedSince").Device(tf::DEVICE_CPU), StoreTouchedSinceOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicCacheStats").Device(tf::DEVICE_CPU), CacheStatsOp);
REGISTER_KERNEL_BUILDER(Name("TfSokHostLinkBandwidth").Device(tf::DEVICE_CPU), HostLinkBandwidthOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreImport").Device(tf::DEVICE_CPU), StoreImportOp);

#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicIndex").Device(tf::DEVICE_GPU).HostMemory("handle"), IndexOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_GPU).HostMemory("index"), FindOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFindMany").Device(tf::DEVICE_GPU).HostMemory("indices"), FindManyOp);
REGISTER_KERNEL_BUILDER(Name("TfSokRowSplitsValid").Device(tf::DEVICE_GPU), RowSplitsValidOp<impl::GpuDevice>);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicAttach").Device(tf::DEVICE_GPU).HostMemory("index").HostMemory("array"),
                        AttachOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicSize")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("size")
                            .HostMemory("rows"),
                        SizeOp);
// an index snapshot (export / import) travels in host memory
#define TF_SOK_SNAPSHOT_ON_HOST                                                                            \
  HostMemory("index").HostMemory("keys").HostMemory("slots").HostMemory("scores").HostMemory("generations") \
      .HostMemory("candidate_keys").HostMemory("candidate_counts").HostMemory("counters")
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicExport").Device(tf::DEVICE_GPU).TF_SOK_SNAPSHOT_ON_HOST, ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicTouchedSince")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("since")
                            .HostMemory("keys")
                            .HostMemory("rows"),
                        TouchedSinceOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicImport").Device(tf::DEVICE_GPU).TF_SOK_SNAPSHOT_ON_HOST, ImportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicStoreExport")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("keys")
                            .HostMemory("rows")
                            .HostMemory("widths"),
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
    Name("TfSokDynamicStoreImport").Device(tf::DEVICE_GPU).HostMemory("index").HostMemory("keys").HostMemory("rows"),
    StoreImportOp);
#undef TF_SOK_SNAPSHOT_ON_HOST
#endif

}  // namespace
}  // namespace tf_sok
