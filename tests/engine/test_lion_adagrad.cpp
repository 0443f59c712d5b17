// Lion and Adagrad through CpuAdam, on every ISA this CPU runs: each step against a float64 transcription of
// the rule as torch writes it, bit-identical for any thread count and tile, out of place equal to in place,
// maximize equal to descent on the negated gradient, and refused arguments that change nothing.
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

enum class Rule { lion, adagrad };

const char* rule_name(Rule r) { return r == Rule::lion ? "Lion" : "Adagrad"; }

// The hyper-parameters both rules are tested with: weight decay and a gradient scale on, Adagrad's lr_decay
// too; lr large enough that the updates are far above p's rounding.
struct Hypers {
  LionHyper lion;
  AdagradHyper adagrad;
  Hypers() {
    lion.lr = 1e-3f;
    lion.weight_decay = 0.1f;
    adagrad.lr = 1e-2f;
    adagrad.lr_decay = 0.01f;
    adagrad.weight_decay = 0.05f;
  }
};

Status step(CpuAdam& engine, Rule rule, const Hypers& h, const StepOptions& o, std::span<const OneStateTensor> t) {
  return rule == Rule::lion ? engine.step(h.lion, o, t) : engine.step(h.adagrad, o, t);
}

// Owns the arrays of tensors of the given sizes. The state starts as a caller would leave it after some
// steps (Lion's m in [-1e-2, 1e-2), Adagrad's sum in [0, 1e-4)), so that every term of the rules counts.
struct Model {
  std::vector<std::vector<float>> p, s;  // s holds a bf16 state two to a float
  std::vector<test::GradData> g;
  std::vector<std::vector<std::uint16_t>> out;
  std::vector<OneStateTensor> tensors;
  DType state;

  Model(const std::vector<std::size_t>& sizes, Rule rule, DType grad, DType state_dtype, bool with_out,
        std::uint64_t seed)
      : state(state_dtype) {
    Random rng(seed);
    for (std::size_t n : sizes) {
      p.emplace_back(n);
      s.emplace_back((n * dtype_size(state) + 3) / 4, 0.0f);
      out.emplace_back(n, 0);
      for (float& x : p.back()) x = static_cast<float>(rng.uniform(-1, 1));
      for (std::size_t i = 0; i < n; ++i) {
        set_state(s.size() - 1, i, static_cast<float>(rule == Rule::lion ? rng.uniform(-1e-2, 1e-2) : rng.uniform(0, 1e-4)));
      }
      g.push_back(test::make_grad(grad, n, rng, 1e-2));
    }
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      OneStateTensor t;
      t.param = p[k].data();
      t.state = s[k].data();
      t.state_dtype = state;
      t.grad = g[k].bytes.data();
      t.grad_dtype = grad;
      t.out = with_out ? out[k].data() : nullptr;
      t.n = sizes[k];
      tensors.push_back(t);
    }
  }
  float state_at(std::size_t k, std::size_t i) const {
    if (state == DType::f32) return s[k][i];
    return bf16_to_float(reinterpret_cast<const std::uint16_t*>(s[k].data())[i]);
  }
  void set_state(std::size_t k, std::size_t i, float x) {
    if (state == DType::f32) {
      s[k][i] = x;
    } else {
      reinterpret_cast<std::uint16_t*>(s[k].data())[i] = float_to_bf16(x);
    }
  }
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> b;
    auto append = [&b](const void* data, std::size_t size) {
      const auto* c = static_cast<const unsigned char*>(data);
      b.insert(b.end(), c, c + size);
    };
    for (std::size_t k = 0; k < p.size(); ++k) {
      append(p[k].data(), p[k].size() * 4);
      append(s[k].data(), s[k].size() * 4);
      append(out[k].data(), out[k].size() * 2);
    }
    return b;
  }
};

// One fp32 rounding, relative. Each kernel result is a handful of fp32 operations on terms no larger than
// the `scale` the check names, so it lies within a few of these of the float64 value: kUlps of them.
constexpr double kUlp = 1.0 / (1 << 24);
constexpr double kUlps = 16;
// A bf16 state is stored rounded to nearest even: half a unit of its 8 significant bits, at most 2^-8 of the
// value, beside which the fp32 error before the rounding counts too.
constexpr double kBf16Rounding = 1.0 / (1 << 8) + 16.0 / (1 << 24);

bool near(double got, double want, double scale, double rel) { return std::fabs(got - want) <= rel * scale + 1e-30; }

