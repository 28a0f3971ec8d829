// Kernel of TfSokSparseApply: lock the variable and its slots, check shapes,
// make the buffers exclusive (copy-on-write), run the impl functor.
#include <string>
#include <vector>

#include "tf_sok/cc/impl/optimizer.h"
#include "tf_sok/cc/kernels/kernel_util.h"

namespace tf_sok {

template <typename Device>
absl::Status MakeExclusive(tf::OpKernelContext* ctx, const Device& d, tf::Var* var) {
  tf::Tensor* t = var->tensor();
  if (t->RefCountIsOne()) return absl::OkStatus();
  tf::Tensor copy;
  tf::AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &copy, attr));
  impl::DeviceCopy<Device>(d, copy.data(), t->data(), t->TotalBytes());
  *t = copy;
  return absl::OkStatus();
}

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
    std::string algorithm;
    OP_REQUIRES_OK(c, c->GetAttr("algorithm", &algorithm));
    OP_REQUIRES_OK(c, c->GetAttr("num_slots", &num_slots_));
    OP_REQUIRES_OK(c, c->GetAttr("num_steps", &num_steps_));
    OP_REQUIRES_OK(c, c->GetAttr("table_name", &table_));
    h_.algorithm = ParseAlgorithm(algorithm);
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
    if (table_.empty()) table_ = "<unnamed>";
    what_ = absl::StrCat("tf_sok ", algorithm, " update of table '", table_, "'");
    OP_REQUIRES(c, num_slots_ == impl::NumDenseSlots(h_) &&
                       num_steps_ == (impl::HasStepSlot(h_) ? 1 : 0),
                absl::InvalidArgumentError(absl::StrCat(
                    what_, ": expects ", impl::NumDenseSlots(h_), " slot(s) and ",
                    impl::HasStepSlot(h_) ? 1 : 0, " step counter(s); got ", num_slots_,
                    " and ", num_steps_)));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int lr_input = 1 + num_slots_ + num_steps_;
    const tf::Tensor& lr = ctx->input(lr_input);
    const tf::Tensor& indices = ctx->input(lr_input + 1);
    const tf::Tensor& grads = ctx->input(lr_input + 2);
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(lr.shape()),
                absl::InvalidArgumentError(what_ + ": learning_rate must be a scalar"));

    std::vector<tf::core::RefCountPtr<tf::Var>> vars(lr_input);
    std::vector<tf::Var*> raw;
    for (int i = 0; i < lr_input; ++i) {
      const bool is_step = i > num_slots_;
      OP_REQUIRES_OK(ctx, GetVar(ctx, i, is_step ? 1 : 2,
                                 i == 0 ? what_ + ": the table" : what_ + ": a slot", &vars[i]));
      raw.push_back(vars[i].get());
    }
    ExclusiveLocks locks(raw);
    const tf::Tensor& var = *vars[0]->tensor();
    const int64_t rows = var.dim_size(0), dim = var.dim_size(1);
    for (int i = 1; i < lr_input; ++i) {
      const tf::Tensor& s = *vars[i]->tensor();
      const bool is_step = i > num_slots_;
      OP_REQUIRES(ctx, s.dim_size(0) == rows && (is_step || s.dim_size(1) == dim),
                  absl::InvalidArgumentError(absl::StrCat(
                      what_, ": slot ", i, " has shape ", s.shape().DebugString(),
                      " but the table has ", var.shape().DebugString())));
    }
    OP_REQUIRES(ctx, indices.dims() == 1 && grads.dims() == 2 &&
                         grads.dim_size(0) == indices.dim_size(0) && grads.dim_size(1) == dim,
                absl::InvalidArgumentError(absl::StrCat(
                    what_, ": gradient values ", grads.shape().DebugString(),
                    " do not match indices ", indices.shape().DebugString(), " and dim ", dim)));
    const int64_t n = indices.dim_size(0);
    if (n == 0) return;

    TensorScratch scratch(ctx);
    const Device d = MakeDevice<Device>(ctx, &scratch);
    for (auto* v : raw) OP_REQUIRES_OK(ctx, MakeExclusive(ctx, d, v));

    impl::Hyper h = h_;
    h.lr = lr.scalar<float>()();
    impl::SparseUpdate u;
    u.var = vars[0]->tensor()->flat<float>().data();
    for (int s = 0; s < 3; ++s)
      u.slots[s] = s < num_slots_ ? vars[1 + s]->tensor()->flat<float>().data() : nullptr;
    u.step = num_steps_ ? vars[1 + num_slots_]->tensor()->flat<float>().data() : nullptr;
    u.rows = rows;
    u.dim = static_cast<int32_t>(dim);
    impl::Error e = impl::SparseApply<Device, Id>()(d, h, u, indices.flat<Id>().data(),
                                                    grads.flat<float>().data(), n);
    OP_REQUIRES(ctx, e.ok(),
                e.kind == impl::ErrorKind::kIdOutOfRange
                    ? absl::InvalidArgumentError(absl::StrCat(
                          what_, ": row index ", e.value, " (at position ", e.item,
                          ") is outside [0, ", rows, "); nothing was updated"))
                    : absl::InternalError(absl::StrCat(what_, ": failed (kind ",
                                                       static_cast<int>(e.kind), ", value ",
                                                       e.value, ")")));
  }

 private:
  impl::Hyper h_;
  int num_slots_ = 0, num_steps_ = 0;
  std::string table_, what_;
};

#define TF_SOK_REGISTER_APPLY(DEV, DEVICE, ID)                                           \
  REGISTER_KERNEL_BUILDER(Name("TfSokSparseApply")                                        \
                              .Device(DEV)                                                \
                              .TypeConstraint<ID>("Tid")                                  \
                              .HostMemory("learning_rate"),                               \
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
