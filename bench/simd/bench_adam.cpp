// Google Benchmark suite: each ISA's Adam kernel beside its streams ceiling, single-threaded, for every
// gradient x copy-out dtype, at a cache-resident size (1M) and a memory-bound one (64M); and the engine on
// many small tensors beside the same parameters as one array.
// Names: simd/adam/<isa>/<grad>_<out>/<size>, simd/streams/..., engine/adam/<isa>/<shape>.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "zoe/adam.h"
#include "zoe/aligned_buffer.h"

namespace zoe {
namespace {

constexpr const char* kOutNames[] = {"none", "f16", "bf16"};

struct Arrays {
  AlignedBuffer p, m, v, g, out;
  explicit Arrays(std::size_t n)
      : p(AlignedBuffer::allocate(n * 4).value()),
        m(AlignedBuffer::allocate(n * 4).value()),
        v(AlignedBuffer::allocate(n * 4).value()),
        g(AlignedBuffer::allocate(n * 4).value()),
        out(AlignedBuffer::allocate(n * 2).value()) {
    for (std::size_t i = 0; i < n; ++i) {  // touch every page; small gradients, zero moments
      p.as<float>()[i] = 0.5f;
      m.as<float>()[i] = 0.0f;
      v.as<float>()[i] = 0.0f;
      g.as<float>()[i] = 1e-3f;  // as f16/bf16 the bytes decode to small finite values too
      out.as<std::uint16_t>()[i] = 0;
    }
  }
};

double bytes_per_param(int grad, int out) { return 24.0 + (grad == simd::kF32 ? 4 : 2) + (out == simd::kOutNone ? 0 : 2); }

void kernel_bench(benchmark::State& state, const simd::KernelTable* table, bool streams, int grad, int out,
                  std::size_t n) {
  Arrays a(n);
  const simd::AdamConstants c{0.9f, 0.1f, 0.999f, 0.001f, -1e-3f, 1.0f, 1e-8f, 1.0f, 0.0f, 1.0f};
  const simd::AdamFn fn = streams ? table->streams[grad][out][simd::kStateF32] : table->adam[grad][out][simd::kStateF32];
  for (auto _ : state) {
    const simd::StateIn in{a.p.as<float>(), a.m.as<float>(), a.v.as<float>(), nullptr, nullptr};
    fn(c, in, a.p.as<float>(), a.m.as<float>(), a.v.as<float>(), a.g.data(), a.out.data(), n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * bytes_per_param(grad, out)));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

// The engine over `count` separately allocated tensors holding `n` parameters in all (bf16 grads and copy).
void engine_bench(benchmark::State& state, Isa isa, std::size_t n, std::size_t count) {
  CpuAdamOptions o;
  o.isa = std::string(isa_name(isa));
  CpuAdam engine = CpuAdam::create(o).value();
  std::vector<Arrays> arrays;
  std::vector<AdamTensor> tensors;
  arrays.reserve(count);
  for (std::size_t k = 0; k < count; ++k) {
    Arrays& a = arrays.emplace_back(n / count);
    tensors.push_back({a.p.as<float>(), a.m.as<float>(), a.v.as<float>(), DType::f32, a.g.data(), DType::bf16, a.out.data(),
                       DType::bf16, n / count});
  }
  StepOptions step;
  for (auto _ : state) {
    if (!engine.step(AdamHyper{}, step, tensors).ok()) state.SkipWithError("step failed");
    ++step.step;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * 28));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

void register_all() {
  const struct {
    const char* label;
    std::size_t n;
  } sizes[] = {{"1M", std::size_t(1) << 20}, {"64M", std::size_t(64) << 20}};
  for (Isa isa : supported_isas()) {
    const simd::KernelTable* table = &simd::kernel_table(isa);
    for (int grad = 0; grad < simd::kElems; ++grad) {
      for (int out = 0; out < simd::kElems; ++out) {
        for (const auto& size : sizes) {
          for (bool streams : {false, true}) {
            const std::string name = std::string(streams ? "simd/streams/" : "simd/adam/") + table->name + "/" +
                                     std::string(dtype_name(DType(grad))) + "_" + kOutNames[out] + "/" + size.label;
            benchmark::RegisterBenchmark(name.c_str(), kernel_bench, table, streams, grad, out, size.n)
                ->Unit(benchmark::kMillisecond);
          }
        }
      }
    }
    const std::string prefix = "engine/adam/" + std::string(isa_name(isa));
    benchmark::RegisterBenchmark((prefix + "/1x40960000").c_str(), engine_bench, isa, 40960000, 1)
        ->Unit(benchmark::kMillisecond)->UseRealTime();
    benchmark::RegisterBenchmark((prefix + "/10000x4096").c_str(), engine_bench, isa, 40960000, 10000)
        ->Unit(benchmark::kMillisecond)->UseRealTime();
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
