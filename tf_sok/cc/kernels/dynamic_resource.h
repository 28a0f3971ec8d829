// The state of a dynamic table's index as a TensorFlow resource, shared by the dynamic-table
// kernels (dynamic_kernels.cc, dynamic_{find,prefetch,read}_kernels.cc, hybrid_kernels.cc): the key ->
// row index (host or GPU), the row arrays it serves and, for a hybrid table, its host tier.
#ifndef TF_SOK_CC_KERNELS_DYNAMIC_RESOURCE_H_
#define TF_SOK_CC_KERNELS_DYNAMIC_RESOURCE_H_

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/platform/mutex.h"
#include "tf_sok/cc/impl/dynamic_index.h"
#include "tf_sok/cc/impl/host_store.h"
#include "tf_sok/cc/kernels/kernel_util.h"

#if TF_SOK_WITH_CUDA
#include <cuda_runtime.h>

#include "tf_sok/cc/impl/dynamic_index_gpu.h"
#endif

namespace tf_sok {
namespace dynamic_kernels {

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
  bool lfu = false;            // evict_strategy "lfu"
  std::unique_ptr<impl::HostStore> store;
  // a hybrid table's counters since it was made: finds with insert, key positions looked up, those
  // not cached, keys taken into the cache, of them first seen, keys written back, bytes each way
  struct Stats {
    int64_t calls = 0, lookups = 0, misses = 0, loaded = 0, fresh = 0, evicted = 0, bytes_in = 0, bytes_out = 0;
    int64_t dropped = 0;   // keys the host tier's bound (max_capacity) dropped from the table
    int64_t prefetched = 0;   // keys of `loaded` that prefetches took in
    int64_t bytes_in_gathered = 0;   // of bytes_in, records the host's threads gathered and copied over (GPU)
    // read-only lookups (TfSokDynamicRead): key positions read, of them read from the host tier, and
    // those bytes read in place by the device, or gathered by the host's threads and copied over
    int64_t reads = 0, reads_from_host = 0, bytes_read_in_place = 0, bytes_read_gathered = 0;
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
  // recorded on TensorFlow's stream after each GPU find with insert, with the index's call count then:
  // what a prefetch on a stream of its own waits for (the index's state, the steps queued before)
  cudaEvent_t found_event = nullptr;
  int64_t found_call = -1;
  // A hybrid table without max_capacity (unless TF_SOK_STORE_KEYS_ON_GPU=0 when it was made): its
  // host tier's keys are mapped to their store rows on the device as well (GpuDynamicIndex::StoreMap*), so that
  // a find gives the keys it takes in their store rows, and a read its keys not cached, without a
  // round trip through the host. The host store learns the keys a find added later (SettleStore).
  bool store_keys_on_gpu = false;
  int64_t store_map_version = -1;   // the store's version() the device map is a copy of
  // What a find on the device left for the host: the keys its map added (their count, then `asked`
  // keys and `asked` rows in settle_host, pinned), there once settle_event has passed.
  bool unsettled = false;
  int64_t unsettled_asked = 0, unsettled_row_bytes = 0;
  int64_t* settle_host = nullptr;
  size_t settle_bytes = 0;
  cudaEvent_t settle_event = nullptr;
  // reads' count of keys read from the host tier, on the device (added to stats when asked)
  int64_t* reads_from_host_dev = nullptr;
  // A prefetch's row moves into the arrays and the host tier, queued on the prefetch's stream and
  // not waited for by it (they run on past its op, beside the rest of the step): done once this
  // event (shared by the tables of that prefetch) has passed. The next op to take mu waits for them
  // first (SettleMoves).
  std::shared_ptr<CUevent_st> moves;
  // A GPU find's evicted records go back by copies (MoveRecords): gathered on the device, copied into
  // write_back_host (pinned) on write_back_stream, then written into their store rows by the host (a
  // host function there); write_back_done has passed once they all are, which the store waits for
  // before its records are used (HostStore::Pending, set_settle: WaitWriteBack).
  cudaStream_t write_back_stream = nullptr;
  cudaEvent_t write_back_gathered = nullptr, write_back_copied = nullptr, write_back_done = nullptr;
  void* write_back_host = nullptr;
  size_t write_back_bytes = 0;
  void WaitWriteBack() {
    if (write_back_done) cudaEventSynchronize(write_back_done);
  }
  // A find's records taken in, gathered by the host (MoveRecords): their store rows, then the records
  // (pinned; reused by the next such call, which waits for TensorFlow's stream first), copied over on
  // gather_stream once it has passed gather_ready (TensorFlow's stream, before the call's reads in
  // place), while those reads run; TensorFlow's stream waits for gather_copied before using them.
  void* gather_pinned = nullptr;
  size_t gather_bytes = 0;
  cudaStream_t gather_stream = nullptr;
  cudaEvent_t gather_ready = nullptr, gather_copied = nullptr;
  void RecordFind(cudaStream_t stream) {
    if (found_event == nullptr && cudaEventCreateWithFlags(&found_event, cudaEventDisableTiming) != cudaSuccess) {
      found_event = nullptr;
      return;
    }
    cudaEventRecord(found_event, stream);
    found_call = gpu->calls();
  }
  ~IndexResource() override {
    if (store) store->Settle();   // (its settle waits on write_back_done)
    if (write_back_stream) {
      cudaStreamSynchronize(write_back_stream);
      for (cudaEvent_t e : {write_back_gathered, write_back_copied, write_back_done})
        if (e) cudaEventDestroy(e);
      cudaStreamDestroy(write_back_stream);
    }
    if (write_back_host) pinned->Free(write_back_host);
    if (gather_stream) {
      cudaStreamSynchronize(gather_stream);
      for (cudaEvent_t e : {gather_ready, gather_copied})
        if (e) cudaEventDestroy(e);
      cudaStreamDestroy(gather_stream);
    }
    if (gather_pinned) pinned->Free(gather_pinned);
    if (moves) {
      cudaEventSynchronize(moves.get());
      for (const Array& a : arrays) ClearSideWrites(a.var.get());
    }
    if (found_event) cudaEventDestroy(found_event);
    if (settle_event) {
      cudaEventSynchronize(settle_event);
      cudaEventDestroy(settle_event);
    }
    if (settle_host) pinned->Free(settle_host);
    if (reads_from_host_dev) memory->Free(reads_from_host_dev);
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

absl::Status GetIndex(tf::OpKernelContext* ctx, tf::core::RefCountPtr<IndexResource>* out);
// An InvalidArgument error naming the table: "dynamic table '<table>'" + what + error.
absl::Status Failed(const IndexResource& res, const std::string& what, const std::string& error);
// The index of input 0, which must be a hybrid table's (one with a host tier).
absl::Status GetHybridIndex(tf::OpKernelContext* ctx, tf::core::RefCountPtr<IndexResource>* out);
// Output `output`: the vector v, in host memory.
void HostVector(tf::OpKernelContext* ctx, int output, const std::vector<int64_t>& v, absl::Status* s);
// The index's contents, on the host, and their restore (the caller holds res->mu).
absl::Status ExportIndex(tf::OpKernelContext* ctx, IndexResource* res, impl::DynamicIndexSnapshot* snap);
absl::Status ImportIndex(tf::OpKernelContext* ctx, IndexResource* res, const impl::DynamicIndexSnapshot& snap);
// After the store or the cache of a hybrid table was replaced (hybrid_kernels.cc).
absl::Status RelinkCache(tf::OpKernelContext* ctx, IndexResource* res, bool store_replaced);
// A table whose host tier's keys are on the GPU (store_keys_on_gpu): what its last find left for the
// host taken in (the keys the device map added, in the host store; the counters), after waiting for
// that find's device work. Every op on the table but a read calls it first, holding mu; no-op
// otherwise.
absl::Status SettleStore(IndexResource* res);
// Waits for a prefetch's row moves still running into the table (IndexResource::moves); SettleStore
// and LockIndices call it. No-op otherwise.
absl::Status SettleMoves(IndexResource* res);

#if TF_SOK_WITH_CUDA
absl::Status CudaWait(cudaStream_t stream);
// n counts the device left at `counts`, read back (one wait)
absl::Status ReadCounts(cudaStream_t stream, const int64_t* counts, int n, int64_t* host);
#endif

}  // namespace dynamic_kernels
}  // namespace tf_sok

#endif  // TF_SOK_CC_KERNELS_DYNAMIC_RESOURCE_H_
