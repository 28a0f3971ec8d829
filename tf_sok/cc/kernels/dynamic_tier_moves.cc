// How a hybrid table's records cross the host link beside its index (dynamic_rows.h): the host's
// threads gathering host-tier rows into pinned memory for the device (reads of many keys, finds that
// take many small records in), and a GPU call's moves (evicted records copied back and written into
// the tier by the host's threads, new records read in place or gathered).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tf_sok/cc/impl/env.h"
#include "tf_sok/cc/kernels/dynamic_rows.h"

namespace tf_sok {
namespace dynamic_kernels {

namespace {
// A row copied into memory that the device's copy engine reads next, not this core: with streaming
// stores where asked and both ends allow it (the destination's lines are not read first, and stay
// out of the caches); the caller fences before the rows are handed on.
inline void CopyRow(float* dst, const float* src, size_t bytes, bool streaming) {
#if defined(__SSE2__)
  if (streaming && reinterpret_cast<uintptr_t>(dst) % 16 == 0 && bytes % 16 == 0) {
    auto* d = reinterpret_cast<__m128i*>(dst);
    const auto* s = reinterpret_cast<const __m128i*>(src);
    for (size_t k = 0; k < bytes / 16; ++k) _mm_stream_si128(d + k, _mm_loadu_si128(s + k));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}
inline void FenceStreaming() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}
// Streaming stores for the rows the host's threads write for the device (a read's gathered rows) or
// from it (evicted records written back) unless TF_SOK_GATHER_STREAMING=0 (read at each call). Side by
// side on one H100 host they made reads 1.45x faster; on another, 5-8 % slower (benchmarks/RESULTS.md).
bool StreamingGather() { return SwitchOn("TF_SOK_GATHER_STREAMING"); }
}  // namespace

bool SwitchOn(const char* name) {
  const char* v = std::getenv(name);
  return !(v != nullptr && v[0] == '0' && v[1] == 0);
}

namespace {
// TF_SOK_READ_GATHER_MIN_ROWS when set to a whole number
std::optional<double> GatherMinRowsSet() { return impl::EnvNumber("TF_SOK_READ_GATHER_MIN_ROWS", -1e15, 1e15, true); }
}  // namespace

int64_t GatherMinRows() { return static_cast<int64_t>(GatherMinRowsSet().value_or(32768)); }

int64_t GatherRecordsMinRows(int64_t record_bytes) {
  if (const std::optional<double> rows = GatherMinRowsSet()) return static_cast<int64_t>(*rows);
  return record_bytes <= kGatherRecordMaxBytes ? GatherMinRows() : -1;
}

int64_t GatherCount(int64_t n, bool records) {
  const double share = impl::EnvNumber("TF_SOK_GATHER_SHARE", 0, 1, false)
                           .value_or(records ? kGatherShareRecords : kGatherShareRows);
  return std::min<int64_t>(n, std::llround(share * static_cast<double>(n)));
}

std::vector<int64_t> GatherStoreRows(tf::OpKernelContext* ctx, const std::vector<IndexResource*>& res,
                                     const std::vector<int64_t>& n, const std::vector<int64_t*>& rows,
                                     int64_t min_rows, const std::vector<float*>& out, const GatherHooks& hooks,
                                     std::vector<bool>* gathered, bool* ok, bool records) {
  // chunks of each table's rows, counted, then (where gathered) filled from each chunk's offset: the
  // host's threads take the chunks in order, and the thread that completes a group of a table's
  // consecutive chunks tells ready of its rows (no barrier between groups)
  constexpr int64_t kChunk = 4096, kGroup = 16, kAhead = 8;
  struct Chunk {
    size_t table;
    int64_t begin, end, held = 0, at = 0;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < res.size(); ++i)
    for (int64_t b = 0; b < n[i]; b += kChunk) chunks.push_back({i, b, std::min(n[i], b + kChunk)});
  TensorScratch scratch(ctx);
  const impl::CpuDevice host = MakeDevice<impl::CpuDevice>(ctx, &scratch);
  host.parallel_for(static_cast<int64_t>(chunks.size()), kChunk * 2, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t* r = rows[chunks[c].table];
      int64_t held = 0;
      for (int64_t j = chunks[c].begin; j < chunks[c].end; ++j) held += r[j] >= 0;
      chunks[c].held = held;
    }
  });
  std::vector<int64_t> held(res.size(), 0);
  for (Chunk& c : chunks) {
    c.at = held[c.table];
    held[c.table] += c.held;
  }
  *ok = true;
  gathered->assign(res.size(), false);
  for (size_t i = 0; i < res.size(); ++i) {
    if (held[i] == 0 || held[i] < min_rows) continue;
    if (!hooks.start(i, held[i])) {
      *ok = false;
      return held;
    }
    (*gathered)[i] = true;
  }
  // the gathered tables' chunks (a table's consecutive) and their groups: group g is work[first[g],
  // first[g + 1]), all of one table
  std::vector<int64_t> work, first;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    if (!(*gathered)[chunks[c].table]) continue;
    const bool opens = work.empty() || chunks[work.back()].table != chunks[c].table ||
                       static_cast<int64_t>(work.size()) - first.back() == kGroup;
    if (opens) first.push_back(static_cast<int64_t>(work.size()));
    work.push_back(c);
  }
  if (work.empty()) return held;
  first.push_back(static_cast<int64_t>(work.size()));
  std::vector<int64_t> group_of(work.size());
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[first.size() - 1]);
  for (size_t g = 0; g + 1 < first.size(); ++g) {
    left[g].store(first[g + 1] - first[g]);
    for (int64_t w = first[g]; w < first[g + 1]; ++w) group_of[w] = static_cast<int64_t>(g);
  }
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max(1, ctx->device()->tensorflow_cpu_worker_threads()->num_threads);
  const bool streaming = StreamingGather();
  // (each row a random access into a large array: the rows a few ahead are asked for first)
  host.parallel_for(threads, int64_t{1} << 40, [&](int64_t, int64_t) {
    for (int64_t w; (w = next.fetch_add(1)) < static_cast<int64_t>(work.size());) {
      const Chunk& c = chunks[work[w]];
      const size_t i = c.table;
      int64_t* r = rows[i];
      const int64_t stride = res[i]->store->stride(), dim = records ? stride : res[i]->dim;
      const float* base = records ? res[i]->store->device_records() : res[i]->store->base(0);
      const size_t bytes = sizeof(float) * static_cast<size_t>(dim);
      int64_t at = c.at;
      for (int64_t j = c.begin; j < c.end; ++j) {
        const int64_t ahead = j + kAhead < c.end ? r[j + kAhead] : -1;
        if (ahead >= 0) {
          const char* p = reinterpret_cast<const char*>(base + ahead * stride);
          for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
        }
        if (r[j] < 0) continue;
        CopyRow(out[i] + at * dim, base + r[j] * stride, bytes, streaming);
        r[j] = at++;
      }
      if (streaming) FenceStreaming();   // (before the group's rows may be sent)
      const int64_t g = group_of[w];
      if (left[g].fetch_sub(1) != 1) continue;
      const Chunk& a = chunks[work[first[g]]];
      const Chunk& z = chunks[work[first[g + 1] - 1]];
      if (z.at + z.held > a.at) hooks.ready(i, a.at, z.at + z.held - a.at);
    }
  });
  return held;
}
#if TF_SOK_WITH_CUDA
namespace {
// Evicted records go back by copies (MoveRecords) unless TF_SOK_WRITE_BACK_COPIES=0 (read at each call).
bool WriteBackByCopies() { return SwitchOn("TF_SOK_WRITE_BACK_COPIES"); }

// The host's threads that write copied-back records into their store rows, shared by every table
// (CUDA runs a device's host functions one at a time); never destroyed (host functions may run late).
tf::thread::ThreadPool* WriteBackThreads() {
  static auto* pool = new tf::thread::ThreadPool(
      tf::Env::Default(), "tf_sok_write_back",
      std::max(1, std::min(8, static_cast<int>(std::thread::hardware_concurrency()) / 2)));
  return pool;
}

// Pinned memory *p (*have bytes) of a table's, grown to at least `bytes` (doubling) once `stream` is
// done with it; *p null when there is no pinned memory for it.
absl::Status GrowPinned(IndexResource* res, cudaStream_t stream, size_t bytes, void** p, size_t* have) {
  if (bytes <= *have) return absl::OkStatus();
  TF_RETURN_IF_ERROR(CudaWait(stream));
  if (*p) res->pinned->Free(*p);
  *have = std::max(bytes, 2 * *have);
  *p = res->pinned->Allocate(*have);
  if (*p == nullptr) *have = 0;
  return absl::OkStatus();
}

struct WriteBackJob {
  const float* records;   // [n, stride], pinned
  const int64_t* rows;    // [n]: each record's store row
  int64_t n, stride;
  float* store;           // HostStore::records()
  bool streaming;
};

// A host function of the write-back stream (no CUDA calls): the copied records into their store rows.
void CUDART_CB WriteBackRecords(void* arg) {
  std::unique_ptr<WriteBackJob> job(static_cast<WriteBackJob*>(arg));
  const size_t bytes = sizeof(float) * static_cast<size_t>(job->stride);
  WriteBackThreads()->ParallelFor(job->n, static_cast<int64_t>(bytes) * 4, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j)
      CopyRow(job->store + job->rows[j] * job->stride, job->records + j * job->stride, bytes, job->streaming);
    if (job->streaming) FenceStreaming();
  });
}

