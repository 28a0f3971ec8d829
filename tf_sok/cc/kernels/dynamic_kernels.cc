// Kernels of the dynamic-table ops: the key -> row index lives in host memory
// (a resource); the rows it hands out index the table's value and state arrays,
// which the lookup and optimizer kernels read and update like a static table's.
#include <string>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_op_kernel.h"
#include "tensorflow/core/platform/mutex.h"
#include "tf_sok/cc/impl/dynamic_index.h"

namespace tf_sok {
namespace {

namespace tf = ::tensorflow;

class IndexResource : public tf::ResourceBase {
 public:
  IndexResource(const std::string& table, const impl::DynamicIndexConfig& config, int64_t dim, int init_kind,
                float a, float b, int64_t seed)
      : table(table), dim(dim), init_kind(init_kind), a(a), b(b), seed(seed), index(config) {}
  std::string DebugString() const override { return "tf_sok dynamic index of table '" + table + "'"; }

  const std::string table;
  const int64_t dim;
  const int init_kind;
  const float a, b;
  const int64_t seed;
  tf::mutex mu;
  impl::DynamicIndex index TF_GUARDED_BY(mu);
};

class IndexOp : public tf::ResourceOpKernel<IndexResource> {
 public:
  explicit IndexOp(tf::OpKernelConstruction* c) : tf::ResourceOpKernel<IndexResource>(c) {
    std::string evict, init;
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
  }

 private:
  absl::Status CreateResource(IndexResource** out) override TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *out = new IndexResource(table_, config_, dim_, kind_, a_, b_, seed_);
    return absl::OkStatus();
  }

  std::string table_;
  impl::DynamicIndexConfig config_;
  int64_t dim_ = 0, seed_ = 0;
  int kind_ = 0;
  float a_ = 0, b_ = 0;
};

absl::Status GetIndex(tf::OpKernelContext* ctx, tf::core::RefCountPtr<IndexResource>* out) {
  return tf::LookupResource(ctx, tf::HandleFromInput(ctx, 0), out);
}

tf::Tensor* Vector(tf::OpKernelContext* ctx, int output, const std::vector<int64_t>& v, absl::Status* s) {
  tf::Tensor* t = nullptr;
  *s = ctx->allocate_output(output, tf::TensorShape({static_cast<int64_t>(v.size())}), &t);
  if (s->ok()) std::copy(v.begin(), v.end(), t->flat<int64_t>().data());
  return t;
}

class FindOp : public tf::OpKernel {
 public:
  explicit FindOp(tf::OpKernelConstruction* c) : tf::OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("insert", &insert_)); }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<IndexResource> res;
    OP_REQUIRES_OK(ctx, GetIndex(ctx, &res));
    const tf::Tensor& keys = ctx->input(1);
    OP_REQUIRES(ctx, keys.dims() == 1,
                absl::InvalidArgumentError("dynamic table '" + res->table + "': keys must be a vector, got shape " +
                                           keys.shape().DebugString()));
    tf::Tensor* slots = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &slots));
    impl::FindChanges ch;
    {
      tf::mutex_lock l(res->mu);
      const std::string error = res->index.Find(keys.flat<int64_t>().data(), keys.NumElements(), insert_,
                                                slots->flat<int64_t>().data(), &ch);
      OP_REQUIRES(ctx, error.empty(), absl::InvalidArgumentError("dynamic table '" + res->table + "' " + error));
    }
    absl::Status s;
    Vector(ctx, 1, ch.new_slots, &s);
    OP_REQUIRES_OK(ctx, s);
    tf::Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, tf::TensorShape({static_cast<int64_t>(ch.new_keys.size()), res->dim}),
                                             &values));
    impl::InitialRows(res->init_kind, res->a, res->b, res->seed, ch.new_keys.data(),
                      static_cast<int64_t>(ch.new_keys.size()), res->dim, values->flat<float>().data());
    Vector(ctx, 3, ch.evicted_keys, &s);
    OP_REQUIRES_OK(ctx, s);
    Vector(ctx, 4, ch.evicted_slots, &s);
    OP_REQUIRES_OK(ctx, s);
    tf::Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, tf::TensorShape({}), &rows));
    rows->scalar<int64_t>()() = ch.rows;
  }

 private:
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
    res->index.Generations(slots.flat<int64_t>().data(), slots.NumElements(), out->flat<int64_t>().data());
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
    size->scalar<int64_t>()() = res->index.size();
    rows->scalar<int64_t>()() = res->index.rows();
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
      snap = res->index.Export();
    }
    absl::Status s;
    const std::vector<int64_t>* parts[] = {&snap.keys,         &snap.slots,          &snap.scores,
                                           &snap.generations, &snap.candidate_keys, &snap.candidate_counts};
    for (int i = 0; i < 6; ++i) {
      Vector(ctx, i, *parts[i], &s);
      OP_REQUIRES_OK(ctx, s);
    }
    Vector(ctx, 6, {snap.clock, snap.rows, snap.next_free}, &s);
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
      OP_REQUIRES(ctx, t.dims() == 1,
                  absl::InvalidArgumentError("dynamic table '" + res->table + "': restoring its index: part " +
                                             std::to_string(i) + " is not a vector"));
      parts[i]->assign(t.flat<int64_t>().data(), t.flat<int64_t>().data() + t.NumElements());
    }
    const tf::Tensor& counters = ctx->input(7);
    OP_REQUIRES(ctx, counters.NumElements() == 3,
                absl::InvalidArgumentError("dynamic table '" + res->table + "': restoring its index: 3 counters "
                                           "expected"));
    snap.clock = counters.flat<int64_t>()(0);
    snap.rows = counters.flat<int64_t>()(1);
    snap.next_free = counters.flat<int64_t>()(2);
    tf::mutex_lock l(res->mu);
    const std::string error = res->index.Import(snap);
    OP_REQUIRES(ctx, error.empty(),
                absl::InvalidArgumentError("dynamic table '" + res->table + "': restoring its index: " + error));
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSokDynamicIndex").Device(tf::DEVICE_CPU), IndexOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicFind").Device(tf::DEVICE_CPU), FindOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicGenerations").Device(tf::DEVICE_CPU), GenerationsOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicSize").Device(tf::DEVICE_CPU), SizeOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicExport").Device(tf::DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("TfSokDynamicImport").Device(tf::DEVICE_CPU), ImportOp);

}  // namespace
}  // namespace tf_sok
