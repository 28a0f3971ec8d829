// Kernel of TfSokRoute: attributes, checks, outputs, the impl functor.
#include <vector>

#include "tf_sok/cc/impl/route.h"
#include "tf_sok/cc/kernels/kernel_util.h"

namespace tf_sok {
namespace {

template <typename Device>
class RouteOp : public tf::OpKernel {
 public:
  explicit RouteOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    std::vector<int> owner;
    OP_REQUIRES_OK(c, c->GetAttr("num_buckets", &num_buckets_));
    OP_REQUIRES_OK(c, c->GetAttr("table_owner", &owner));
    OP_REQUIRES_OK(c, c->GetAttr("by_table", &by_table_));
    for (int o : owner) {
      OP_REQUIRES(c, by_table_ || (o >= -1 && o < num_buckets_),
                  absl::InvalidArgumentError(absl::StrCat("tf_sok route: table owner ", o,
                                                          " is not a rank in [0, ", num_buckets_, ")")));
      owner_.push_back(o);
    }
    OP_REQUIRES(c, !by_table_ || num_buckets_ == static_cast<int>(owner_.size()),
                absl::InvalidArgumentError("tf_sok route: by_table needs one bucket per table"));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& keys = ctx->input(0);
    OP_REQUIRES(ctx, keys.dims() == 1,
                absl::InvalidArgumentError(absl::StrCat("tf_sok route: keys must be 1-D, got ",
                                                        keys.shape().DebugString())));
    OP_REQUIRES(ctx, keys.NumElements() < (int64_t{1} << 31),
                absl::InvalidArgumentError("tf_sok route: at most 2^31 - 1 keys per step"));
    TensorScratch scratch(ctx);
    const Device d = MakeDevice<Device>(ctx, &scratch);
    impl::RouteSpec spec;
    spec.num_buckets = num_buckets_;
    spec.by_table = by_table_;
    spec.num_tables = static_cast<int>(owner_.size());
    spec.table_owner = owner_.data();
    impl::Route<Device> route;
    impl::RoutePlan plan;
    impl::Error e = route.Prepare(d, keys.flat<int64_t>().data(), keys.NumElements(), spec, &plan);
    OP_REQUIRES_OK(ctx, Explain(e, spec.num_tables));
    tf::Tensor *unique = nullptr, *splits = nullptr, *position = nullptr, *unit = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({plan.num_unique}), &unique));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({num_buckets_}), &splits));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, keys.shape(), &position));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, tf::TensorShape({plan.num_unique + num_buckets_}), &unit));
    e = route.Finish(d, plan, spec, unique->flat<int64_t>().data(), splits->flat<int32_t>().data(),
                     position->flat<int64_t>().data(), unit->flat<int64_t>().data());
    OP_REQUIRES_OK(ctx, Explain(e, spec.num_tables));
  }

 private:
  static absl::Status Explain(const impl::Error& e, int num_tables) {
    switch (e.kind) {
      case impl::ErrorKind::kOk:
        return absl::OkStatus();
      case impl::ErrorKind::kIdOutOfRange:
        return absl::InvalidArgumentError(absl::StrCat(
            "tf_sok route: key ", e.value, " at position ", e.item, " names table ",
            e.value >> impl::kTableShift, "; keys must be (table << 40) | row with table in [0, ",
            num_tables, ") and row >= 0"));
      case impl::ErrorKind::kOutOfMemory:
        return absl::ResourceExhaustedError("tf_sok route: out of scratch memory");
      default:
        return absl::InternalError(absl::StrCat("tf_sok route: failed (kind ", static_cast<int>(e.kind),
                                                ", value ", e.value, ")"));
    }
  }

  int num_buckets_ = 1;
  bool by_table_ = false;
  std::vector<int32_t> owner_;
};

REGISTER_KERNEL_BUILDER(Name("TfSokRoute").Device(tf::DEVICE_CPU), RouteOp<impl::CpuDevice>);
#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokRoute").Device(tf::DEVICE_GPU).HostMemory("bucket_splits"),
                        RouteOp<impl::GpuDevice>);
#endif

}  // namespace
}  // namespace tf_sok
