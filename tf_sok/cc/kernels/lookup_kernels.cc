// Kernels of TfSokFusedLookup / TfSokFusedLookupGrad: read attributes, check
// shapes, allocate outputs, call the impl functor, explain its errors.
#define EIGEN_USE_THREADS

#include <string>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/device.h"
#include "tensorflow/core/framework/tensor_types.h"
#include "tf_sok/cc/impl/lookup.h"
#include "tf_sok/cc/kernels/kernel_util.h"

namespace tf_sok {
namespace {

// What an error message names: each feature, the table it reads, each table.
struct LookupNames {
  std::vector<int> feature_table;
  std::vector<std::string> feature_names, table_names;

  // Fills names left empty with "#index".
  void Complete(int num_features, int num_tables) {
    if (feature_names.size() < static_cast<size_t>(num_features)) feature_names.resize(num_features);
    if (table_names.size() < static_cast<size_t>(num_tables)) table_names.resize(num_tables);
    for (int f = 0; f < num_features; ++f)
      if (feature_names[f].empty()) feature_names[f] = absl::StrCat("#", f);
    for (int t = 0; t < num_tables; ++t)
      if (table_names[t].empty()) table_names[t] = absl::StrCat("#", t);
  }
};

// Attributes shared by the forward and backward kernels.
struct LookupAttrs : LookupNames {
  int num_tables = 0, num_features = 0;
  std::vector<int> dims;
  std::vector<impl::Combiner> combiners;
  std::vector<bool> weighted;

  absl::Status Read(tf::OpKernelConstruction* c, bool with_names) {
    std::vector<std::string> comb;
    TF_RETURN_IF_ERROR(c->GetAttr("num_tables", &num_tables));
    TF_RETURN_IF_ERROR(c->GetAttr("num_features", &num_features));
    TF_RETURN_IF_ERROR(c->GetAttr("feature_table", &feature_table));
    TF_RETURN_IF_ERROR(c->GetAttr("dims", &dims));
    TF_RETURN_IF_ERROR(c->GetAttr("combiners", &comb));
    TF_RETURN_IF_ERROR(c->GetAttr("weighted", &weighted));
    if (with_names) {
      TF_RETURN_IF_ERROR(c->GetAttr("feature_names", &feature_names));
      TF_RETURN_IF_ERROR(c->GetAttr("table_names", &table_names));
    }
    if (static_cast<int>(feature_table.size()) != num_features ||
        static_cast<int>(comb.size()) != num_features ||
        static_cast<int>(weighted.size()) != num_features ||
        static_cast<int>(dims.size()) != num_tables) {
      return absl::InvalidArgumentError(
          "tf_sok lookup: feature_table, combiners and weighted need one entry per feature, "
          "dims one per table");
    }
    for (int f = 0; f < num_features; ++f) {
      if (feature_table[f] < 0 || feature_table[f] >= num_tables) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tf_sok lookup: feature ", f, " maps to table ", feature_table[f], " but there are ",
            num_tables, " tables"));
      }
      combiners.push_back(comb[f] == "sum"    ? impl::Combiner::kSum
                          : comb[f] == "mean" ? impl::Combiner::kMean
                                              : impl::Combiner::kSqrtn);
    }
    Complete(num_features, num_tables);
    return absl::OkStatus();
  }

  // Checks ids / row_splits / weights of each feature and builds its view.
  template <typename Id>
  absl::Status Features(tf::OpKernelContext* ctx, int first_input,
                        std::vector<impl::FeatureView<Id>>* out) const {
    for (int f = 0; f < num_features; ++f) {
      const tf::Tensor& ids = ctx->input(first_input + f);
      const tf::Tensor& splits = ctx->input(first_input + num_features + f);
      const tf::Tensor& w = ctx->input(first_input + 2 * num_features + f);
      const std::string& name = feature_names.empty() ? absl::StrCat("#", f) : feature_names[f];
      if (ids.dims() != 1 || splits.dims() != 1 || splits.NumElements() < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tf_sok lookup: feature '", name, "' needs 1-D ids and 1-D row_splits with at "
            "least one element; got ids ", ids.shape().DebugString(), " and row_splits ",
            splits.shape().DebugString()));
      }
      if (weighted[f] ? w.shape() != ids.shape() : w.NumElements() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tf_sok lookup: weights of feature '", name, "' must match its ids ",
            ids.shape().DebugString(), "; got ", w.shape().DebugString()));
      }
      impl::FeatureView<Id> v;
      v.ids = ids.flat<Id>().data();
      v.splits = splits.flat<int64_t>().data();
      v.weights = weighted[f] ? w.flat<float>().data() : nullptr;
      v.num_ids = ids.NumElements();
      v.batch = splits.NumElements() - 1;
      v.table = feature_table[f];
      v.combiner = combiners[f];
      out->push_back(v);
    }
    return absl::OkStatus();
  }
};

