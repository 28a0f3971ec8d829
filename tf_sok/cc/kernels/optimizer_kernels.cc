// Kernel of TfSokSparseApply: lock every table and its slots, check shapes,
// make the buffers exclusive (copy-on-write), run the impl functor once for all tables.
#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "tf_sok/cc/impl/optimizer.h"
#include "tf_sok/cc/kernels/kernel_util.h"

#if TF_SOK_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace tf_sok {

#if TF_SOK_WITH_CUDA
namespace {
tf::mutex side_writes_mu;
std::unordered_map<const tf::Var*, cudaEvent_t>& SideWrites() {
  static auto* pending = new std::unordered_map<const tf::Var*, cudaEvent_t>();
  return *pending;
}

// (before a copy of var's buffer on stream: the writes queued on other streams first)
void AfterSideWrites(const tf::Var* var, cudaStream_t stream) {
  tf::mutex_lock l(side_writes_mu);
  auto it = SideWrites().find(var);
  if (it != SideWrites().end()) cudaStreamWaitEvent(stream, it->second, 0);
}
void AfterSideWrites(const tf::Var*, const impl::CpuDevice&) {}
void AfterSideWrites(const tf::Var* var, const impl::GpuDevice& d) {
  AfterSideWrites(var, static_cast<cudaStream_t>(d.stream));
}
}  // namespace

void NoteSideWrites(const tf::Var* var, void* done) {
  tf::mutex_lock l(side_writes_mu);
  SideWrites()[var] = static_cast<cudaEvent_t>(done);
}

void ClearSideWrites(const tf::Var* var) {
  tf::mutex_lock l(side_writes_mu);
  SideWrites().erase(var);
}
#endif

template <typename Device>
absl::Status MakeExclusive(tf::OpKernelContext* ctx, const Device& d, tf::Var* var) {
  tf::Tensor* t = var->tensor();
  if (t->RefCountIsOne()) return absl::OkStatus();
#if TF_SOK_WITH_CUDA
  AfterSideWrites(var, d);
#endif
  tf::Tensor copy;
  tf::AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &copy, attr));
  impl::DeviceCopy<Device>(d, copy.data(), t->data(), t->TotalBytes());
  *t = copy;
  return absl::OkStatus();
}
template absl::Status MakeExclusive<impl::CpuDevice>(tf::OpKernelContext*, const impl::CpuDevice&, tf::Var*);
#if TF_SOK_WITH_CUDA
template absl::Status MakeExclusive<impl::GpuDevice>(tf::OpKernelContext*, const impl::GpuDevice&, tf::Var*);
#endif

