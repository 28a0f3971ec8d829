// Kernels of the dynamic-table ops. The key -> row index is a resource in host
// memory (CPU kernels) or in GPU memory (GPU kernels: keys and rows stay on the
// device); the rows it hands out index the table's value and state arrays, which
// the lookup and optimizer kernels read and update like a static table's.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/platform/mutex.h"
#include "tf_sok/cc/impl/dynamic_index.h"
#include "tf_sok/cc/impl/optimizer.h"
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
  // the row arrays the index serves: the values, then optimizer state as optimizers attach it
  struct Array {
    tf::core::RefCountPtr<tf::Var> var;
    float fill;
    bool values;
  };
  std::vector<Array> arrays;
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

// The row upkeep of impl, on the host or the device.
void InitialRowsAt(const impl::CpuDevice&, const IndexResource& r, const int64_t* keys, const int64_t* rows, int64_t n,
                   int64_t width, float* base) {
  impl::InitialRowsAt(r.init_kind, r.a, r.b, r.seed, keys, rows, n, width, base);
}
void FillRows(const impl::CpuDevice&, float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  impl::FillRows(base, width, rows, n, fill);
}
void GatherRows(const impl::CpuDevice&, const float* base, int64_t width, const int64_t* rows, int64_t n, float* out) {
  impl::GatherRows(base, width, rows, n, out);
}
void Fill(const impl::CpuDevice&, float* p, int64_t count, float value) { impl::Fill(p, count, value); }
#if TF_SOK_WITH_CUDA
void InitialRowsAt(const impl::GpuDevice& d, const IndexResource& r, const int64_t* keys, const int64_t* rows,
                   int64_t n, int64_t width, float* base) {
  impl::GpuInitialRowsAt(d, r.init_kind, r.a, r.b, r.seed, keys, rows, n, width, base);
}
void FillRows(const impl::GpuDevice& d, float* base, int64_t width, const int64_t* rows, int64_t n, float fill) {
  impl::GpuFillRows(d, base, width, rows, n, fill);
}
void GatherRows(const impl::GpuDevice& d, const float* base, int64_t width, const int64_t* rows, int64_t n,
                float* out) {
  impl::GpuGatherRows(d, base, width, rows, n, out);
}
void Fill(const impl::GpuDevice& d, float* p, int64_t count, float value) { impl::GpuFill(d, p, count, value); }
#endif

// An attached array grown to `rows` rows (new rows at its fill; values: zeros until a key's row is set).
template <typename Device>
absl::Status GrowArray(tf::OpKernelContext* ctx, const Device& d, const IndexResource& res,
                       const IndexResource::Array& a, int64_t rows) {
  tf::Tensor* t = a.var->tensor();
  if (!a.var->is_initialized || t->dtype() != tf::DT_FLOAT || t->dims() < 1 || t->dims() > 2)
    return absl::InvalidArgumentError("dynamic table '" + res.table + "': an attached array must be an initialized "
                                      "float32 variable [rows] or [rows, width], got " + t->shape().DebugString());
  if (t->dim_size(0) >= rows) return MakeExclusive(ctx, d, a.var.get());
  tf::TensorShape shape = t->shape();
  shape.set_dim(0, rows);
  tf::Tensor fresh;
  tf::AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_FLOAT, shape, &fresh, attr));
  const int64_t old = t->NumElements();
  if (old > 0) impl::DeviceCopy<Device>(d, fresh.data(), t->data(), t->TotalBytes());
  Fill(d, fresh.flat<float>().data() + old, fresh.NumElements() - old, a.values ? 0.0f : a.fill);
  *t = fresh;
  return absl::OkStatus();
}

