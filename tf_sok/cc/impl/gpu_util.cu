#include "tf_sok/cc/impl/gpu_util.cuh"

namespace tf_sok {
namespace impl {
namespace gpu {

__global__ void IotaKernel(int* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i;
}

__global__ void SetFirstZero(int* offsets) { offsets[0] = 0; }

}  // namespace gpu
}  // namespace impl
}  // namespace tf_sok
