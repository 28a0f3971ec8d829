// NCCL collectives for the multi-rank lookup; see nccl.h.
#include <dlfcn.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tf_sok/cc/impl/gpu_util.cuh"
#include "tf_sok/cc/impl/nccl.h"

namespace tf_sok {
namespace impl {
namespace nccl {
namespace {

// The slice of NCCL's C ABI used here (nccl.h, stable since NCCL 2.7).
typedef struct NcclComm* CommHandle;
struct UniqueId {
  char internal[kUniqueIdBytes];
};
constexpr int kSuccess = 0;
constexpr int kInt8 = 0;
constexpr int kInt32 = 2;

struct Api {
  const char* (*get_error_string)(int);
  int (*get_version)(int*);
  int (*get_unique_id)(UniqueId*);
  int (*comm_init_rank)(CommHandle*, int, UniqueId, int);
  int (*group_start)();
  int (*group_end)();
  int (*send)(const void*, size_t, int, int, CommHandle, cudaStream_t);
  int (*recv)(void*, size_t, int, int, CommHandle, cudaStream_t);
  int (*all_gather)(const void*, void*, size_t, int, CommHandle, cudaStream_t);
};

template <typename F>
bool Bind(void* lib, const char* name, F* f) {
  *f = reinterpret_cast<F>(dlsym(lib, name));
  return *f != nullptr;
}

// Opens the library once; returns nullptr and sets *why if it cannot.
const Api* Load(std::string* why) {
  static std::once_flag once;
  static Api api;
  static std::string error;
  std::call_once(once, [] {
    const char* path = std::getenv("TF_SOK_NCCL_LIBRARY");
    const char* name = path && *path ? path : "libnccl.so.2";
    void* lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      error = std::string("cannot open NCCL (") + name + "): " + dlerror() +
              "; put libnccl.so.2 on LD_LIBRARY_PATH or set TF_SOK_NCCL_LIBRARY to its path";
      return;
    }
    bool ok = Bind(lib, "ncclGetErrorString", &api.get_error_string) && Bind(lib, "ncclGetVersion", &api.get_version) &&
              Bind(lib, "ncclGetUniqueId", &api.get_unique_id) && Bind(lib, "ncclCommInitRank", &api.comm_init_rank) &&
              Bind(lib, "ncclGroupStart", &api.group_start) && Bind(lib, "ncclGroupEnd", &api.group_end) &&
              Bind(lib, "ncclSend", &api.send) && Bind(lib, "ncclRecv", &api.recv) &&
              Bind(lib, "ncclAllGather", &api.all_gather);
    if (!ok) error = std::string(name) + " lacks a symbol tf_sok needs (NCCL >= 2.7 required)";
  });
  if (!error.empty()) {
    *why = error;
    return nullptr;
  }
  return &api;
}

// The ranks of one communicator that live in this process (several under
// MirroredStrategy, one GPU each). Before each collective they meet on the
// host, so that no rank's NCCL kernel starts waiting on its GPU for a peer
// that has yet to launch: meanwhile a CUDA call that may synchronise every
// device of the process (allocations among them) would wait for that kernel,
// and could hold up the very peer it waits for. Measured: without the meeting
// the first step on two H200s never finished; with it, it does.
class LocalRanks {
 public:
  void Join() {
    std::lock_guard<std::mutex> l(mu_);
    ++size_;
  }
  void Meet() {
    std::unique_lock<std::mutex> l(mu_);
    if (size_ < 2) return;
    const uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(l, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int size_ = 0, arrived_ = 0;
  uint64_t generation_ = 0;
};

struct Comm {
  CommHandle handle = nullptr;
  int rank = 0;
  int size = 0;
  int device = -1;
  std::shared_ptr<LocalRanks> local;
};

std::mutex registry_mu;
std::map<int64_t, Comm>& Registry() {
  static auto* r = new std::map<int64_t, Comm>();  // never destroyed: NCCL may outlive static teardown
  return *r;
}

// This process's ranks of each communicator, by its unique id (guarded by registry_mu).
std::map<std::string, std::shared_ptr<LocalRanks>>& LocalRanksById() {
  static auto* r = new std::map<std::string, std::shared_ptr<LocalRanks>>();
  return *r;
}

// Set once this process holds communicators on two GPUs or more (see SeveralDevicesInProcess).
std::atomic<bool> several_devices{false};

std::string Failed(const Api* api, const char* what, int r) {
  return std::string("NCCL ") + what + " failed: " + api->get_error_string(r);
}

std::string CudaFailed(const char* what, cudaError_t c) {
  return std::string(what) + " failed: " + cudaGetErrorString(c);
}

// The device of d's stream, made current on the calling thread.
std::string CurrentFromStream(const GpuDevice& d, int* device) {
  cudaError_t c = cudaStreamGetDevice(gpu::StreamOf(d), device);
  if (c != cudaSuccess) return CudaFailed("cudaStreamGetDevice", c);
  c = cudaSetDevice(*device);
  return c == cudaSuccess ? "" : CudaFailed("cudaSetDevice", c);
}

// The communicator `key`, checked against the device of d's stream; makes that device current.
std::string Use(int64_t key, const GpuDevice& d, const Api** api, Comm* comm) {
  std::string why;
  *api = Load(&why);
  if (!*api) return why;
  {
    std::lock_guard<std::mutex> l(registry_mu);
    auto it = Registry().find(key);
    if (it == Registry().end()) {
      return "tf_sok NCCL communicator " + std::to_string(key) + " does not exist in this process; create it with "
             "sok.init(exchange=\"nccl\") on every rank first";
    }
    *comm = it->second;
  }
  int device = -1;
  why = CurrentFromStream(d, &device);
  if (!why.empty() || device == comm->device) return why;
  return "tf_sok NCCL communicator " + std::to_string(key) + " was created on GPU " + std::to_string(comm->device) +
         " but this op runs on GPU " + std::to_string(device);
}

// ncclGroupStart .. body .. ncclGroupEnd, ending the group even when the body fails.
template <typename Body>
std::string Grouped(const Api* api, Body body) {
  int r = api->group_start();
  if (r != kSuccess) return Failed(api, "ncclGroupStart", r);
  std::string why = body();
  r = api->group_end();
  if (why.empty() && r != kSuccess) why = Failed(api, "ncclGroupEnd", r);
  return why;
}

}  // namespace

std::string Version(std::string* version) {
  std::string why;
  const Api* api = Load(&why);
  if (!api) return why;
  int v = 0;
  int r = api->get_version(&v);
  if (r != kSuccess) return Failed(api, "ncclGetVersion", r);
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch
  *version = std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
  return "";
}

std::string GetUniqueId(char id[kUniqueIdBytes]) {
  std::string why;
  const Api* api = Load(&why);
  if (!api) return why;
  UniqueId u;
  int r = api->get_unique_id(&u);
  if (r != kSuccess) return Failed(api, "ncclGetUniqueId", r);
  std::memcpy(id, u.internal, kUniqueIdBytes);
  return "";
}

std::string Init(int64_t key, const char id[kUniqueIdBytes], int rank, int size, const GpuDevice& d) {
  std::string why;
  const Api* api = Load(&why);
  if (!api) return why;
  if (size < 1 || rank < 0 || rank >= size) {
    return "tf_sok NCCL communicator: rank " + std::to_string(rank) + " is not in [0, " + std::to_string(size) + ")";
  }
  {
    std::lock_guard<std::mutex> l(registry_mu);
    if (Registry().count(key)) return "tf_sok NCCL communicator " + std::to_string(key) + " exists already";
  }
  Comm comm;
  comm.rank = rank;
  comm.size = size;
  why = CurrentFromStream(d, &comm.device);
  if (!why.empty()) return why;
  // work already queued on the stream may be an earlier communicator's: let it finish first
  cudaError_t c = cudaStreamSynchronize(gpu::StreamOf(d));
  if (c != cudaSuccess) return CudaFailed("cudaStreamSynchronize", c);
  {
    std::lock_guard<std::mutex> l(registry_mu);
    auto& local = LocalRanksById()[std::string(id, kUniqueIdBytes)];
    if (!local) local = std::make_shared<LocalRanks>();
    local->Join();  // before ncclCommInitRank returns anywhere: every local rank has joined by then
    comm.local = local;
  }
  UniqueId u;
  std::memcpy(u.internal, id, kUniqueIdBytes);
  int r = api->comm_init_rank(&comm.handle, size, u, rank);
  if (r != kSuccess) return Failed(api, "ncclCommInitRank", r);
  std::lock_guard<std::mutex> l(registry_mu);
  for (const auto& kv : Registry()) {
    if (kv.second.device != comm.device) several_devices.store(true, std::memory_order_relaxed);
  }
  Registry()[key] = comm;
  return "";
}

int Size(int64_t key, int* rank) {
  std::lock_guard<std::mutex> l(registry_mu);
  auto it = Registry().find(key);
  if (it == Registry().end()) return -1;
  if (rank) *rank = it->second.rank;
  return it->second.size;
}

bool SeveralDevicesInProcess() { return several_devices.load(std::memory_order_relaxed); }

std::string MakeStreamDeviceCurrent(const GpuDevice& d) {
  int device = -1;
  return CurrentFromStream(d, &device);
}

std::string ExchangeCounts(int64_t key, const GpuDevice& d, const int32_t* send_counts, int32_t* recv_counts) {
  const Api* api = nullptr;
  Comm comm;
  std::string why = Use(key, d, &api, &comm);
  if (!why.empty()) return why;
  const int n = comm.size;
  cudaStream_t stream = gpu::StreamOf(d);
  auto* dev = gpu::Alloc<int32_t>(d, 2 * n);
  if (!dev) return "tf_sok NCCL: out of GPU memory for " + std::to_string(n) + " counts";
  cudaMemcpyAsync(dev, send_counts, sizeof(int32_t) * n, cudaMemcpyHostToDevice, stream);
  comm.local->Meet();
  why = Grouped(api, [&]() -> std::string {
    for (int p = 0; p < n; ++p) {
      if (p == comm.rank) continue;
      int r = api->send(dev + p, 1, kInt32, p, comm.handle, stream);
      if (r != kSuccess) return Failed(api, "ncclSend", r);
      r = api->recv(dev + n + p, 1, kInt32, p, comm.handle, stream);
      if (r != kSuccess) return Failed(api, "ncclRecv", r);
    }
    return "";
  });
  if (!why.empty()) return why;
  cudaMemcpyAsync(recv_counts, dev + n, sizeof(int32_t) * n, cudaMemcpyDeviceToHost, stream);
  cudaError_t c = cudaStreamSynchronize(stream);
  if (c != cudaSuccess) return CudaFailed("tf_sok NCCL count exchange", c);
  recv_counts[comm.rank] = send_counts[comm.rank];
  return "";
}

std::string AllToAll(int64_t key, const GpuDevice& d, const void* send, const int64_t* send_bytes, void* recv,
                     const int64_t* recv_bytes) {
  const Api* api = nullptr;
  Comm comm;
  std::string why = Use(key, d, &api, &comm);
  if (!why.empty()) return why;
  cudaStream_t stream = gpu::StreamOf(d);
  const char* src = static_cast<const char*>(send);
  char* dst = static_cast<char*>(recv);
  std::vector<int64_t> send_at(comm.size + 1, 0), recv_at(comm.size + 1, 0);
  for (int p = 0; p < comm.size; ++p) {
    send_at[p + 1] = send_at[p] + send_bytes[p];
    recv_at[p + 1] = recv_at[p] + recv_bytes[p];
  }
  const int me = comm.rank;
  if (send_bytes[me] > 0) {
    cudaError_t c = cudaMemcpyAsync(dst + recv_at[me], src + send_at[me], send_bytes[me], cudaMemcpyDeviceToDevice,
                                    stream);
    if (c != cudaSuccess) return CudaFailed("cudaMemcpyAsync", c);
  }
  comm.local->Meet();
  return Grouped(api, [&]() -> std::string {
    for (int p = 0; p < comm.size; ++p) {
      if (p == me) continue;
      if (send_bytes[p] > 0) {  // a peer skips the matching receive of an empty message alike
        int r = api->send(src + send_at[p], send_bytes[p], kInt8, p, comm.handle, stream);
        if (r != kSuccess) return Failed(api, "ncclSend", r);
      }
      if (recv_bytes[p] > 0) {
        int r = api->recv(dst + recv_at[p], recv_bytes[p], kInt8, p, comm.handle, stream);
        if (r != kSuccess) return Failed(api, "ncclRecv", r);
      }
    }
    return "";
  });
}

std::string AllGather(int64_t key, const GpuDevice& d, const void* send, void* recv, int64_t bytes) {
  const Api* api = nullptr;
  Comm comm;
  std::string why = Use(key, d, &api, &comm);
  if (!why.empty()) return why;
  if (bytes == 0) return "";
  comm.local->Meet();
  int r = api->all_gather(send, recv, bytes, kInt8, comm.handle, gpu::StreamOf(d));
  return r == kSuccess ? "" : Failed(api, "ncclAllGather", r);
}

}  // namespace nccl
}  // namespace impl
}  // namespace tf_sok
