// Kernels of the read op of dynamic tables (TfSokDynamicRead): values of keys, nothing changed, the
// keys a hybrid table does not cache read from its host tier.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tf_sok/cc/kernels/dynamic_find.h"

namespace tf_sok {
namespace dynamic_kernels {
namespace {

// TfSokDynamicRead: the values of keys in several dynamic tables, nothing changed: cached keys' rows
// from the arrays, the rest of a hybrid table's keys read from its host tier in place, keys not held
// their initial value (zeros for tables that admit keys after min_frequency > 1 sightings).
class ReadOp : public tf::OpKernel {
 public:
  explicit ReadOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("dims", &dims_)); }

  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    std::vector<tf::core::RefCountPtr<IndexResource>> res;
    std::vector<std::unique_ptr<tf::mutex_lock>> locks;
    OP_REQUIRES_OK(ctx, LockIndices(ctx, n, "TfSokDynamicRead", &res, &locks));
    std::vector<IndexResource*> tables;
    std::vector<tf::Tensor*> out(n);
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i].get();
      tables.push_back(r);
      OP_REQUIRES(ctx, !r->arrays.empty() && r->arrays[0].values,
                  Failed(*r, ": ", "has no value array attached to read"));
      OP_REQUIRES(ctx, dims_[i] == r->dim,
                  Failed(*r, ": ", "is " + std::to_string(r->dim) + " wide, read as " + std::to_string(dims_[i])));
      const tf::TensorShape shape({ctx->input(n + i).NumElements(), r->dim});
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shape, &out[i]));
    }
    const auto arrays = LockArrays(tables);
    TensorScratch scratch(ctx);
#if TF_SOK_WITH_CUDA
    if (tables[0]->gpu) {
      OP_REQUIRES_OK(ctx, ComputeGpu(ctx, MakeDevice<impl::GpuDevice>(ctx, &scratch), tables, out));
      return;
    }
#endif
    const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
    for (int i = 0; i < n; ++i) {
      IndexResource* r = tables[i];
      OP_REQUIRES(ctx, r->host != nullptr, Failed(*r, ": ", "its index lives on a GPU; read it there"));
      const tf::Tensor& keys = ctx->input(n + i);
      const int64_t count = keys.NumElements();
      const int64_t* k = keys.flat<int64_t>().data();
      std::vector<int64_t> slots(count), store_rows;
      impl::FindChanges ch;
      const std::string error = r->host->Find(k, count, false, slots.data(), &ch, false, 1.0f, {}, &d.parallel_for);
      OP_REQUIRES(ctx, error.empty(), Failed(*r, " ", error));
      if (r->store) {   // the keys not cached looked up in the host tier
        store_rows.resize(count);
        Count(r, count, StoreRowsOfMissing(ctx, {r}, {k}, {slots.data()}, {count}, {store_rows.data()})[0]);
      }
      const float* cache = r->arrays[0].var->tensor()->flat<float>().data();
      float* values = out[i]->flat<float>().data();
      // (on the host's threads: each row a random access into a large array)
      d.parallel_for(count, 50 + 4 * r->dim, [&](int64_t lo, int64_t hi) {
        impl::ReadRows(k + lo, slots.data() + lo, r->store ? store_rows.data() + lo : nullptr, hi - lo, cache, r->dim,
                       r->store ? r->store->base(0) : nullptr, r->store ? r->store->stride() : 0, InitKind(*r), r->a,
                       r->b, r->seed, values + lo * r->dim);
      });
    }
  }

 private:
  // keys not held read their initial value, or zeros when the table admits keys late (as serving does)
  static int InitKind(const IndexResource& r) { return r.min_frequency > 1 ? -1 : r.init_kind; }
  static void Count(IndexResource* r, int64_t reads, int64_t from_host) {
    r->stats.reads += reads;
    r->stats.reads_from_host += from_host;
    r->stats.bytes_read_in_place += from_host * r->dim * static_cast<int64_t>(sizeof(float));
  }
