// grad_stats and simulate_compute kernels. grad_stats is two passes — one partial result per block, then one
// block adds the partials in index order — instead of atomics, so that its result is bit-identical from run
// to run (the overlap schedule is tested against sync, and both compute the norm from these sums).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/cuda_kernels.h"

namespace zoe::cuda {
namespace {

constexpr unsigned kThreads = 256;  // block_reduce assumes exactly this many threads per block
constexpr unsigned kWarps = kThreads / 32;

struct Acc {
  double sum_sq;
  unsigned long long non_finite;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Squares are summed in fp64: a finite f32 or bf16 value above ~1.8e19 would overflow an fp32 square, and
// the product of two floats is exact in fp64, so the only rounding is in the additions. The kernel is bound
// by memory bandwidth; the fp64 FMA does not show.
template <typename T>
__device__ __forceinline__ void accumulate(Acc& acc, T x) {
  const double v = to_float(x);
  acc.non_finite += isfinite(v) ? 0ull : 1ull;
  acc.sum_sq = fma(v, v, acc.sum_sq);
}

// A fixed tree (shuffles, then one warp over the warp totals), so the result does not depend on scheduling.
// The block total is valid in thread 0 only. Called once per kernel: the shared arrays are not reused.
__device__ Acc block_reduce(Acc acc) {
  __shared__ double warp_sum_sq[kWarps];
  __shared__ unsigned long long warp_non_finite[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) {
    acc.sum_sq += __shfl_down_sync(0xffffffffu, acc.sum_sq, offset);
    acc.non_finite += __shfl_down_sync(0xffffffffu, acc.non_finite, offset);
  }
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_sum_sq[warp] = acc.sum_sq;
    warp_non_finite[warp] = acc.non_finite;
  }
  __syncthreads();
  Acc total{0.0, 0ull};
  if (warp == 0) {
    if (lane < kWarps) total = Acc{warp_sum_sq[lane], warp_non_finite[lane]};
    for (int offset = 16; offset > 0; offset /= 2) {
      total.sum_sq += __shfl_down_sync(0xffffffffu, total.sum_sq, offset);
      total.non_finite += __shfl_down_sync(0xffffffffu, total.non_finite, offset);
    }
  }
  return total;
}

// The gradients split into a head before the first 16-byte boundary and a tail after the last one (each
// under 16 bytes, read by the first threads) and a body read as 16-byte vectors by a grid-stride loop.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    grad_stats_blocks(const T* __restrict__ head, unsigned head_n, const uint4* __restrict__ body,
                      std::size_t body_n, const T* __restrict__ tail, unsigned tail_n, StatsScratch* scratch) {
  constexpr unsigned kPerVector = sizeof(uint4) / sizeof(T);
  Acc acc{0.0, 0ull};
  const std::size_t first = std::size_t{blockIdx.x} * kThreads + threadIdx.x;
  const std::size_t stride = std::size_t{gridDim.x} * kThreads;
  if (first < head_n) accumulate(acc, head[first]);
  if (first < tail_n) accumulate(acc, tail[first]);
  for (std::size_t i = first; i < body_n; i += stride) {
    const uint4 packed = body[i];
    const T* values = reinterpret_cast<const T*>(&packed);
#pragma unroll
    for (unsigned k = 0; k < kPerVector; ++k) accumulate(acc, values[k]);
  }
  const Acc total = block_reduce(acc);
  if (threadIdx.x == 0) {
    scratch->block_sum_sq[blockIdx.x] = total.sum_sq;
    scratch->block_non_finite[blockIdx.x] = total.non_finite;
  }
}

// One block: each thread adds a fixed, strided subset of the partials in index order.
__global__ void __launch_bounds__(kThreads) grad_stats_total(StatsScratch* scratch, unsigned blocks) {
  Acc acc{0.0, 0ull};
  for (unsigned i = threadIdx.x; i < blocks; i += kThreads) {
    acc.sum_sq += scratch->block_sum_sq[i];
    acc.non_finite += scratch->block_non_finite[i];
  }
  const Acc total = block_reduce(acc);
  if (threadIdx.x == 0) scratch->result = StatsResult{total.sum_sq, total.non_finite};
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin(unsigned long long ns) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < ns) {
#if __CUDA_ARCH__ >= 700
    __nanosleep(1000);  // frees the issue slots; the timer, not the loop count, decides when to stop
#endif
  }
}

cudaLaunchConfig_t launch_config(unsigned blocks, cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  return config;
}

template <typename T>
cudaError_t launch_typed(const void* grads, std::size_t n, StatsScratch* scratch, cudaStream_t stream) {
  constexpr std::size_t kPerVector = sizeof(uint4) / sizeof(T);
  const T* head = static_cast<const T*>(grads);
  const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(grads) % sizeof(uint4);
  const std::size_t head_n = misaligned == 0 ? 0 : std::min(n, (sizeof(uint4) - misaligned) / sizeof(T));
  const std::size_t body_n = (n - head_n) / kPerVector;
  const auto tail_n = static_cast<unsigned>((n - head_n) % kPerVector);
  const auto* body = reinterpret_cast<const uint4*>(head + head_n);
  const T* tail = head + head_n + body_n * kPerVector;
  const auto blocks = static_cast<unsigned>(
      std::clamp<std::size_t>((body_n + kThreads - 1) / kThreads, 1, kStatsMaxBlocks));

  cudaLaunchConfig_t config = launch_config(blocks, stream);
  cudaError_t err = cudaLaunchKernelEx(&config, grad_stats_blocks<T>, head, static_cast<unsigned>(head_n), body,
                                       body_n, tail, tail_n, scratch);
  if (err != cudaSuccess) return err;
  config = launch_config(1, stream);
  return cudaLaunchKernelEx(&config, grad_stats_total, scratch, blocks);
}

}  // namespace

cudaError_t launch_grad_stats(const void* grads, DType dtype, std::size_t n, StatsScratch* scratch,
                              cudaStream_t stream) {
  switch (dtype) {
    case DType::f32: return launch_typed<float>(grads, n, scratch, stream);
    case DType::f16: return launch_typed<__half>(grads, n, scratch, stream);
    case DType::bf16: return launch_typed<__nv_bfloat16>(grads, n, scratch, stream);
    case DType::i8: break;  // not a gradient dtype
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_spin(std::uint64_t ns, cudaStream_t stream) {
  cudaLaunchConfig_t config = launch_config(1, stream);
  config.blockDim = dim3(1);
  return cudaLaunchKernelEx(&config, spin, static_cast<unsigned long long>(ns));
}

}  // namespace zoe::cuda
