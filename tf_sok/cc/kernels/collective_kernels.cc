// Kernels of the NCCL collectives (CUDA builds only): checks, outputs, the impl
// calls. Errors name the op and the offending value.
#if TF_SOK_WITH_CUDA

#include <cstdio>
#include <string>
#include <vector>

#include "tf_sok/cc/impl/nccl.h"
#include "tf_sok/cc/kernels/kernel_util.h"

namespace tf_sok {
namespace {

namespace nccl = impl::nccl;

absl::Status Check(const std::string& why) {
  return why.empty() ? absl::OkStatus() : absl::InternalError(why);
}

class UniqueIdOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::Tensor* id = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({nccl::kUniqueIdBytes}), &id));
    OP_REQUIRES_OK(ctx, Check(nccl::GetUniqueId(reinterpret_cast<char*>(id->flat<uint8_t>().data()))));
  }
};

class InitOp : public tf::OpKernel {
 public:
  explicit InitOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
    OP_REQUIRES_OK(c, c->GetAttr("size", &size_));
  }
  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& id = ctx->input(0);
    OP_REQUIRES(ctx, id.NumElements() == nccl::kUniqueIdBytes,
                absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL init: the id must have ", nccl::kUniqueIdBytes,
                                                        " bytes, got ", id.NumElements())));
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    OP_REQUIRES_OK(ctx, Check(nccl::Init(key_, reinterpret_cast<const char*>(id.flat<uint8_t>().data()), rank_,
                                         size_, d)));
    std::string version;
    OP_REQUIRES_OK(ctx, Check(nccl::Version(&version)));
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out));
    out->scalar<tf::tstring>()() = version;
  }

 private:
  int64_t key_ = 0;
  int rank_ = 0;
  int size_ = 1;
};

// The communicator's size, checked against a splits vector.
absl::Status CheckSplits(int64_t key, const tf::Tensor& splits, const char* what, int64_t* total) {
  const int size = nccl::Size(key);
  if (size < 0) {
    return absl::FailedPreconditionError(absl::StrCat("tf_sok NCCL communicator ", key,
                                                      " does not exist in this process; create it with "
                                                      "sok.init(exchange=\"nccl\") on every rank first"));
  }
  if (splits.dims() != 1 || splits.NumElements() != size) {
    return absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL all-to-all: ", what, " must have one entry per rank (",
                                                   size, "), got shape ", splits.shape().DebugString()));
  }
  *total = 0;
  auto s = splits.flat<int32_t>();
  for (int p = 0; p < size; ++p) {
    if (s(p) < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL all-to-all: ", what, "[", p, "] = ", s(p),
                                                     " is negative"));
    }
    *total += s(p);
  }
  return absl::OkStatus();
}

class ExchangeSplitsOp : public tf::OpKernel {
 public:
  explicit ExchangeSplitsOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
  }
  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& send = ctx->input(0);
    int64_t total = 0;
    OP_REQUIRES_OK(ctx, CheckSplits(key_, send, "send_splits", &total));
    tf::Tensor* recv = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, send.shape(), &recv));
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    OP_REQUIRES_OK(ctx, Check(nccl::ExchangeCounts(key_, d, send.flat<int32_t>().data(),
                                                   recv->flat<int32_t>().data())));
  }

 private:
  int64_t key_ = 0;
};

// Bytes of one row (everything after the first axis).
int64_t RowBytes(const tf::Tensor& t) {
  int64_t n = tf::DataTypeSize(t.dtype());
  for (int i = 1; i < t.dims(); ++i) n *= t.dim_size(i);
  return n;
}