// The element type of the pooled outputs of a kernel of type T.
template <typename T>
constexpr impl::Precision PrecisionOf() {
  return std::is_same<T, Eigen::half>::value       ? impl::Precision::kFloat16
         : std::is_same<T, tf::bfloat16>::value ? impl::Precision::kBFloat16
                                                : impl::Precision::kFloat32;
}

// The CPU functors pool in float32 only: outputs of another type are pooled
// into float32 scratch and converted, output gradients converted first.
template <typename Device, typename T>
constexpr bool kConverts = std::is_same<Device, impl::CpuDevice>::value && !std::is_same<T, float>::value;

// Output gradient f of a pooling op: [batch, dim], as the forward produced it;
// `converted` receives its float32 copy where the device pools in float32 only.
template <typename Device, typename T>
absl::Status OutputGrad(tf::OpKernelContext* ctx, int input, int f, int64_t batch, int dim,
                        tf::Tensor* converted, const void** out) {
  const tf::Tensor& g = ctx->input(input);
  if (g.dims() != 2 || g.dim_size(0) != batch || g.dim_size(1) != dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tf_sok lookup gradient: output gradient of feature ", f, " has shape ",
        g.shape().DebugString(), ", expected [", batch, ", ", dim, "]"));
  }
  if (!kConverts<Device, T>) {
    *out = g.data();
    return absl::OkStatus();
  }
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_FLOAT, g.shape(), converted));
  converted->flat<float>().device(ctx->eigen_device<Eigen::ThreadPoolDevice>()) =
      g.flat<T>().template cast<float>();
  *out = converted->data();
  return absl::OkStatus();
}

// `rows`: the rows of the table of the feature with a bad id.
absl::Status Explain(const LookupNames& a, const impl::Error& e, int64_t rows) {
  const bool named = e.group >= 0 && e.group < static_cast<int>(a.feature_names.size()) &&
                     e.group < static_cast<int>(a.feature_table.size());
  if (!named && (e.kind == impl::ErrorKind::kIdOutOfRange || e.kind == impl::ErrorKind::kBadSplits)) {
    return absl::InternalError(absl::StrCat("tf_sok lookup: error kind ", static_cast<int>(e.kind),
                                            " names feature ", e.group, ", which the op does not have"));
  }
  switch (e.kind) {
    case impl::ErrorKind::kOk:
      return absl::OkStatus();
    case impl::ErrorKind::kIdOutOfRange: {
      const int t = a.feature_table[e.group];
      return absl::InvalidArgumentError(absl::StrCat(
          "tf_sok lookup: feature '", a.feature_names[e.group], "' has id ", e.value,
          " (at position ", e.item, ") outside table '", a.table_names.at(t), "' of ",
          rows, " rows; ids must be in [0, ", rows, ")"));
    }
    case impl::ErrorKind::kBadSplits:
      return absl::InvalidArgumentError(absl::StrCat(
          "tf_sok lookup: row_splits of feature '", a.feature_names[e.group], "' are invalid at ",
          "index ", e.item, " (value ", e.value, "): they must start at 0, never decrease and "
          "end at the number of ids"));
    case impl::ErrorKind::kOutOfMemory:
      return absl::ResourceExhaustedError("tf_sok lookup: out of scratch memory");
    case impl::ErrorKind::kCudaError:
      return absl::InternalError(absl::StrCat("tf_sok lookup: CUDA error ", e.value));
    default:
      break;
  }
  return absl::UnknownError(absl::StrCat("tf_sok lookup: unknown error kind ", static_cast<int>(e.kind)));
}

