// The host link for the rows a hybrid table moves: 26.6 MB each way of random rows (52,000 rows of
// 512 bytes, 128 floats, by default) of a pinned, device-mapped host buffer read and / or written in
// place by a kernel, against contiguous rows; pinned 4K pages (cudaHostAlloc) and transparent huge
// pages (mmap + madvise + cudaHostRegister); one grid per launch or a grid-stride grid of a given
// size; best of 5 each, every repetition on other random rows (none still in the host's caches).
// Standalone (no TensorFlow):
//   nvcc -O2 -arch=sm_90 -o host_link_rows benchmarks/host_link_rows.cu
//   ./host_link_rows [GiB, 8] [row bytes, 512: a multiple of 16; the same bytes in fewer, larger rows]
// Modes: interleaved (blocks of writes and reads alternating in one grid, as the hybrid step's
// moves), writes then reads in one grid, writes and reads as two grids, grid-stride (grid size);
// and "log" duplex: random rows read while the written rows are contiguous (as a store that writes
// the rows it takes back at the end of a log rather than in their old places would move them);
// "swap" duplex: each written row goes where a row was just read, by the thread that read it (as a
// store that gives an evicted key the record of a key taken in would move them).
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <algorithm>
#include <cstring>

__constant__ long W;   // float4 per row (32: 128 floats)

// word i of the rows written back (out) or read in
__device__ void MoveWord(bool out, long i, const float4* evicted, const long* out_rows, long n_out,
                         const long* in_rows, long n_in, float4* store, float4* cache) {
  const long j = i / W, c = i - j * W;
  if (out) {
    if (i < n_out * W) store[out_rows[j] * W + c] = evicted[i];
  } else if (i < n_in * W) {
    cache[j * W + c] = store[in_rows[j] * W + c];
  }
}

// block b's part of the move: blocks of writes and reads alternating, then the rest of the larger
__device__ void MoveBlock(long b, const float4* evicted, const long* out_rows, long n_out, const long* in_rows,
                          long n_in, float4* store, float4* cache) {
  const long per = blockDim.x;
  const long bo = (n_out * W + per - 1) / per, bi = (n_in * W + per - 1) / per;
  const long paired = 2 * (bo < bi ? bo : bi);
  const bool out = b < paired ? b % 2 == 0 : bo > bi;
  const long i = (b < paired ? b / 2 : b - paired / 2) * per + threadIdx.x;
  MoveWord(out, i, evicted, out_rows, n_out, in_rows, n_in, store, cache);
}

// the writes' blocks first, then the reads'
__global__ void MoveSeq(const float4* evicted, const long* out_rows, long n_out, const long* in_rows, long n_in,
                        float4* store, float4* cache) {
  const long per = blockDim.x, bo = (n_out * W + per - 1) / per, b = blockIdx.x;
  MoveWord(b < bo, (b < bo ? b : b - bo) * per + threadIdx.x, evicted, out_rows, n_out, in_rows, n_in, store, cache);
}

// each word read in from in_rows[j] and replaced by the evicted row j's (n_out == n_in)
__global__ void MoveSwap(const float4* evicted, const long* in_rows, long n, float4* store, float4* cache) {
  const long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i >= n * W) return;
  const long j = i / W, c = i - j * W;
  float4* at = store + in_rows[j] * W + c;
  cache[i] = *at;
  *at = evicted[i];
}

// grid-stride: `gridDim.x` blocks walk the blocks of Move
__global__ void MoveStride(const float4* evicted, const long* out_rows, long n_out, const long* in_rows, long n_in,
                           float4* store, float4* cache) {
  const long per = blockDim.x, total = (n_out * W + per - 1) / per + (n_in * W + per - 1) / per;
  for (long b = blockIdx.x; b < total; b += gridDim.x)
    MoveBlock(b, evicted, out_rows, n_out, in_rows, n_in, store, cache);
}

// as the hybrid step's moves: one grid, blocks of writes and reads alternating
__global__ void Move(const float4* evicted, const long* out_rows, long n_out, const long* in_rows, long n_in,
                     float4* store, float4* cache) {
  MoveBlock(blockIdx.x, evicted, out_rows, n_out, in_rows, n_in, store, cache);
}

float4* HostBuffer(size_t bytes, bool huge) {
  if (!huge) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) { printf("alloc fail\n"); exit(1); }
    return (float4*)p;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { printf("mmap fail\n"); exit(1); }
  int r = madvise(p, bytes, MADV_HUGEPAGE);
  memset(p, 0, bytes);
  if (cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) != cudaSuccess) { printf("register fail\n"); exit(1); }
  printf("  (madvise %d)\n", r);
  return (float4*)p;
}

