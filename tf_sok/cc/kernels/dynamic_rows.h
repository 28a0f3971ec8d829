// How a dynamic table's row arrays follow its index, shared by the dynamic-table kernels: the
// arrays grown, new keys' rows set and, for a hybrid table, rows moved between its cache (the
// arrays) and its host tier, on the host or the device.
#ifndef TF_SOK_CC_KERNELS_DYNAMIC_ROWS_H_
#define TF_SOK_CC_KERNELS_DYNAMIC_ROWS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "tf_sok/cc/impl/optimizer.h"
#include "tf_sok/cc/kernels/dynamic_resource.h"
#include "tf_sok/cc/kernels/kernel_util.h"

namespace tf_sok {
namespace dynamic_kernels {

// The row upkeep of impl, on the host or the device.
inline void InitialRowsAt(const impl::CpuDevice&, const IndexResource& r, const int64_t* keys, const int64_t* rows,
                          int64_t n, int64_t width, float* base) {
  impl::InitialRowsAt(r.init_kind, r.a, r.b, r.seed, keys, rows, n, width, base);
}
inline void FillRows(const impl::CpuDevice&, float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  impl::FillRows(base, width, rows, n, fill);
}
inline void GatherRows(const impl::CpuDevice&, const float* base, int64_t width, const int64_t* rows, int64_t n,
                       float* out) {
  impl::GatherRows(base, width, width, rows, n, out);
}
inline void Fill(const impl::CpuDevice&, float* p, int64_t count, float value) { impl::Fill(p, count, value); }
inline void StoreWrite(const impl::CpuDevice&, const float* cache, int64_t width, const int64_t* cache_rows,
                const int64_t* store_row_of, int64_t n, float* store, int64_t stride) {
  impl::StoreWrite(cache, width, cache_rows, store_row_of, n, store, stride);
}
// An LFU cache's scores carried over its host tier (DynamicIndex::AddStoreScores).
// (records: the store's, HostStore::device_records())
inline void AddStoreScores(const impl::CpuDevice&, IndexResource* r, float* records, const int64_t* cache_rows,
                           const int64_t* store_rows, const uint8_t* fresh, int64_t n) {
  r->host->AddStoreScores(cache_rows, store_rows, fresh, reinterpret_cast<int64_t*>(records) + 1,
                          r->store->meta_stride(), n);
}
// A call's moves between the cache's arrays (l) and the host tier (store: HostStore::records()): the
// evicted keys' records written back (with their marks and scores), then the new keys' read in
// (fresh ones left to StoreFresh).
inline absl::Status MoveRecords(tf::OpKernelContext*, const impl::CpuDevice&, IndexResource*,
                                const impl::StoreRecordLayout& l,
                                const int64_t* evicted_slots,
                                const int64_t* store_row_of, int64_t n_out, const int64_t* store_rows,
                                const uint8_t* fresh, const int64_t* cache_rows, int64_t n_in, float* store) {
  for (int a = 0; a < l.arrays; ++a)
    impl::StoreWrite(l.cache[a], l.width[a], evicted_slots, store_row_of, n_out, store + l.offset[a], l.stride);
  for (int64_t j = 0; j < n_out; ++j) {
    int64_t* meta = reinterpret_cast<int64_t*>(store + store_row_of[evicted_slots[j]] * l.stride);
    meta[0] = l.touched[j];
    meta[1] = l.scores ? l.scores[j] : 0;
  }
  for (int a = 0; a < l.arrays; ++a)
    impl::StoreRead(store + l.offset[a], l.stride, l.width[a], store_rows, fresh, cache_rows, n_in, l.cache[a]);
  return absl::OkStatus();
}
// The rows of new keys the store had no row for: their initial value (values) or the array's fill.
inline void StoreFresh(const impl::CpuDevice&, const IndexResource& r, const IndexResource::Array& a, int64_t width,
                       const uint8_t* fresh, const int64_t* keys, const int64_t* cache_rows, int64_t n, float* cache) {
  impl::StoreFresh(width, fresh, keys, cache_rows, n, a.values ? r.init_kind : -1, r.a, r.b, r.seed, a.fill, cache);
}
#if TF_SOK_WITH_CUDA
inline void StoreWrite(const impl::GpuDevice& d, const float* cache, int64_t width, const int64_t* cache_rows,
                const int64_t* store_row_of, int64_t n, float* store, int64_t stride) {
  impl::GpuStoreWrite(d, cache, width, cache_rows, store_row_of, n, store, stride);
}
inline void AddStoreScores(const impl::GpuDevice& d, IndexResource* r, float* records, const int64_t* cache_rows,
                           const int64_t* store_rows, const uint8_t* fresh, int64_t n) {
  r->gpu->AddStoreScores(d, cache_rows, store_rows, fresh, reinterpret_cast<int64_t*>(records) + 1,
                         r->store->meta_stride(), n);
}
// On a GPU the evicted records are gathered into device memory first, then copied back to the host,
// which writes them into their store rows after the call (HostStore::Pending), while the new records
// are read in place; with TF_SOK_WRITE_BACK_COPIES=0, or no pinned memory for the copies, both
// directions in place, in one launch. The call's stream first waits for earlier calls' write-backs
// (store: HostStore::device_records()). A call taking in at least GatherRecordsMinRows() records (not a
// prefetch's) has the host's threads gather the first GatherCount of them and copies them over
// contiguous, as reads do (the link reads random records in place at a fixed rate of accesses), while
// the kernel reads the rest in place.
absl::Status MoveRecords(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res,
                         const impl::StoreRecordLayout& l,
                         const int64_t* evicted_slots, const int64_t* store_row_of, int64_t n_out,
                         const int64_t* store_rows, const uint8_t* fresh, const int64_t* cache_rows, int64_t n_in,
                         float* store);
inline void StoreFresh(const impl::GpuDevice& d, const IndexResource& r, const IndexResource::Array& a, int64_t width,
                       const uint8_t* fresh, const int64_t* keys, const int64_t* cache_rows, int64_t n, float* cache) {
  impl::GpuStoreFresh(d, width, fresh, keys, cache_rows, n, a.values ? r.init_kind : -1, r.a, r.b, r.seed, a.fill,
                      cache);
}
inline void InitialRowsAt(const impl::GpuDevice& d, const IndexResource& r, const int64_t* keys, const int64_t* rows,
                   int64_t n, int64_t width, float* base) {
  impl::GpuInitialRowsAt(d, r.init_kind, r.a, r.b, r.seed, keys, rows, n, width, base);
}
inline void FillRows(const impl::GpuDevice& d, float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  impl::GpuFillRows(d, base, width, rows, n, fill);
}
inline void GatherRows(const impl::GpuDevice& d, const float* base, int64_t width, const int64_t* rows, int64_t n,
                float* out) {
  impl::GpuGatherRows(d, base, width, width, rows, n, out);
}
inline void Fill(const impl::GpuDevice& d, float* p, int64_t count, float value) { impl::GpuFill(d, p, count, value); }
#endif

// An attached array grown to `rows` rows (new rows at its fill; values: zeros until a key's row is set).
template <typename Device>
inline absl::Status GrowArray(tf::OpKernelContext* ctx, const Device& d, const IndexResource& res,
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
  const int64_t* evicted_scores = nullptr;
  int64_t num_evicted = 0;
  bool prefetch = false;   // a prefetch's: the caller holds every array's lock, the arrays keep their buffers
  bool values_given = false;   // the caller writes the new keys' values next: zeros, not initial values, meanwhile
};

// A hybrid table's store rows for a call's new keys (fresh: the store had no row for the key yet),
// in memory the call's device reads, and its per-cache-row store rows.
struct StorePlan {
  const int64_t* new_rows = nullptr;
  const uint8_t* fresh = nullptr;
  int64_t* store_row_of = nullptr;
  int64_t fresh_count = 0;
  bool planned = false;
  // the store rows came from the tier's key map on the device (IndexResource::store_keys_on_gpu): which
  // keys are fresh is known there only (fresh is given, fresh_count 0 until SettleStore counts them)
  bool by_device_map = false;
  uint8_t* staging = nullptr;     // on a GPU: [new keys | their store rows | fresh flags] on the host
  uint8_t* on_device = nullptr;   // [store rows | fresh flags] on the device
  // a bounded host tier: the keys the cache wrote back, their last touching calls and (LFU) scores (on
  // a GPU, in staging after the new keys' lists), and the keys the bound dropped from the table, with
  // their rows
  const int64_t* written_back = nullptr;
  const int64_t* written_back_calls = nullptr;
  const int64_t* written_back_scores = nullptr;   // LFU caches'
  int64_t num_written_back = 0;
  std::vector<int64_t> dropped_keys, dropped_rows;
};

// Whether the store plan of a call needs the device's lists on the host (new keys; with a bound,
// the keys written back too).
bool PlanReadsBack(const IndexResource& r, const Changes& c);
// The store rows of distinct keys (inserted when absent) into staging [keys | rows | fresh flags].
absl::Status StoreRowsOnHost(tf::OpKernelContext* ctx, IndexResource* res, const int64_t* keys, int64_t n,
                             uint8_t* staging, int64_t* fresh_count);
// Per cache row, the store row of its key (`rows` of them at least), where the device reads it.
absl::Status StoreRowArray(tf::OpKernelContext* ctx, const impl::CpuDevice& d, IndexResource* res, int64_t rows,
                           int64_t** out);
// The store plan of one call (the store rows of its new keys, the bound applied).
absl::Status PlanStore(tf::OpKernelContext* ctx, const impl::CpuDevice& d, IndexResource* res, const Changes& c,
                       StorePlan* p);
// store_row_of[cache_rows[j]] = rows[j]
void SetStoreRows(const impl::CpuDevice& d, int64_t* store_row_of, const int64_t* cache_rows, const int64_t* rows,
                  int64_t n);
// Per table i (a hybrid table's), the store row of each of its n[i] keys whose slot is < 0 (-1: its
// host tier does not hold the key; -1 for slots >= 0 too) into rows[i], looked up on the host's
// threads for all tables at once (the stores must not change meanwhile). Returns per table the keys
// its tier held.
std::vector<int64_t> StoreRowsOfMissing(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& res,
                                        const std::vector<const int64_t*>& keys,
                                        const std::vector<const int64_t*>& slots, const std::vector<int64_t>& n,
                                        const std::vector<int64_t*>& rows);
// A read's host-tier rows gathered on the host's threads, for all tables at once: of table i's n[i]
// store rows rows[i] (-1: none), those >= 0 counted; where there are at least min_rows of them,
// start(i, count) is told, their values (array 0's) are copied in order into out[i] (room for n[i]
// rows of the table's dim) and each rows[i][j] >= 0 is replaced by its row's place there. The host's
// threads copy chunks of rows in order; as each group of a table's consecutive chunks completes,
// ready(i, first, count) is told its rows of out[i] (to send them on while the rest are copied), from
// whichever host thread completed it (concurrently with other groups'). Returns per table the
// count of rows >= 0, and in gathered[i] whether they were gathered (rows[i] untouched where not);
// a start that returns false stops it (nothing gathered after; false returned in *ok). records:
// whole records (HostStore::stride() floats each, from device_records(): the caller has settled the
// rows it gathers) instead of the values.
struct GatherHooks {
  std::function<bool(size_t table, int64_t count)> start;
  std::function<void(size_t table, int64_t first, int64_t count)> ready;
};
std::vector<int64_t> GatherStoreRows(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& res,
                                     const std::vector<int64_t>& n, const std::vector<int64_t*>& rows,
                                     int64_t min_rows, const std::vector<float*>& out, const GatherHooks& hooks,
                                     std::vector<bool>* gathered, bool* ok, bool records = false);
// The first 64-byte boundary at or after p: gathered rows start on whole cache lines, for the host's
// streaming stores (the buffer has 64 bytes to spare for it).
inline float* LineAligned(void* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}
// An environment switch that is on unless set to "0" (read at each call).
bool SwitchOn(const char* name);
// The fewest host-tier rows a GPU read gathers on the host's threads (of the share of its keys they
// take, GatherCount) and copies over contiguous rather than reading them in place
// (TF_SOK_READ_GATHER_MIN_ROWS, read at each call; negative: never). Fewer are read in place, with no
// wait.
int64_t GatherMinRows();
// The same for the records (values and optimizer state) of keys a GPU find takes into the cache, of
// record_bytes each: GatherMinRows() for records of at most kGatherRecordMaxBytes, never for larger
// ones, unless TF_SOK_READ_GATHER_MIN_ROWS is set (then that, whatever their size). The link reads
// random records in place at a rate of accesses more than of bytes (H100: 256-byte rows at 6.7 GB/s,
// 1 KB records at 32 GB/s beside a step's copies) and the host's threads gather at about 20 GB/s: even
// near 700 bytes. Measured side by side: training lookups of 272-byte records 1.26x faster gathered;
// steps of 8 tables of 1,040-byte records (dim 128 + Adagrad) 1.94-1.98x slower gathered.
constexpr int64_t kGatherRecordMaxBytes = 640;
int64_t GatherRecordsMinRows(int64_t record_bytes);
// Of the n rows a GPU read (or n records a GPU find) gathers in those ways, how many the host's threads
// gather (the first ones) while the device reads the rest in place, both at once: a share of n
// (TF_SOK_GATHER_SHARE in [0, 1], read at each call, for both; otherwise kGatherShareRows for a read,
// kGatherShareRecords for a find). Side by side on an H100 (32M keys x 64 half cached, 1M uniform
// keys a call): training lookups 1.02-1.07x faster with 0.8 than gathering all (0.7: 1.05-1.06x,
// 0.5: 0.90-0.96x); reads 0.93-0.98x with 0.8, 0.98-1.03x with 0.9: the device's reads in place slow
// the host's gather of small rows about as much as they take off it.
constexpr double kGatherShareRows = 1.0;
constexpr double kGatherShareRecords = 0.8;
int64_t GatherCount(int64_t n, bool records);
#if TF_SOK_WITH_CUDA
// A table's gathered rows are copied over on its gather stream, beside TensorFlow's `stream`:
// GatherStreamStart, once the device memory they go to is allocated (the copies follow what the stream
// had queued by then, the call's reads in place queued after it do not hold them up); GatherStreamJoin
// once they are all queued (what the stream queues next follows them).
absl::Status GatherStreamStart(IndexResource* res, cudaStream_t stream);
absl::Status GatherStreamJoin(IndexResource* res, cudaStream_t stream);
// rows[i][j]: the store row of keys[i][j] in table i's host tier (-1: absent), j < n[i], for all
// tables at once on the host's threads (the stores must not change meanwhile).
void StoreRowsOfTables(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& res,
                       const std::vector<const int64_t*>& keys, const std::vector<int64_t>& n,
                       const std::vector<int64_t*>& rows);
// HostStore::Loaded of rows[i][0, n[i]) (distinct store rows a GPU call of table i took into its
// cache), for all tables at once on the host's threads.
void LoadedOfTables(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& res,
                    const std::vector<const int64_t*>& rows, const std::vector<int64_t>& n);
absl::Status StoreRowArray(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res, int64_t rows,
                           int64_t** out);
absl::Status PlanStore(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res, const Changes& c,
                       StorePlan* p);
void SetStoreRows(const impl::GpuDevice& d, int64_t* store_row_of, const int64_t* cache_rows, const int64_t* rows,
                  int64_t n);
// A GPU call's store plan in two halves (several tables' with one wait between): StartStorePlan
// sends the new keys (and with a bound, the keys written back) to the host; once they are there
// (the caller waits), FinishStorePlans looks them up in each table's store and sends their rows to
// the device.
absl::Status StartStorePlan(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res,
                            const Changes& c, StorePlan* p);
absl::Status FinishStorePlans(tf::OpKernelContext* ctx, const impl::GpuDevice& d,
                              const std::vector<IndexResource*>& res, const std::vector<int64_t>& num_new,
                              std::vector<StorePlan>* plans);
// A table whose tier's keys are on the GPU (after DeviceMapReady(d, res, c.num_new) and SettleStore):
// its call's store plan from the device map, no wait; the keys the map added reach the host store
// at the next SettleStore.
absl::Status DeviceMapStorePlan(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res,
                                const Changes& c, StorePlan* p);
// The device map of the tier's keys current (built from the host store when it changed since),
// with room for `adding` more.
absl::Status CurrentStoreMap(const impl::GpuDevice& d, IndexResource* res, int64_t adding);
// Whether a call on `res` uses its tier's key map on the device (store_keys_on_gpu), made current
// with room for `adding` more keys. When that fails (a map too large for the device's memory), the
// table looks its keys up on the host from then on, with a warning on stderr, and this is false.
bool DeviceMapReady(const impl::GpuDevice& d, IndexResource* res, int64_t adding);
// The reads' count of keys read from the host tier on the device (store_keys_on_gpu) added to the
// table's counters (one wait).
absl::Status CollectReadCounts(const impl::GpuDevice& d, IndexResource* res);
#endif

// Locks the arrays of the tables (in address order, as TensorFlow's ops take them).
std::vector<std::unique_ptr<tf::mutex_lock>> LockArrays(const std::vector<IndexResource*>& tables);

// After an index call: every attached array grown to `c.rows` and the rows of new keys set (hybrid
// tables: evicted rows written to the host store first, new keys' rows read from it);
// evicted_values (when given): the evicted rows' values, read before anything is written.
// planned: the store plan when the caller made it (several tables' with one wait).
template <typename Device>
absl::Status KeepArraysInStep(tf::OpKernelContext* ctx, const Device& d, IndexResource* res, const Changes& c,
                              float* evicted_values, StorePlan* given = nullptr);

Changes HostChanges(const impl::FindChanges& ch, int64_t positions);
#if TF_SOK_WITH_CUDA
Changes DeviceChanges(const impl::GpuFindResult& r, int64_t positions);
#endif

}  // namespace dynamic_kernels
}  // namespace tf_sok

#endif  // TF_SOK_CC_KERNELS_DYNAMIC_ROWS_H_