absl::Status Explain(const LookupAttrs& a, const impl::Error& e,
                     const std::vector<impl::TableView>& tables) {
  const bool id = e.kind == impl::ErrorKind::kIdOutOfRange && e.group >= 0 && e.group < a.num_features;
  return Explain(static_cast<const LookupNames&>(a), e, id ? tables[a.feature_table[e.group]].rows : 0);
}

// Table t's current value: a variable's buffer (TfSokFusedLookup) or a plain
// float tensor (TfSokFusedCombine).
absl::Status TableInput(tf::OpKernelContext* ctx, int t, bool from_variable, const std::string& name,
                        tf::Tensor* out) {
  if (!from_variable) {
    *out = ctx->input(t);
    if (out->dtype() != tf::DT_FLOAT || out->dims() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("tf_sok combine: rows of '", name,
                                                     "' must be a float32 matrix, got ",
                                                     out->shape().DebugString()));
    }
    return absl::OkStatus();
  }
  tf::core::RefCountPtr<tf::Var> var;
  TF_RETURN_IF_ERROR(GetVar(ctx, t, 2, absl::StrCat("table '", name, "'"), &var));
  tf::tf_shared_lock l(*var->mu());
  *out = *var->tensor();
  return absl::OkStatus();
}

template <typename Device, typename Id, bool kFromVariables, typename TOut = float>
class FusedLookupOp : public tf::OpKernel {
 public:
  explicit FusedLookupOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Read(c, /*with_names=*/true));
    OP_REQUIRES_OK(c, c->GetAttr("checked", &checked_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int T = attrs_.num_tables;
    std::vector<tf::Tensor> held(T);  // keeps each table's buffer alive while reading
    std::vector<impl::TableView> tables(T);
    for (int t = 0; t < T; ++t) {
      OP_REQUIRES_OK(ctx, TableInput(ctx, t, kFromVariables, attrs_.table_names[t], &held[t]));
      OP_REQUIRES(ctx, held[t].dim_size(1) == attrs_.dims[t],
                  absl::InvalidArgumentError(absl::StrCat(
                      "tf_sok lookup: table '", attrs_.table_names[t], "' has shape ",
                      held[t].shape().DebugString(), " but the op expects dim ",
                      attrs_.dims[t])));
      tables[t] = {held[t].flat<float>().data(), held[t].dim_size(0),
                   static_cast<int32_t>(attrs_.dims[t])};
    }
    std::vector<impl::FeatureView<Id>> features;
    OP_REQUIRES_OK(ctx, attrs_.Features<Id>(ctx, T, &features));
    std::vector<void*> outputs(attrs_.num_features);
    std::vector<tf::Tensor> pooled(kConverts<Device, TOut> ? attrs_.num_features : 0);  // float32, converted after
    for (int f = 0; f < attrs_.num_features; ++f) {
      tf::Tensor* out = nullptr;
      const tf::TensorShape shape({features[f].batch, attrs_.dims[features[f].table]});
      OP_REQUIRES_OK(ctx, ctx->allocate_output(f, shape, &out));
      if (kConverts<Device, TOut>) {
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_FLOAT, shape, &pooled[f]));
        outputs[f] = pooled[f].data();
      } else {
        outputs[f] = out->data();
      }
    }
    tf::Tensor* status = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(attrs_.num_features,
                                             tf::TensorShape({impl::kErrorRecordWords}), &status));
    auto* record = reinterpret_cast<impl::ErrorRecord*>(status->flat<int64_t>().data());
    if (std::is_same<Device, impl::CpuDevice>::value) *record = impl::ErrorRecord{};
    TensorScratch scratch(ctx);
    const Device d = MakeDevice<Device>(ctx, &scratch);
    constexpr impl::Precision precision = kConverts<Device, TOut> ? impl::Precision::kFloat32 : PrecisionOf<TOut>();
    OP_REQUIRES_OK(ctx, Explain(attrs_, impl::FusedLookup<Device, Id>()(d, tables, features, outputs,
                                                                        checked_ ? nullptr : record, precision),
                                tables));
    for (size_t f = 0; f < pooled.size(); ++f) {
      ctx->mutable_output(f)->flat<TOut>().device(ctx->eigen_device<Eigen::ThreadPoolDevice>()) =
          pooled[f].flat<float>().template cast<TOut>();
    }
  }

 private:
  LookupAttrs attrs_;
  bool checked_ = false;
};

