// What the host stand-in device offers inside zoe beyond the Device interface.
#pragma once

#include <functional>

#include "zoe/device.h"

namespace zoe {

// Runs `work` on `stream` of a host stand-in device, in order with the stream's other work (in-process
// collectives run this way); invalid_argument for any other device.
Status enqueue_on_host_device(Device& device, Stream stream, std::function<void()> work);

}  // namespace zoe