// The n_out evicted records gathered into `evicted` (device memory) and sent back: copied into pinned
// memory on the table's write-back stream, then written into their store rows by a host function
// there; the store settles on them (HostStore::Pending). *started false: no pinned memory for them
// (nothing queued).
absl::Status StartWriteBack(const impl::GpuDevice& d, IndexResource* res, const impl::StoreRecordLayout& l,
                            const int64_t* evicted_slots, const int64_t* store_row_of, int64_t n_out, float* evicted,
                            float* store, bool* started) {
  *started = false;
  auto cuda = [&](cudaError_t e) {
    return e == cudaSuccess ? absl::OkStatus()
                            : absl::InternalError("dynamic table '" + res->table + "': writing evicted rows back: " +
                                                  "CUDA error " + cudaGetErrorString(e));
  };
  if (res->write_back_stream == nullptr) {
    TF_RETURN_IF_ERROR(cuda(cudaStreamCreateWithFlags(&res->write_back_stream, cudaStreamNonBlocking)));
    for (cudaEvent_t* e : {&res->write_back_gathered, &res->write_back_copied, &res->write_back_done})
      TF_RETURN_IF_ERROR(cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming)));
  }
  const size_t record_bytes = sizeof(float) * static_cast<size_t>(n_out * l.stride);
  const size_t bytes = record_bytes + 8 * static_cast<size_t>(n_out);
  // (the pinned memory is reused in the stream's order: the copies into it follow the last host function)
  TF_RETURN_IF_ERROR(GrowPinned(res, res->write_back_stream, bytes, &res->write_back_host, &res->write_back_bytes));
  if (res->write_back_host == nullptr) return absl::OkStatus();
  auto* rows_dev = static_cast<int64_t*>(d.scratch->Allocate(8 * static_cast<size_t>(n_out)));
  if (rows_dev == nullptr) return absl::ResourceExhaustedError("out of GPU memory for the rows a hybrid table evicts");
  impl::GpuGatherRecords(d, l, evicted_slots, n_out, evicted, store_row_of, rows_dev);
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream), side = res->write_back_stream;
  auto* records = static_cast<float*>(res->write_back_host);
  auto* rows = reinterpret_cast<int64_t*>(static_cast<char*>(res->write_back_host) + record_bytes);
  TF_RETURN_IF_ERROR(cuda(cudaEventRecord(res->write_back_gathered, stream)));
  TF_RETURN_IF_ERROR(cuda(cudaStreamWaitEvent(side, res->write_back_gathered, 0)));
  TF_RETURN_IF_ERROR(cuda(cudaMemcpyAsync(records, evicted, record_bytes, cudaMemcpyDeviceToHost, side)));
  TF_RETURN_IF_ERROR(cuda(cudaMemcpyAsync(rows, rows_dev, 8 * n_out, cudaMemcpyDeviceToHost, side)));
  TF_RETURN_IF_ERROR(cuda(cudaEventRecord(res->write_back_copied, side)));
  auto* job = new WriteBackJob{records, rows, n_out, l.stride, store, StreamingGather()};
  const cudaError_t queued = cudaLaunchHostFunc(side, WriteBackRecords, job);
  if (queued != cudaSuccess) delete job;
  TF_RETURN_IF_ERROR(cuda(queued));
  TF_RETURN_IF_ERROR(cuda(cudaEventRecord(res->write_back_done, side)));
  res->store->Pending();
  *started = true;
  return absl::OkStatus();
}

