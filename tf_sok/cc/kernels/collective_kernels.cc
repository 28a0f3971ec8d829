// Kernels of the NCCL collectives (CUDA builds only): checks, outputs, the impl
// calls. Errors name the op and the offending value.
#if TF_SOK_WITH_CUDA

#include <cstdio>
#include <string>
#include <vector>

#include "tf_sok/cc/impl/key_exchange.h"
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
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({nccl::kUniqueIdBytes}), &id));
    TF_SOK_REQUIRES_OK(ctx, Check(nccl::GetUniqueId(reinterpret_cast<char*>(id->flat<uint8_t>().data()))));
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
    TF_SOK_REQUIRES(ctx, id.NumElements() == nccl::kUniqueIdBytes,
                absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL init: the id must have ", nccl::kUniqueIdBytes,
                                                        " bytes, got ", id.NumElements())));
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    TF_SOK_REQUIRES_OK(ctx, Check(nccl::Init(key_, reinterpret_cast<const char*>(id.flat<uint8_t>().data()), rank_,
                                         size_, d)));
    std::string version;
    TF_SOK_REQUIRES_OK(ctx, Check(nccl::Version(&version)));
    tf::Tensor* out = nullptr;
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out));
    out->scalar<tf::tstring>()() = version;
  }

 private:
  int64_t key_ = 0;
  int rank_ = 0;
  int size_ = 1;
};

// The size of communicator `key`, or an error if this process has none such.
absl::Status SizeOf(int64_t key, int* size) {
  *size = nccl::Size(key);
  if (*size > 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("tf_sok NCCL communicator ", key,
                                                    " does not exist in this process; create it with "
                                                    "sok.init(exchange=\"nccl\") on every rank first"));
}

// The communicator's size, checked against a splits vector.
absl::Status CheckSplits(int64_t key, const tf::Tensor& splits, const char* what, int64_t* total) {
  int size = 0;
  TF_RETURN_IF_ERROR(SizeOf(key, &size));
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
    TF_SOK_REQUIRES_OK(ctx, CheckSplits(key_, send, "send_splits", &total));
    tf::Tensor* recv = nullptr;
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(0, send.shape(), &recv));
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    TF_SOK_REQUIRES_OK(ctx, Check(nccl::ExchangeCounts(key_, d, send.flat<int32_t>().data(),
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
    TF_SOK_REQUIRES(ctx, input.dims() >= 1,
                absl::InvalidArgumentError("tf_sok NCCL all-to-all: the input must have at least one axis"));
    int64_t sent = 0, received = 0;
    TF_SOK_REQUIRES_OK(ctx, CheckSplits(key_, send, "send_splits", &sent));
    TF_SOK_REQUIRES_OK(ctx, CheckSplits(key_, recv, "recv_splits", &received));
    TF_SOK_REQUIRES(ctx, sent == input.dim_size(0),
                absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL all-to-all: send_splits add up to ", sent,
                                                        " rows but the input has ", input.dim_size(0))));
    int me = 0;
    nccl::Size(key_, &me);
    TF_SOK_REQUIRES(ctx, send.flat<int32_t>()(me) == recv.flat<int32_t>()(me),
                absl::InvalidArgumentError(absl::StrCat(
                    "tf_sok NCCL all-to-all: rank ", me, " sends itself ", send.flat<int32_t>()(me),
                    " rows (send_splits) but expects ", recv.flat<int32_t>()(me), " (recv_splits)")));
    tf::TensorShape shape = input.shape();
    shape.set_dim(0, received);
    tf::Tensor* output = nullptr;
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &output));
    const int64_t row = RowBytes(input);
    std::vector<int64_t> send_bytes(send.NumElements()), recv_bytes(recv.NumElements());
    for (size_t p = 0; p < send_bytes.size(); ++p) {
      send_bytes[p] = row * send.flat<int32_t>()(p);
      recv_bytes[p] = row * recv.flat<int32_t>()(p);
    }
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    TF_SOK_REQUIRES_OK(ctx, Check(nccl::AllToAll(key_, d, input.data(), send_bytes.data(), output->data(),
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
    TF_SOK_REQUIRES(ctx, input.dims() >= 1,
                absl::InvalidArgumentError("tf_sok NCCL all-gather: the input must have at least one axis"));
    int size = 0;
    TF_SOK_REQUIRES_OK(ctx, SizeOf(key_, &size));
    tf::TensorShape shape = input.shape();
    shape.set_dim(0, input.dim_size(0) * size);
    tf::Tensor* output = nullptr;
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &output));
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    TF_SOK_REQUIRES_OK(ctx, Check(nccl::AllGather(key_, d, input.data(), output->data(),
                                              input.dim_size(0) * RowBytes(input))));
  }

 private:
  int64_t key_ = 0;
};