template <typename Device, typename Id>
class FusedCombineGradOp : public tf::OpKernel {
 public:
  explicit FusedCombineGradOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Read(c, /*with_names=*/false));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int T = attrs_.num_tables, F = attrs_.num_features;
    std::vector<impl::TableView> tables(T);
    std::vector<float*> grads(T);
    for (int t = 0; t < T; ++t) {
      const tf::Tensor& p = ctx->input(t);
      OP_REQUIRES(ctx, p.dims() == 2 && p.dim_size(1) == attrs_.dims[t],
                  absl::InvalidArgumentError(absl::StrCat(
                      "tf_sok combine gradient: params ", t, " have shape ", p.shape().DebugString(),
                      " but the op expects dim ", attrs_.dims[t])));
      tf::Tensor* g = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(t, p.shape(), &g));
      tables[t] = {nullptr, p.dim_size(0), static_cast<int32_t>(attrs_.dims[t])};
      grads[t] = g->flat<float>().data();
    }
    std::vector<impl::FeatureView<Id>> features;
    OP_REQUIRES_OK(ctx, attrs_.Features<Id>(ctx, T, &features));
    std::vector<const float*> out_grads(F);
    for (int f = 0; f < F; ++f) {
      const void* g = nullptr;
      OP_REQUIRES_OK(ctx, (OutputGrad<Device, float>(ctx, T + 3 * F + f, f, features[f].batch,
                                                     attrs_.dims[features[f].table], nullptr, &g)));
      out_grads[f] = static_cast<const float*>(g);
    }
    TensorScratch scratch(ctx);
    const Device d = MakeDevice<Device>(ctx, &scratch);
    OP_REQUIRES_OK(ctx, Explain(attrs_, impl::CombineGrad<Device, Id>()(d, tables, features, out_grads,
                                                                        grads),
                                tables));
  }

 private:
  LookupAttrs attrs_;
};

template <typename Device, typename Id, typename TOut>
class FusedLookupGradOp : public tf::OpKernel {
 public:
  explicit FusedLookupGradOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Read(c, /*with_names=*/false));
    OP_REQUIRES_OK(c, c->GetAttr("rows", &rows_));
    OP_REQUIRES(c, rows_.empty() || static_cast<int>(rows_.size()) == attrs_.num_tables,
                absl::InvalidArgumentError(absl::StrCat("tf_sok lookup gradient: rows has ", rows_.size(),
                                                        " entries for ", attrs_.num_tables, " tables")));
    for (size_t t = 0; t < rows_.size(); ++t) {
      OP_REQUIRES(c, rows_[t] > 0,
                  absl::InvalidArgumentError(absl::StrCat("tf_sok lookup gradient: table ", t, " has ",
                                                          rows_[t], " rows")));
    }
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const int T = attrs_.num_tables, F = attrs_.num_features;
    std::vector<impl::FeatureView<Id>> all;
    TF_SOK_REQUIRES_OK(ctx, attrs_.Features<Id>(ctx, 0, &all));
    TensorScratch scratch(ctx);
    const Device d = MakeDevice<Device>(ctx, &scratch);
    std::vector<impl::TableGradInput<Id>> tables(T);
    for (int t = 0; t < T; ++t) {
      tables[t].dim = attrs_.dims[t];
      tables[t].rows = rows_.empty() ? 0 : rows_[t];
      tables[t].precision = kConverts<Device, TOut> ? impl::Precision::kFloat32 : PrecisionOf<TOut>();
    }
    std::vector<tf::Tensor> converted(F);  // float32 output gradients, where the device needs them
    for (int f = 0; f < F; ++f) {
      const int t = all[f].table;
      const void* g = nullptr;
      TF_SOK_REQUIRES_OK(ctx, (OutputGrad<Device, TOut>(ctx, 3 * F + f, f, all[f].batch, attrs_.dims[t],
                                                        &converted[f], &g)));
      tables[t].features.push_back(all[f]);
      tables[t].out_grads.push_back(g);
    }
    impl::LookupGrad<Device, Id> grad;
    impl::GradPlan plan;
    impl::Error e = grad.Prepare(d, tables, &plan);
    if (e.kind == impl::ErrorKind::kIdOutOfRange) {
      const std::string bound = e.limit == impl::kRowMask + 1 ? absl::StrCat("2^", impl::kTableShift)
                                                              : absl::StrCat(e.limit);
      ctx->SetStatus(absl::InvalidArgumentError(
          absl::StrCat("tf_sok lookup gradient: id ", e.value, " is outside [0, ", bound, ")")));
      return;
    }
    TF_SOK_REQUIRES(ctx, e.ok(), absl::InternalError(absl::StrCat(
                                 "tf_sok lookup gradient failed (kind ", static_cast<int>(e.kind),
                                 ", value ", e.value, ")")));
    std::vector<int64_t*> indices(T, nullptr);
    std::vector<float*> values(T, nullptr);
    tf::OpOutputList index_outputs, value_outputs;   // (the op's "indices" and "values", table by table)
    TF_SOK_REQUIRES_OK(ctx, ctx->output_list("indices", &index_outputs));
    TF_SOK_REQUIRES_OK(ctx, ctx->output_list("values", &value_outputs));
    for (int t = 0; t < T; ++t) {
      tf::Tensor* idx = nullptr;
      tf::Tensor* val = nullptr;
      const int64_t u = plan.rows_out[t];
      TF_SOK_REQUIRES_OK(ctx, index_outputs.allocate(t, tf::TensorShape({u}), &idx));
      TF_SOK_REQUIRES_OK(ctx, value_outputs.allocate(t, tf::TensorShape({u, attrs_.dims[t]}), &val));
      indices[t] = idx->flat<int64_t>().data();
      values[t] = val->flat<float>().data();
    }
    grad.Finish(d, plan, indices, values);
  }

 private:
  LookupAttrs attrs_;
  std::vector<int64_t> rows_;  // per table, or empty (not known)
};