// After an index call: every attached array grown to `rows` and the rows of new keys set;
// evicted_values (when given): the evicted rows' values, read before anything is written.
template <typename Device>
absl::Status KeepArraysInStep(tf::OpKernelContext* ctx, const Device& d, IndexResource* res, int64_t rows,
                              const int64_t* new_keys, const int64_t* new_slots, int64_t num_new,
                              const int64_t* evicted_slots, int64_t num_evicted, float* evicted_values) {
  for (auto& a : res->arrays) {
    tf::mutex_lock l(*a.var->mu());
    tf::Tensor* t = a.var->tensor();
    const int64_t width = t->dims() == 2 ? t->dim_size(1) : 1;
    if (a.values && evicted_values != nullptr && num_evicted > 0)
      GatherRows(d, t->flat<float>().data(), width, evicted_slots, num_evicted, evicted_values);
    if (num_new == 0 && t->dim_size(0) >= rows && !a.values) continue;
    TF_RETURN_IF_ERROR(GrowArray(ctx, d, *res, a, rows));
    float* base = a.var->tensor()->flat<float>().data();
    if (a.values) {
      Fill(d, base, width, 0.0f);   // row 0, which keys not inserted read (an update may have moved it)
      InitialRowsAt(d, *res, new_keys, new_slots, num_new, width, base);
    } else {
      FillRows(d, base, width, new_slots, num_new, a.fill);
    }
  }
  return absl::OkStatus();
}

absl::Status EvictedOutputs(tf::OpKernelContext* ctx, const IndexResource& res, int64_t n, tf::Tensor** keys,
                            tf::Tensor** values) {
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, tf::TensorShape({n}), keys));
  return ctx->allocate_output(2, tf::TensorShape({n, res.dim}), values);
}

class FindOp : public tf::OpKernel {
 public:
  explicit FindOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("insert", &insert_));
    OP_REQUIRES_OK(c, c->GetAttr("with_evicted", &with_evicted_));
    OP_REQUIRES_OK(c, c->GetAttr("admit_all", &admit_all_));
    OP_REQUIRES_OK(c, c->GetAttr("insert_ratio", &insert_ratio_));
  }

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
    tf::mutex_lock l(res->mu);
    const std::string error = res->host->Find(keys.flat<int64_t>().data(), keys.NumElements(), insert_,
                                              slots->flat<int64_t>().data(), &ch, admit_all_, insert_ratio_);
    OP_REQUIRES(ctx, error.empty(), Failed(*res, " ", error));
    const int64_t evicted = with_evicted_ ? static_cast<int64_t>(ch.evicted_keys.size()) : 0;
    tf::Tensor *ev_keys = nullptr, *ev_values = nullptr;
    OP_REQUIRES_OK(ctx, EvictedOutputs(ctx, *res, evicted, &ev_keys, &ev_values));
    std::copy(ch.evicted_keys.begin(), ch.evicted_keys.begin() + evicted, ev_keys->flat<int64_t>().data());
    if (!insert_) return;
    TensorScratch scratch(ctx);
    OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, MakeDevice<impl::CpuDevice>(ctx, &scratch), res.get(), ch.rows,
                                         ch.new_keys.data(), ch.new_slots.data(),
                                         static_cast<int64_t>(ch.new_slots.size()), ch.evicted_slots.data(), evicted,
                                         ev_values->flat<float>().data()));
  }

 private:
#if TF_SOK_WITH_CUDA
  void ComputeGpu(tf::OpKernelContext* ctx, IndexResource* res, const tf::Tensor& keys) {
    TensorScratch scratch(ctx);
    const impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    tf::Tensor* slots = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &slots));
    impl::GpuFindResult r;
    tf::mutex_lock l(res->mu);
    const std::string error =
        res->gpu->Find(d, keys.flat<int64_t>().data(), keys.NumElements(), insert_, &r, admit_all_, insert_ratio_);
    OP_REQUIRES(ctx, error.empty(), Failed(*res, " ", error));
    if (keys.NumElements() > 0)
      cudaMemcpyAsync(slots->flat<int64_t>().data(), r.slots, 8 * keys.NumElements(), cudaMemcpyDeviceToDevice,
                      stream);
    const int64_t evicted = with_evicted_ ? r.num_evicted : 0;
    tf::Tensor *ev_keys = nullptr, *ev_values = nullptr;
    OP_REQUIRES_OK(ctx, EvictedOutputs(ctx, *res, evicted, &ev_keys, &ev_values));
    if (evicted > 0)
      cudaMemcpyAsync(ev_keys->flat<int64_t>().data(), r.evicted_keys, 8 * evicted, cudaMemcpyDeviceToDevice, stream);
    if (!insert_) return;
    // stream-ordered: the scratch these read is reused only by work queued after them
    OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, res, r.rows, r.new_keys, r.new_slots, r.num_new, r.evicted_slots,
                                         evicted, ev_values->flat<float>().data()));
  }