class RouteKeysOp : public tf::OpKernel {
 public:
  explicit RouteKeysOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("signature", &signature_));
    OP_REQUIRES_OK(c, c->GetAttr("step", &step_));
    OP_REQUIRES_OK(c, c->GetAttr("num_groups", &num_groups_));
    OP_REQUIRES_OK(c, c->GetAttr("feature_table", &feature_table_));
    OP_REQUIRES_OK(c, c->GetAttr("feature_rows", &feature_rows_));
    OP_REQUIRES_OK(c, c->GetAttr("table_owner", &owner_));
    OP_REQUIRES_OK(c, c->GetAttr("table_group", &table_group_));
    OP_REQUIRES_OK(c, c->GetAttr("feature_names", &feature_names_));
    OP_REQUIRES_OK(c, c->GetAttr("table_names", &table_names_));
    const size_t F = static_cast<size_t>(c->num_inputs());
    OP_REQUIRES(c, feature_table_.size() == F && feature_rows_.size() == F && feature_names_.size() == F &&
                       table_names_.size() == F,
                absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL key routing: ", F, " features need ", F,
                                                        " tables, row counts, feature and table names each")));
    for (int32_t t : feature_table_) {
      OP_REQUIRES(c, t >= 0 && t < static_cast<int32_t>(owner_.size()),
                  absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL key routing: feature table ", t,
                                                          " is not one of the ", owner_.size(), " tables")));
    }
    OP_REQUIRES(c, table_group_.size() == owner_.size(),
                absl::InvalidArgumentError("tf_sok NCCL key routing: one width group per table"));
    for (int32_t g : table_group_) {
      OP_REQUIRES(c, g >= 0 && g < num_groups_,
                  absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL key routing: width group ", g,
                                                          " is not in [0, ", num_groups_, ")")));
    }
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int F = ctx->num_inputs();
    const int T = static_cast<int>(owner_.size()), G = num_groups_;
    std::vector<const int64_t*> ids(F);
    std::vector<int64_t> sizes(F);
    int64_t n = 0;
    for (int f = 0; f < F; ++f) {
      const tf::Tensor& t = ctx->input(f);
      TF_SOK_REQUIRES(ctx, t.dims() == 1,
                  absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL key routing: ids of feature '",
                                                          feature_names_[f], "' must be a vector, got ",
                                                          t.shape().DebugString())));
      ids[f] = t.flat<int64_t>().data();
      sizes[f] = t.NumElements();
      n += sizes[f];
    }
    TF_SOK_REQUIRES(ctx, n < (int64_t{1} << 31),
                absl::InvalidArgumentError("tf_sok NCCL key routing: at most 2^31 - 1 ids per step"));
    int ranks = 0;
    TF_SOK_REQUIRES_OK(ctx, SizeOf(key_, &ranks));
    for (int32_t o : owner_) {
      TF_SOK_REQUIRES(ctx, o >= -1 && o < ranks,
                  absl::InvalidArgumentError(absl::StrCat("tf_sok NCCL key routing: table owner ", o,
                                                          " is not a rank in [0, ", ranks, ")")));
    }
    tf::AllocatorAttributes pinned;  // page-locked: copied to the device without a wait
    pinned.set_on_host(true);
    pinned.set_gpu_compatible(true);
    tf::Tensor staging;
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64, tf::TensorShape({impl::key_exchange::StagingSize(F, T)}),
                                           &staging, pinned));
    TensorScratch scratch(ctx);
    const auto d = MakeDevice<impl::GpuDevice>(ctx, &scratch);
    impl::key_exchange::Spec spec;
    spec.comm = key_;
    spec.signature = signature_;
    spec.num_features = F;
    spec.ids = ids.data();
    spec.sizes = sizes.data();
    spec.feature_table = feature_table_.data();
    spec.feature_rows = feature_rows_.data();
    spec.table_group = table_group_.data();
    spec.num_groups = G;
    spec.staging = staging.flat<int64_t>().data();
    spec.route.num_buckets = ranks;
    spec.route.num_tables = T;
    spec.route.table_owner = owner_.data();
    impl::key_exchange::Plan plan;
    TF_SOK_REQUIRES_OK(ctx, Check(impl::key_exchange::Prepare(d, spec, &plan)));
    TF_SOK_REQUIRES_OK(ctx, Verdict(plan));
    const int64_t R = plan.received;
    tf::Tensor *rows = nullptr, *counts = nullptr, *unit = nullptr, *gather = nullptr, *totals = nullptr,
               *slot = nullptr;
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({R}), &rows));
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({T}), &counts));
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(2, tf::TensorShape({R + T}), &unit));
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(3, tf::TensorShape({R}), &gather));
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(4, tf::TensorShape({G}), &totals));
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(5, tf::TensorShape({n}), &slot));
    tf::Tensor* scatter = nullptr;
    TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(6 + 2 * G, tf::TensorShape({R}), &scatter));
    for (int t = 0; t < T; ++t) counts->flat<int32_t>()(t) = plan.table_counts[t];
    for (int g = 0; g < G; ++g) {
      totals->flat<int32_t>()(g) = plan.group_totals[g];
      tf::Tensor *send = nullptr, *recv = nullptr;
      TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(6 + g, tf::TensorShape({plan.size}), &send));
      TF_SOK_REQUIRES_OK(ctx, ctx->allocate_output(6 + G + g, tf::TensorShape({plan.size}), &recv));
      for (int p = 0; p < plan.size; ++p) {
        send->flat<int32_t>()(p) = plan.group_send[g][p];
        recv->flat<int32_t>()(p) = plan.group_recv[g][p];
      }
    }
    TF_SOK_REQUIRES_OK(ctx, Check(impl::key_exchange::Finish(d, plan, spec, rows->flat<int64_t>().data(),
                                                         unit->flat<int64_t>().data(), gather->flat<int64_t>().data(),
                                                         scatter->flat<int64_t>().data(),
                                                         slot->flat<int64_t>().data())));
  }

 private:
  // The same error on every rank (every rank holds every rank's status).
  absl::Status Verdict(const impl::key_exchange::Plan& plan) const {
    std::string signatures;
    bool same = true;
    for (int p = 0; p < plan.size; ++p) {
      same = same && plan.status[p].signature == signature_;
      absl::StrAppend(&signatures, p ? " " : "", plan.status[p].signature);
    }
    if (!same) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tf_sok lookup: ranks disagree on lookup step ", step_,
          " (different tables, features, combiners or order); signatures per rank: [", signatures, "]"));
    }
    for (int p = 0; p < plan.size; ++p) {
      const impl::key_exchange::RankStatus& st = plan.status[p];
      if (!st.found) continue;
      const bool known = st.feature >= 0 && st.feature < static_cast<int64_t>(feature_names_.size());
      return absl::InvalidArgumentError(absl::StrCat(
          "tf_sok lookup: feature '", known ? feature_names_[st.feature] : absl::StrCat("#", st.feature),
          "' has id ", st.id, " on rank ", p, ", outside table '", known ? table_names_[st.feature] : "?", "' of ",
          st.rows, " rows; ids must be in [0, ", st.rows, ")"));
    }
    return absl::OkStatus();
  }

  int64_t key_ = 0, signature_ = 0, step_ = 0;
  int num_groups_ = 1;
  std::vector<int32_t> feature_table_, owner_, table_group_;
  std::vector<int64_t> feature_rows_;
  std::vector<std::string> feature_names_, table_names_;
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
    Detached<ExchangeSplitsOp>);