// a CUDA call's error on the way of a table's gathered rows
absl::Status GatherCopyStatus(const IndexResource& res, cudaError_t e) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError("dynamic table '" + res.table + "': copying gathered rows: CUDA error " +
                             cudaGetErrorString(e));
}
}  // namespace

absl::Status GatherStreamStart(IndexResource* res, cudaStream_t stream) {
  if (res->gather_stream == nullptr) {
    TF_RETURN_IF_ERROR(GatherCopyStatus(*res, cudaStreamCreateWithFlags(&res->gather_stream, cudaStreamNonBlocking)));
    for (cudaEvent_t* e : {&res->gather_ready, &res->gather_copied})
      TF_RETURN_IF_ERROR(GatherCopyStatus(*res, cudaEventCreateWithFlags(e, cudaEventDisableTiming)));
  }
  TF_RETURN_IF_ERROR(GatherCopyStatus(*res, cudaEventRecord(res->gather_ready, stream)));
  return GatherCopyStatus(*res, cudaStreamWaitEvent(res->gather_stream, res->gather_ready, 0));
}

absl::Status GatherStreamJoin(IndexResource* res, cudaStream_t stream) {
  TF_RETURN_IF_ERROR(GatherCopyStatus(*res, cudaEventRecord(res->gather_copied, res->gather_stream)));
  return GatherCopyStatus(*res, cudaStreamWaitEvent(stream, res->gather_copied, 0));
}

