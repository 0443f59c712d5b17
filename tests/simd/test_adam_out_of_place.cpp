// Every kernel table this CPU runs: a step from one state set into another (the overlap schedule's
// speculation) writes the same bits as the step in place, and leaves the set it read as it was. At the sizes
// where vector code goes wrong (0, 1, lanes - 1, lanes, lanes + 1, a large odd size), with unaligned pointers,
// for every moment storage (fp32, bf16, 8-bit blocks).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "tests/reference.h"
#include "tests/simd/kernel_variants.h"

namespace zoe::simd {
namespace {

using test::GradData;
using test::kVariants;
using test::Random;
using test::skip_reason;
using test::Variant;

constexpr AdamConstants kConstants{0.9f, 0.1f, 0.999f, 0.001f, -0.0123f, 1.3f, 1e-8f, 0.9999f, 0.0f, 0.5f};
constexpr AdamConstants kL2Constants{0.9f, 0.1f, 0.999f, 0.001f, -0.0123f, 1.3f, 1e-8f, 1.0f, 0.01f, 0.5f};

// One state set as bytes, one element of padding in front so that every array starts unaligned.
struct Set {
  std::vector<float> p;
  std::vector<unsigned char> m, v;
  std::vector<float> ms, vs;
  std::vector<std::uint16_t> out;
  Set(std::size_t n, std::size_t state_bytes)
      : p(n + 1), m((n + 1) * state_bytes), v((n + 1) * state_bytes), ms(n / 2048 + 2), vs(n / 2048 + 2), out(n + 1) {}
  float* pp() { return p.data() + 1; }
  unsigned char* mp(std::size_t sb) { return m.data() + sb; }
  unsigned char* vp(std::size_t sb) { return v.data() + sb; }
  bool operator==(const Set&) const = default;
};

using Param = std::tuple<int /*variant*/, DType /*grad*/, int /*StateElem or kStateInt8*/>;

class AdamOutOfPlace : public ::testing::TestWithParam<Param> {
 protected:
  const Variant& variant() const { return kVariants[std::get<0>(GetParam())]; }
  DType grad() const { return std::get<1>(GetParam()); }
  int state() const { return std::get<2>(GetParam()); }
  std::size_t state_bytes() const { return state() == kStateF32 ? 4 : state() == kStateBF16 ? 2 : 1; }
  void SetUp() override {
    if (const std::string why = skip_reason(variant()); !why.empty()) GTEST_SKIP() << why;
  }

  // A state set of plausible values: the moments stepped once from zero, so every storage holds real codes.
  Set start(std::size_t n, Random& rng) {
    Set s(n, state_bytes());
    for (std::size_t i = 0; i < n; ++i) s.pp()[i] = static_cast<float>(rng.uniform(-1, 1));
    step(kConstants, s, s, test::make_grad(grad(), n, rng, 1e-2), n);
    return s;
  }

  // One step reading `from`, writing `to` (the same set: in place).
  void step(const AdamConstants& c, Set& from, Set& to, const GradData& g, std::size_t n) {
    const KernelTable& t = variant().table();
    const std::size_t sb = state_bytes();
    const StateIn in{from.pp(), from.mp(sb), from.vp(sb), from.ms.data(), from.vs.data()};
    const void* gp = test::grad_ptr(g, grad(), 0);
    if (state() == kStateInt8) {
      t.adam_q8[int(grad())][kOutBF16](c, in, to.pp(), reinterpret_cast<std::int8_t*>(to.mp(sb)), to.vp(sb),
                                       to.ms.data(), to.vs.data(), gp, to.out.data() + 1, n);
    } else {
      t.adam[int(grad())][kOutBF16][state()](c, in, to.pp(), to.mp(sb), to.vp(sb), gp, to.out.data() + 1, n);
    }
  }
};

TEST_P(AdamOutOfPlace, SameBitsAsInPlaceAndTheSetReadUnchanged) {
  const std::size_t lanes = variant().table().lanes;
  for (const AdamConstants& c : {kConstants, kL2Constants}) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, lanes - 1, lanes, lanes + 1, std::size_t{2 * 2048 + 77}}) {
      Random rng(n * 7 + 3);
      Set a = start(n, rng);
      Set other(n, state_bytes());  // the second set: whatever it held before
      std::memset(other.p.data(), 0x5a, other.p.size() * 4);
      const Set before = a;
      const GradData g = test::make_grad(grad(), n, rng, 1e-2);
      step(c, a, other, g, n);
      EXPECT_TRUE(a == before) << "the set read was written, n = " << n;
      step(c, a, a, g, n);  // in place
      EXPECT_EQ(std::memcmp(other.pp(), a.pp(), n * 4), 0) << "p, n = " << n;
      EXPECT_EQ(std::memcmp(other.mp(state_bytes()), a.mp(state_bytes()), n * state_bytes()), 0) << "m, n = " << n;
      EXPECT_EQ(std::memcmp(other.vp(state_bytes()), a.vp(state_bytes()), n * state_bytes()), 0) << "v, n = " << n;
      EXPECT_EQ(std::memcmp(other.out.data() + 1, a.out.data() + 1, n * 2), 0) << "out, n = " << n;
      if (state() == kStateInt8 && n > 0) {
        const std::size_t blocks = (n + 2047) / 2048;
        EXPECT_EQ(std::memcmp(other.ms.data(), a.ms.data(), blocks * 4), 0) << "m scales, n = " << n;
        EXPECT_EQ(std::memcmp(other.vs.data(), a.vs.data(), blocks * 4), 0) << "v scales, n = " << n;
      }
    }
  }
}