// The float64 value of one element's step, as torch writes the rule, from the state the kernel read.
struct Expected {
  double p, s, p_scale, s_scale;
  bool sign_ambiguous = false;  // Lion: the update's sign is within rounding of 0; p may take any of the three
  double p_if[3] = {};          // Lion: p for u = -1, 0, 1
};

Expected lion_reference(const LionHyper& h, const StepOptions& o, double p, double m, double g) {
  g *= o.grad_scale;
  const double b1 = h.beta1, b2 = h.beta2, lr = h.lr;
  const double c1 = b1 * m, c2 = (1 - b1) * g;
  const double c = c1 + c2;
  Expected e;
  const double decayed = p * (1 - lr * h.weight_decay);
  for (int u = -1; u <= 1; ++u) e.p_if[u + 1] = decayed - lr * u;
  e.p = e.p_if[(c > 0) - (c < 0) + 1];
  e.sign_ambiguous = std::fabs(c) <= 4 * kUlp * (std::fabs(c1) + std::fabs(c2));
  e.p_scale = std::fabs(p) + lr;
  e.s = b2 * m + (1 - b2) * g;
  e.s_scale = std::fabs(b2 * m) + std::fabs((1 - b2) * g);
  return e;
}

Expected adagrad_reference(const AdagradHyper& h, const StepOptions& o, double p, double sum, double g) {
  g *= o.grad_scale;
  const double g_scale = std::fabs(g) + std::fabs(h.weight_decay * p);
  if (h.weight_decay != 0) g += double(h.weight_decay) * p;
  const double clr = double(h.lr) / (1 + double(o.step - 1) * h.lr_decay);
  Expected e;
  e.s = sum + g * g;
  e.s_scale = sum + g_scale * g_scale;
  const double update = clr * g / (std::sqrt(e.s) + h.eps);
  e.p = p - update;
  e.p_scale = std::fabs(p) + std::fabs(clr * g_scale / (std::sqrt(e.s) + h.eps));
  return e;
}

class RulesIsa : public test::EngineIsa {};

