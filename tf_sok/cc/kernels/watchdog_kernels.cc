// Kernels of the collective watchdog's ops (host only: they hold no data) and the
// count of open watches, read by tests through ctypes.
#include <string>

#include "tensorflow/core/framework/op_kernel.h"
#include "tf_sok/cc/impl/watchdog.h"

namespace tf_sok {
namespace {

namespace tf = ::tensorflow;

class WatchOpenOp : public tf::OpKernel {
 public:
  explicit WatchOpenOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("what", &what_));
    OP_REQUIRES_OK(c, c->GetAttr("timeout_s", &timeout_s_));
    OP_REQUIRES_OK(c, c->GetAttr("eager", &eager_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({2}), &out));
    out->vec<int64_t>()(0) = 0;  // no watch
    out->vec<int64_t>()(1) = tf::CancellationManager::kInvalidToken;
    if (timeout_s_ <= 0) return;
    const int64_t token = impl::OpenWatch(what_, timeout_s_);
    // In a graph the step's cancellation manager runs its callbacks when the step fails or
    // ends (its destructor cancels what is still registered): a watch whose collective never
    // completed, because the step failed elsewhere, closes then. An eager op's manager (if
    // any) ends with the op itself, so eager watches are closed by the caller.
    tf::CancellationManager* cm = ctx->cancellation_manager();
    tf::CancellationToken ct = tf::CancellationManager::kInvalidToken;
    if (!eager_ && cm != nullptr) {
      ct = cm->get_cancellation_token();
      if (!cm->RegisterCallback(ct, [token] { impl::CloseWatch(token); })) {
        impl::CloseWatch(token);  // the step is being cancelled already
        ct = tf::CancellationManager::kInvalidToken;
      }
    }
    out->vec<int64_t>()(0) = token;
    out->vec<int64_t>()(1) = ct;
  }

 private:
  std::string what_;
  float timeout_s_ = 0;
  bool eager_ = false;
};

class WatchCloseOp : public tf::OpKernel {
 public:
  explicit WatchCloseOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {}
  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& t = ctx->input(0);
    OP_REQUIRES(ctx, t.NumElements() == 2,
                absl::InvalidArgumentError("tf_sok watchdog: the token must be what TfSokWatchOpen returned"));
    if (t.vec<int64_t>()(0) != 0) impl::CloseWatch(t.vec<int64_t>()(0));
    // the same step's manager: no callback left to run (or to pile up over a long loop)
    const tf::CancellationToken ct = t.vec<int64_t>()(1);
    if (ct != tf::CancellationManager::kInvalidToken && ctx->cancellation_manager() != nullptr) {
      ctx->cancellation_manager()->TryDeregisterCallback(ct);
    }
    for (int i = 1; i < ctx->num_inputs(); ++i) ctx->set_output(i - 1, ctx->input(i));
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSokWatchOpen").Device(tf::DEVICE_CPU), WatchOpenOp);
REGISTER_KERNEL_BUILDER(Name("TfSokWatchClose").Device(tf::DEVICE_CPU), WatchCloseOp);
#if TF_SOK_WITH_CUDA
// the outputs stay where the collective left them (int32 in host memory, as TensorFlow keeps it)
REGISTER_KERNEL_BUILDER(Name("TfSokWatchClose").Device(tf::DEVICE_GPU).HostMemory("token"), WatchCloseOp);
#endif

}  // namespace
}  // namespace tf_sok

extern "C" __attribute__((visibility("default"))) long long TfSokOpenWatches() {
  return tf_sok::impl::OpenWatches();
}
