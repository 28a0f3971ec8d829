// Kernels of the dynamic-table ops. The key -> row index is a resource in host
// memory (CPU kernels) or in GPU memory (GPU kernels: keys and rows stay on the
// device); the rows it hands out index the table's value and state arrays, which
// the lookup and optimizer kernels read and update like a static table's.
#include <memory>
#include <string>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/platform/mutex.h"
#include "tf_sok/cc/impl/dynamic_index.h"
#include "tf_sok/cc/kernels/kernel_util.h"

#if TF_SOK_WITH_CUDA
#include <cuda_runtime.h>

#include "tf_sok/cc/impl/dynamic_index_gpu.h"
#endif

namespace tf_sok {
namespace {

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
  std::unique_ptr<impl::DynamicIndex> host;  // one of the two
#if TF_SOK_WITH_CUDA
  std::unique_ptr<impl::DeviceMemory> memory;
  std::unique_ptr<impl::GpuDynamicIndex> gpu;  // destroyed before `memory`
  ~IndexResource() override { gpu.reset(); }
#endif
};

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
    config_.evict = evict == "lru" ? impl::Evict::kLru : evict == "lfu" ? impl::Evict::kLfu : impl::Evict::kNone;
    kind_ = init == "uniform" ? 0 : init == "normal" ? 1 : init == "truncated_normal" ? 2 : 3;
    if (shared_name_.empty()) shared_name_ = name();
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::ResourceHandle handle = tf::MakeResourceHandle<IndexResource>(ctx, container_, shared_name_);
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, tf::LookupOrCreateResource<IndexResource>(ctx, handle, &res, [&](IndexResource** out) {
      auto* r = new IndexResource(table_, dim_, kind_, a_, b_, seed_);
#if TF_SOK_WITH_CUDA
      if (ctx->device()->device_type() == tf::DEVICE_GPU) {
        r->memory = std::make_unique<AllocatorMemory>(ctx->device()->GetAllocator(tf::AllocatorAttributes()));
        r->gpu = std::make_unique<impl::GpuDynamicIndex>(config_, r->memory.get());
        *out = r;
        return absl::OkStatus();
      }
#endif
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
  int64_t dim_ = 0, seed_ = 0;
  int kind_ = 0;
  float a_ = 0, b_ = 0;
};

absl::Status GetIndex(tf::OpKernelContext* ctx, tf::core::RefCountPtr<IndexResource>* out) {
  return tf::LookupResource(ctx, tf::HandleFromInput(ctx, 0), out);
}

absl::Status Failed(const IndexResource& res, const std::string& what, const std::string& error) {
  return absl::InvalidArgumentError("dynamic table '" + res.table + "'" + what + error);
}

void HostVector(tf::OpKernelContext* ctx, int output, const std::vector<int64_t>& v, absl::Status* s) {
  tf::Tensor* t = nullptr;
  *s = ctx->allocate_output(output, tf::TensorShape({static_cast<int64_t>(v.size())}), &t);
  if (s->ok()) std::copy(v.begin(), v.end(), t->flat<int64_t>().data());
}

class FindOp : public tf::OpKernel {
 public:
  explicit FindOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("insert", &insert_)); }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    const tf::Tensor& keys = ctx->input(1);
    OP_REQUIRES(ctx, keys.dims() == 1, Failed(*res, ": ", "keys must be a vector, got shape " + keys.shape().DebugString()));
#if TF_SOK_WITH_CUDA
    if (res->gpu) {
      ComputeGpu(ctx, res.get(), keys);
      return;
    }
#endif
    OP_REQUIRES(ctx, res->host != nullptr, Failed(*res, ": ", "its index lives on a GPU; look it up there"));
    tf::Tensor* slots = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &slots));
    impl::FindChanges ch;
    {
      tf::mutex_lock l(res->mu);
      const std::string error = res->host->Find(keys.flat<int64_t>().data(), keys.NumElements(), insert_,
                                                slots->flat<int64_t>().data(), &ch);
      OP_REQUIRES(ctx, error.empty(), Failed(*res, " ", error));
    }
    absl::Status s;
    HostVector(ctx, 1, ch.new_slots, &s);
    OP_REQUIRES_OK(ctx, s);
    tf::Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, tf::TensorShape({static_cast<int64_t>(ch.new_keys.size()), res->dim}),
                                             &values));
    impl::InitialRows(res->init_kind, res->a, res->b, res->seed, ch.new_keys.data(),
                      static_cast<int64_t>(ch.new_keys.size()), res->dim, values->flat<float>().data());
    HostVector(ctx, 3, ch.evicted_keys, &s);
    OP_REQUIRES_OK(ctx, s);
    HostVector(ctx, 4, ch.evicted_slots, &s);
    OP_REQUIRES_OK(ctx, s);
    tf::Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, tf::TensorShape({}), &rows));
    rows->scalar<int64_t>()() = ch.rows;
  }

 private:
