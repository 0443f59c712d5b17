// make_cuda_device for a build without nvcc: the CUDA device is then simply not there.
#include "zoe/device.h"

namespace zoe {

Result<std::unique_ptr<Device>> make_cuda_device(int ordinal) {
  return Status(StatusCode::unsupported, "zoe was built without CUDA (nvcc not found at configure time); cuda:" +
                                             std::to_string(ordinal) + " is not available");
}

}  // namespace zoe
