// What the engine suites share: an engine with a given ISA, thread count and tile, and the fixture that runs
// a test once per ISA (skipped, with the reason, where this CPU cannot run it).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "simd/dispatch.h"
#include "zoe/adam.h"

namespace zoe::test {

inline CpuAdam make_engine(const std::string& isa, int threads, std::size_t tile) {
  CpuAdamOptions o;
  o.isa = isa;
  o.threads = threads;
  o.tile = tile;
  Result<CpuAdam> e = CpuAdam::create(o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return std::move(e).value();
}

class EngineIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!simd::isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU cannot run " << isa_name(GetParam()) << " code";
    }
  }
  std::string isa() const { return std::string(isa_name(GetParam())); }
};

// The ISAs of the build's architecture (the engine suites run once per ISA).
#if defined(__aarch64__)
inline constexpr Isa kBuildIsas[] = {Isa::scalar, Isa::neon, Isa::sve};
#else
inline constexpr Isa kBuildIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512};
#endif

inline std::string isa_test_name(const ::testing::TestParamInfo<Isa>& i) { return std::string(isa_name(i.param)); }

}  // namespace zoe::test