namespace {
// The records of the n_in keys a call takes in (store_rows, fresh: on the device): the first share of
// them gathered from the host tier by the host's threads and copied over group by group as they
// complete (on the table's gather stream), then written into their cache rows, while the device reads
// the rest in place (in_place(first): the reads of records [first, n_in), launched once the gather
// starts). *read_in false: too few of them held, nothing done (in_place not called).
absl::Status GatherRecordsIn(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res,
                             const impl::StoreRecordLayout& l, const int64_t* store_rows, const uint8_t* fresh,
                             const int64_t* cache_rows, int64_t n_in, int64_t min_rows,
                             const std::function<void(int64_t)>& in_place, bool* read_in) {
  *read_in = false;
  const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
  const int64_t n = GatherCount(n_in, /*records=*/true);
  if (n <= 0) return absl::OkStatus();
  // [store rows | fresh flags | records from a 64-byte boundary]
  const size_t list_bytes = 8 * static_cast<size_t>(n) + (fresh ? (static_cast<size_t>(n) + 7) / 8 * 8 : 0);
  const size_t bytes = list_bytes + 64 + sizeof(float) * static_cast<size_t>(n * l.stride);
  TF_RETURN_IF_ERROR(GrowPinned(res, stream, bytes, &res->gather_pinned, &res->gather_bytes));
  if (res->gather_pinned == nullptr) return absl::OkStatus();
  auto* rows = static_cast<int64_t*>(res->gather_pinned);
  auto* fresh_host = reinterpret_cast<uint8_t*>(rows + n);
  cudaMemcpyAsync(rows, store_rows, 8 * n, cudaMemcpyDeviceToHost, stream);
  if (fresh) cudaMemcpyAsync(fresh_host, fresh, n, cudaMemcpyDeviceToHost, stream);
  TF_RETURN_IF_ERROR(CudaWait(stream));
  if (fresh)
    for (int64_t j = 0; j < n; ++j)
      if (fresh_host[j]) rows[j] = -1;   // (StoreFresh sets them)
  float* out = LineAligned(static_cast<char*>(res->gather_pinned) + list_bytes);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return absl::InternalError("no current CUDA device");
  float* records_dev = nullptr;
  absl::Status status;
  GatherHooks hooks;
  hooks.start = [&](size_t, int64_t m) {
    records_dev = static_cast<float*>(d.scratch->Allocate(sizeof(float) * static_cast<size_t>(m * l.stride)));
    if (records_dev == nullptr) return false;
    status = GatherStreamStart(res, stream);
    if (!status.ok()) return false;
    in_place(n);
    return true;
  };
  hooks.ready = [&](size_t, int64_t first, int64_t m) {
    cudaSetDevice(device);
    cudaMemcpyAsync(records_dev + first * l.stride, out + first * l.stride, sizeof(float) * m * l.stride,
                    cudaMemcpyHostToDevice, res->gather_stream);
  };
  std::vector<bool> gathered;
  bool ok = true;
  const std::vector<int64_t> held =
      GatherStoreRows(ctx, {res}, {n}, {rows}, min_rows, {out}, hooks, &gathered, &ok, /*records=*/true);
  TF_RETURN_IF_ERROR(status);
  if (!ok) return absl::ResourceExhaustedError("out of GPU memory for the rows a hybrid table takes in");
  if (!gathered[0]) return absl::OkStatus();
  *read_in = true;   // (the reads in place are launched)
  res->stats.bytes_in_gathered += held[0] * res->store->row_bytes();
  TF_RETURN_IF_ERROR(GatherStreamJoin(res, stream));
  // (each record's place in the gathered ones; pinned: the next call to use them waits for the stream)
  auto* at = static_cast<int64_t*>(d.scratch->Allocate(8 * static_cast<size_t>(n)));
  if (at == nullptr) return absl::ResourceExhaustedError("out of GPU memory for the rows a hybrid table takes in");
  cudaMemcpyAsync(at, rows, 8 * n, cudaMemcpyHostToDevice, stream);
  impl::GpuMoveRecords(d, l, nullptr, nullptr, nullptr, 0, at, fresh, cache_rows, n, records_dev);
  return absl::OkStatus();
}
}  // namespace