REGISTER_KERNEL_BUILDER(
    Name("TfSokNcclRouteKeys").Device(tf::DEVICE_GPU).HostMemory("table_counts").HostMemory("group_totals")
        .HostMemory("group_send").HostMemory("group_recv"),
    Detached<RouteKeysOp>);

#define TF_SOK_REGISTER_COLLECTIVES(T)                                                          \
  REGISTER_KERNEL_BUILDER(Name("TfSokNcclAllToAll")                                             \
                              .Device(tf::DEVICE_GPU)                                           \
                              .TypeConstraint<T>("T")                                           \
                              .HostMemory("send_splits")                                        \
                              .HostMemory("recv_splits"),                                       \
                          Detached<AllToAllOp>);                                        \
  REGISTER_KERNEL_BUILDER(Name("TfSokNcclAllGather").Device(tf::DEVICE_GPU).TypeConstraint<T>("T"), \
                          Detached<AllGatherOp>);
TF_SOK_REGISTER_COLLECTIVES(float)
TF_SOK_REGISTER_COLLECTIVES(double)
TF_SOK_REGISTER_COLLECTIVES(Eigen::half)
TF_SOK_REGISTER_COLLECTIVES(Eigen::bfloat16)
TF_SOK_REGISTER_COLLECTIVES(int64_t)
#undef TF_SOK_REGISTER_COLLECTIVES

}  // namespace
}  // namespace tf_sok

#endif  // TF_SOK_WITH_CUDA