#endif
  bool insert_ = true, with_evicted_ = false, admit_all_ = false;
  float insert_ratio_ = 1.0f;
};

// TfSokDynamicFindMany: one find (insert) per table; on a GPU the missing-key counts of all
// tables come back in one wait. Indices are locked in address order (no deadlock with other ops).
class FindManyOp : public tf::OpKernel {
 public:
  explicit FindManyOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("insert_ratio", &insert_ratio_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    std::vector<tf::core::RefCountPtr<IndexResource>> res(n);
    std::vector<IndexResource*> order;
    for (int i = 0; i < n; ++i) {
      OP_REQUIRES_OK(ctx, tf::LookupResource(ctx, tf::HandleFromInput(ctx, i), &res[i]));
      const tf::Tensor& keys = ctx->input(n + i);
      OP_REQUIRES(ctx, keys.dims() == 1,
                  Failed(*res[i], ": ", "keys must be a vector, got shape " + keys.shape().DebugString()));
      order.push_back(res[i].get());
    }
    std::sort(order.begin(), order.end());
    OP_REQUIRES(ctx, std::adjacent_find(order.begin(), order.end()) == order.end(),
                absl::InvalidArgumentError("TfSokDynamicFindMany: a dynamic table's index is given twice"));
    std::vector<std::unique_ptr<tf::mutex_lock>> locks;
    for (IndexResource* r : order) locks.push_back(std::make_unique<tf::mutex_lock>(r->mu));
#if TF_SOK_WITH_CUDA
    if (res[0]->gpu) {
      ComputeGpu(ctx, res);
      return;
    }
#endif
    TensorScratch scratch(ctx);
    const impl::CpuDevice d = MakeDevice<impl::CpuDevice>(ctx, &scratch);
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i].get();
      OP_REQUIRES(ctx, r->host != nullptr, Failed(*r, ": ", "its index lives on a GPU; look it up there"));
      const tf::Tensor& keys = ctx->input(n + i);
      tf::Tensor* slots = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, keys.shape(), &slots));
      impl::FindChanges ch;
      const std::string error = r->host->Find(keys.flat<int64_t>().data(), keys.NumElements(), true,
                                              slots->flat<int64_t>().data(), &ch, false, insert_ratio_);
      OP_REQUIRES(ctx, error.empty(), Failed(*r, " ", error));
      OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, r, ch.rows, ch.new_keys.data(), ch.new_slots.data(),
                                           static_cast<int64_t>(ch.new_slots.size()), nullptr, 0, nullptr));
    }
  }

 private:
#if TF_SOK_WITH_CUDA
  void ComputeGpu(tf::OpKernelContext* ctx, const std::vector<tf::core::RefCountPtr<IndexResource>>& res) {
    const int n = static_cast<int>(res.size());
    TensorScratch scratch(ctx);
    const impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    const cudaStream_t stream = static_cast<cudaStream_t>(d.stream);
    auto* counts = static_cast<int64_t*>(d.scratch->Allocate(8 * static_cast<size_t>(n)));
    OP_REQUIRES(ctx, counts != nullptr, absl::ResourceExhaustedError("TfSokDynamicFindMany: out of GPU memory"));
    std::vector<impl::GpuFindResult> found(n);
    std::vector<impl::GpuFindPending> pending(n);
    for (int i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, res[i]->gpu != nullptr, Failed(*res[i], ": ", "its index is on the host; look it up there"));
      const tf::Tensor& keys = ctx->input(n + i);
      const std::string error = res[i]->gpu->Probe(d, keys.flat<int64_t>().data(), keys.NumElements(), &found[i],
                                                   &pending[i], counts + i);
      OP_REQUIRES(ctx, error.empty(), Failed(*res[i], " ", error));
    }
    std::vector<int64_t> missing(n);
    cudaMemcpyAsync(missing.data(), counts, 8 * n, cudaMemcpyDeviceToHost, stream);
    const cudaError_t c = cudaStreamSynchronize(stream);   // the op's one wait
    OP_REQUIRES(ctx, c == cudaSuccess, absl::InternalError(std::string("CUDA error ") + cudaGetErrorString(c)));
    for (int i = 0; i < n; ++i) {
      IndexResource* r = res[i].get();
      const tf::Tensor& keys = ctx->input(n + i);
      const std::string error = r->gpu->Finish(d, pending[i], missing[i], &found[i], false, insert_ratio_);
      OP_REQUIRES(ctx, error.empty(), Failed(*r, " ", error));
      tf::Tensor* slots = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, keys.shape(), &slots));
      if (keys.NumElements() > 0)
        cudaMemcpyAsync(slots->flat<int64_t>().data(), found[i].slots, 8 * keys.NumElements(),
                        cudaMemcpyDeviceToDevice, stream);
      OP_REQUIRES_OK(ctx, KeepArraysInStep(ctx, d, r, found[i].rows, found[i].new_keys, found[i].new_slots,
                                           found[i].num_new, nullptr, 0, nullptr));
    }
  }
