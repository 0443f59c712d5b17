// Launchers of CudaDevice's kernels (cuda_kernels.cu), callable from host C++. Each enqueues on `stream`
// and returns the launch's own error; nothing here allocates or synchronizes.
#pragma once

#include "cuda/private.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "zoe/dtype.h"

namespace zoe::cuda {

// The 16 bytes grad_stats leaves in device memory and copies to the host.
struct StatsResult {
  double sum_sq;
  unsigned long long non_finite;
};
static_assert(sizeof(StatsResult) == 16);

// Fixed, not derived from the GPU's SM count, so the summation order — and the result's bits — depend only
// on n and the alignment of the gradients, on every GPU.
constexpr unsigned kStatsMaxBlocks = 1024;

// Device scratch of grad_stats on one stream. Calls on one stream run in order, so they may share it as long
// as each call's kernels are enqueued without another call's in between; calls on two streams may not.
struct StatsScratch {
  double block_sum_sq[kStatsMaxBlocks];
  unsigned long long block_non_finite[kStatsMaxBlocks];
  StatsResult result;
};

// Leaves in scratch->result the sum of squares (fp64) and the NaN/Inf count of n gradients of `dtype`.
// `grads` must be aligned to the element size; n may be 0.
cudaError_t launch_grad_stats(const void* grads, DType dtype, std::size_t n, StatsScratch* scratch,
                              cudaStream_t stream);

// One thread that spins until the GPU's global nanosecond timer has advanced by `ns`.
cudaError_t launch_spin(std::uint64_t ns, cudaStream_t stream);

}  // namespace zoe::cuda