// TfSokLookupCheck: turns a lookup's status into its error.
absl::Status ReadNames(tf::OpKernelConstruction* c, LookupNames* names) {
  TF_RETURN_IF_ERROR(c->GetAttr("feature_names", &names->feature_names));
  TF_RETURN_IF_ERROR(c->GetAttr("table_names", &names->table_names));
  TF_RETURN_IF_ERROR(c->GetAttr("feature_table", &names->feature_table));
  for (int t : names->feature_table) {
    if (t < 0 || t >= static_cast<int>(names->table_names.size())) {
      return absl::InvalidArgumentError(absl::StrCat("tf_sok lookup check: feature_table entry ", t,
                                                     " but ", names->table_names.size(), " table names"));
    }
  }
  names->Complete(static_cast<int>(names->feature_table.size()),
                  static_cast<int>(names->table_names.size()));
  return absl::OkStatus();
}

absl::Status StatusInput(tf::OpKernelContext* ctx) {
  const tf::Tensor& s = ctx->input(0);
  if (s.dtype() != tf::DT_INT64 || s.NumElements() != impl::kErrorRecordWords) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tf_sok lookup check: status must be a lookup's int64 status output of ",
        impl::kErrorRecordWords, " words; got ", s.shape().DebugString()));
  }
  return absl::OkStatus();
}

absl::Status ExplainRecord(const LookupNames& names, const impl::ErrorRecord& r) {
  return Explain(names, impl::FromRecord(r), r.limit);
}

class LookupCheckOp : public tf::OpKernel {
 public:
  explicit LookupCheckOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, ReadNames(c, &names_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, StatusInput(ctx));
    OP_REQUIRES_OK(ctx, ExplainRecord(names_, *reinterpret_cast<const impl::ErrorRecord*>(
                                                  ctx->input(0).flat<int64_t>().data())));
  }

 private:
  LookupNames names_;
};