#if TF_SOK_WITH_CUDA
  void ComputeGpu(tf::OpKernelContext* ctx, IndexResource* res, const tf::Tensor& keys) {
    TensorScratch scratch(ctx);
    const impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    impl::GpuFindResult r;
    {
      tf::mutex_lock l(res->mu);
      const std::string error = res->gpu->Find(d, keys.flat<int64_t>().data(), keys.NumElements(), insert_, &r);
      OP_REQUIRES(ctx, error.empty(), Failed(*res, " ", error));
    }
    auto copy = [&](int output, const int64_t* from, int64_t n) -> bool {
      tf::Tensor* t = nullptr;
      if (!ctx->allocate_output(output, tf::TensorShape({n}), &t).ok()) return false;
      if (n > 0) cudaMemcpyAsync(t->flat<int64_t>().data(), from, 8 * n, cudaMemcpyDeviceToDevice, stream);
      return true;
    };
    OP_REQUIRES(ctx, copy(0, r.slots, keys.NumElements()), absl::ResourceExhaustedError("dynamic table outputs"));
    OP_REQUIRES(ctx, copy(1, r.new_slots, r.num_new), absl::ResourceExhaustedError("dynamic table outputs"));
    tf::Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, tf::TensorShape({r.num_new, res->dim}), &values));
    impl::GpuInitialRows(d, res->init_kind, res->a, res->b, res->seed, r.new_keys, r.num_new, res->dim,
                         values->flat<float>().data());
    OP_REQUIRES(ctx, copy(3, r.evicted_keys, r.num_evicted), absl::ResourceExhaustedError("dynamic table outputs"));
    OP_REQUIRES(ctx, copy(4, r.evicted_slots, r.num_evicted), absl::ResourceExhaustedError("dynamic table outputs"));
    tf::Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, tf::TensorShape({}), &rows));  // host memory
    rows->scalar<int64_t>()() = r.rows;
    // the call's scratch (which the copies read) is freed when Compute returns: keep the stream's order
    const cudaError_t c = cudaStreamSynchronize(stream);
    OP_REQUIRES(ctx, c == cudaSuccess, absl::InternalError(std::string("CUDA: ") + cudaGetErrorString(c)));
  }
#endif
  bool insert_ = true;
};

class GenerationsOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    const tf::Tensor& slots = ctx->input(1);
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, slots.shape(), &out));
    tf::mutex_lock l(res->mu);
#if TF_SOK_WITH_CUDA
    if (res->gpu) {
      TensorScratch scratch(ctx);
      res->gpu->Generations(MakeDevice<impl::GpuDevice>(ctx, &scratch), slots.flat<int64_t>().data(),
                            slots.NumElements(), out->flat<int64_t>().data());
      return;
    }