#if TF_SOK_WITH_CUDA
  static void CountGathered(IndexResource* r, int64_t reads, int64_t from_host) {
    r->stats.reads += reads;
    r->stats.reads_from_host += from_host;
    r->stats.bytes_read_gathered += from_host * r->dim * static_cast<int64_t>(sizeof(float));
  }
  // Every table's index probed, the hybrid tables' keys and slots brought to the host (each table's
  // pinned staging: [keys | slots | store rows], then room for gathered rows) with one wait, the keys
  // not cached looked up in all host tiers together (or, the tier's keys on the device, in its map
  // there), their store rows sent back; one read kernel per table. The host link reads random rows in
  // place at a fraction of its copy rate (an access per row), so the rows of a read of many keys not
  // cached are gathered by the host's threads into the staging and copied over contiguous instead.
  absl::Status ComputeGpu(tf::OpKernelContext* ctx, const impl::GpuDevice& d, const std::vector<IndexResource*>& res,
                          const std::vector<tf::Tensor*>& out) {
    const int n = static_cast<int>(res.size());
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    StageClock clock(stream, StageClock::kRead);
    const int64_t gather_min = GatherMinRows();
    std::vector<impl::GpuFindResult> found(n);
    std::vector<int64_t*> staging(n, nullptr);
    std::vector<bool> on_gpu(n, false);   // the keys not cached found in the tier's map on the device
    std::vector<bool> may_gather(n, false);
    auto staging_bytes = [&](const IndexResource& r, int64_t count, bool gather) {
      return (24 + (gather ? 4 * r.dim : 0)) * static_cast<size_t>(count) + (gather ? 64 : 0);
    };
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i];
      if (r->gpu == nullptr) return Failed(*r, ": ", "its index is on the host; read it there");
      const tf::Tensor& keys = ctx->input(n + i);
      const int64_t count = keys.NumElements();
      const std::string error = r->gpu->Find(d, keys.flat<int64_t>().data(), count, false, &found[i]);
      if (!error.empty()) return Failed(*r, " ", error);
      on_gpu[i] = r->store && count > 0 && DeviceMapReady(d, r, 0);
      may_gather[i] = r->store && gather_min >= 0 && count > 0 && count >= gather_min;
      if (!r->store || count == 0 || on_gpu[i]) continue;
      staging[i] = reinterpret_cast<int64_t*>(r->Staging(staging_bytes(*r, count, may_gather[i])));
      if (staging[i] == nullptr) return Failed(*r, ": ", "ran out of host memory");
      cudaMemcpyAsync(staging[i], keys.flat<int64_t>().data(), 8 * count, cudaMemcpyDeviceToHost, stream);
      cudaMemcpyAsync(staging[i] + count, found[i].slots, 8 * count, cudaMemcpyDeviceToHost, stream);
    }
    clock.Mark(StageClock::kReadProbe);
    if (std::any_of(staging.begin(), staging.end(), [](int64_t* p) { return p != nullptr; }))
      TF_RETURN_IF_ERROR(CudaWait(stream));
    clock.Mark(StageClock::kReadWait);
    std::vector<const int64_t*> key_lists(n), slot_lists(n);
    std::vector<int64_t*> row_lists(n);   // each key's store row (-1: cached, or not held)
    std::vector<int64_t> counts(n, 0);
    for (int i = 0; i < n; ++i) {
      if (staging[i] == nullptr) continue;
      counts[i] = ctx->input(n + i).NumElements();
      key_lists[i] = staging[i];
      slot_lists[i] = staging[i] + counts[i];
      row_lists[i] = staging[i] + 2 * counts[i];
    }
    const std::vector<int64_t> held = StoreRowsOfMissing(ctx, res, key_lists, slot_lists, counts, row_lists);
    clock.Mark(StageClock::kReadHostLookups);
    std::vector<int64_t*> store_rows(n, nullptr);   // on the device
    // table i's keys [first, first + m) read (m < 0: to the last)
    auto read = [&](int i, const float* store, int64_t stride, int64_t first = 0, int64_t m = -1) {
      IndexResource* r = res[i];
      if (m < 0) m = ctx->input(n + i).NumElements() - first;
      impl::GpuReadRows(d, ctx->input(n + i).flat<int64_t>().data() + first, found[i].slots + first,
                        store_rows[i] + first, m, r->arrays[0].var->tensor()->flat<float>().data(), r->dim, store,
                        stride, InitKind(*r), r->a, r->b, r->seed, out[i]->flat<float>().data() + first * r->dim);
    };
    bool wait_rows = false;
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i];
      const tf::Tensor& keys = ctx->input(n + i);
      const int64_t count = keys.NumElements();
      if (on_gpu[i] || staging[i]) {
        store_rows[i] = static_cast<int64_t*>(d.scratch->Allocate(8 * count));
        if (store_rows[i] == nullptr) return Failed(*r, ": ", "out of GPU memory");
      }
      if (on_gpu[i]) {
        int64_t* held_dev = nullptr;   // (a read that may gather counts its rows on the host)
        if (may_gather[i]) {
          staging[i] = reinterpret_cast<int64_t*>(r->Staging(staging_bytes(*r, count, true)));
          if (staging[i] == nullptr) return Failed(*r, ": ", "ran out of host memory");
          row_lists[i] = staging[i] + 2 * count;
          counts[i] = count;
          wait_rows = true;
        } else {
          held_dev = r->reads_from_host_dev;
          if (held_dev == nullptr) {
            held_dev = r->reads_from_host_dev = static_cast<int64_t*>(r->memory->Allocate(8));
            if (held_dev == nullptr) return Failed(*r, ": ", "out of GPU memory");
            cudaMemsetAsync(held_dev, 0, 8, stream);
          }
        }
        const std::string error = r->gpu->StoreMapRowsOfMissing(d, keys.flat<int64_t>().data(), found[i].slots,
                                                                count, store_rows[i], held_dev);
        if (!error.empty()) return Failed(*r, ": ", error);
        if (may_gather[i]) {
          cudaMemcpyAsync(row_lists[i], store_rows[i], 8 * count, cudaMemcpyDeviceToHost, stream);
          continue;
        }
        Count(r, count, 0);
      } else if (staging[i]) {
        if (may_gather[i]) continue;
        // (pinned: the next call to use the staging waits for this stream first)
        cudaMemcpyAsync(store_rows[i], row_lists[i], 8 * count, cudaMemcpyHostToDevice, stream);
        Count(r, count, held[i]);
      }
      read(i, r->store ? r->store->base(0) : nullptr, r->store ? r->store->stride() : 0);
    }
    clock.Mark(StageClock::kReadLaunched);
    if (!std::any_of(may_gather.begin(), may_gather.end(), [](bool g) { return g; })) return absl::OkStatus();
    if (wait_rows) TF_RETURN_IF_ERROR(CudaWait(stream));
    clock.Mark(StageClock::kReadRowsWait);
    // each table's first keys gathered (g_n of them), the rest read in place meanwhile
    std::vector<IndexResource*> g_res;
    std::vector<int64_t> g_n;
    std::vector<int64_t*> g_rows;
    std::vector<float*> g_out;
    std::vector<int> g_table;
    for (int i = 0; i < n; ++i) {
      if (!may_gather[i]) continue;
      g_res.push_back(res[i]);
      g_n.push_back(GatherCount(counts[i], /*records=*/false));
      g_rows.push_back(row_lists[i]);
      g_out.push_back(LineAligned(staging[i] + 3 * counts[i]));
      g_table.push_back(i);
    }
    // (each gathered table's rows sent over group by group on its gather stream, as the host's threads
    // gather the rest; the host thread that completes a group sends it, on this call's device)
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return Failed(*g_res[0], ": ", "no current CUDA device");
    std::vector<float*> rows_dev(g_res.size(), nullptr);
    size_t failed = 0;
    absl::Status status;
    GatherHooks hooks;
    hooks.start = [&](size_t g, int64_t m) {
      const int i = g_table[g];
      IndexResource* r = g_res[g];
      const int64_t first = g_n[g], count = counts[i];
      rows_dev[g] = static_cast<float*>(d.scratch->Allocate(4 * m * r->dim));
      failed = g;
      if (rows_dev[g] == nullptr) return false;
      status = GatherStreamStart(r, stream);
      if (!status.ok()) return false;
      // the keys after the gathered ones read in place now (the store rows a host lookup found sent first)
      if (!on_gpu[i])
        cudaMemcpyAsync(store_rows[i] + first, row_lists[i] + first, 8 * (count - first), cudaMemcpyHostToDevice,
                        stream);
      read(i, r->store->base(0), r->store->stride(), first);
      return true;
    };
    hooks.ready = [&](size_t g, int64_t first, int64_t m) {
      const int64_t dim = g_res[g]->dim;
      cudaSetDevice(device);
      cudaMemcpyAsync(rows_dev[g] + first * dim, g_out[g] + first * dim, 4 * m * dim, cudaMemcpyHostToDevice,
                      g_res[g]->gather_stream);
    };
    std::vector<bool> gathered;
    bool ok = true;
    const std::vector<int64_t> rows_held =
        GatherStoreRows(ctx, g_res, g_n, g_rows, gather_min, g_out, hooks, &gathered, &ok);
    TF_RETURN_IF_ERROR(status);
    if (!ok) return Failed(*g_res[failed], ": ", "out of GPU memory");
    clock.Mark(StageClock::kReadGather);
    for (size_t g = 0; g < g_res.size(); ++g) {
      const int i = g_table[g];
      IndexResource* r = res[i];
      // (rows_held: of the first m keys; the rest's rows, none with the default share, read in place)
      const int64_t count = counts[i], m = g_n[g];
      const int64_t rest_held = std::count_if(row_lists[i] + m, row_lists[i] + count, [](int64_t x) { return x >= 0; });
      if (!gathered[g]) {   // (all read in place; the store rows a host lookup found sent first)
        if (!on_gpu[i]) cudaMemcpyAsync(store_rows[i], row_lists[i], 8 * count, cudaMemcpyHostToDevice, stream);
        Count(r, count, rows_held[g] + rest_held);
        read(i, r->store->base(0), r->store->stride());
        continue;
      }
      Count(r, count - m, rest_held);
      // (the rows' places in the gathered rows)
      cudaMemcpyAsync(store_rows[i], row_lists[i], 8 * m, cudaMemcpyHostToDevice, stream);
      TF_RETURN_IF_ERROR(GatherStreamJoin(r, stream));
      CountGathered(r, m, rows_held[g]);
      read(i, rows_dev[g], r->dim, 0, m);
    }
    clock.Mark(StageClock::kReadGatheredLaunched);
    return absl::OkStatus();
  }
#endif
  std::vector<int64_t> dims_;
};

REGISTER_KERNEL_BUILDER(Name("TfSokDynamicRead").Device(tf::DEVICE_CPU), ReadOp);
#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicRead").Device(tf::DEVICE_GPU).HostMemory("indices"), ReadOp);
#endif

}  // namespace
}  // namespace dynamic_kernels
}  // namespace tf_sok