#if TF_SOK_WITH_CUDA
// Copies the record to pinned host memory in stream order and completes from
// TensorFlow's event manager once the stream has reached it: the launching
// thread goes on queueing the ops after the lookup.
class LookupCheckGpuOp : public tf::AsyncOpKernel {
 public:
  explicit LookupCheckGpuOp(tf::OpKernelConstruction* c) : tf::AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, ReadNames(c, &names_));
  }

  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    OP_REQUIRES_OK_ASYNC(ctx, StatusInput(ctx), done);
    tf::AllocatorAttributes pinned;
    pinned.set_on_host(true);
    pinned.set_gpu_compatible(true);
    tf::Tensor host;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_temp(tf::DT_INT64, tf::TensorShape({impl::kErrorRecordWords}),
                                                 &host, pinned),
                         done);
    auto* record = reinterpret_cast<impl::ErrorRecord*>(host.flat<int64_t>().data());
    const impl::Error copied = impl::CopyRecordToHost(
        MakeDevice<impl::GpuDevice>(ctx, nullptr),
        reinterpret_cast<const impl::ErrorRecord*>(ctx->input(0).flat<int64_t>().data()), record);
    OP_REQUIRES_ASYNC(ctx, copied.ok(),
                      absl::InternalError(absl::StrCat("tf_sok lookup check: CUDA error ", copied.value)),
                      done);
    tf::DeviceContext* dc = ctx->op_device_context();
    auto explain = [this, ctx, host, done]() {
      ctx->SetStatus(ExplainRecord(names_, *reinterpret_cast<const impl::ErrorRecord*>(
                                               host.flat<int64_t>().data())));
      done();
    };
    const absl::Status queued = dc->ThenExecute(static_cast<tf::Device*>(ctx->device()), dc->stream(), explain);
    OP_REQUIRES_OK_ASYNC(ctx, queued, done);
  }

 private:
  LookupNames names_;
};
#endif

#define TF_SOK_REGISTER_POOLED_TYPE(DEV, DEVICE, ID, T)                                         \
  REGISTER_KERNEL_BUILDER(                                                                     \
      Name("TfSokFusedLookup").Device(DEV).TypeConstraint<ID>("Tid").TypeConstraint<T>("T"),   \
      FusedLookupOp<DEVICE, ID, true, T>);                                                     \
  REGISTER_KERNEL_BUILDER(                                                                     \
      Name("TfSokFusedLookupGrad").Device(DEV).TypeConstraint<ID>("Tid").TypeConstraint<T>("T"), \
      FusedLookupGradOp<DEVICE, ID, T>);

#define TF_SOK_REGISTER_LOOKUP(DEV, DEVICE, ID)                                \
  TF_SOK_REGISTER_POOLED_TYPE(DEV, DEVICE, ID, float)                          \
  TF_SOK_REGISTER_POOLED_TYPE(DEV, DEVICE, ID, Eigen::half)                    \
  TF_SOK_REGISTER_POOLED_TYPE(DEV, DEVICE, ID, tf::bfloat16)                   \
  REGISTER_KERNEL_BUILDER(                                                     \
      Name("TfSokFusedCombine").Device(DEV).TypeConstraint<ID>("Tid"),         \
      FusedLookupOp<DEVICE, ID, false>);                                       \
  REGISTER_KERNEL_BUILDER(                                                     \
      Name("TfSokFusedCombineGrad").Device(DEV).TypeConstraint<ID>("Tid"),     \
      FusedCombineGradOp<DEVICE, ID>);

REGISTER_KERNEL_BUILDER(Name("TfSokLookupCheck").Device(tf::DEVICE_CPU), LookupCheckOp);
#if TF_SOK_WITH_CUDA
REGISTER_KERNEL_BUILDER(Name("TfSokLookupCheck").Device(tf::DEVICE_GPU), LookupCheckGpuOp);
#endif

TF_SOK_REGISTER_LOOKUP(tf::DEVICE_CPU, impl::CpuDevice, int32_t)
TF_SOK_REGISTER_LOOKUP(tf::DEVICE_CPU, impl::CpuDevice, int64_t)
#if TF_SOK_WITH_CUDA
TF_SOK_REGISTER_LOOKUP(tf::DEVICE_GPU, impl::GpuDevice, int32_t)
TF_SOK_REGISTER_LOOKUP(tf::DEVICE_GPU, impl::GpuDevice, int64_t)
#endif
#undef TF_SOK_REGISTER_LOOKUP
#undef TF_SOK_REGISTER_POOLED_TYPE

}  // namespace
}  // namespace tf_sok
