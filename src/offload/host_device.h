// What the host stand-in device offers inside zoe beyond its public face (zoe/host_device.h): the gradient
// statistics its grad_stats() computes, for the engine's own passes over host gradients.
#pragma once

#include "src/private.h"

#include <cstddef>

#include "zoe/host_device.h"

namespace zoe {

// The statistics a host stand-in's grad_stats() computes, on the calling thread: the same kernel wherever
// the gradients are in host memory, so that every schedule reaches the same decision bit for bit.
GradStats host_grad_stats(const void* grad, DType dtype, std::size_t n);
// Only the count of NaN/Inf values (sum_sq stays 0), in one read of the gradients: all that the refusal of
// non-finite gradients needs when nothing asks for the norm.
GradStats host_non_finite(const void* grad, DType dtype, std::size_t n);

}  // namespace zoe
