// Sparse optimizer updates applied in place to the rows named by a batch.
// Duplicate indices are summed first; rows not named are never touched. The
// per-element math is shared by the CPU and CUDA functors (TF_SOK_HD).
#ifndef TF_SOK_CC_IMPL_OPTIMIZER_H_
#define TF_SOK_CC_IMPL_OPTIMIZER_H_

#include <cmath>
#include <type_traits>
#include <vector>

#include "tf_sok/cc/impl/common.h"

namespace tf_sok {
namespace impl {

enum class Algorithm : int32_t {
  kSgd = 0, kMomentum = 1, kAdagrad = 2, kAdam = 3, kFtrl = 4, kRmsprop = 5,
};

// Hyper-parameters; which fields matter depends on the algorithm. The formulas
// follow Keras 3's optimizers applied to one row at a time.
struct Hyper {
  Algorithm algorithm = Algorithm::kSgd;
  float lr = 0.01f;
  // Where set, the rate is read from here when the update runs (on a GPU: device memory, so a rate
  // computed on the device needs no copy to the host, which would wait for the device) instead of lr.
  const float* lr_at = nullptr;
  float beta1 = 0.9f, beta2 = 0.999f;  // adam
  float epsilon = 1e-7f;               // adagrad, adam, rmsprop
  float momentum = 0.0f;               // momentum, rmsprop
  bool nesterov = false;               // momentum
  float rho = 0.9f;                    // rmsprop
  bool centered = false;               // rmsprop
  float l1 = 0.0f, l2 = 0.0f, l2_shrinkage = 0.0f, lr_power = -0.5f, beta = 0.0f;  // ftrl
};

// Number of [rows, dim] slots and whether a per-row step counter ([rows]) is kept.
inline int NumDenseSlots(const Hyper& h) {
  switch (h.algorithm) {
    case Algorithm::kSgd: return 0;
    case Algorithm::kMomentum: return 1;                 // accumulator
    case Algorithm::kAdagrad: return 1;                  // accumulator
    case Algorithm::kAdam: return 2;                     // m, v
    case Algorithm::kFtrl: return 2;                     // accumulator, linear
    case Algorithm::kRmsprop:                            // velocity [, mean grad] [, momentum]
      return 1 + (h.centered ? 1 : 0) + (h.momentum > 0.0f ? 1 : 0);
  }
  return 0;
}
inline bool HasStepSlot(const Hyper& h) { return h.algorithm == Algorithm::kAdam; }

struct RowState {
  float* slot[3];   // pointers to this row's slot values (dim floats each)
  float* step;      // this row's step counter (adam) or nullptr
};

// Per-row constants computed once before the element loop.
struct RowScalars {
  float alpha = 0.0f;  // adam: lr * sqrt(1 - b2^t) / (1 - b1^t)
};

// steps_before: how many updates this row had before this one (adam only).
TF_SOK_HD RowScalars RowConstants(const Hyper& h, float steps_before) {
  RowScalars s;
  if (h.algorithm == Algorithm::kAdam) {
    const float t = steps_before + 1.0f;
    s.alpha = h.lr * sqrtf(1.0f - powf(h.beta2, t)) / (1.0f - powf(h.beta1, t));
  }
  return s;
}

// Updates element j of one row: w is the weight, g the summed gradient, slot
// the row's state. A template on the algorithm so each row loop is a tight,
// vectorisable loop with no per-element dispatch.
template <Algorithm A>
TF_SOK_HD float UpdateElement(const Hyper& h, const RowScalars& s, float w, float g, float& s0,
                             float& s1, float& s2) {
  if (A == Algorithm::kSgd) {
    return w - h.lr * g;
  } else if (A == Algorithm::kMomentum) {  // Keras SGD(momentum): v = m*v - lr*g
    const float v = h.momentum * s0 - h.lr * g;
    s0 = v;
    return h.nesterov ? w + h.momentum * v - h.lr * g : w + v;
  } else if (A == Algorithm::kAdagrad) {
    const float a = s0 + g * g;
    s0 = a;
    return w - h.lr * g / sqrtf(a + h.epsilon);
  } else if (A == Algorithm::kAdam) {
    const float m = s0 + (g - s0) * (1.0f - h.beta1);
    const float v = s1 + (g * g - s1) * (1.0f - h.beta2);
    s0 = m;
    s1 = v;
    return w - s.alpha * m / (sqrtf(v) + h.epsilon);
  } else if (A == Algorithm::kFtrl) {  // s0: accumulator, s1: linear
    const float g2 = g + 2.0f * h.l2_shrinkage * w;
    const float new_acc = s0 + g * g;
    const float p_new = powf(new_acc, -h.lr_power), p_old = powf(s0, -h.lr_power);
    const float lin = s1 + g2 - (p_new - p_old) / h.lr * w;
    s0 = new_acc;
    s1 = lin;
    const float quad = p_new / h.lr + 2.0f * (h.l2 + h.beta / (2.0f * h.lr));
    const float clipped = lin < -h.l1 ? -h.l1 : (lin > h.l1 ? h.l1 : lin);
    return (clipped - lin) / quad;
  } else {  // kRmsprop: s0 velocity, then [mean gradient if centered], then [momentum]
    const float vel = h.rho * s0 + (1.0f - h.rho) * g * g;
    s0 = vel;
    float denom = vel + h.epsilon;
    if (h.centered) {
      const float mg = h.rho * s1 + (1.0f - h.rho) * g;
      s1 = mg;
      denom = vel - mg * mg + h.epsilon;
    }
    const float inc = h.lr * g / sqrtf(denom);
    if (h.momentum > 0.0f) {
      float& mom = h.centered ? s2 : s1;
      mom = h.momentum * mom + inc;
      return w - mom;
    }
    return w - inc;
  }
}

// Calls fn(std::integral_constant<Algorithm, A>) for the runtime algorithm.
template <typename Fn>
auto DispatchAlgorithm(Algorithm a, Fn&& fn) {
  switch (a) {
    case Algorithm::kMomentum: return fn(std::integral_constant<Algorithm, Algorithm::kMomentum>());
    case Algorithm::kAdagrad: return fn(std::integral_constant<Algorithm, Algorithm::kAdagrad>());
    case Algorithm::kAdam: return fn(std::integral_constant<Algorithm, Algorithm::kAdam>());
    case Algorithm::kFtrl: return fn(std::integral_constant<Algorithm, Algorithm::kFtrl>());
    case Algorithm::kRmsprop: return fn(std::integral_constant<Algorithm, Algorithm::kRmsprop>());
    default: return fn(std::integral_constant<Algorithm, Algorithm::kSgd>());
  }
}

struct SparseUpdate {
  float* var;          // [rows, dim]
  float* slots[3];     // [rows, dim] each, NumDenseSlots(h) of them
  float* step;         // [rows] or nullptr
  int64_t rows;
  int32_t dim;
};

// One table's part of a fused update: its storage and its gradient rows
// (grads is [n, dim], row i for row indices[i]).
template <typename Id>
struct TableUpdate {
  SparseUpdate u;
  const Id* indices;
  const float* grads;
  int64_t n;
};

// Applies every table's row-sparse gradient in one call; rows repeated within a
// table are summed first. Every index of every table is checked before anything
// is written: one outside [0, rows) fails the call with kIdOutOfRange (group =
// table, item = position, value = index) and leaves all tables and state as
// they were. indices_unique: the caller promises each table's indices as the
// lookup gradient emits them: strictly ascending, except repeats of an index
// whose gradient rows are zero (the gradient's padding), which are skipped; no
// grouping is needed. A decreasing index fails the call the same way with
// kNotAscending.
// report = false (indices tf_sok produced itself): a device does not wait to
// learn the check's verdict; a bad index still stops every write.
template <typename Device, typename Id>
struct FusedSparseApply {
  Error operator()(const Device& d, const Hyper& h, const std::vector<TableUpdate<Id>>& tables,
                   bool indices_unique, bool report = true);
};

// Copies bytes within device memory (used for copy-on-write of shared buffers).
template <typename Device>
void DeviceCopy(const Device& d, void* dst, const void* src, size_t bytes);

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_OPTIMIZER_H_
