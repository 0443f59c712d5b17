// Adam/AdamW with amsgrad through CpuAdam, on every ISA this CPU runs: amsgrad = false is Adam bit for bit
// (max_exp_avg_sq untouched), amsgrad = true keeps max_exp_avg_sq the exact running maximum of exp_avg_sq
// and each step matches a float64 transcription of torch.optim.Adam(amsgrad=True); bit-identical for any
// thread count and tile, out of place equal to in place, and refused arguments that change nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tests/engine/engine_isa.h"
#include "tests/reference.h"
#include "zoe/adam.h"

namespace zoe {
namespace {

using test::make_engine;
using test::Random;

// Tensors with Adam's three state arrays. The moments start as after some steps, v and v_max large beside
// the new squared gradients, so that v decays below v_max and the maximum decides the denominator.
struct Model {
  std::vector<std::vector<float>> p, m, v, vmax;  // the moments hold bf16 two to a float with that state
  std::vector<test::GradData> g;
  std::vector<std::vector<std::uint16_t>> out;
  std::vector<AdamTensor> tensors;
  DType state;

  Model(const std::vector<std::size_t>& sizes, DType grad, DType state_dtype, std::uint64_t seed) : state(state_dtype) {
    Random rng(seed);
    for (std::size_t n : sizes) {
      const std::size_t floats = (n * dtype_size(state) + 3) / 4;
      p.emplace_back(n);
      m.emplace_back(floats, 0.0f);
      v.emplace_back(floats, 0.0f);
      vmax.emplace_back(floats, 0.0f);
      out.emplace_back(n, 0);
      const std::size_t k = p.size() - 1;
      for (std::size_t i = 0; i < n; ++i) {
        p[k][i] = static_cast<float>(rng.uniform(-1, 1));
        set(m[k], i, static_cast<float>(rng.uniform(-1e-2, 1e-2)));
        const float v0 = static_cast<float>(rng.uniform(0, 2e-4));
        set(v[k], i, v0);
        set(vmax[k], i, v0 * static_cast<float>(rng.uniform(1, 1.5)));
      }
      g.push_back(test::make_grad(grad, n, rng, 1e-2));
    }
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      AdamTensor t;
      t.param = p[k].data();
      t.exp_avg = m[k].data();
      t.exp_avg_sq = v[k].data();
      t.max_exp_avg_sq = vmax[k].data();
      t.state_dtype = state;
      t.grad = g[k].bytes.data();
      t.grad_dtype = grad;
      t.out = out[k].data();
      t.n = sizes[k];
      tensors.push_back(t);
    }
  }
  float get(const std::vector<float>& a, std::size_t i) const {
    if (state == DType::f32) return a[i];
    return bf16_to_float(reinterpret_cast<const std::uint16_t*>(a.data())[i]);
  }
  void set(std::vector<float>& a, std::size_t i, float x) {
    if (state == DType::f32) {
      a[i] = x;
    } else {
      reinterpret_cast<std::uint16_t*>(a.data())[i] = float_to_bf16(x);
    }
  }
  std::vector<unsigned char> bytes(bool with_vmax = true) const {
    std::vector<unsigned char> b;
    auto append = [&b](const void* data, std::size_t size) {
      const auto* c = static_cast<const unsigned char*>(data);
      b.insert(b.end(), c, c + size);
    };
    for (std::size_t k = 0; k < p.size(); ++k) {
      append(p[k].data(), p[k].size() * 4);
      append(m[k].data(), m[k].size() * 4);
      append(v[k].data(), v[k].size() * 4);
      if (with_vmax) append(vmax[k].data(), vmax[k].size() * 4);
      append(out[k].data(), out[k].size() * 2);
    }
    return b;
  }
};

AdamHyper amsgrad_hyper(bool adamw) {
  AdamHyper h;
  h.lr = 1e-2f;
  h.weight_decay = 0.05f;
  h.adamw = adamw;
  h.amsgrad = true;
  return h;
}

// One fp32 rounding, relative; each kernel result is within kUlps of them of the float64 value, scaled by
// the magnitude of the terms it adds (a handful of fp32 operations each).
constexpr double kUlp = 1.0 / (1 << 24);
constexpr double kUlps = 16;
// A bf16 moment is stored rounded to nearest even: half a unit of its 8 significant bits, at most 2^-8 of the
// value, beside which the fp32 error before the rounding counts too.
constexpr double kBf16Rounding = 1.0 / (1 << 8) + 16.0 / (1 << 24);

bool near(double got, double want, double scale, double rel) { return std::fabs(got - want) <= rel * scale + 1e-30; }

class AmsgradIsa : public test::EngineIsa {};

// amsgrad = false ignores max_exp_avg_sq: the bits of plain Adam, the array untouched.
TEST_P(AmsgradIsa, OffIsAdamBitForBit) {
  CpuAdam engine = make_engine(isa(), 2, 1000);
  for (DType state : {DType::f32, DType::bf16}) {
    Model with(std::vector<std::size_t>{4097, 33}, DType::bf16, state, 4);
    Model without(std::vector<std::size_t>{4097, 33}, DType::bf16, state, 4);
    for (AdamTensor& t : without.tensors) t.max_exp_avg_sq = nullptr;
    const std::vector<std::vector<float>> vmax_before = with.vmax;
    AdamHyper h = amsgrad_hyper(true);
    h.amsgrad = false;
    for (int s = 1; s <= 3; ++s) {
      StepOptions o;
      o.step = s;
      ASSERT_TRUE(engine.step(h, o, with.tensors).ok());
      ASSERT_TRUE(engine.step(h, o, without.tensors).ok());
    }
    EXPECT_EQ(with.bytes(false), without.bytes(false)) << dtype_name(state);
    EXPECT_EQ(with.vmax, vmax_before) << dtype_name(state);
  }
}

// Each step against torch's rule in float64 from the state the kernel read; max_exp_avg_sq is exactly
// max(the one read, the new exp_avg_sq as stored) (rounding is monotone, so also with bf16 moments), hence
// never decreases; and amsgrad really moves p differently from Adam.
TEST_P(AmsgradIsa, EachStepMatchesTorchAndTheMaximumIsExact) {
  const std::vector<std::size_t> sizes = {1, 7, 8, 9, 16, 17, 33, 1000, 4097};
  CpuAdam engine = make_engine(isa(), 2, 512);
  for (bool adamw : {true, false}) {
    for (DType grad : {DType::f32, DType::f16, DType::bf16}) {
      for (DType state : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(std::string(adamw ? "AdamW, " : "Adam, ") + std::string(dtype_name(grad)) + " gradients, " +
                     std::string(dtype_name(state)) + " moments");
        Model model(sizes, grad, state, 7), adam(sizes, grad, state, 7);
        const AdamHyper h = amsgrad_hyper(adamw);
        std::size_t max_decides = 0;
        for (int s = 1; s <= 4; ++s) {
          const Model before = model;
          StepOptions o;
          o.step = s;
          o.grad_scale = 0.75f;
          ASSERT_TRUE(engine.step(h, o, model.tensors).ok());
          const double bc1 = 1 - std::pow(double(h.beta1), s), bc2 = 1 - std::pow(double(h.beta2), s);
          const double b1 = h.beta1, b2 = h.beta2, wd = h.weight_decay, lr = h.lr;
          const double s_rel = state == DType::bf16 ? kBf16Rounding : kUlps * kUlp;
          for (std::size_t k = 0; k < sizes.size(); ++k) {
            for (std::size_t i = 0; i < sizes[k]; ++i) {
              const double p0 = before.p[k][i], m0 = before.get(before.m[k], i), v0 = before.get(before.v[k], i);
              const double vmax0 = before.get(before.vmax[k], i);
              double g = model.g[k].values[i] * o.grad_scale;
              if (!adamw) g += wd * p0;
              const double m1 = m0 + (1 - b1) * (g - m0), v1 = b2 * v0 + (1 - b2) * g * g;
              const float got_v = model.get(model.v[k], i), got_vmax = model.get(model.vmax[k], i);
              ASSERT_TRUE(near(model.get(model.m[k], i), m1, std::fabs(m0) + std::fabs(g), s_rel)) << k << " " << i;
              ASSERT_TRUE(near(got_v, v1, b2 * v0 + g * g, s_rel)) << k << " " << i;
              ASSERT_EQ(got_vmax, std::max(static_cast<float>(vmax0), got_v)) << k << " " << i;
              max_decides += vmax0 > got_v;
              const double vmax1 = std::max(vmax0, v1);
              const double update = lr / bc1 * m1 / (std::sqrt(vmax1) / std::sqrt(bc2) + h.eps);
              const double p1 = (adamw ? p0 * (1 - lr * wd) : p0) - update;
              const double scale = std::fabs(p0) + lr / bc1 * (std::fabs(m0) + std::fabs(g)) / (std::sqrt(vmax1) / std::sqrt(bc2) + h.eps);
              ASSERT_TRUE(near(model.p[k][i], p1, scale, kUlps * kUlp))
                  << k << " " << i << " step " << s << ": " << model.p[k][i] << " vs " << p1;
            }
          }
        }
        EXPECT_GT(max_decides, 100u);  // the maximum, not v, set many denominators
        AdamHyper plain = h;
        plain.amsgrad = false;
        for (int s = 1; s <= 4; ++s) {
          StepOptions o;
          o.step = s;
          o.grad_scale = 0.75f;
          ASSERT_TRUE(engine.step(plain, o, adam.tensors).ok());
        }
        EXPECT_NE(model.p, adam.p);
      }
    }
  }
}

std::vector<unsigned char> run_steps(CpuAdam& engine, Model& model, int steps, bool maximize = false) {
  AdamHyper h = amsgrad_hyper(true);
  h.maximize = maximize;
  for (int s = 1; s <= steps; ++s) {
    StepOptions o;
    o.step = s;
    o.grad_scale = 0.5f;
    EXPECT_TRUE(engine.step(h, o, model.tensors).ok());
  }
  return model.bytes();
}

TEST_P(AmsgradIsa, BitIdenticalForAnyThreadCountAndTile) {
  const std::vector<std::size_t> sizes = {100'003, 77};
  CpuAdam one = make_engine(isa(), 1, 1 << 20);
  for (DType state : {DType::f32, DType::bf16}) {
    Model base(sizes, DType::bf16, state, 1);
    const auto want = run_steps(one, base, 4);
    for (int threads : {1, 2, 3}) {
      for (std::size_t tile : {std::size_t(1), std::size_t(7), std::size_t(1000), std::size_t(65536)}) {
        CpuAdam engine = make_engine(isa(), threads, tile);
        Model model(sizes, DType::bf16, state, 1);
        EXPECT_EQ(run_steps(engine, model, 4), want) << dtype_name(state) << ", " << threads << " threads, tile " << tile;
      }
    }
  }
}

TEST_P(AmsgradIsa, StepIntoTheOtherSetEqualsTheStepInPlace) {
  const std::vector<std::size_t> sizes = {100'003, 77, 4096};
  for (DType state : {DType::f32, DType::bf16}) {
    for (std::size_t tile : {std::size_t(7), std::size_t(1000), std::size_t(65536)}) {
      CpuAdam engine = make_engine(isa(), 2, tile);
      Model current(sizes, DType::bf16, state, 1), in_place(sizes, DType::bf16, state, 1);
      Model other(sizes, DType::bf16, state, 9);
      const auto before = run_steps(engine, current, 2);
      ASSERT_EQ(run_steps(engine, in_place, 2), before);
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        AdamTensor& t = other.tensors[k];
        t.grad = current.tensors[k].grad;
        t.from.param = current.p[k].data();
        t.from.exp_avg = current.m[k].data();
        t.from.exp_avg_sq = current.v[k].data();
        t.from.max_exp_avg_sq = current.vmax[k].data();
      }
      StepOptions o;
      o.step = 3;
      ASSERT_TRUE(engine.step(amsgrad_hyper(true), o, other.tensors).ok());
      ASSERT_TRUE(engine.step(amsgrad_hyper(true), o, in_place.tensors).ok());
      EXPECT_EQ(current.bytes(), before) << dtype_name(state) << ", tile " << tile;
      EXPECT_EQ(other.bytes(), in_place.bytes()) << dtype_name(state) << ", tile " << tile;
    }
  }
}

TEST_P(AmsgradIsa, MaximizeEqualsDescentOnTheNegatedGradient) {
  CpuAdam engine = make_engine(isa(), 2, 1000);
  for (DType grad : {DType::f32, DType::f16, DType::bf16}) {
    Model up({5000, 77, 1}, grad, DType::f32, 3), down({5000, 77, 1}, grad, DType::f32, 3);
    for (test::GradData& g : down.g) {
      const std::size_t elem = dtype_size(grad);
      for (std::size_t b = elem - 1; b < g.bytes.size(); b += elem) g.bytes[b] ^= 0x80;
    }
    EXPECT_EQ(run_steps(engine, up, 3, true), run_steps(engine, down, 3)) << dtype_name(grad);
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, AmsgradIsa, ::testing::ValuesIn(test::kBuildIsas), test::isa_test_name);

// Bad arguments: invalid_argument naming the fault, and not one byte of state changed.
class AmsgradErrors : public ::testing::Test {
 protected:
  Model model{{1000, 500}, DType::f32, DType::f32, 3};
  CpuAdam engine = make_engine("auto", 2, 128);
  AdamHyper hyper = amsgrad_hyper(true);

  void expect_refused(const std::string& fragment) {
    const auto before = model.bytes();
    const Status s = engine.step(hyper, StepOptions{}, model.tensors);
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
    EXPECT_NE(s.message().find(fragment), std::string::npos) << "message: " << s.message();
    EXPECT_EQ(model.bytes(), before) << "state changed by a refused step";
  }
};

TEST_F(AmsgradErrors, MissingMaximum) {
  model.tensors[1].max_exp_avg_sq = nullptr;
  expect_refused("tensor 1: max_exp_avg_sq is null with n = 500 and amsgrad");
}

TEST_F(AmsgradErrors, Int8MomentsAreRefused) {
  model.tensors[0].state_dtype = DType::i8;
  expect_refused("tensor 0: amsgrad with state dtype i8 is not supported");
}

TEST_F(AmsgradErrors, MaximumOverlapsAnotherArray) {
  model.tensors[0].max_exp_avg_sq = model.tensors[0].exp_avg_sq;
  expect_refused("overlaps");
}

TEST_F(AmsgradErrors, SourceNeedsTheMaximum) {
  std::vector<float> p(1000), m(1000), v(1000);
  model.tensors[0].from.param = p.data();
  model.tensors[0].from.exp_avg = m.data();
  model.tensors[0].from.exp_avg_sq = v.data();
  expect_refused("tensor 0: from.max_exp_avg_sq is null while from.param is set");
}

TEST_F(AmsgradErrors, BadBetaStillRefused) {
  hyper.beta1 = 1.0f;
  expect_refused("beta1");
}

}  // namespace
}  // namespace zoe