namespace {

impl::Algorithm ParseAlgorithm(const std::string& s) {
  if (s == "momentum") return impl::Algorithm::kMomentum;
  if (s == "adagrad") return impl::Algorithm::kAdagrad;
  if (s == "adam") return impl::Algorithm::kAdam;
  if (s == "ftrl") return impl::Algorithm::kFtrl;
  if (s == "rmsprop") return impl::Algorithm::kRmsprop;
  return impl::Algorithm::kSgd;
}

template <typename Device, typename Id>
class SparseApplyOp : public tf::OpKernel {
 public:
  explicit SparseApplyOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("algorithm", &algorithm_));
    OP_REQUIRES_OK(c, c->GetAttr("num_tables", &num_tables_));
    OP_REQUIRES_OK(c, c->GetAttr("num_slot_vars", &num_slot_vars_));
    OP_REQUIRES_OK(c, c->GetAttr("num_step_vars", &num_step_vars_));
    OP_REQUIRES_OK(c, c->GetAttr("indices_unique", &indices_unique_));
    OP_REQUIRES_OK(c, c->GetAttr("checked", &checked_));
    OP_REQUIRES_OK(c, c->GetAttr("table_names", &tables_));
    h_.algorithm = ParseAlgorithm(algorithm_);
    OP_REQUIRES_OK(c, c->GetAttr("beta1", &h_.beta1));
    OP_REQUIRES_OK(c, c->GetAttr("beta2", &h_.beta2));
    OP_REQUIRES_OK(c, c->GetAttr("epsilon", &h_.epsilon));
    OP_REQUIRES_OK(c, c->GetAttr("momentum", &h_.momentum));
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &h_.nesterov));
    OP_REQUIRES_OK(c, c->GetAttr("rho", &h_.rho));
    OP_REQUIRES_OK(c, c->GetAttr("centered", &h_.centered));
    OP_REQUIRES_OK(c, c->GetAttr("l1", &h_.l1));
    OP_REQUIRES_OK(c, c->GetAttr("l2", &h_.l2));
    OP_REQUIRES_OK(c, c->GetAttr("l2_shrinkage", &h_.l2_shrinkage));
    OP_REQUIRES_OK(c, c->GetAttr("lr_power", &h_.lr_power));
    OP_REQUIRES_OK(c, c->GetAttr("beta", &h_.beta));
    tables_.resize(num_tables_);
    for (int t = 0; t < num_tables_; ++t)
      if (tables_[t].empty()) tables_[t] = absl::StrCat("#", t);
    slots_ = impl::NumDenseSlots(h_);
    steps_ = impl::HasStepSlot(h_) ? 1 : 0;
    OP_REQUIRES(c, num_slot_vars_ == num_tables_ * slots_ && num_step_vars_ == num_tables_ * steps_,
                absl::InvalidArgumentError(absl::StrCat(
                    "tf_sok ", algorithm_, " update: expects ", slots_, " slot(s) and ", steps_,
                    " step counter(s) per table for ", num_tables_, " table(s); got ",
                    num_slot_vars_, " and ", num_step_vars_)));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int T = num_tables_;
    const int lr_input = T + num_slot_vars_ + num_step_vars_;
    const tf::Tensor& lr = ctx->input(lr_input);
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(lr.shape()),
                absl::InvalidArgumentError(absl::StrCat("tf_sok ", algorithm_,
                                                        " update: learning_rate must be a scalar")));
    // Inputs 0..T-1 are the tables, then table-major slots, then step counters.
    std::vector<tf::core::RefCountPtr<tf::Var>> vars(lr_input);
    std::vector<tf::Var*> raw;
    for (int i = 0; i < lr_input; ++i) {
      const bool is_step = i >= T + num_slot_vars_;
      const int t = i < T ? i : is_step ? (i - T - num_slot_vars_) : (i - T) / std::max(slots_, 1);
      OP_REQUIRES_OK(ctx, GetVar(ctx, i, is_step ? 1 : 2,
                                 What(t) + (i < T ? ": the table" : ": a slot"), &vars[i]));
      raw.push_back(vars[i].get());
    }
    ExclusiveLocks locks(raw);
    std::vector<impl::TableUpdate<Id>> updates(T);
    for (int t = 0; t < T; ++t) {
      const tf::Tensor& var = *vars[t]->tensor();
      const int64_t rows = var.dim_size(0), dim = var.dim_size(1);
      std::vector<int> mine;
      for (int s = 0; s < slots_; ++s) mine.push_back(T + t * slots_ + s);
      for (int s = 0; s < steps_; ++s) mine.push_back(T + num_slot_vars_ + t * steps_ + s);
      for (int i : mine) {
        const tf::Tensor& st = *vars[i]->tensor();
        const bool is_step = i >= T + num_slot_vars_;
        OP_REQUIRES(ctx, st.dim_size(0) == rows && (is_step || st.dim_size(1) == dim),
                    absl::InvalidArgumentError(absl::StrCat(
                        What(t), ": a slot has shape ", st.shape().DebugString(),
                        " but the table has ", var.shape().DebugString())));
      }
      const tf::Tensor& indices = ctx->input(lr_input + 1 + t);
      const tf::Tensor& grads = ctx->input(lr_input + 1 + T + t);
      OP_REQUIRES(ctx, indices.dims() == 1 && grads.dims() == 2 &&
                           grads.dim_size(0) == indices.dim_size(0) && grads.dim_size(1) == dim,
                  absl::InvalidArgumentError(absl::StrCat(
                      What(t), ": gradient values ", grads.shape().DebugString(),
                      " do not match indices ", indices.shape().DebugString(), " and dim ", dim)));
      updates[t].u.rows = rows;
      updates[t].u.dim = static_cast<int32_t>(dim);
      updates[t].indices = indices.flat<Id>().data();
      updates[t].grads = grads.flat<float>().data();
      updates[t].n = indices.dim_size(0);
    }

    TensorScratch scratch(ctx);
    const Device d = MakeDevice<Device>(ctx, &scratch);
    for (auto* v : raw) OP_REQUIRES_OK(ctx, MakeExclusive(ctx, d, v));
    for (int t = 0; t < T; ++t) {
      impl::SparseUpdate& u = updates[t].u;
      u.var = vars[t]->tensor()->flat<float>().data();
      for (int s = 0; s < 3; ++s)
        u.slots[s] = s < slots_ ? vars[T + t * slots_ + s]->tensor()->flat<float>().data() : nullptr;
      u.step = steps_ ? vars[T + num_slot_vars_ + t]->tensor()->flat<float>().data() : nullptr;
    }
    impl::Hyper h = h_;
    if (std::is_same<Device, impl::CpuDevice>::value) {
      h.lr = lr.scalar<float>()();
    } else {   // the rate stays in device memory: read by the update kernel
      h.lr_at = lr.flat<float>().data();
    }
    impl::Error e = impl::FusedSparseApply<Device, Id>()(d, h, updates, indices_unique_, !checked_);
    if (e.ok()) return;
    const std::string what = e.group >= 0 && e.group < T ? What(e.group) : What(-1);
    if (e.kind == impl::ErrorKind::kIdOutOfRange) {
      ctx->SetStatus(absl::InvalidArgumentError(absl::StrCat(
          what, ": row index ", e.value, " (at position ", e.item, ") is outside [0, ",
          updates[e.group].u.rows, "); nothing was updated")));
    } else if (e.kind == impl::ErrorKind::kNotAscending) {
      ctx->SetStatus(absl::InvalidArgumentError(absl::StrCat(
          what, ": indices_unique was set but row index ", e.value, " (at position ", e.item,
          ") is below the one before it; nothing was updated")));
    } else {
      ctx->SetStatus(absl::InternalError(absl::StrCat(what, ": failed (kind ",
                                                      static_cast<int>(e.kind), ", value ",
                                                      e.value, ")")));
    }
  }

 private:
  std::string What(int t) const {
    return t < 0 ? absl::StrCat("tf_sok ", algorithm_, " update")
                 : absl::StrCat("tf_sok ", algorithm_, " update of table '", tables_[t], "'");
  }

  impl::Hyper h_;
  std::string algorithm_;
  int num_tables_ = 0, num_slot_vars_ = 0, num_step_vars_ = 0, slots_ = 0, steps_ = 0;
  bool indices_unique_ = false;
  bool checked_ = false;
  std::vector<std::string> tables_;
};

#define TF_SOK_REGISTER_APPLY(DEV, DEVICE, ID)                                           \
  REGISTER_KERNEL_BUILDER(Name("TfSokSparseApply")                                        \
                              .Device(DEV)                                                \
                              .TypeConstraint<ID>("Tid"),                                 \
                          SparseApplyOp<DEVICE, ID>);

TF_SOK_REGISTER_APPLY(tf::DEVICE_CPU, impl::CpuDevice, int32_t)
TF_SOK_REGISTER_APPLY(tf::DEVICE_CPU, impl::CpuDevice, int64_t)
#if TF_SOK_WITH_CUDA
TF_SOK_REGISTER_APPLY(tf::DEVICE_GPU, impl::GpuDevice, int32_t)
TF_SOK_REGISTER_APPLY(tf::DEVICE_GPU, impl::GpuDevice, int64_t)
#endif
#undef TF_SOK_REGISTER_APPLY

}  // namespace
}  // namespace tf_sok