#endif
    OP_REQUIRES(ctx, res->host != nullptr, Failed(*res, ": ", "its index lives on a GPU"));
    res->host->Generations(slots.flat<int64_t>().data(), slots.NumElements(), out->flat<int64_t>().data());
  }
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
#if TF_SOK_WITH_CUDA
      if (res->gpu) {
        TensorScratch scratch(ctx);
        const std::string error = res->gpu->Export(MakeDevice<impl::GpuDevice>(ctx, &scratch), &snap);
        OP_REQUIRES(ctx, error.empty(), Failed(*res, ": exporting its index: ", error));
      } else {
        snap = res->host->Export();
      }
#else
      snap = res->host->Export();
#endif
    }
    absl::Status s;
    const std::vector<int64_t>* parts[] = {&snap.keys,         &snap.slots,          &snap.scores,
                                           &snap.generations, &snap.candidate_keys, &snap.candidate_counts};
    for (int i = 0; i < 6; ++i) {
      HostVector(ctx, i, *parts[i], &s);
      OP_REQUIRES_OK(ctx, s);
    }
    HostVector(ctx, 6, {snap.clock, snap.rows, snap.next_free}, &s);
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
    std::vector<int64_t>* parts[] = {&snap.keys,         &snap.slots,          &snap.scores,
                                     &snap.generations, &snap.candidate_keys, &snap.candidate_counts};
    for (int i = 0; i < 6; ++i) {
      const tf::Tensor& t = ctx->input(1 + i);
      OP_REQUIRES(ctx, t.dims() == 1, Failed(*res, ": restoring its index: part ", std::to_string(i) + " is not a vector"));
      parts[i]->assign(t.flat<int64_t>().data(), t.flat<int64_t>().data() + t.NumElements());
    }
    const tf::Tensor& counters = ctx->input(7);
    OP_REQUIRES(ctx, counters.NumElements() == 3, Failed(*res, ": restoring its index: ", "3 counters expected"));
    snap.clock = counters.flat<int64_t>()(0);
    snap.rows = counters.flat<int64_t>()(1);
    snap.next_free = counters.flat<int64_t>()(2);
    tf::mutex_lock l(res->mu);
    std::string error;
#if TF_SOK_WITH_CUDA
    if (res->gpu) {
      TensorScratch scratch(ctx);
      error = res->gpu->Import(MakeDevice<impl::GpuDevice>(ctx, &scratch), snap);
    } else {
      error = res->host->Import(snap);
    }
#else
    error = res->host->Import(snap);
#endif
    OP_REQUIRES(ctx, error.empty(), Failed(*res, ": restoring its index: ", error));
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSokDynamicIndex").Device(tf::DEVICE_CPU), IndexOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_CPU), FindOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicGenerations").Device(tf::DEVICE_CPU), GenerationsOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicSize").Device(tf::DEVICE_CPU), SizeOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicExport").Device(tf::DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicImport").Device(tf::DEVICE_CPU), ImportOp);

#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicIndex").Device(tf::DEVICE_GPU).HostMemory("handle"), IndexOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_GPU).HostMemory("index").HostMemory("rows"),
                        FindOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicGenerations").Device(tf::DEVICE_GPU).HostMemory("index"), GenerationsOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicSize")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("size")
                            .HostMemory("rows"),
                        SizeOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicExport")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("keys")
                            .HostMemory("slots")
                            .HostMemory("scores")
                            .HostMemory("generations")
                            .HostMemory("candidate_keys")
                            .HostMemory("candidate_counts")
                            .HostMemory("counters"),
                        ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicImport")
                            .Device(tf::DEVICE_GPU)
                            .HostMemory("index")
                            .HostMemory("keys")
                            .HostMemory("slots")
                            .HostMemory("scores")
                            .HostMemory("generations")
                            .HostMemory("candidate_keys")
                            .HostMemory("candidate_counts")
                            .HostMemory("counters"),
                        ImportOp);
#endif

}  // namespace
}  // namespace tf_sok