class AllToAllOp : public tf::OpKernel {
 public:
  explicit AllToAllOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
  }
  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& input = ctx->input(0);
    const tf::Tensor& send = ctx->input(1);
    const tf::Tensor& recv = ctx->input(2);
    OP_REQUIRES(ctx, input.dims() >= 1,
                absl::InvalidArgumentError("tf_sok NCCL all-to-all: the input must have at least one axis"));
    int64_t sent = 0, received = 0;
    OP_REQUIRES_OK(ctx, CheckSplits(key_, send, "send_splits", &sent));
    OP_REQUIRES_OK(ctx, CheckSplits(key_, recv, "recv_splits", &received));
    OP_REQUIRES(ctx, sent == input.dim_size(0),
                absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL all-to-all: send_splits add up to ", sent,
                                                        " rows but the input has ", input.dim_size(0))));
    int me = 0;
    nccl::Size(key_, &me);
    OP_REQUIRES(ctx, send.flat<int32_t>()(me) == recv.flat<int32_t>()(me),
                absl::InvalidArgumentError(absl::StrCat(
                    "tf_sok NCCL all-to-all: rank ", me, " sends itself ", send.flat<int32_t>()(me),
                    " rows (send_splits) but expects ", recv.flat<int32_t>()(me), " (recv_splits)")));
    tf::TensorShape shape = input.shape();
    shape.set_dim(0, received);
    tf::Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &output));
    const int64_t row = RowBytes(input);
    std::vector<int64_t> send_bytes(send.NumElements()), recv_bytes(recv.NumElements());
    for (size_t p = 0; p < send_bytes.size(); ++p) {
      send_bytes[p] = row * send.flat<int32_t>()(p);
      recv_bytes[p] = row * recv.flat<int32_t>()(p);
    }
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    OP_REQUIRES_OK(ctx, Check(nccl::AllToAll(key_, d, input.data(), send_bytes.data(), output->data(),
                                             recv_bytes.data())));
  }

 private:
  int64_t key_ = 0;
};

class AllGatherOp : public tf::OpKernel {
 public:
  explicit AllGatherOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
  }
  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& input = ctx->input(0);
    OP_REQUIRES(ctx, input.dims() >= 1,
                absl::InvalidArgumentError("tf_sok NCCL all-gather: the input must have at least one axis"));
    const int size = nccl::Size(key_);
    OP_REQUIRES(ctx, size > 0,
                absl::FailedPreconditionError(absl::StrCat("tf_sok NCCL communicator ", key_,
                                                           " does not exist in this process")));
    tf::TensorShape shape = input.shape();
    shape.set_dim(0, input.dim_size(0) * size);
    tf::Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &output));
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    OP_REQUIRES_OK(ctx, Check(nccl::AllGather(key_, d, input.data(), output->data(),
                                              input.dim_size(0) * RowBytes(input))));
  }

 private:
  int64_t key_ = 0;
};

}  // namespace
}  // namespace tf_sok

// Whether NCCL can be opened here: writes its version (returns 1) or the reason (returns 0),
// truncated to `size` bytes. Read by the Python communicator (ctypes) on every rank before
// any rank starts a collective, so that all of them fall back or fail alike.
extern "C" __attribute__((visibility("default"))) int TfSokNcclProbe(char* text, int size) {
  std::string version;
  std::string why = tf_sok::impl::nccl::Version(&version);
  const std::string& out = why.empty() ? version : why;
  if (size > 0) {
    std::snprintf(text, static_cast<size_t>(size), "%s", out.c_str());
  }
  return why.empty() ? 1 : 0;
}

namespace tf_sok {
namespace {

REGISTER_KERNEL_BUILDER(Name("TfSokNcclUniqueId").Device(tf::DEVICE_CPU), UniqueIdOp);
REGISTER_KERNEL_BUILDER(Name("TfSokNcclInit").Device(tf::DEVICE_GPU).HostMemory("id").HostMemory("version"), InitOp);
REGISTER_KERNEL_BUILDER(
    Name("TfSokNcclExchangeSplits").Device(tf::DEVICE_GPU).HostMemory("send_splits").HostMemory("recv_splits"),
    ExchangeSplitsOp);

#define TF_SOK_REGISTER_COLLECTIVES(T)                                                          \
  REGISTER_KERNEL_BUILDER(Name("TfSokNcclAllToAll")                                             \
                              .Device(tf::DEVICE_GPU)                                           \
                              .TypeConstraint<T>("T")                                           \
                              .HostMemory("send_splits")                                        \
                              .HostMemory("recv_splits"),                                       \
                          AllToAllOp);                                                          \
  REGISTER_KERNEL_BUILDER(Name("TfSokNcclAllGather").Device(tf::DEVICE_GPU).TypeConstraint<T>("T"), \
                          AllGatherOp);
TF_SOK_REGISTER_COLLECTIVES(float)
TF_SOK_REGISTER_COLLECTIVES(double)
TF_SOK_REGISTER_COLLECTIVES(Eigen::half)
TF_SOK_REGISTER_COLLECTIVES(Eigen::bfloat16)
TF_SOK_REGISTER_COLLECTIVES(int64_t)
#undef TF_SOK_REGISTER_COLLECTIVES

}  // namespace
}  // namespace tf_sok

#endif  // TF_SOK_WITH_CUDA
