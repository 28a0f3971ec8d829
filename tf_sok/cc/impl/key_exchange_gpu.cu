// The lookup's exchange plan on the GPU; see key_exchange.h.
#include <vector>

#include "tf_sok/cc/impl/gpu_util.cuh"
#include "tf_sok/cc/impl/key_exchange.h"
#include "tf_sok/cc/impl/nccl.h"

namespace tf_sok {
namespace impl {
namespace key_exchange {
namespace {

constexpr int kThreads = 256;
constexpr int kStatusWords = 5;  // after the counts per owner: signature, found, feature, id, rows

inline int Blocks(long long n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

// Per-feature facts on the device: offsets[F + 1], then table[F], rows[F].
struct Features {
  const long long* offsets;
  const long long* table;
  const long long* rows;
  int count;
};

// keys[i] = table << kTableShift | id; a bad id is recorded (the first position
// wins) and stands in as row 0 of table 0, so the grouping and the counts stay
// well defined until the caller reports it.
__global__ void KeysKernel(const long long* ids, int n, const Features f, long long* keys,
                           unsigned long long* first_bad) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int feature = gpu::SegmentOf(f.offsets, f.count, i);
  const long long id = ids[i];
  if (id < 0 || id >= f.rows[feature]) {
    atomicMin(first_bad, static_cast<unsigned long long>(i));
    keys[i] = 0;
    return;
  }
  keys[i] = (f.table[feature] << kTableShift) | id;
}

// This rank's row of the all-gather: [N] distinct keys per owner, the status
// words, [N x T] distinct keys per owner and table.
__global__ void StatusKernel(const int* counts, const int* owner_table, int N, int T, long long signature,
                             const unsigned long long* first_bad, int n, const long long* ids, const Features f,
                             long long* row) {
  for (int p = threadIdx.x; p < N; p += blockDim.x) row[p] = counts[p];
  for (int k = threadIdx.x; k < N * T; k += blockDim.x) row[N + kStatusWords + k] = owner_table[k];
  if (threadIdx.x != 0) return;
  const unsigned long long bad = *first_bad;
  const bool found = bad < static_cast<unsigned long long>(n);
  const int feature = found ? gpu::SegmentOf(f.offsets, f.count, static_cast<long long>(bad)) : -1;
  row[N] = signature;
  row[N + 1] = found ? 1 : 0;
  row[N + 2] = feature;
  row[N + 3] = found ? ids[bad] : -1;
  row[N + 4] = found ? f.rows[feature] : 0;
}

// Where blocks of keys (one block per rank and table) start and go. Receiving
// side, blocks (sender s, table t) in the order the all-to-all delivers them;
// sending side, blocks (owner p, table t) in the order this rank sent them.
struct Layout {
  long long* recv_start;  // [N*T + 1]: the block's first key among the received
  long long* recv_row;    // [N*T]: its place in table_rows
  long long* recv_ret;    // [N*T]: its place in group_gather
  long long* recv_val;    // [N*T]: its row among its group's tables' lookups, concatenated
  long long* recv_goff;   // [N*T]: where its group starts in group_gather
  long long* send_start;  // [N*T + 1]: the block's first key among the sent
  long long* send_ret;    // [N*T]: its place among the vectors its group's all-to-all brings back
  int* table_count;       // [T]: keys received per table
  long long* table_start; // [T]: where table t starts in table_rows
  long long* in_group;    // [T]: where table t starts among its group's tables' rows
  long long* sender_acc;  // [T]: running count of table t's keys from earlier senders
};

constexpr int kMaxGroups = kMaxExchangeWidths;  // LayoutKernel's per-group arrays

// One thread, O(ranks x tables): cnt(s, p, t) = distinct keys of table t rank s
// sends rank p, read from the all-gathered rows of width W.
__global__ void LayoutKernel(const long long* every, int W, int N, int T, int G, int me, const long long* group,
                             Layout L) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  auto cnt = [&](int s, int p, int t) { return every[static_cast<long long>(s) * W + N + kStatusWords + p * T + t]; };
  long long group_rows[kMaxGroups], ret_at[kMaxGroups], back_at[kMaxGroups];
  for (int g = 0; g < G; ++g) group_rows[g] = back_at[g] = 0;
  long long at = 0;
  for (int t = 0; t < T; ++t) {
    long long c = 0;
    for (int s = 0; s < N; ++s) c += cnt(s, me, t);
    L.table_count[t] = static_cast<int>(c);
    L.table_start[t] = at;
    L.in_group[t] = group_rows[group[t]];
    L.sender_acc[t] = 0;
    group_rows[group[t]] += c;
    at += c;
  }
  long long group_at[kMaxGroups];
  for (int g = 0; g < G; ++g) group_at[g] = ret_at[g] = g ? ret_at[g - 1] + group_rows[g - 1] : 0;
  at = 0;
  for (int s = 0; s < N; ++s) {
    for (int t = 0; t < T; ++t) {
      const int k = s * T + t;
      const long long c = cnt(s, me, t);
      L.recv_start[k] = at;
      L.recv_row[k] = L.table_start[t] + L.sender_acc[t];
      L.recv_val[k] = L.in_group[t] + L.sender_acc[t];
      L.recv_ret[k] = ret_at[group[t]];
      L.recv_goff[k] = group_at[group[t]];
      ret_at[group[t]] += c;
      L.sender_acc[t] += c;
      at += c;
    }
  }
  L.recv_start[N * T] = at;
  at = 0;  // sending: the vectors of group g come back owner by owner, table by table
  for (int p = 0; p < N; ++p) {
    for (int t = 0; t < T; ++t) {
      const int k = p * T + t;
      L.send_start[k] = at;
      L.send_ret[k] = back_at[group[t]];
      back_at[group[t]] += cnt(me, p, t);
      at += cnt(me, p, t);
    }
  }
  L.send_start[N * T] = at;
}

__global__ void PlaceReceivedKernel(const long long* recv_keys, long long R, int blocks, const Layout L,
                                    long long* table_rows, long long* group_gather,
                                    long long* group_scatter) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= R) return;
  const int b = gpu::SegmentOf(L.recv_start, blocks, i);
  const long long j = i - L.recv_start[b];
  table_rows[L.recv_row[b] + j] = recv_keys[i] & kRowMask;
  group_gather[L.recv_ret[b] + j] = L.recv_val[b] + j;
  group_scatter[L.recv_goff[b] + L.recv_val[b] + j] = L.recv_ret[b] + j - L.recv_goff[b];  // the inverse
}

__global__ void SlotKernel(const long long* position, int n, int blocks, const Layout L, long long* slot) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const long long u = position[i];
  const int b = gpu::SegmentOf(L.send_start, blocks, u);
  slot[i] = L.send_ret[b] + (u - L.send_start[b]);
}

