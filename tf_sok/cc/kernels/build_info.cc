// What the op library was built against, read by the Python loader (ctypes)
// to refuse a library built for another TensorFlow.
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
}
