// make_cuda_device and the NCCL collectives for a build without nvcc: they are then simply not there.
#include "zoe/device.h"
#include "zoe/partition.h"

namespace zoe {

Result<std::unique_ptr<Device>> make_cuda_device(int ordinal) {
  return Status(StatusCode::unsupported, "zoe was built without CUDA (nvcc not found at configure time); cuda:" +
                                             std::to_string(ordinal) + " is not available");
}

Result<NcclUniqueId> make_nccl_unique_id() {
  return Status(StatusCode::unsupported, "zoe was built without CUDA: no NCCL");
}

Result<std::unique_ptr<Collectives>> make_nccl_collectives(Device&, const NcclUniqueId&, int, int) {
  return Status(StatusCode::unsupported, "zoe was built without CUDA: no NCCL");
}

}  // namespace zoe
