// Google Benchmark suite: each ISA's gradient-accumulation kernel beside its streams ceiling,
// single-threaded, for every gradient dtype in the add and add_zero modes, at a cache-resident size (1M)
// and a memory-bound one (64M). Names: simd/accumulate/<isa>/<grad>_<mode>/<size>,
// simd/accumulate_streams/...; bytes counted as zoe bench accumulate counts them.
#include <benchmark/benchmark.h>

#include <string>

#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "zoe/adam.h"
#include "zoe/aligned_buffer.h"

namespace zoe {
namespace {

// acc read and written (8) + g read, and g written when zeroed.
double bytes_per_param(int grad, int mode) {
  const double g = grad == simd::kF32 ? 4 : 2;
  return 8.0 + g + ((mode & simd::kAccumulateZeroSource) != 0 ? g : 0.0);
}

void kernel_bench(benchmark::State& state, const simd::KernelTable* table, bool streams, int grad, int mode,
                  std::size_t n) {
  AlignedBuffer acc = AlignedBuffer::allocate(n * 4).value();
  AlignedBuffer g = AlignedBuffer::allocate(n * 4).value();
  for (std::size_t i = 0; i < n; ++i) {  // touch every page
    acc.as<float>()[i] = 0.5f;
    g.as<float>()[i] = 1e-3f;  // as f16/bf16 the bytes decode to small finite values too
  }
  const simd::AccumulateFn fn = streams ? table->accumulate_streams[grad] : table->accumulate[grad];
  for (auto _ : state) {
    fn(acc.as<float>(), g.data(), n, mode);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * bytes_per_param(grad, mode)));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

void register_all() {
  const struct {
    const char* label;
    std::size_t n;
  } sizes[] = {{"1M", std::size_t(1) << 20}, {"64M", std::size_t(64) << 20}};
  const struct {
    const char* label;
    int mode;
  } modes[] = {{"add", simd::kAccumulateAdd}, {"add_zero", simd::kAccumulateZeroSource}};
  for (Isa isa : supported_isas()) {
    const simd::KernelTable* table = &simd::kernel_table(isa);
    for (int grad = 0; grad < simd::kElems; ++grad) {
      for (const auto& mode : modes) {
        for (const auto& size : sizes) {
          for (bool streams : {false, true}) {
            const std::string name = std::string(streams ? "simd/accumulate_streams/" : "simd/accumulate/") +
                                     table->name + "/" + std::string(dtype_name(DType(grad))) + "_" + mode.label +
                                     "/" + size.label;
            benchmark::RegisterBenchmark(name.c_str(), kernel_bench, table, streams, grad, mode.mode, size.n)
                ->Unit(benchmark::kMillisecond);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace zoe

int main(int argc, char** argv) {
  zoe::register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