absl::Status MoveRecords(tf::OpKernelContext* ctx, const impl::GpuDevice& d, IndexResource* res,
                         const impl::StoreRecordLayout& l, const int64_t* evicted_slots, const int64_t* store_row_of,
                         int64_t n_out, const int64_t* store_rows, const uint8_t* fresh, const int64_t* cache_rows,
                         int64_t n_in, float* store) {
  // (the store rows read and written here after every earlier write-back's)
  if (res->write_back_done != nullptr) {
    const cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(d.stream), res->write_back_done, 0);
    if (e != cudaSuccess) return absl::InternalError(std::string("CUDA error ") + cudaGetErrorString(e));
  }
  const int64_t gather_min = GatherRecordsMinRows(static_cast<int64_t>(sizeof(float)) * l.stride);
  const bool gather_in = !l.beside && gather_min >= 0 && n_in > 0 && n_in >= gather_min;
  if (gather_in) res->store->Settle();   // (the host reads the records: earlier write-backs in first)
  float* evicted = nullptr;
  bool sent_back = false;   // the evicted records on their way back by copies
  if (n_out > 0) {
    evicted = static_cast<float*>(d.scratch->Allocate(sizeof(float) * static_cast<size_t>(n_out * l.stride)));
    if (evicted == nullptr) return absl::ResourceExhaustedError("out of GPU memory for the rows a hybrid table evicts");
    // (a prefetch's, beside the step, in place: copies written back by the host would hold up the
    // next step, which waits for them)
    if (WriteBackByCopies() && !l.beside)
      TF_RETURN_IF_ERROR(StartWriteBack(d, res, l, evicted_slots, store_row_of, n_out, evicted, store, &sent_back));
    if (!sent_back) impl::GpuGatherRecords(d, l, evicted_slots, n_out, evicted);
  }
  // what is left in place, in one launch: the evicted records' writes, the new records' reads from `first`
  const auto in_place = [&](int64_t first) {
    impl::GpuMoveRecords(d, l, evicted, evicted_slots, store_row_of, sent_back ? 0 : n_out, store_rows + first,
                         fresh ? fresh + first : nullptr, cache_rows + first, n_in - first, store);
  };
  bool read_in = false;   // a share of the new records gathered by the host (and the rest read in place)
  absl::Status status;
  if (gather_in)
    status = GatherRecordsIn(ctx, d, res, l, store_rows, fresh, cache_rows, n_in, gather_min, in_place, &read_in);
  if (status.ok() && !read_in) in_place(0);
  // (the copies back read the call's scratch memory: its stream waits for them, whatever happened since)
  if (sent_back) {
    const cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(d.stream), res->write_back_copied, 0);
    if (e != cudaSuccess && status.ok())
      status = absl::InternalError(std::string("CUDA error ") + cudaGetErrorString(e));
  }
  return status;
}
#endif

}  // namespace dynamic_kernels
}  // namespace tf_sok