// Five steps of each rule for every gradient dtype, state dtype, with and without the weight copy, on sizes
// around the vector widths: each element of each step against the float64 rule from the state it read.
TEST_P(RulesIsa, EachStepMatchesTheRuleAsTorchWritesIt) {
  const std::vector<std::size_t> sizes = {1, 3, 7, 8, 9, 15, 16, 17, 33, 64, 1000, 4097};
  CpuAdam engine = make_engine(isa(), 2, 512);
  const Hypers h;
  std::size_t ambiguous = 0, checked = 0;
  for (Rule rule : {Rule::lion, Rule::adagrad}) {
    for (DType grad : {DType::f32, DType::f16, DType::bf16}) {
      for (DType state : {DType::f32, DType::bf16}) {
        for (bool with_out : {false, true}) {
          SCOPED_TRACE(std::string(rule_name(rule)) + ", " + std::string(dtype_name(grad)) + " gradients, " +
                       std::string(dtype_name(state)) + " state" + (with_out ? ", bf16 copy" : ""));
          Model model(sizes, rule, grad, state, with_out, 11);
          for (int s = 1; s <= 5; ++s) {
            const Model before = model;
            StepOptions o;
            o.step = s;
            o.grad_scale = 0.75f;
            ASSERT_TRUE(step(engine, rule, h, o, model.tensors).ok());
            const double s_rel = state == DType::bf16 ? kBf16Rounding : kUlps * kUlp;
            for (std::size_t k = 0; k < sizes.size(); ++k) {
              for (std::size_t i = 0; i < sizes[k]; ++i) {
                const double p0 = before.p[k][i], s0 = before.state_at(k, i), g = model.g[k].values[i];
                const Expected e = rule == Rule::lion ? lion_reference(h.lion, o, p0, s0, g)
                                                      : adagrad_reference(h.adagrad, o, p0, s0, g);
                const double got = model.p[k][i];
                bool p_ok = near(got, e.p, e.p_scale, kUlps * kUlp);
                if (!p_ok && e.sign_ambiguous) {
                  ++ambiguous;
                  for (double alt : e.p_if) p_ok = p_ok || near(got, alt, e.p_scale, kUlps * kUlp);
                }
                ASSERT_TRUE(p_ok) << "p, tensor " << k << " element " << i << " step " << s << ": " << got << " vs "
                                  << e.p;
                ASSERT_TRUE(near(model.state_at(k, i), e.s, e.s_scale, s_rel))
                    << "state, tensor " << k << " element " << i << " step " << s << ": " << model.state_at(k, i)
                    << " vs " << e.s;
                if (with_out) {
                  ASSERT_EQ(model.out[k][i], float_to_bf16(model.p[k][i]));
                }
                ++checked;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_LT(ambiguous * 1000, checked) << "Lion's sign within rounding of 0 should be rare";
}

// Adagrad after 20 steps within 1e-5 of torch's rule carried in float64 all the way (issue 53's bound for p);
// the sum, a sum of positive terms, within a few fp32 roundings per step.
constexpr test::Tolerance kSumTol{1e-5, 1e-12};
TEST_P(RulesIsa, AdagradTwentyStepsWithinTorchsBound) {
  const std::size_t n = 4097;
  CpuAdam engine = make_engine(isa(), 2, 256);
  const Hypers h;
  Model model({n}, Rule::adagrad, DType::bf16, DType::f32, false, 5);
  std::vector<double> p(model.p[0].begin(), model.p[0].end()), sum(n);
  for (std::size_t i = 0; i < n; ++i) sum[i] = model.state_at(0, i);
  Random rng(21);
  for (int s = 1; s <= 20; ++s) {
    test::GradData g = test::make_grad(DType::bf16, n, rng, 1e-2);
    model.tensors[0].grad = g.bytes.data();
    StepOptions o;
    o.step = s;
    ASSERT_TRUE(engine.step(h.adagrad, o, model.tensors).ok());
    for (std::size_t i = 0; i < n; ++i) {
      const Expected e = adagrad_reference(h.adagrad, o, p[i], sum[i], g.values[i]);
      p[i] = e.p;
      sum[i] = e.s;
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(model.p[0][i], p[i], 1e-5) << i;
    ASSERT_TRUE(kSumTol.accepts(model.state_at(0, i), sum[i])) << i;
  }
}

std::vector<unsigned char> run_steps(CpuAdam& engine, Rule rule, Model& model, int steps, bool maximize = false) {
  Hypers h;
  h.lion.maximize = h.adagrad.maximize = maximize;
  for (int s = 1; s <= steps; ++s) {
    StepOptions o;
    o.step = s;
    o.grad_scale = 0.5f;
    EXPECT_TRUE(step(engine, rule, h, o, model.tensors).ok());
  }
  return model.bytes();
}

TEST_P(RulesIsa, BitIdenticalForAnyThreadCountAndTile) {
  const std::vector<std::size_t> sizes = {100'003, 77};
  CpuAdam one = make_engine(isa(), 1, 1 << 20);
  for (Rule rule : {Rule::lion, Rule::adagrad}) {
    for (DType state : {DType::f32, DType::bf16}) {
      Model base(sizes, rule, DType::bf16, state, true, 1);
      const auto want = run_steps(one, rule, base, 4);
      for (int threads : {1, 2, 3}) {
        for (std::size_t tile : {std::size_t(1), std::size_t(7), std::size_t(1000), std::size_t(65536)}) {
          CpuAdam engine = make_engine(isa(), threads, tile);
          Model model(sizes, rule, DType::bf16, state, true, 1);
          EXPECT_EQ(run_steps(engine, rule, model, 4), want)
              << rule_name(rule) << ", " << dtype_name(state) << ", " << threads << " threads, tile " << tile;
        }
      }
    }
  }
}

// A step that reads one state set and writes the other (OneStateSource) writes the bits the step in place
// writes and leaves the set it read as it was; the offsets of the arrays differ so that streaming stores
// take their staged head.
TEST_P(RulesIsa, StepIntoTheOtherSetEqualsTheStepInPlace) {
  const std::vector<std::size_t> sizes = {100'003, 77, 4096};
  for (Rule rule : {Rule::lion, Rule::adagrad}) {
    for (DType state : {DType::f32, DType::bf16}) {
      for (std::size_t tile : {std::size_t(7), std::size_t(1000), std::size_t(65536)}) {
        CpuAdam engine = make_engine(isa(), 2, tile);
        Model current(sizes, rule, DType::bf16, state, true, 1), in_place(sizes, rule, DType::bf16, state, true, 1);
        Model other(sizes, rule, DType::bf16, state, true, 9);
        const auto before = run_steps(engine, rule, current, 2);
        ASSERT_EQ(run_steps(engine, rule, in_place, 2), before);
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          OneStateTensor& t = other.tensors[k];
          t.grad = current.tensors[k].grad;
          t.from = OneStateSource{current.p[k].data(), current.s[k].data()};
        }
        const Hypers h;
        StepOptions o;
        o.step = 3;
        ASSERT_TRUE(step(engine, rule, h, o, other.tensors).ok());
        ASSERT_TRUE(step(engine, rule, h, o, in_place.tensors).ok());
        EXPECT_EQ(current.bytes(), before) << rule_name(rule) << ", " << dtype_name(state) << ", tile " << tile;
        EXPECT_EQ(other.bytes(), in_place.bytes()) << rule_name(rule) << ", " << dtype_name(state) << ", tile " << tile;
      }
    }
  }
}

// maximize: the step with g ascends exactly as the plain step with -g descends, for every kernel.
TEST_P(RulesIsa, MaximizeEqualsDescentOnTheNegatedGradient) {
  const std::vector<std::size_t> sizes = {5000, 77, 1};
  CpuAdam engine = make_engine(isa(), 2, 1000);
  for (Rule rule : {Rule::lion, Rule::adagrad}) {
    for (DType grad : {DType::f32, DType::f16, DType::bf16}) {
      for (DType state : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(std::string(rule_name(rule)) + ", " + std::string(dtype_name(grad)) + " gradients, " +
                     std::string(dtype_name(state)) + " state");
        Model up(sizes, rule, grad, state, true, 3), down(sizes, rule, grad, state, true, 3);
        Model plain(sizes, rule, grad, state, true, 3);
        for (test::GradData& g : down.g) {  // -g: the sign bit of every element flipped
          const std::size_t elem = dtype_size(grad);
          for (std::size_t b = elem - 1; b < g.bytes.size(); b += elem) g.bytes[b] ^= 0x80;
        }
        const std::vector<unsigned char> ascended = run_steps(engine, rule, up, 3, true);
        EXPECT_EQ(ascended, run_steps(engine, rule, down, 3));
        (void)run_steps(engine, rule, plain, 3);
        EXPECT_NE(up.bytes(), plain.bytes());  // maximize is really in effect
      }
    }
  }
}

// torch.sign(0) is 0: with m = 0 and g = 0, Lion only decays p; a NaN gradient gives u = 0 as torch.sign(NaN)
// does (the moment becomes NaN). Adagrad without weight decay never computes 0 * p: an infinite weight stays.
TEST_P(RulesIsa, SignOfZeroAndNaNAndNoZeroTimesInfinity) {
  CpuAdam engine = make_engine(isa(), 1, 1024);
  const std::size_t n = 37;
  std::vector<float> p(n, 0.5f), m(n, 0.0f), g(n, 0.0f);
  g[3] = NAN;
  OneStateTensor t;
  t.param = p.data();
  t.state = m.data();
  t.grad = g.data();
  t.n = n;
  LionHyper lion;
  lion.lr = 0.25f;
  lion.weight_decay = 0.5f;
  ASSERT_TRUE(engine.step(lion, StepOptions{}, t).ok());
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(p[i], 0.5f * (1.0f - 0.125f)) << i;
  EXPECT_TRUE(std::isnan(m[3]));
  EXPECT_EQ(m[4], 0.0f);

  std::vector<float> q(n, INFINITY), sum(n, 0.0f), gq(n, 1e-3f);
  t.param = q.data();
  t.state = sum.data();
  t.grad = gq.data();
  AdagradHyper adagrad;  // weight_decay 0
  ASSERT_TRUE(engine.step(adagrad, StepOptions{}, t).ok());
  for (float x : q) EXPECT_EQ(x, INFINITY);
}

INSTANTIATE_TEST_SUITE_P(Isas, RulesIsa, ::testing::ValuesIn(test::kBuildIsas), test::isa_test_name);

// Bad arguments: invalid_argument naming the fault, and not one byte of state changed.
class RulesErrors : public ::testing::Test {
 protected:
  Model model{{1000, 500}, Rule::lion, DType::f32, DType::f32, true, 3};
  CpuAdam engine = make_engine("auto", 2, 128);
  LionHyper lion;
  AdagradHyper adagrad;
  StepOptions options;

  void expect_refused(const std::string& fragment, StatusCode code = StatusCode::invalid_argument) {
    for (Rule rule : {Rule::lion, Rule::adagrad}) {
      const auto before = model.bytes();
      const Status s = rule == Rule::lion ? engine.step(lion, options, model.tensors)
                                          : engine.step(adagrad, options, model.tensors);
      EXPECT_EQ(s.code(), code) << rule_name(rule) << ": " << s.to_string();
      EXPECT_NE(s.message().find(fragment), std::string::npos) << rule_name(rule) << ": " << s.message();
      EXPECT_EQ(model.bytes(), before) << rule_name(rule) << ": state changed by a refused step";
    }
  }
};

TEST_F(RulesErrors, LionHyperParametersOutOfRange) {
  const LionHyper good = lion;
  for (auto [bad, fragment] : std::vector<std::pair<LionHyper, std::string>>{
           {[&] { LionHyper h = good; h.lr = -1e-4f; return h; }(), "lr = "},
           {[&] { LionHyper h = good; h.lr = NAN; return h; }(), "lr = "},
           {[&] { LionHyper h = good; h.beta1 = 1.0f; return h; }(), "need 0 <= beta1 < 1"},
           {[&] { LionHyper h = good; h.beta2 = -0.1f; return h; }(), "need 0 <= beta2 < 1"},
           {[&] { LionHyper h = good; h.weight_decay = -1.0f; return h; }(), "weight_decay = "},
           {[&] { LionHyper h = good; h.weight_decay = INFINITY; return h; }(), "weight_decay = "}}) {
    const auto before = model.bytes();
    const Status s = engine.step(bad, options, model.tensors);
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
    EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
    EXPECT_EQ(CpuAdam::validate(bad).code(), StatusCode::invalid_argument);
    EXPECT_EQ(model.bytes(), before);
  }
  EXPECT_TRUE(CpuAdam::validate(good).ok());
}

TEST_F(RulesErrors, AdagradHyperParametersOutOfRange) {
  const AdagradHyper good = adagrad;
  for (auto [bad, fragment] : std::vector<std::pair<AdagradHyper, std::string>>{
           {[&] { AdagradHyper h = good; h.lr = -1e-2f; return h; }(), "lr = "},
           {[&] { AdagradHyper h = good; h.lr_decay = -0.5f; return h; }(), "lr_decay = "},
           {[&] { AdagradHyper h = good; h.weight_decay = -1.0f; return h; }(), "weight_decay = "},
           {[&] { AdagradHyper h = good; h.eps = -1e-10f; return h; }(), "eps = "},
           {[&] { AdagradHyper h = good; h.eps = NAN; return h; }(), "eps = "}}) {
    const auto before = model.bytes();
    const Status s = engine.step(bad, options, model.tensors);
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
    EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
    EXPECT_EQ(CpuAdam::validate(bad).code(), StatusCode::invalid_argument);
    EXPECT_EQ(model.bytes(), before);
  }
  EXPECT_TRUE(CpuAdam::validate(good).ok());
}

TEST_F(RulesErrors, StepBelowOneAndNonFiniteScale) {
  options.step = 0;
  expect_refused("step = 0");
  options.step = 1;
  options.grad_scale = NAN;
  expect_refused("grad_scale");
}

TEST_F(RulesErrors, NullStateAndInt8State) {
  model.tensors[1].state = nullptr;
  expect_refused("tensor 1: state is null with n = 500");
  model.tensors[1].state = model.s[1].data();
  // i8: Lion's state takes the 8-bit code and needs its block scales; Adagrad's sum has no code.
  model.tensors[0].state_dtype = DType::i8;
  const auto before = model.bytes();
  const Status lion_i8 = engine.step(lion, options, model.tensors);
  EXPECT_NE(lion_i8.message().find("tensor 0: state_scale is null with state dtype i8"), std::string::npos)
      << lion_i8.to_string();
  const Status adagrad_i8 = engine.step(adagrad, options, model.tensors);
  EXPECT_NE(adagrad_i8.message().find("tensor 0: state dtype i8 is invalid: Adagrad's state"), std::string::npos)
      << adagrad_i8.to_string();
  EXPECT_EQ(model.bytes(), before);
  const std::vector<OneStateTensor> i8 = {model.tensors[0]};
  const Status ceiling = engine.streams_pass(i8);
  EXPECT_NE(ceiling.message().find("state dtype i8 is invalid: the one-state ceiling"), std::string::npos)
      << ceiling.to_string();
}

TEST_F(RulesErrors, OverlapsAndIncompleteSource) {
  model.tensors[0].state = model.tensors[0].param + 10;
  expect_refused("overlaps");
  model.tensors[0].state = model.s[0].data();
  std::vector<float> p(1000);
  model.tensors[0].from.param = p.data();
  expect_refused("tensor 0: from.state is null while from.param is set");
  model.tensors[0].from.state = model.tensors[1].state;
  expect_refused("overlaps");
}

TEST_F(RulesErrors, FiniteCheckRefusesNaNAndChangesNothing) {
  reinterpret_cast<float*>(model.g[1].bytes.data())[321] = NAN;
  options.check_finite = true;
  expect_refused("tensor 1 at element 321", StatusCode::non_finite);
}

}  // namespace
}  // namespace zoe
