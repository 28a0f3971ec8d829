// Kernels of the dynamic-table ops. The key -> row index is a resource in host
// memory (CPU kernels) or in GPU memory (GPU kernels: keys and rows stay on the
// device); the rows it hands out index the table's value and state arrays, which
// the lookup and optimizer kernels read and update like a static table's.
// This file: the index resource's creation, attaching arrays, size, export / import of the index.
// The finds are in dynamic_find_kernels.cc, prefetches in dynamic_prefetch_kernels.cc, reads in
// dynamic_read_kernels.cc, the host tier's ops in hybrid_kernels.cc.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "tf_sok/cc/kernels/dynamic_rows.h"

namespace tf_sok {
namespace dynamic_kernels {
namespace {

// The six vectors of an index snapshot, in the order of the export op's outputs / import op's inputs.
using SnapshotParts = std::array<std::vector<int64_t>*, 6>;
SnapshotParts PartsOf(impl::DynamicIndexSnapshot* snap) {
  return {&snap->keys, &snap->slots, &snap->scores, &snap->generations, &snap->candidate_keys,
          &snap->candidate_counts};
}

class IndexOp : public tf::OpKernel {
 public:
  explicit IndexOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    std::string evict, init;
    OP_REQUIRES_OK(c, c->GetAttr("container", &container_));
    OP_REQUIRES_OK(c, c->GetAttr("shared_name", &shared_name_));
    OP_REQUIRES_OK(c, c->GetAttr("table_name", &table_));
    OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(c, c->GetAttr("init_rows", &config_.init_rows));
    OP_REQUIRES_OK(c, c->GetAttr("max_keys", &config_.max_keys));
    OP_REQUIRES_OK(c, c->GetAttr("min_frequency", &config_.min_frequency));
    OP_REQUIRES_OK(c, c->GetAttr("evict", &evict));
    OP_REQUIRES_OK(c, c->GetAttr("initializer", &init));
    OP_REQUIRES_OK(c, c->GetAttr("init_a", &a_));
    OP_REQUIRES_OK(c, c->GetAttr("init_b", &b_));
    OP_REQUIRES_OK(c, c->GetAttr("seed", &seed_));
    OP_REQUIRES_OK(c, c->GetAttr("cache_bytes", &cache_bytes_));
    config_.cache = cache_bytes_ >= 0;
    if (config_.cache) {   // a hybrid table's max_keys bounds its host tier; the cache's bound is its budget
      store_max_keys_ = config_.max_keys;
      config_.table_max_keys = config_.max_keys;
      config_.max_keys = 0;
    }
    config_.evict = evict == "lru" ? impl::Evict::kLru : evict == "lfu" ? impl::Evict::kLfu : impl::Evict::kNone;
    kind_ = init == "uniform" ? 0 : init == "normal" ? 1 : init == "truncated_normal" ? 2 : 3;
    if (shared_name_.empty()) shared_name_ = name();
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::ResourceHandle handle = tf::MakeResourceHandle<IndexResource>(ctx, container_, shared_name_);
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, tf::LookupOrCreateResource<IndexResource>(ctx, handle, &res, [&](IndexResource** out) {
      auto* r = new IndexResource(table_, dim_, kind_, a_, b_, seed_);
      r->cache_bytes = cache_bytes_;
      r->min_frequency = config_.min_frequency;
      r->lfu = config_.evict == impl::Evict::kLfu;
#if TF_SOK_WITH_CUDA
      if (ctx->device()->device_type() == tf::DEVICE_GPU) {
        r->memory = std::make_unique<AllocatorMemory>(ctx->device()->GetAllocator(tf::AllocatorAttributes()));
        r->gpu = std::make_unique<impl::GpuDynamicIndex>(config_, r->memory.get());
        r->pinned = impl::NewPinnedHostMemory();
        if (cache_bytes_ >= 0) {
          r->store = std::make_unique<impl::HostStore>(impl::NewGrowablePinnedHostMemory());
          r->store->set_max_keys(store_max_keys_);
          r->store->set_settle([r] { r->WaitWriteBack(); });
          // (TF_SOK_STORE_KEYS_ON_GPU=0: on the host alone; a bounded tier drops keys the host
          // chooses: its keys stay on the host alone)
          r->store_keys_on_gpu = store_max_keys_ == 0 && SwitchOn("TF_SOK_STORE_KEYS_ON_GPU");
        }
        *out = r;
        return absl::OkStatus();
      }
#endif
      if (cache_bytes_ >= 0) {
        r->store = std::make_unique<impl::HostStore>(impl::NewPlainHostMemory());
        r->store->set_max_keys(store_max_keys_);
      }
      r->host = std::make_unique<impl::DynamicIndex>(config_);
      *out = r;
      return absl::OkStatus();
    }));
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out));
    out->scalar<tf::ResourceHandle>()() = handle;
  }

 private:
  std::string container_, shared_name_, table_;
  impl::DynamicIndexConfig config_;
  int64_t dim_ = 0, seed_ = 0, cache_bytes_ = -1, store_max_keys_ = 0;
  int kind_ = 0;
  float a_ = 0, b_ = 0;
};

