// The lookup's first exchange on the GPU; see key_exchange.h.
#include <vector>

#include "tf_sok/cc/impl/gpu_util.cuh"
#include "tf_sok/cc/impl/key_exchange.h"
#include "tf_sok/cc/impl/nccl.h"

namespace tf_sok {
namespace impl {
namespace key_exchange {
namespace {

constexpr int kThreads = 256;

// Status words after the counts in each rank's all-gathered row.
constexpr int kStatusWords = 5;

// keys[i] = table << kTableShift | id; a bad id (or feature) is recorded (the
// first position wins) and stands in as row 0 of table 0, so the grouping and
// the counts stay well defined until the caller reports it.
__global__ void KeysKernel(const long long* ids, const long long* feature_of, int n, const long long* features,
                           int num_features, long long* keys, unsigned long long* first_bad) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const long long f = feature_of[i], id = ids[i];
  const bool known = f >= 0 && f < num_features;
  const long long table = known ? features[2 * f] : 0, rows = known ? features[2 * f + 1] : 0;
  if (!known || id < 0 || id >= rows) {
    atomicMin(first_bad, static_cast<unsigned long long>(i));
    keys[i] = 0;
    return;
  }
  keys[i] = (table << kTableShift) | id;
}

// This rank's row of the all-gather: counts per owner, then signature, found,
// feature, id and the feature's table's rows.
__global__ void StatusKernel(const int* counts, int size, long long signature, const unsigned long long* first_bad,
                             int n, const long long* ids, const long long* feature_of, const long long* features,
                             int num_features, long long* row) {
  for (int p = threadIdx.x; p < size; p += blockDim.x) row[p] = counts[p];
  if (threadIdx.x != 0) return;
  const unsigned long long bad = *first_bad;
  const bool found = bad < static_cast<unsigned long long>(n);
  row[size] = signature;
  row[size + 1] = found ? 1 : 0;
  row[size + 2] = found ? feature_of[bad] : -1;
  row[size + 3] = found ? ids[bad] : -1;
  const long long f = found ? feature_of[bad] : -1;
  row[size + 4] = f >= 0 && f < num_features ? features[2 * f + 1] : 0;
}

std::string Explain(const Error& e, const char* what) {
  if (e.ok()) return "";
  if (e.kind == ErrorKind::kOutOfMemory) return std::string(what) + ": out of GPU scratch memory";
  if (e.kind == ErrorKind::kCudaError) {
    return std::string(what) + ": " + cudaGetErrorString(static_cast<cudaError_t>(e.value));
  }
  return std::string(what) + ": failed (kind " + std::to_string(static_cast<int>(e.kind)) + ")";
}

}  // namespace

std::string Prepare(const GpuDevice& d, const int64_t* ids, const int64_t* feature_of, int64_t n,
                    const Spec& spec, Plan* plan) {
  const char* what = "tf_sok key exchange";
  plan->size = nccl::Size(spec.comm, &plan->rank);
  if (plan->size < 0) {
    return "tf_sok NCCL communicator " + std::to_string(spec.comm) + " does not exist in this process";
  }
  const int N = plan->size;
  if (spec.route.num_buckets != N) {
    return std::string(what) + ": " + std::to_string(spec.route.num_buckets) + " owners for " + std::to_string(N) +
           " ranks";
  }
  cudaStream_t s = gpu::StreamOf(d);
  auto* keys = gpu::Alloc<long long>(d, n);
  auto* first_bad = gpu::Alloc<unsigned long long>(d, 1);
  auto* row = gpu::Alloc<long long>(d, N + kStatusWords);
  auto* every = gpu::Alloc<long long>(d, static_cast<size_t>(N) * (N + kStatusWords));
  if (!keys || !first_bad || !row || !every) return std::string(what) + ": out of GPU scratch memory";
  cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), s);  // "none": larger than any position
  const auto* id = reinterpret_cast<const long long*>(ids);
  const auto* feature = reinterpret_cast<const long long*>(feature_of);
  if (n > 0) {
    KeysKernel<<<static_cast<int>((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(
        id, feature, static_cast<int>(n), reinterpret_cast<const long long*>(spec.features), spec.num_features,
        keys, first_bad);
  }
  const int *num_unique = nullptr, *counts = nullptr;
  std::string why = Explain(
      RouteOnStream(d, reinterpret_cast<const int64_t*>(keys), n, spec.route, &plan->route, &num_unique, &counts),
      what);
  if (!why.empty()) return why;
  StatusKernel<<<1, 32, 0, s>>>(counts, N, spec.signature, first_bad, static_cast<int>(n), id, feature,
                                reinterpret_cast<const long long*>(spec.features), spec.num_features, row);
  why = nccl::AllGather(spec.comm, d, row, every, sizeof(long long) * (N + kStatusWords));
  if (!why.empty()) return why;
  std::vector<long long> host(static_cast<size_t>(N) * (N + kStatusWords));
  int unique = 0;
  cudaMemcpyAsync(host.data(), every, sizeof(long long) * host.size(), cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(&unique, num_unique, sizeof(int), cudaMemcpyDeviceToHost, s);
  cudaError_t c = cudaStreamSynchronize(s);  // the op's one wait
  if (c != cudaSuccess) return std::string(what) + ": " + cudaGetErrorString(c);
  plan->send_splits.assign(N, 0);
  plan->recv_splits.assign(N, 0);
  plan->status.assign(N, RankStatus());
  for (int p = 0; p < N; ++p) {
    const long long* r = host.data() + static_cast<size_t>(p) * (N + kStatusWords);
    plan->send_splits[p] = static_cast<int32_t>(host[static_cast<size_t>(plan->rank) * (N + kStatusWords) + p]);
    plan->recv_splits[p] = static_cast<int32_t>(r[plan->rank]);
    plan->status[p] = RankStatus{r[N], r[N + 1], r[N + 2], r[N + 3], r[N + 4]};
  }
  plan->route.num_unique = unique;
  plan->route.splits = plan->send_splits;
  return "";
}

std::string Finish(const GpuDevice& d, const Plan& plan, const Spec& spec, int64_t* send_keys, int64_t* position,
                   int64_t* recv_keys) {
  std::vector<int32_t> splits(plan.size);
  std::string why = Explain(Route<GpuDevice>().Finish(d, plan.route, spec.route, send_keys, splits.data(), position),
                            "tf_sok key exchange");
  if (!why.empty()) return why;
  std::vector<int64_t> send_bytes(plan.size), recv_bytes(plan.size);
  for (int p = 0; p < plan.size; ++p) {
    send_bytes[p] = static_cast<int64_t>(sizeof(int64_t)) * plan.send_splits[p];
    recv_bytes[p] = static_cast<int64_t>(sizeof(int64_t)) * plan.recv_splits[p];
  }
  return nccl::AllToAll(spec.comm, d, send_keys, send_bytes.data(), recv_keys, recv_bytes.data());
}

}  // namespace key_exchange
}  // namespace impl
}  // namespace tf_sok