#endif
  float insert_ratio_ = 1.0f;
};

template <typename Device>
class RowSplitsValidOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() / 2;
    tf::Tensor* valid = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({n}), &valid));
    for (int i = 0; i < n; ++i) {
      const tf::Tensor& splits = ctx->input(i);
      OP_REQUIRES(ctx, splits.dims() == 1,
                  absl::InvalidArgumentError("row_splits must be a vector, got " + splits.shape().DebugString()));
      Check(ctx, splits.flat<int64_t>().data(), splits.NumElements(), ctx->input(n + i).NumElements(),
            valid->flat<bool>().data() + i);
    }
  }

 private:
  void Check(tf::OpKernelContext* ctx, const int64_t* splits, int64_t n, int64_t count, bool* out);
};

template <>
void RowSplitsValidOp<impl::CpuDevice>::Check(tf::OpKernelContext*, const int64_t* splits, int64_t n, int64_t count,
                                              bool* out) {
  *out = impl::RowSplitsValid(splits, n, count);
}

#if TF_SOK_WITH_CUDA
template <>
void RowSplitsValidOp<impl::GpuDevice>::Check(tf::OpKernelContext* ctx, const int64_t* splits, int64_t n,
                                              int64_t count, bool* out) {
  TensorScratch scratch(ctx);
  impl::GpuRowSplitsValid(MakeDevice<impl::GpuDevice>(ctx, &scratch), splits, n, count, out);
}
#endif

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
    int64_t rows = 0;
#if TF_SOK_WITH_CUDA
    if (res->gpu) {
      TensorScratch scratch(ctx);
      tf::mutex_lock vl(*a.var->mu());
      OP_REQUIRES_OK(ctx, GrowArray(ctx, MakeDevice<impl::GpuDevice>(ctx, &scratch), *res, a, res->gpu->rows()));
      res->arrays.push_back(std::move(a));
      return;
    }
#endif
    rows = res->host->rows();
    TensorScratch scratch(ctx);
    {
      tf::mutex_lock vl(*a.var->mu());
      OP_REQUIRES_OK(ctx, GrowArray(ctx, MakeDevice<impl::CpuDevice>(ctx, &scratch), *res, a, rows));
    }
    res->arrays.push_back(std::move(a));
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
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFindMany").Device(tf::DEVICE_CPU), FindManyOp);
REGISTER_KERNEL_BUILDER(Name("TfSokRowSplitsValid").Device(tf::DEVICE_CPU), RowSplitsValidOp<impl::CpuDevice>);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicAttach").Device(tf::DEVICE_CPU), AttachOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicSize").Device(tf::DEVICE_CPU), SizeOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicExport").Device(tf::DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicTouchedSince").Device(tf::DEVICE_CPU), TouchedSinceOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicImport").Device(tf::DEVICE_CPU), ImportOp);

#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicIndex").Device(tf::DEVICE_GPU).HostMemory("handle"), IndexOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_GPU).HostMemory("index"), FindOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFindMany").Device(tf::DEVICE_GPU).HostMemory("indices"), FindManyOp);
REGISTER_KERNEL_BUILDER(Name("TfSokRowSplitsValid").Device(tf::DEVICE_GPU), RowSplitsValidOp<impl::GpuDevice>);
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
}  // namespace tf_sok