class AttachOp : public tf::OpKernel {
 public:
  explicit AttachOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("fill", &fill_));
    OP_REQUIRES_OK(c, c->GetAttr("values", &values_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    IndexResource::Array a;
    OP_REQUIRES_OK(ctx, tf::LookupResource(ctx, tf::HandleFromInput(ctx, 1), &a.var));
    a.fill = fill_;
    a.values = values_;
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, SettleStore(res.get()));
    TensorScratch scratch(ctx);
    {
      tf::mutex_lock vl(*a.var->mu());
#if TF_SOK_WITH_CUDA
      if (res->gpu)
        OP_REQUIRES_OK(ctx, GrowArray(ctx, MakeDevice<impl::GpuDevice>(ctx, &scratch), *res, a, res->gpu->rows()));
      else
#endif
        OP_REQUIRES_OK(ctx, GrowArray(ctx, MakeDevice<impl::CpuDevice>(ctx, &scratch), *res, a, res->host->rows()));
    }
    if (res->store) {   // a hybrid table: the array's rows in the host tier too
      const tf::Tensor* t = a.var->tensor();
      const std::string error = res->store->AddArray(t->dims() == 2 ? t->dim_size(1) : 1, a.values ? 0.0f : a.fill);
      OP_REQUIRES(ctx, error.empty(), Failed(*res, ": ", error));
    }
    res->arrays.push_back(std::move(a));
    res->UpdateCacheBound();
  }

 private:
  float fill_ = 0;
  bool values_ = false;
};

class SizeOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    tf::Tensor *size = nullptr, *rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &size));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({}), &rows));
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, SettleStore(res.get()));
    if (res->store) {   // every key of a hybrid table has a row in its host tier
      size->scalar<int64_t>()() = res->store->size();
      rows->scalar<int64_t>()() = res->store->size();
      return;
    }
#if TF_SOK_WITH_CUDA
    if (res->gpu) {
      size->scalar<int64_t>()() = res->gpu->size();
      rows->scalar<int64_t>()() = res->gpu->rows();
      return;
    }
#endif
    size->scalar<int64_t>()() = res->host->size();
    rows->scalar<int64_t>()() = res->host->rows();
  }
};

class ExportOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    impl::DynamicIndexSnapshot snap;
    {
      tf::mutex_lock l(res->mu);
      OP_REQUIRES_OK(ctx, SettleStore(res.get()));
      OP_REQUIRES_OK(ctx, ExportIndex(ctx, res.get(), &snap));
    }
    absl::Status s;
    const SnapshotParts parts = PartsOf(&snap);
    for (int i = 0; i < 6; ++i) {
      HostVector(ctx, i, *parts[i], &s);
      OP_REQUIRES_OK(ctx, s);
    }
    HostVector(ctx, 6, {snap.clock, snap.rows, snap.next_free}, &s);
    OP_REQUIRES_OK(ctx, s);
  }
};

class TouchedSinceOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    const tf::Tensor& since = ctx->input(1);
    OP_REQUIRES(ctx, since.dims() == 0, Failed(*res, ": ", "since must be a scalar (ns since the epoch)"));
    std::vector<int64_t> keys, rows;
    {
      tf::mutex_lock l(res->mu);
      OP_REQUIRES_OK(ctx, SettleStore(res.get()));
#if TF_SOK_WITH_CUDA
      if (res->gpu) {
        TensorScratch scratch(ctx);
        const std::string error = res->gpu->TouchedSince(MakeDevice<impl::GpuDevice>(ctx, &scratch),
                                                         since.scalar<int64_t>()(), &keys, &rows);
        OP_REQUIRES(ctx, error.empty(), Failed(*res, ": reading its touched keys: ", error));
      } else {
        res->host->TouchedSince(since.scalar<int64_t>()(), &keys, &rows);
      }
#else
      res->host->TouchedSince(since.scalar<int64_t>()(), &keys, &rows);
#endif
    }
    absl::Status s;
    HostVector(ctx, 0, keys, &s);
    OP_REQUIRES_OK(ctx, s);
    HostVector(ctx, 1, rows, &s);
    OP_REQUIRES_OK(ctx, s);
  }
};

class ImportOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    impl::DynamicIndexSnapshot snap;
    const SnapshotParts parts = PartsOf(&snap);
    for (int i = 0; i < 6; ++i) {
      const tf::Tensor& t = ctx->input(1 + i);
      OP_REQUIRES(ctx, t.dims() == 1,
                  Failed(*res, ": restoring its index: part ", std::to_string(i) + " is not a vector"));
      parts[i]->assign(t.flat<int64_t>().data(), t.flat<int64_t>().data() + t.NumElements());
    }
    const tf::Tensor& counters = ctx->input(7);
    OP_REQUIRES(ctx, counters.NumElements() == 3, Failed(*res, ": restoring its index: ", "3 counters expected"));
    snap.clock = counters.flat<int64_t>()(0);
    snap.rows = counters.flat<int64_t>()(1);
    snap.next_free = counters.flat<int64_t>()(2);
    tf::mutex_lock l(res->mu);
    OP_REQUIRES_OK(ctx, SettleStore(res.get()));
    OP_REQUIRES_OK(ctx, ImportIndex(ctx, res.get(), snap));
    if (res->store) {
      res->store->ClearMarks();   // touches count from the import on, as the index's own marks
      // (a restore replaces the host tier next, which then counts its keys for admission)
      OP_REQUIRES_OK(ctx, RelinkCache(ctx, res.get(), false));
    }
  }
};


REGISTER_KERNEL_BUILDER(Name("TfSokDynamicIndex").Device(tf::DEVICE_CPU), IndexOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicAttach").Device(tf::DEVICE_CPU), AttachOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicSize").Device(tf::DEVICE_CPU), SizeOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicExport").Device(tf::DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicTouchedSince").Device(tf::DEVICE_CPU), TouchedSinceOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicImport").Device(tf::DEVICE_CPU), ImportOp);

#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicIndex").Device(tf::DEVICE_GPU).HostMemory("handle"), IndexOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicAttach").Device(tf::DEVICE_GPU).HostMemory("index").HostMemory("array"),
                        AttachOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicSize")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("size")
                            .HostMemory("rows"),
                        SizeOp);
// an index snapshot (export / import) travels in host memory
#define TF_SOK_SNAPSHOT_ON_HOST                                                                            \
  HostMemory("index").HostMemory("keys").HostMemory("slots").HostMemory("scores").HostMemory("generations") \
      .HostMemory("candidate_keys").HostMemory("candidate_counts").HostMemory("counters")
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicExport").Device(tf::DEVICE_GPU).TF_SOK_SNAPSHOT_ON_HOST, ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicTouchedSince")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("since")
                            .HostMemory("keys")
                            .HostMemory("rows"),
                        TouchedSinceOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicImport").Device(tf::DEVICE_GPU).TF_SOK_SNAPSHOT_ON_HOST, ImportOp);
#undef TF_SOK_SNAPSHOT_ON_HOST
#endif

}  // namespace
}  // namespace dynamic_kernels
}  // namespace tf_sok
