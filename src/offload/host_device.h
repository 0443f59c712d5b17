// What the host stand-in device offers inside zoe beyond the Device interface.
#pragma once

#include <functional>

#include "zoe/device.h"

namespace zoe {

// Runs `work` on `stream` of a host stand-in device, in order with the stream's other work (in-process
// collectives run this way); invalid_argument for any other device.
Status enqueue_on_host_device(Device& device, Stream stream, std::function<void()> work);

// The statistics a host stand-in's grad_stats() computes, on the calling thread: the same kernel wherever
// the gradients are in host memory, so that every schedule reaches the same decision bit for bit.
GradStats host_grad_stats(const void* grad, DType dtype, std::size_t n);
// Only the count of NaN/Inf values (sum_sq stays 0), in one read of the gradients: all that the refusal of
// non-finite gradients needs when nothing asks for the norm.
GradStats host_non_finite(const void* grad, DType dtype, std::size_t n);

}  // namespace zoe