// fp32 state whose arrays share one alignment (as tier ram's do): the kernels that can stream their stores
// step the elements before a vector boundary staged and the rest streamed; every shift gives the same bits
// as the step in place.
TEST_P(AdamOutOfPlace, EveryAlignmentOfAlignedArraysGivesTheSameBits) {
  if (state() != kStateF32) GTEST_SKIP() << "only fp32 state is streamed";
  const KernelTable& t = variant().table();
  const std::size_t lanes = t.lanes;
  constexpr std::size_t kMax = 3000;
  struct Aligned {
    alignas(64) float x[kMax + 64];
  };
  auto buffers = std::make_unique<Aligned[]>(6);
  for (std::size_t shift : {std::size_t{0}, std::size_t{1}, lanes - 1, lanes, lanes + 3}) {
    const std::size_t n = 2000 + shift;
    Random rng(shift + 17);
    float* p0 = buffers[0].x + shift;
    float* m0 = buffers[1].x + shift;
    float* v0 = buffers[2].x + shift;
    for (std::size_t i = 0; i < n; ++i) {
      p0[i] = static_cast<float>(rng.uniform(-1, 1));
      m0[i] = static_cast<float>(rng.uniform(-1e-2, 1e-2));
      v0[i] = static_cast<float>(rng.uniform(0, 1e-4));
    }
    float* p1 = buffers[3].x + shift;
    float* m1 = buffers[4].x + shift;
    float* v1 = buffers[5].x + shift;
    const GradData g = test::make_grad(grad(), n, rng, 1e-2);
    std::vector<std::uint16_t> out_aside(n), out_in_place(n);
    const StateIn in{p0, m0, v0, nullptr, nullptr};
    t.adam[int(grad())][kOutBF16][kStateF32](kConstants, in, p1, m1, v1, test::grad_ptr(g, grad(), 0),
                                             out_aside.data(), n);
    t.adam[int(grad())][kOutBF16][kStateF32](kConstants, in, p0, m0, v0, test::grad_ptr(g, grad(), 0),
                                             out_in_place.data(), n);
    EXPECT_EQ(std::memcmp(p0, p1, n * 4), 0) << "p, shift " << shift;
    EXPECT_EQ(std::memcmp(m0, m1, n * 4), 0) << "m, shift " << shift;
    EXPECT_EQ(std::memcmp(v0, v1, n * 4), 0) << "v, shift " << shift;
    EXPECT_EQ(out_aside, out_in_place) << "out, shift " << shift;
  }
}

std::string name(const ::testing::TestParamInfo<Param>& info) {
  const int s = std::get<2>(info.param);
  return std::string(kVariants[std::get<0>(info.param)].token) + "_grad_" +
         std::string(dtype_name(std::get<1>(info.param))) + (s == kStateF32 ? "_f32" : s == kStateBF16 ? "_bf16" : "_i8");
}

INSTANTIATE_TEST_SUITE_P(AllIsas, AdamOutOfPlace,
                         ::testing::Combine(::testing::Range(0, test::kVariantCount),
                                            ::testing::Values(DType::f32, DType::f16, DType::bf16),
                                            ::testing::Values(int(kStateF32), int(kStateBF16), int(kStateInt8))),
                         name);

}  // namespace
}  // namespace zoe::simd
