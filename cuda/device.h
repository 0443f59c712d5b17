// What GPUs this process can use. A machine with no GPU or no driver is not an error: count is 0 and
// `reason` says why, so that callers and tests can skip cleanly; any other CUDA failure is an error.
#pragma once

#include "cuda/private.h"

#include <string>

#include "zoe/status.h"

namespace zoe::cuda {

struct DeviceQuery {
  int count = 0;
  std::string reason;  // why count is 0
  std::string first_name;
};

Result<DeviceQuery> query_devices();

}  // namespace zoe::cuda
