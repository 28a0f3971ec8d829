"""Design alternatives for the lookup gradient's segment sum on a GPU, measured
outside TensorFlow (CuPy): gpu_bench.py's 26 Criteo tables, batch 65,536, dim 128,
Zipf(1.05) ids. Every variant is checked against the first (the library's form
before 16-byte atomics) and timed with CUDA events.

Build the kernels with nvcc, then run on the GPU machine (its python3 has CuPy):
    python3 benchmarks/design/segment_sum_variants.py --source > seg.cu
    nvcc -arch=sm_90 -O3 -cubin seg.cu -o seg.cubin
    python3 benchmarks/design/segment_sum_variants.py --cubin seg.cubin 10 1
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_common import CARDINALITIES, fixed_hot_batch  # noqa: E402
from design.timing import timeit  # noqa: E402

B = 65536
DIM = 128
SRC = r"""
extern "C" {
__device__ int SegOf(const int* off, int n, long long pos) {
  int lo = 0, hi = n;
  while (hi - lo > 1) { int mid = (lo + hi) / 2; if (off[mid] <= pos) lo = mid; else hi = mid; }
  return lo;
}
__device__ void fma4(float4& a, float w, float4 x) { a.x += w*x.x; a.y += w*x.y; a.z += w*x.z; a.w += w*x.w; }

// scatter: one warp per bag; reads its dY row once, adds it into each id's distinct row
__global__ void seg_scatter(const long long* splits_all, int nbags, const int* inv, const float* coef,
                            const float* dy, float* out, int hot, int skip_hot_len, const int* offsets) {
  long long r = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  if (r >= nbags) return;
  float4 x = __ldcs(reinterpret_cast<const float4*>(dy + r * 128) + lane);
  long long s = r * hot, e = s + hot;
  for (long long p = s; p < e; ++p) {
    int u = inv[p];
    if (skip_hot_len > 0 && offsets[u + 1] - offsets[u] >= skip_hot_len) continue;
    float c = coef[p];
    atomicAdd(reinterpret_cast<float4*>(out + (long long)u * 128) + lane, make_float4(c*x.x, c*x.y, c*x.z, c*x.w));
  }
}
// raw: read dY rows in sorted order, no segments
__global__ void raw_sorted(const int* order, const long long* rowptr, const float* dy, float* sink, int total) {
  long long chunk = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  long long start = chunk * 32;
  if (start >= total) return;
  int stop = start + 32 < total ? start + 32 : total;
  float4 acc = make_float4(0, 0, 0, 0);
  for (int q = start; q < stop; ++q) fma4(acc, 1.0f, __ldg(reinterpret_cast<const float4*>(dy + rowptr[order[q]]) + lane));
  if (acc.x == 12345.f) sink[lane] = acc.y;
}
__global__ void inv_from_order(const int* offsets, int nu, const int* order, int* inv, int total) {
  long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (q >= total) return;
  inv[order[q]] = SegOf(offsets, nu, q);
}

}
// A warp per chunk of C sorted positions; an id inside the chunk is stored, the part
// of one that spans chunks is added atomically (kV4: one 16-byte atomic, sm_90; else
// four scalar ones). unroll: 4 positions' loads issued together. Ids of fewer than
// min_len positions are skipped (the hybrid's gather half).
template <bool kV4>
__device__ void gather(const int* offsets, int nu, const int* order, const float* coef,
                       const long long* rowptr, const float* dy, float* out, int total, int C, int unroll,
                       int min_len) {
  long long chunk = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  long long start = chunk * C;
  if (start >= total) return;
  int stop = start + C < total ? start + C : total;
  int u = SegOf(offsets, nu, start);
  for (int k = start; k < stop; ++u) {
    int sb = offsets[u], se = offsets[u + 1];
    int end = se < stop ? se : stop;
    if (se - sb < min_len) { k = end; continue; }
    bool whole = sb >= start && se <= stop;
    float4 acc = make_float4(0, 0, 0, 0);
    int q = k;
    if (unroll) {
      for (; q + 4 <= end; q += 4) {
        int p[4]; float c[4]; long long r[4]; float4 x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) p[i] = order[q + i];
#pragma unroll
        for (int i = 0; i < 4; ++i) { c[i] = coef[p[i]]; r[i] = rowptr[p[i]]; }
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = __ldg(reinterpret_cast<const float4*>(dy + r[i]) + lane);
#pragma unroll
        for (int i = 0; i < 4; ++i) fma4(acc, c[i], x[i]);
      }
    }
    for (; q < end; ++q) {
      int p = order[q];
      fma4(acc, coef[p], __ldg(reinterpret_cast<const float4*>(dy + rowptr[p]) + lane));
    }
    float4* o = reinterpret_cast<float4*>(out + (long long)u * 128) + lane;
    if (whole) *o = acc;
    else if (kV4) atomicAdd(o, acc);
    else { atomicAdd(&o->x, acc.x); atomicAdd(&o->y, acc.y); atomicAdd(&o->z, acc.z); atomicAdd(&o->w, acc.w); }
    k = end;
  }
}
extern "C" {
// the library's form before: chunks of 32, scalar atomics
__global__ void seg_gather(const int* offsets, int nu, const int* order, const float* coef,
                           const long long* rowptr, const float* dy, float* out, int total) {
  gather<false>(offsets, nu, order, coef, rowptr, dy, out, total, 32, 0, 0);
}
__global__ void seg_chunk(const int* offsets, int nu, const int* order, const float* coef,
                          const long long* rowptr, const float* dy, float* out, int total, int C, int unroll,
                          int min_len) {
  gather<true>(offsets, nu, order, coef, rowptr, dy, out, total, C, unroll, min_len);
}
// 8 warps of a block combine the pieces of segments that cross their chunks in shared
// memory; one atomic per block per crossing segment
__global__ void seg_block(const int* offsets, int nu, const int* order, const float* coef,
                          const long long* rowptr, const float* dy, float* out, int total) {
  __shared__ int su[16];
  __shared__ float4 sv[16][32];
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long b0 = (long long)blockIdx.x * 256, b1 = b0 + 256 < total ? b0 + 256 : total;
  const long long start = b0 + w * 32;
  if (lane == 0) { su[2 * w] = -1; su[2 * w + 1] = -1; }
  if (start < total) {
    int stop = start + 32 < total ? start + 32 : total;
    int u = SegOf(offsets, nu, start);
    for (int k = start; k < stop; ++u) {
      int sb = offsets[u], se = offsets[u + 1];
      int end = se < stop ? se : stop;
      bool whole = sb >= start && se <= stop;
      float4 acc = make_float4(0, 0, 0, 0);
      for (int q = k; q < end; ++q) {
        int p = order[q];
        fma4(acc, coef[p], __ldg(reinterpret_cast<const float4*>(dy + rowptr[p]) + lane));
      }
      if (whole) {
        reinterpret_cast<float4*>(out + (long long)u * 128)[lane] = acc;
      } else {
        int slot = 2 * w + (k == start ? 0 : 1);
        sv[slot][lane] = acc;
        if (lane == 0) su[slot] = u;
      }
      k = end;
    }
  }
  __syncthreads();
  for (int slot = 2 * w; slot < 2 * w + 2; ++slot) {
    const int u = su[slot];
    if (u < 0) continue;
    int prev = slot - 1;
    while (prev >= 0 && su[prev] < 0) --prev;
    if (prev >= 0 && su[prev] == u) continue;  // not the first piece of u in this block
    float4 acc = sv[slot][lane];
    for (int n = slot + 1; n < 16; ++n) {
      if (su[n] < 0) continue;
      if (su[n] != u) break;
      float4 x = sv[n][lane];
      acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
    }
    float4* o = reinterpret_cast<float4*>(out + (long long)u * 128) + lane;
    if (offsets[u] >= b0 && offsets[u + 1] <= b1) *o = acc; else atomicAdd(o, acc);
  }
}
}
"""


def main(hot, cubin):
    import cupy as cp

    mod = cp.RawModule(path=cubin)
    k = {n: mod.get_function(n) for n in ("seg_gather", "seg_scatter", "raw_sorted", "inv_from_order",
                                          "seg_chunk", "seg_block")}
    rng = np.random.default_rng(1)
    raw = [fixed_hot_batch(rng, rows, B, hot, "zipf:1.05") for rows in CARDINALITIES]
    shift = int(max(CARDINALITIES) - 1).bit_length()
    keys = np.concatenate([(t << shift) | ids for t, (ids, _) in enumerate(raw)])
    total = keys.size
    nbags = 26 * B
    d_keys = cp.asarray(keys)
    comp = cp.sort((d_keys << 25) | cp.arange(total, dtype=cp.int64))
    order = (comp & ((1 << 25) - 1)).astype(cp.int32)
    sk = comp >> 25
    flag = cp.concatenate([cp.ones(1, bool), sk[1:] != sk[:-1]])
    starts = cp.flatnonzero(flag).astype(cp.int32)
    nu = int(starts.size)
    offsets = cp.concatenate([starts, cp.asarray([total], cp.int32)])
    seglen = cp.diff(offsets)
    coef = cp.asarray(rng.random(total, dtype=np.float32))
    rowptr = (cp.arange(total, dtype=cp.int64) // hot) * DIM  # position p -> its bag's dY row
    dy = cp.asarray(rng.standard_normal((nbags, DIM), dtype=np.float32))
    out = cp.zeros((nu, DIM), cp.float32)
    inv = cp.empty(total, cp.int32)
    sink = cp.zeros(32, cp.float32)
    lens = cp.asnumpy(seglen)
    print(f"hot {hot}: {total} ids, {nu} distinct, longest segment {lens.max()}, positions in segments >= 32:"
          f" {lens[lens >= 32].sum() / total:.2f}, >= 1024: {lens[lens >= 1024].sum() / total:.2f}")
    T = 256
    gblocks = ((total + 31) // 32 * 32 + T - 1) // T
    sblocks = (nbags * 32 + T - 1) // T

    def before():
        out.fill(0)
        k["seg_gather"]((gblocks,), (T,), (offsets, np.int32(nu), order, coef, rowptr, dy, out, np.int32(total)))

    def chunks(C, unroll, min_len=0):
        blocks = ((total + C - 1) // C * 32 + T - 1) // T
        k["seg_chunk"]((blocks,), (T,), (offsets, np.int32(nu), order, coef, rowptr, dy, out, np.int32(total),
                                        np.int32(C), np.int32(unroll), np.int32(min_len)))

    def inv_k():
        k["inv_from_order"](((total + T - 1) // T,), (T,), (offsets, np.int32(nu), order, inv, np.int32(total)))

    def scatter(skip=0):
        def f():
            out.fill(0)
            k["seg_scatter"]((sblocks,), (T,), (np.int64(0), np.int32(nbags), inv, coef, dy, out, np.int32(hot),
                                                  np.int32(skip), offsets))
        return f

    def hybrid(th):
        def f():
            out.fill(0)
            k["seg_scatter"]((sblocks,), (T,), (np.int64(0), np.int32(nbags), inv, coef, dy, out, np.int32(hot),
                                                  np.int32(th), offsets))
            chunks(32, 0, min_len=th)
        return f

    res = {}
    before(); ref = out.copy()
    res["zero only"] = timeit(lambda: out.fill(0))
    res["gather (current)"] = timeit(before)
    res["raw sorted reads"] = timeit(lambda: k["raw_sorted"]((gblocks,), (T,), (order, rowptr, dy, sink, np.int32(total))))
    def chunked(C, un):
        def f():
            out.fill(0)
            chunks(C, un)
        return f
    def check(name, f):
        f(); d = float(cp.abs(out - ref).max() / (cp.abs(ref).max() + 1e-9))
        res[name] = timeit(f)
        print(f"  {name}: max rel diff vs current {d:.2e}")
    for C in (32, 64, 128, 256):
        for un in (0, 1):
            check(f"v4 chunk {C} unroll {un}", chunked(C, un))
    def block():
        out.fill(0)
        k["seg_block"](((total + 255) // 256,), (T,), (offsets, np.int32(nu), order, coef, rowptr, dy, out,
                                                      np.int32(total)))
    check("block combine (8 warps)", block)
    inv_k()
    res["inv (position -> distinct id)"] = timeit(inv_k)
    check("scatter by bag (16-byte atomics)", scatter())
    for th in (32, 1024):
        check(f"hybrid: ids of >= {th} by gather", hybrid(th))
    gb = total * DIM * 4 / 1e9
    for name, ms in res.items():
        print(f"  {name:24s} {ms:8.3f} ms")
    print(f"  ({gb:.2f} GB of dY rows per id, {nbags * DIM * 4 / 1e9:.2f} GB dY)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hotness", type=int, nargs="*", default=[10, 1], help="ids per feature")
    p.add_argument("--cubin", default="seg.cubin")
    p.add_argument("--source", action="store_true", help="print the kernels' CUDA source and exit")
    a = p.parse_args()
    if a.source:
        print(SRC)
    else:
        for h in a.hotness:
            main(h, a.cubin)
