#include <cuda_runtime.h>

#include "cuda/device.h"

namespace zoe::cuda {

Result<DeviceQuery> query_devices() {
  DeviceQuery q;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    cudaGetLastError();  // clear the sticky error so later calls start clean
    q.reason = std::string("no usable GPU: ") + cudaGetErrorString(err);
    return q;
  }
  if (err != cudaSuccess) {
    return Status(StatusCode::internal, std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err));
  }
  q.count = count;
  if (count == 0) q.reason = "no GPU found";
  cudaDeviceProp prop{};
  if (count > 0 && cudaGetDeviceProperties(&prop, 0) == cudaSuccess) q.first_name = prop.name;
  return q;
}

}  // namespace zoe::cuda