std::string Explain(const Error& e, const char* what) {
  if (e.ok()) return "";
  if (e.kind == ErrorKind::kOutOfMemory) return std::string(what) + ": out of GPU scratch memory";
  if (e.kind == ErrorKind::kCudaError) {
    return std::string(what) + ": " + cudaGetErrorString(static_cast<cudaError_t>(e.value));
  }
  return std::string(what) + ": failed (kind " + std::to_string(static_cast<int>(e.kind)) + ")";
}

// Device buffers Prepare leaves for Finish (scratch: alive until the op returns).
struct Buffers {
  const long long* every = nullptr;   // [N][W] all-gathered rows
  const long long* group = nullptr;   // [T] width group of each table
  int width = 0;
};

}  // namespace

std::string Prepare(const GpuDevice& d, const Spec& spec, Plan* plan) {
  const char* what = "tf_sok key exchange";
  plan->size = nccl::Size(spec.comm, &plan->rank);
  if (plan->size < 0) {
    return "tf_sok NCCL communicator " + std::to_string(spec.comm) + " does not exist in this process";
  }
  const int N = plan->size, F = spec.num_features, T = spec.route.num_tables, G = spec.num_groups;
  if (spec.route.num_buckets != N) {
    return std::string(what) + ": " + std::to_string(spec.route.num_buckets) + " owners for " + std::to_string(N) +
           " ranks";
  }
  if (G < 1 || G > kMaxGroups) {
    return std::string(what) + ": " + std::to_string(G) + " embedding widths in one lookup; at most " +
           std::to_string(kMaxGroups);
  }
  const int W = N + kStatusWords + N * T;
  int64_t* staged = spec.staging;  // page-locked: offsets, tables, rows per feature; group per table
  staged[0] = 0;
  for (int f = 0; f < F; ++f) {
    staged[f + 1] = staged[f] + spec.sizes[f];
    staged[F + 1 + f] = spec.feature_table[f];
    staged[2 * F + 1 + f] = spec.feature_rows[f];
  }
  for (int t = 0; t < T; ++t) staged[3 * F + 1 + t] = spec.table_group[t];
  const int64_t n = staged[F];
  plan->n = n;
  cudaStream_t s = gpu::StreamOf(d);
  const int64_t staged_size = StagingSize(F, T);
  auto* info = gpu::Alloc<long long>(d, staged_size);
  auto* flat = gpu::Alloc<long long>(d, n);
  auto* keys = gpu::Alloc<long long>(d, n);
  auto* first_bad = gpu::Alloc<unsigned long long>(d, 1);
  auto* owner_table = gpu::Alloc<int>(d, static_cast<size_t>(N) * T);
  auto* row = gpu::Alloc<long long>(d, W);
  auto* every = gpu::Alloc<long long>(d, static_cast<size_t>(N) * W);
  if (!info || !flat || !keys || !first_bad || !owner_table || !row || !every) {
    return std::string(what) + ": out of GPU scratch memory";
  }
  cudaMemcpyAsync(info, staged, sizeof(long long) * staged_size, cudaMemcpyHostToDevice, s);
  for (int f = 0; f < F; ++f) {
    if (spec.sizes[f] > 0) {
      cudaMemcpyAsync(flat + staged[f], spec.ids[f], sizeof(long long) * spec.sizes[f], cudaMemcpyDeviceToDevice, s);
    }
  }
  cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), s);  // "none": larger than any position
  cudaMemsetAsync(owner_table, 0, sizeof(int) * N * T, s);
  const Features features{info, info + F + 1, info + 2 * F + 1, F};
  if (n > 0) {
    KeysKernel<<<Blocks(n), kThreads, 0, s>>>(flat, static_cast<int>(n), features, keys, first_bad);
  }
  const int *num_unique = nullptr, *counts = nullptr;
  std::string why = Explain(RouteOnStream(d, reinterpret_cast<const int64_t*>(keys), n, spec.route, &plan->route,
                                          &num_unique, &counts, owner_table),
                            what);
  if (!why.empty()) return why;
  StatusKernel<<<1, 256, 0, s>>>(counts, owner_table, N, T, spec.signature, first_bad, static_cast<int>(n), flat,
                                 features, row);
  why = nccl::AllGather(spec.comm, d, row, every, sizeof(long long) * W);
  if (!why.empty()) return why;
  std::vector<long long> host(static_cast<size_t>(N) * W);
  int unique = 0;
  cudaMemcpyAsync(host.data(), every, sizeof(long long) * host.size(), cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(&unique, num_unique, sizeof(int), cudaMemcpyDeviceToHost, s);
  cudaError_t c = cudaStreamSynchronize(s);  // the op's one wait
  if (c != cudaSuccess) return std::string(what) + ": " + cudaGetErrorString(c);

  const int me = plan->rank;
  auto cnt = [&](int sender, int owner, int t) {
    return static_cast<int32_t>(host[static_cast<size_t>(sender) * W + N + kStatusWords + owner * T + t]);
  };
  plan->status.assign(N, RankStatus());
  plan->send_splits.assign(N, 0);
  plan->recv_splits.assign(N, 0);
  plan->table_counts.assign(T, 0);
  plan->group_send.assign(G, std::vector<int32_t>(N, 0));
  plan->group_recv.assign(G, std::vector<int32_t>(N, 0));
  plan->group_totals.assign(G, 0);
  plan->received = 0;
  for (int p = 0; p < N; ++p) {
    const long long* r = host.data() + static_cast<size_t>(p) * W;
    plan->status[p] = RankStatus{r[N], r[N + 1], r[N + 2], r[N + 3], r[N + 4]};
    plan->send_splits[p] = static_cast<int32_t>(host[static_cast<size_t>(me) * W + p]);
    plan->recv_splits[p] = static_cast<int32_t>(r[me]);
    plan->received += plan->recv_splits[p];
    for (int t = 0; t < T; ++t) {
      const int g = spec.table_group[t];
      plan->table_counts[t] += cnt(p, me, t);
      plan->group_send[g][p] += cnt(p, me, t);
      plan->group_recv[g][p] += cnt(me, p, t);
      plan->group_totals[g] += cnt(p, me, t);
    }
  }
  plan->route.num_unique = unique;
  plan->route.splits = plan->send_splits;
  auto buffers = std::make_shared<Buffers>();
  buffers->every = every;
  buffers->group = info + 3 * F + 1;
  buffers->width = W;
  plan->device = buffers;
  return "";
}

