// What the op library was built against, read by the Python loader (ctypes)
// to refuse a library built for another TensorFlow, and the constants the
// Python side must agree with (a test compares them).
#include <cstring>

#include "tf_sok/cc/impl/common.h"
#include "tf_sok/cc/impl/key_exchange.h"

#ifndef TF_SOK_BUILT_TF_VERSION
#define TF_SOK_BUILT_TF_VERSION "unknown"
#endif
#ifndef TF_SOK_BUILT_CUDA_ARCHS
#define TF_SOK_BUILT_CUDA_ARCHS ""
#endif

extern "C" {
__attribute__((visibility("default"))) const char* TfSokBuiltTfVersion() {
  return TF_SOK_BUILT_TF_VERSION;
}
__attribute__((visibility("default"))) int TfSokBuiltWithCuda() { return TF_SOK_WITH_CUDA; }
__attribute__((visibility("default"))) const char* TfSokBuiltCudaArchs() {
  return TF_SOK_BUILT_CUDA_ARCHS;
}
// table_shift: keys are (table << it) | row; status_words: int64 words of a
// lookup's status; max_exchange_widths: widths of one planned exchange. -1: unknown name.
__attribute__((visibility("default"))) long long TfSokConstant(const char* name) {
  namespace impl = tf_sok::impl;
  if (std::strcmp(name, "table_shift") == 0) return impl::kTableShift;
  if (std::strcmp(name, "status_words") == 0) return impl::kErrorRecordWords;
  if (std::strcmp(name, "max_exchange_widths") == 0) return impl::kMaxExchangeWidths;
  return -1;
}
}