int main(int argc, char** argv) {
  const long row_bytes = argc > 2 ? atol(argv[2]) : 512;
  if (row_bytes < 16 || row_bytes % 16 != 0) { printf("row bytes must be a positive multiple of 16\n"); return 1; }
  const long W = row_bytes / 16;
  cudaMemcpyToSymbol(::W, &W, sizeof(long));
  const size_t rows_total = (argc > 1 ? atol(argv[1]) : 8L) * (1L << 30) / (W * 16);
  const long N = 52000L * 32 / W;
  constexpr int kReps = 5;
  printf("%ld rows of %ld bytes each way, %.1f MB\n", N, row_bytes, N * W * 16 / 1e6);
  std::mt19937_64 g(1);
  std::vector<long> pick(2 * N * kReps);   // repetition r: rows [2N r, 2N (r + 1))
  for (auto& x : pick) x = g() % rows_total;
  std::vector<long> contig(2 * N * kReps);
  for (long j = 0; j < 2 * N * kReps; ++j) contig[j] = j;
  std::vector<long> log(pick);   // each repetition: contiguous rows written (a region of its own), random rows read
  for (int rep = 0; rep < kReps; ++rep)
    for (long j = 0; j < N; ++j) log[2 * N * rep + j] = (rows_total / kReps) * rep + j;
  long *d_rand, *d_contig, *d_log;
  cudaMalloc(&d_rand, 16 * N * kReps); cudaMalloc(&d_contig, 16 * N * kReps); cudaMalloc(&d_log, 16 * N * kReps);
  cudaMemcpy(d_rand, pick.data(), 16 * N * kReps, cudaMemcpyHostToDevice);
  cudaMemcpy(d_contig, contig.data(), 16 * N * kReps, cudaMemcpyHostToDevice);
  cudaMemcpy(d_log, log.data(), 16 * N * kReps, cudaMemcpyHostToDevice);
  float4 *evicted, *cache;
  cudaMalloc(&evicted, N * W * 16); cudaMalloc(&cache, N * W * 16);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int huge = 0; huge < 2; ++huge) {
    float4* store = HostBuffer(rows_total * W * 16, huge);
    float4* dstore; cudaHostGetDevicePointer((void**)&dstore, store, 0);
    auto run = [&](const char* what, const long* all_rows, long n_out, long n_in, int launches, int mode = 0) {
      float best = 1e9;
      for (int rep = 0; rep < kReps; ++rep) {
        const long* rows = all_rows + 2 * N * rep;
        cudaEventRecord(a);
        for (int l = 0; l < launches; ++l) {
          const long o = n_out / launches, i = n_in / launches;
          const long blocks = (o * W + 255) / 256 + (i * W + 255) / 256;
          if (mode == 3) MoveSwap<<<(i * W + 255) / 256, 256>>>(evicted + l * o * W, rows + N + l * i, i, dstore, cache + l * i * W);
          else if (mode >= 100) MoveStride<<<mode, 256>>>(evicted + l * o * W, rows + l * o, o, rows + N + l * i, i, dstore, cache + l * i * W);
          else if (mode == 0) Move<<<blocks, 256>>>(evicted + l * o * W, rows + l * o, o, rows + N + l * i, i, dstore, cache + l * i * W);
          else if (mode == 1) MoveSeq<<<blocks, 256>>>(evicted + l * o * W, rows + l * o, o, rows + N + l * i, i, dstore, cache + l * i * W);
          else {  // two launches: writes, then reads
            Move<<<(o * W + 255) / 256, 256>>>(evicted + l * o * W, rows + l * o, o, rows + N + l * i, 0, dstore, cache + l * i * W);
            Move<<<(i * W + 255) / 256, 256>>>(evicted + l * o * W, rows + l * o, 0, rows + N + l * i, i, dstore, cache + l * i * W);
          }
        }
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); best = std::min(best, ms);
      }
      printf("%s %-36s launches %2d: %.3f ms, %.1f GB/s\n", huge ? "huge" : "4K  ", what, launches, best,
             (n_out + n_in) * W * 16 / best / 1e6);
    };
    for (int launches : {1, 16}) {
      run("random read", d_rand, 0, N, launches);
      run("random write", d_rand, N, 0, launches);
      run("random duplex", d_rand, N, N, launches);
      for (int grid : {132, 264, 528, 1056, 2112}) {
        char name[64];
        snprintf(name, 64, "read, grid %d", grid); run(name, d_rand, 0, N, launches, grid);
        snprintf(name, 64, "write, grid %d", grid); run(name, d_rand, N, 0, launches, grid);
        snprintf(name, 64, "duplex, grid %d", grid); run(name, d_rand, N, N, launches, grid);
      }
      run("random writes then reads (1 grid)", d_rand, N, N, launches, 1);
      run("random writes, reads (2 grids)", d_rand, N, N, launches, 2);
      run("contiguous read", d_contig, 0, N, launches);
      run("contiguous write", d_contig, N, 0, launches);
      run("contiguous duplex", d_contig, N, N, launches);
      run("log duplex (contiguous writes)", d_log, N, N, launches);
      run("log duplex, grid 528", d_log, N, N, launches, 528);
      run("swap duplex (writes where reads were)", d_rand, N, N, launches, 3);
    }
    printf("error: %s\n", cudaGetErrorString(cudaGetLastError()));
    if (huge) { cudaHostUnregister(store); munmap(store, rows_total * W * 16); } else cudaFreeHost(store);
  }
}