std::string Finish(const GpuDevice& d, const Plan& plan, const Spec& spec, int64_t* table_rows, int64_t* unit_splits,
                   int64_t* group_gather, int64_t* group_scatter, int64_t* slot) {
  const char* what = "tf_sok key exchange";
  const int N = plan.size, T = spec.route.num_tables;
  const int64_t U = plan.route.num_unique, R = plan.received, n = plan.n;
  const auto& buf = *static_cast<const Buffers*>(plan.device.get());
  cudaStream_t s = gpu::StreamOf(d);
  auto* send_keys = gpu::Alloc<long long>(d, U);
  auto* position = gpu::Alloc<long long>(d, n);
  auto* recv_keys = gpu::Alloc<long long>(d, R);
  Layout L;
  L.recv_start = gpu::Alloc<long long>(d, N * T + 1);
  L.recv_row = gpu::Alloc<long long>(d, N * T);
  L.recv_ret = gpu::Alloc<long long>(d, N * T);
  L.recv_val = gpu::Alloc<long long>(d, N * T);
  L.recv_goff = gpu::Alloc<long long>(d, N * T);
  L.send_start = gpu::Alloc<long long>(d, N * T + 1);
  L.send_ret = gpu::Alloc<long long>(d, N * T);
  L.table_count = gpu::Alloc<int>(d, T);
  L.table_start = gpu::Alloc<long long>(d, T);
  L.in_group = gpu::Alloc<long long>(d, T);
  L.sender_acc = gpu::Alloc<long long>(d, T);
  if (!send_keys || !position || !recv_keys || !L.recv_start || !L.recv_row || !L.recv_ret || !L.recv_val || !L.recv_goff ||
      !L.send_start || !L.send_ret || !L.table_count || !L.table_start || !L.in_group || !L.sender_acc) {
    return std::string(what) + ": out of GPU scratch memory";
  }
  std::vector<int32_t> splits(N);
  std::string why = Explain(Route<GpuDevice>().Finish(d, plan.route, spec.route, reinterpret_cast<int64_t*>(send_keys),
                                                      splits.data(), reinterpret_cast<int64_t*>(position)),
                            what);
  if (!why.empty()) return why;
  std::vector<int64_t> send_bytes(N), recv_bytes(N);
  for (int p = 0; p < N; ++p) {
    send_bytes[p] = static_cast<int64_t>(sizeof(int64_t)) * plan.send_splits[p];
    recv_bytes[p] = static_cast<int64_t>(sizeof(int64_t)) * plan.recv_splits[p];
  }
  why = nccl::AllToAll(spec.comm, d, send_keys, send_bytes.data(), recv_keys, recv_bytes.data());
  if (!why.empty()) return why;
  LayoutKernel<<<1, 1, 0, s>>>(buf.every, buf.width, N, T, spec.num_groups, plan.rank, buf.group, L);
  if (R > 0) {
    PlaceReceivedKernel<<<Blocks(R), kThreads, 0, s>>>(recv_keys, R, N * T, L,
                                                        reinterpret_cast<long long*>(table_rows),
                                                        reinterpret_cast<long long*>(group_gather),
                                                        reinterpret_cast<long long*>(group_scatter));
  }
  if (n > 0) {
    SlotKernel<<<Blocks(n), kThreads, 0, s>>>(position, static_cast<int>(n), N * T, L,
                                              reinterpret_cast<long long*>(slot));
  }
  why = Explain(UnitSplitsOnStream(d, L.table_count, T, R + T, unit_splits), what);
  if (!why.empty()) return why;
  cudaError_t c = cudaGetLastError();
  return c == cudaSuccess ? "" : std::string(what) + ": " + cudaGetErrorString(c);
}

}  // namespace key_exchange
}  // namespace impl
}  // namespace tf_sok
