// TensorFlow glue shared by the tf_sok kernels: scratch memory from the op's
// allocator, the impl device handle for CPU or GPU, variable access.
#ifndef TF_SOK_CC_KERNELS_KERNEL_UTIL_H_
#define TF_SOK_CC_KERNELS_KERNEL_UTIL_H_

#include <algorithm>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/platform/mutex.h"
#include "tf_sok/cc/impl/common.h"

#if TF_SOK_WITH_CUDA
#include <thread>

#include "tf_sok/cc/impl/nccl.h"
#include "xla/stream_executor/stream.h"
#endif

namespace tf_sok {

namespace tf = ::tensorflow;

// Scratch buffers allocated as temporary tensors; freed when the kernel returns.
class TensorScratch : public impl::ScratchAllocator {
 public:
  explicit TensorScratch(tf::OpKernelContext* ctx) : ctx_(ctx) {}
  void* Allocate(size_t bytes) override {
    tf::mutex_lock l(mu_);  // the CPU functors allocate from several threads
    tf::Tensor t;
    const int64_t n = static_cast<int64_t>(std::max<size_t>(bytes, 1));
    if (!ctx_->allocate_temp(tf::DT_INT8, tf::TensorShape({n}), &t).ok()) return nullptr;
    held_.push_back(t);
    return t.flat<int8_t>().data();
  }

 private:
  tf::mutex mu_;
  tf::OpKernelContext* ctx_;
  std::vector<tf::Tensor> held_;
};

// OP_REQUIRES / OP_REQUIRES_OK for the Compute of a kernel that Detached may
// wrap: TensorFlow's macros abort the process when they fail inside an
// AsyncOpKernel (the Detached wrapper is one); these set the status and return.
#define TF_SOK_REQUIRES(CTX, EXP, STATUS) \
  do {                                    \
    if (!TF_PREDICT_TRUE(EXP)) {          \
      (CTX)->SetStatus(STATUS);           \
      return;                             \
    }                                     \
  } while (0)
#define TF_SOK_REQUIRES_OK(CTX, ...)                \
  do {                                              \
    const absl::Status tf_sok_status_(__VA_ARGS__); \
    if (!TF_PREDICT_TRUE(tf_sok_status_.ok())) {    \
      (CTX)->SetStatus(tf_sok_status_);             \
      return;                                       \
    }                                               \
  } while (0)

template <typename Device>
Device MakeDevice(tf::OpKernelContext* ctx, impl::ScratchAllocator* scratch);

template <>
inline impl::CpuDevice MakeDevice<impl::CpuDevice>(tf::OpKernelContext* ctx,
                                                   impl::ScratchAllocator* scratch) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  impl::CpuDevice d;
  d.parallel_for = [pool](int64_t total, int64_t cost,
                          const std::function<void(int64_t, int64_t)>& fn) {
    if (total > 0) pool->ParallelFor(total, cost, fn);
  };
  d.scratch = scratch;
  return d;
}

#if TF_SOK_WITH_CUDA
template <>
inline impl::GpuDevice MakeDevice<impl::GpuDevice>(tf::OpKernelContext* ctx,
                                                   impl::ScratchAllocator* scratch) {
  impl::GpuDevice d;
  d.stream = ctx->op_device_context()->stream()->platform_specific_handle().stream;
  d.scratch = scratch;
  return d;
}
#endif

#if TF_SOK_WITH_CUDA
// A GPU kernel whose Compute waits (on its stream, or for the peer ranks of a
// collective), as an asynchronous kernel; its Compute reports errors with
// TF_SOK_REQUIRES / TF_SOK_REQUIRES_OK. With one GPU per process it runs where
// TensorFlow calls it. With several GPUs in the process (ranks of one NCCL
// exchange under MirroredStrategy) it runs on a thread of its own, so that its
// wait never holds a thread TensorFlow could need to launch a peer rank's part.
// always: on a thread of its own whatever the devices (an op that should overlap the step's others).
template <typename Kernel, bool always = false>
class Detached : public tf::AsyncOpKernel {
 public:
  explicit Detached(tf::OpKernelConstruction* c) : tf::AsyncOpKernel(c), kernel_(c) {}

  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    if (!always && !impl::nccl::SeveralDevicesInProcess()) {
      kernel_.Compute(ctx);
      done();
      return;
    }
    std::thread([this, ctx, done = std::move(done)]() {
      impl::GpuDevice d = MakeDevice<impl::GpuDevice>(ctx, nullptr);
      const std::string why = impl::nccl::MakeStreamDeviceCurrent(d);
      if (why.empty()) {
        kernel_.Compute(ctx);
      } else {
        ctx->SetStatus(absl::InternalError(why));
      }
      done();
    }).detach();
  }

 private:
  Kernel kernel_;
};
#endif

// Looks up the variable behind resource input `input` and checks it holds an
// initialized float tensor of the given rank.
inline absl::Status GetVar(tf::OpKernelContext* ctx, int input, int rank,
                           const std::string& what, tf::core::RefCountPtr<tf::Var>* var) {
  TF_RETURN_IF_ERROR(tf::LookupResource(ctx, tf::HandleFromInput(ctx, input), var));
  tf::Tensor* t = (*var)->tensor();
  if (!(*var)->is_initialized || t->dtype() != tf::DT_FLOAT || t->dims() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " must be an initialized float32 variable of rank ", rank, "; got ",
        tf::DataTypeString(t->dtype()), " ", t->shape().DebugString()));
  }
  return absl::OkStatus();
}

// Locks several variables in address order (the same order TF uses), so two
// ops updating overlapping variables cannot deadlock.
class ExclusiveLocks {
 public:
  explicit ExclusiveLocks(const std::vector<tf::Var*>& vars) {
    for (auto* v : vars) mus_.push_back(v->mu());
    std::sort(mus_.begin(), mus_.end());
    mus_.erase(std::unique(mus_.begin(), mus_.end()), mus_.end());
    for (auto* m : mus_) m->lock();
  }
  ~ExclusiveLocks() {
    for (auto it = mus_.rbegin(); it != mus_.rend(); ++it) (*it)->unlock();
  }

 private:
  std::vector<tf::mutex*> mus_;
};

// Gives the variable a private buffer before an in-place update when its
// current one is shared with a tensor read earlier (copy-on-write). On a GPU the
// copy first waits for writes to the buffer queued on another stream (NoteSideWrites).
template <typename Device>
absl::Status MakeExclusive(tf::OpKernelContext* ctx, const Device& d, tf::Var* var);

#if TF_SOK_WITH_CUDA
// Writes into a variable's buffer that a stream other than TensorFlow's has queued and the
// writer has not waited for yet (a prefetch's row moves, which leave every row a step reads
// or updates alone, so other ops run beside them): until ClearSideWrites, a MakeExclusive
// copy of that buffer waits for `done` (an event recorded after the writes) on the GPU.
// `done` stays valid until ClearSideWrites.
void NoteSideWrites(const tf::Var* var, void* done);
void ClearSideWrites(const tf::Var* var);
#endif

}  // namespace tf_sok

#endif  // TF_SOK_CC_KERNELS_KERNEL_UTIL_H_
