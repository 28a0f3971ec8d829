"""Design alternatives for the forward lookup on a GPU, measured outside
TensorFlow (CuPy): 26 features of gpu_bench.py's Criteo tables, batch 65,536.
One id per row: the library's earlier kernel (4 rows per thread group, their
splits, ids and rows loaded together) against a warp that loads 32 rows' splits
and ids at once and hands them round by shuffles, 4 or 8 rows' loads at a time.
Ten ids per row: the multi-hot kernel against the same idea per row. Every
variant is checked against CuPy's gather + sum and timed with CUDA events.

    python3 benchmarks/design/forward_variants.py --source > fwd.cu
    nvcc -arch=sm_90 -O3 -cubin fwd.cu -o fwd.cubin
    python3 benchmarks/design/forward_variants.py --cubin fwd.cubin
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_common import CARDINALITIES, fixed_hot_batch  # noqa: E402
from design.timing import timeit  # noqa: E402

B = 65536


def run(dim, hot, nfeat, cubin):
    import cupy as cp

    mod = cp.RawModule(path=cubin)
    cards = CARDINALITIES[:nfeat]
    rng = np.random.default_rng(1)
    raw = [fixed_hot_batch(rng, r, B, hot, "zipf:1.05") for r in cards]
    ids = [cp.asarray(i) for i, _ in raw]
    splits = [cp.asarray(s) for _, s in raw]
    tables = [cp.random.random((r, dim), dtype=cp.float32) for r in cards]
    outs = [cp.empty((B, dim), cp.float32) for _ in cards]
    P = lambda xs: cp.asarray([x.data.ptr for x in xs], dtype=cp.uint64)
    row_start = cp.asarray(np.arange(nfeat + 1, dtype=np.int64) * B)
    args = (np.int32(nfeat), row_start, P(ids), P(splits), P(tables), cp.asarray(np.array(cards, np.int64)),
            cp.asarray(np.full(nfeat, dim, np.int32)), P(outs))
    total = nfeat * B
    G = 1
    while G < dim // 4 and G < 32:
        G *= 2
    ref = None
    res = {}
    variants = (("rows4", 4), ("coop4", 32), ("coop8", 32)) if hot == 1 else (("multi_cur", 1), ("mcoop4", 1), ("mcoop8", 1))
    for name, rows_per_group in variants:
        k = mod.get_function(name)
        groups = (total + rows_per_group - 1) // rows_per_group if rows_per_group != 32 else (total + 31) // 32 * (32 // G)
        threads = groups * G
        f = lambda: k(((threads + 255) // 256,), (256,), args + (np.int32(G),))
        for o in outs:
            o.fill(0)
        f()
        got = cp.concatenate(outs)
        if ref is None:
            ref = cp.concatenate([t[i].reshape(B, hot, dim).sum(1) for t, i in zip(tables, ids)])
        err = float(cp.abs(got - ref).max())
        res[name] = timeit(f, reps=20)
        print(f"  {name}: max abs err vs cupy gather + sum {err:.1e}")
    for n, ms in res.items():
        print(f"dim {dim} hot {hot}: {n:10s} {ms * 1e3:8.1f} us")
    del tables, outs


SRC = r"""
extern "C" {
__device__ __forceinline__ int FindF(const long long* rs, int nf, long long r) {
  int f = 0; while (f + 1 < nf && r >= rs[f + 1]) ++f; return f;
}
// the library's kernel, simplified: 4 rows per thread group, splits, then ids, then rows loaded together
__global__ void rows4(int nf, const long long* rs, const long long* const* ids, const long long* const* splits,
                      const float* const* tables, const long long* trows, const int* dims, float* const* outs, int G) {
  const long long r0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / G * 4;
  const int lane = threadIdx.x % G, j0 = lane * 4;
  const long long total = rs[nf];
  if (r0 >= total) return;
  int f[4]; long long row[4], s[4], e[4], id[4];
  int ff = FindF(rs, nf, r0);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    long long r = r0 + k;
    while (ff + 1 < nf && r >= rs[ff + 1]) ++ff;
    f[k] = ff; row[k] = r < total ? r - rs[ff] : -1;
    s[k] = row[k] >= 0 ? splits[ff][row[k]] : 0; e[k] = row[k] >= 0 ? splits[ff][row[k] + 1] : 0;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) id[k] = row[k] >= 0 && e[k] - s[k] == 1 ? ids[f[k]][s[k]] : -1;
  float4 x[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    bool ok = id[k] >= 0 && id[k] < trows[f[k]] && j0 < dims[f[k]];
    x[k] = ok ? __ldg(reinterpret_cast<const float4*>(tables[f[k]] + id[k] * dims[f[k]] + j0)) : make_float4(0,0,0,0);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (row[k] >= 0 && j0 < dims[f[k]]) __stcs(reinterpret_cast<float4*>(outs[f[k]] + row[k] * dims[f[k]] + j0), x[k]);
}
}
// a warp's 32 consecutive rows: lane i loads row i's splits and id (coalesced), then the
// warp's thread groups take the rows U at a time, the ids handed round by shuffles
template <int U>
__device__ void coop(int nf, const long long* rs, const long long* const* ids, const long long* const* splits,
                     const float* const* tables, const long long* trows, const int* dims, float* const* outs, int G) {
  const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
  const int wl = threadIdx.x % 32, lane = wl % G, g = wl / G, ng = 32 / G, j0 = lane * 4;
  const long long total = rs[nf];
  const long long r0 = warp * 32;
  if (r0 >= total) return;
  const long long r = r0 + wl;
  int f = -1; long long row = -1, id = -1;
  if (r < total) {
    f = FindF(rs, nf, r); row = r - rs[f];
    long long s = splits[f][row], e = splits[f][row + 1];
    id = e - s == 1 ? ids[f][s] : -1;
    if (id >= trows[f]) id = -1;
  }
  for (int t = 0; t < 32; t += ng * U) {
    float4 x[U]; int fk[U]; long long rk[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int src = t + u * ng + g;
      fk[u] = __shfl_sync(0xffffffff, f, src & 31);
      rk[u] = __shfl_sync(0xffffffff, row, src & 31);
      const long long idk = __shfl_sync(0xffffffff, id, src & 31);
      const bool ok = src < 32 && idk >= 0 && fk[u] >= 0 && j0 < dims[fk[u]];
      if (!(src < 32)) rk[u] = -1;
      x[u] = ok ? __ldg(reinterpret_cast<const float4*>(tables[fk[u]] + idk * dims[fk[u]] + j0)) : make_float4(0,0,0,0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (rk[u] >= 0 && fk[u] >= 0 && j0 < dims[fk[u]])
        __stcs(reinterpret_cast<float4*>(outs[fk[u]] + rk[u] * dims[fk[u]] + j0), x[u]);
  }
}
extern "C" {
__global__ void coop4(int nf, const long long* rs, const long long* const* ids, const long long* const* splits,
                      const float* const* tables, const long long* trows, const int* dims, float* const* outs, int G) {
  coop<4>(nf, rs, ids, splits, tables, trows, dims, outs, G);
}
__global__ void coop8(int nf, const long long* rs, const long long* const* ids, const long long* const* splits,
                      const float* const* tables, const long long* trows, const int* dims, float* const* outs, int G) {
  coop<8>(nf, rs, ids, splits, tables, trows, dims, outs, G);
}

// multi-hot: the library's ForwardKernel<.., kMulti>, simplified (unweighted sum)
__global__ void multi_cur(int nf, const long long* rs, const long long* const* ids, const long long* const* splits,
                      const float* const* tables, const long long* trows, const int* dims, float* const* outs, int G) {
  const long long r = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / G;
  const int lane = threadIdx.x % G, j0 = lane * 4;
  if (r >= rs[nf]) return;
  const int f = FindF(rs, nf, r);
  const long long row = r - rs[f];
  const long long s = splits[f][row], e = splits[f][row + 1];
  const int dim = dims[f];
  if (j0 >= dim) return;
  const float* table = tables[f];
  const long long rows = trows[f];
  float4 acc = make_float4(0,0,0,0);
  long long i = s;
  for (; i + 4 <= e; i += 4) {
    long long id[4]; float4 x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) id[u] = ids[f][i + u];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = id[u] >= 0 && id[u] < rows ? __ldg(reinterpret_cast<const float4*>(table + id[u] * dim + j0)) : make_float4(0,0,0,0);
#pragma unroll
    for (int u = 0; u < 4; ++u) { acc.x += x[u].x; acc.y += x[u].y; acc.z += x[u].z; acc.w += x[u].w; }
  }
  for (; i < e; ++i) {
    long long id = ids[f][i];
    float4 x = id >= 0 && id < rows ? __ldg(reinterpret_cast<const float4*>(table + id * dim + j0)) : make_float4(0,0,0,0);
    acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
  }
  __stcs(reinterpret_cast<float4*>(outs[f] + row * dim + j0), acc);
}
}
template <int U>
__device__ void mcoop(int nf, const long long* rs, const long long* const* ids, const long long* const* splits,
                      const float* const* tables, const long long* trows, const int* dims, float* const* outs, int G) {
  const long long r = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / G;
  const int wl = threadIdx.x % 32, lane = wl % G, g = wl / G, j0 = lane * 4;
  const unsigned mask = G == 32 ? 0xffffffffu : ((1u << G) - 1) << (g * G);
  if (r >= rs[nf]) return;  // whole groups
  const int f = FindF(rs, nf, r);
  const long long row = r - rs[f];
  const long long s = splits[f][row], e = splits[f][row + 1];
  const int dim = dims[f];
  const float* table = tables[f];
  const long long rows = trows[f];
  float4 acc = make_float4(0,0,0,0);
  for (long long b = s; b < e; b += G) {
    const int n = e - b < G ? (int)(e - b) : G;
    const long long mine = lane < n ? ids[f][b + lane] : -1;
    for (int k = 0; k < n; k += U) {
      float4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long id = __shfl_sync(mask, mine, k + u, G);
        x[u] = k + u < n && id >= 0 && id < rows && j0 < dim ? __ldg(reinterpret_cast<const float4*>(table + id * dim + j0)) : make_float4(0,0,0,0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) { acc.x += x[u].x; acc.y += x[u].y; acc.z += x[u].z; acc.w += x[u].w; }
    }
  }
  if (j0 < dim) __stcs(reinterpret_cast<float4*>(outs[f] + row * dim + j0), acc);
}
extern "C" {
__global__ void mcoop4(int nf, const long long* rs, const long long* const* ids, const long long* const* splits,
                      const float* const* tables, const long long* trows, const int* dims, float* const* outs, int G) {
  mcoop<4>(nf, rs, ids, splits, tables, trows, dims, outs, G);
}
__global__ void mcoop8(int nf, const long long* rs, const long long* const* ids, const long long* const* splits,
                      const float* const* tables, const long long* trows, const int* dims, float* const* outs, int G) {
  mcoop<8>(nf, rs, ids, splits, tables, trows, dims, outs, G);
}
}
"""

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cubin", default="fwd.cubin")
    p.add_argument("--source", action="store_true", help="print the kernels' CUDA source and exit")
    a = p.parse_args()
    if a.source:
        print(SRC)
    else:
        for dim, hot in ((128, 1), (16, 1), (128, 10), (16, 10), (64, 10)):
            run(dim, hot, 26, a.cubin)
