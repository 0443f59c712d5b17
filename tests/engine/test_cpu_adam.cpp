// The CpuAdam engine: tiling and threads never change a bit, the multi-tensor form equals separate calls,
// the forced ISA is the one that runs, and bad input changes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "simd/dispatch.h"
#include "tests/engine/engine_isa.h"
#include "tests/reference.h"
#include "zoe/adam.h"

namespace zoe {
namespace {

using test::EngineIsa;
using test::make_engine;

using test::Random;

// Owns the state of a set of tensors of the given sizes.
struct Model {
  std::vector<std::vector<float>> p, m, v;  // m, v hold bf16 moments two to a float (i8: four) with that state
  std::vector<std::vector<float>> ms, vs;   // state i8: the block scales
  std::vector<std::vector<unsigned char>> g;
  std::vector<std::vector<std::uint16_t>> out;
  std::vector<AdamTensor> tensors;

  Model(const std::vector<std::size_t>& sizes, DType grad, bool with_out, std::uint64_t seed,
        DType state = DType::f32) {
    Random rng(seed);
    for (std::size_t n : sizes) {
      const std::size_t moment_floats = (n * dtype_size(state) + 3) / 4;
      p.emplace_back(n);
      m.emplace_back(moment_floats, 0.0f);
      v.emplace_back(moment_floats, 0.0f);
      ms.emplace_back(state == DType::i8 ? moment_blocks(n) : 0, 0.0f);
      vs.emplace_back(state == DType::i8 ? moment_blocks(n) : 0, 0.0f);
      out.emplace_back(n, 0);
      for (float& x : p.back()) x = static_cast<float>(rng.uniform(-1, 1));
      g.push_back(test::make_grad(grad, n, rng, 1e-2).bytes);
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      AdamTensor t;
      t.param = p[i].data();
      t.exp_avg = m[i].data();
      t.exp_avg_sq = v[i].data();
      t.state_dtype = state;
      t.grad = g[i].data();
      t.grad_dtype = grad;
      t.out = with_out ? out[i].data() : nullptr;
      t.out_dtype = DType::bf16;
      t.n = sizes[i];
      if (state == DType::i8) {
        t.exp_avg_scale = ms[i].data();
        t.exp_avg_sq_scale = vs[i].data();
      }
      tensors.push_back(t);
    }
  }
  // All state, concatenated, as bytes.
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> b;
    auto append = [&b](const void* data, std::size_t size) {
      const auto* c = static_cast<const unsigned char*>(data);
      b.insert(b.end(), c, c + size);
    };
    for (std::size_t i = 0; i < p.size(); ++i) {
      append(p[i].data(), p[i].size() * 4);
      append(m[i].data(), m[i].size() * 4);
      append(v[i].data(), v[i].size() * 4);
      append(out[i].data(), out[i].size() * 2);
      append(ms[i].data(), ms[i].size() * 4);
      append(vs[i].data(), vs[i].size() * 4);
    }
    return b;
  }
};


std::vector<unsigned char> run_steps(CpuAdam& engine, Model& model, int steps) {
  AdamHyper h;
  h.weight_decay = 0.01f;
  for (int s = 1; s <= steps; ++s) {
    StepOptions o;
    o.step = s;
    o.grad_scale = 0.5f;
    EXPECT_TRUE(engine.step(h, o, model.tensors).ok());
  }
  return model.bytes();
}


TEST_P(EngineIsa, BitIdenticalForAnyThreadCountAndTile) {
  const std::vector<std::size_t> sizes = {100'003};
  CpuAdam one = make_engine(isa(), 1, 1 << 20);
  Model base(sizes, DType::bf16, true, 1);
  const auto want = run_steps(one, base, 5);
  for (int threads : {1, 2, 3}) {
    for (std::size_t tile : {std::size_t(1), std::size_t(7), std::size_t(1000), std::size_t(4096), std::size_t(65536)}) {
      CpuAdam engine = make_engine(isa(), threads, tile);
      Model model(sizes, DType::bf16, true, 1);
      EXPECT_EQ(run_steps(engine, model, 5), want) << threads << " threads, tile " << tile;
    }
  }
}

TEST_P(EngineIsa, Bf16MomentsBitIdenticalForAnyThreadCountAndTile) {
  const std::vector<std::size_t> sizes = {100'003, 77};
  CpuAdam one = make_engine(isa(), 1, 1 << 20);
  Model base(sizes, DType::bf16, true, 1, DType::bf16);
  const auto want = run_steps(one, base, 5);
  Model fp32(sizes, DType::bf16, true, 1);
  EXPECT_NE(run_steps(one, fp32, 5), want);  // the moments' dtype is really in effect
  for (int threads : {1, 2, 3}) {
    for (std::size_t tile : {std::size_t(1), std::size_t(7), std::size_t(1000), std::size_t(65536)}) {
      CpuAdam engine = make_engine(isa(), threads, tile);
      Model model(sizes, DType::bf16, true, 1, DType::bf16);
      EXPECT_EQ(run_steps(engine, model, 5), want) << threads << " threads, tile " << tile;
    }
  }
}

// 8-bit moments: each block of 2048 is stepped whole by the tile its first element falls in, so tiles that
// cut blocks anywhere (1, 7, 1000 elements) give the same bits as one thread over everything.
TEST_P(EngineIsa, Int8MomentsBitIdenticalForAnyThreadCountAndTile) {
  const std::vector<std::size_t> sizes = {100'003, 77, 4096};
  CpuAdam one = make_engine(isa(), 1, 1 << 20);
  Model base(sizes, DType::bf16, true, 1, DType::i8);
  const auto want = run_steps(one, base, 5);
  Model bf16(sizes, DType::bf16, true, 1, DType::bf16);
  Model q8_p(sizes, DType::bf16, true, 1, DType::i8);
  (void)run_steps(one, q8_p, 5);
  (void)run_steps(one, bf16, 5);
  EXPECT_NE(q8_p.p, bf16.p);  // the moments' dtype is really in effect
  for (int threads : {1, 2, 3}) {
    for (std::size_t tile : {std::size_t(1), std::size_t(7), std::size_t(1000), std::size_t(65536)}) {
      CpuAdam engine = make_engine(isa(), threads, tile);
      Model model(sizes, DType::bf16, true, 1, DType::i8);
      EXPECT_EQ(run_steps(engine, model, 5), want) << threads << " threads, tile " << tile;
    }
  }
  Model no_scales(sizes, DType::bf16, true, 1, DType::i8);
  no_scales.tensors[1].exp_avg_sq_scale = nullptr;
  const Status s = one.step(AdamHyper{}, StepOptions{}, no_scales.tensors);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  EXPECT_NE(s.message().find("exp_avg_sq_scale is null"), std::string::npos) << s.to_string();
}

// A step that reads one state set and writes the other (AdamSource: the overlap schedule's speculation)
// writes the bits the step in place writes, and leaves the set it read byte for byte as it was — for every
// moment dtype and tilings that cut 8-bit blocks and vectors anywhere.
TEST_P(EngineIsa, StepIntoTheOtherSetEqualsTheStepInPlace) {
  const std::vector<std::size_t> sizes = {100'003, 77, 4096};
  for (DType state : {DType::f32, DType::bf16, DType::i8}) {
    for (std::size_t tile : {std::size_t(7), std::size_t(1000), std::size_t(65536)}) {
      CpuAdam engine = make_engine(isa(), 2, tile);
      Model current(sizes, DType::bf16, true, 1, state), in_place(sizes, DType::bf16, true, 1, state);
      Model other(sizes, DType::bf16, true, 9, state);  // the second set: other values before the step
      const auto before = run_steps(engine, current, 2);
      ASSERT_EQ(run_steps(engine, in_place, 2), before);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        AdamTensor& t = other.tensors[i];
        t.grad = current.tensors[i].grad;
        t.from = AdamSource{current.p[i].data(), current.m[i].data(), current.v[i].data(),
                            state == DType::i8 ? current.ms[i].data() : nullptr,
                            state == DType::i8 ? current.vs[i].data() : nullptr};
      }
      AdamHyper h;
      h.weight_decay = 0.01f;
      StepOptions o;
      o.step = 3;
      o.grad_scale = 0.5f;
      ASSERT_TRUE(engine.step(h, o, other.tensors).ok());
      ASSERT_TRUE(engine.step(h, o, in_place.tensors).ok());
      EXPECT_EQ(current.bytes(), before) << dtype_name(state) << ", tile " << tile;
      EXPECT_EQ(other.bytes(), in_place.bytes()) << dtype_name(state) << ", tile " << tile;
    }
  }
}

TEST_P(EngineIsa, ManyTensorsEqualOneCallPerTensor) {
  std::vector<std::size_t> sizes;
  for (std::size_t i = 0; i < 300; ++i) sizes.push_back(1 + (i * 37) % 200);
  sizes.push_back(0);
  sizes.push_back(70'001);
  CpuAdam engine = make_engine(isa(), 2, 1000);
  Model together(sizes, DType::f16, true, 2);
  const auto got = run_steps(engine, together, 3);

  Model separate(sizes, DType::f16, true, 2);
  AdamHyper h;
  h.weight_decay = 0.01f;
  for (int s = 1; s <= 3; ++s) {
    for (const AdamTensor& t : separate.tensors) {
      StepOptions o;
      o.step = s;
      o.grad_scale = 0.5f;
      ASSERT_TRUE(engine.step(h, o, t).ok());
    }
  }
  EXPECT_EQ(got, separate.bytes());
}

TEST_P(EngineIsa, ForcedIsaIsTheKernelThatRuns) {
  CpuAdam engine = make_engine(isa(), 1, 1024);
  EXPECT_EQ(engine.isa(), GetParam());
  EXPECT_EQ(engine.kernel(), isa());  // the name stored in the kernel table the engine calls
}

TEST_P(EngineIsa, ZoeIsaEnvironmentOverridesTheRequest) {
  setenv("ZOE_ISA", isa().c_str(), 1);
  Result<CpuAdam> e = CpuAdam::create({});  // asks for "auto"
  unsetenv("ZOE_ISA");
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_EQ(e->isa(), GetParam());
  EXPECT_EQ(e->kernel(), isa());
}

// maximize (torch's): the step with gradient g ascends exactly as the plain step with -g descends, in every
// kernel of this ISA (each gradient dtype, state dtype, with and without the 16-bit copy), for AdamW and for
// Adam's L2 decay (torch negates the gradient before adding weight_decay * p), with a gradient scale.
TEST_P(EngineIsa, MaximizeEqualsDescentOnTheNegatedGradient) {
  const std::vector<std::size_t> sizes = {5000, 77, 1};
  CpuAdam engine = make_engine(isa(), 2, 1000);
  for (DType grad : {DType::f32, DType::f16, DType::bf16}) {
    for (DType state : {DType::f32, DType::bf16, DType::i8}) {
      for (bool adamw : {true, false}) {
        std::string what(dtype_name(grad));
        what += " gradients, ";
        what += dtype_name(state);
        what += adamw ? " moments, AdamW" : " moments, Adam with L2";
        SCOPED_TRACE(what);
        Model up(sizes, grad, true, 3, state), down(sizes, grad, true, 3, state), plain(sizes, grad, true, 3, state);
        for (std::vector<unsigned char>& g : down.g) {  // -g: the sign bit of every element flipped
          const std::size_t elem = dtype_size(grad);
          for (std::size_t k = elem - 1; k < g.size(); k += elem) g[k] ^= 0x80;
        }
        auto run = [&](Model& model, bool maximize) {
          AdamHyper h;
          h.weight_decay = 0.05f;
          h.adamw = adamw;
          h.maximize = maximize;
          for (int s = 1; s <= 4; ++s) {
            StepOptions o;
            o.step = s;
            o.grad_scale = 0.37f;
            EXPECT_TRUE(engine.step(h, o, model.tensors).ok());
          }
          return model.bytes();
        };
        const std::vector<unsigned char> ascended = run(up, true);
        EXPECT_EQ(ascended, run(down, false));
        EXPECT_NE(ascended, run(plain, false));  // maximize is really in effect
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, EngineIsa, ::testing::ValuesIn(test::kBuildIsas),
                         test::isa_test_name);

TEST(Engine, AutoPicksTheBestSupportedIsa) {
  unsetenv("ZOE_ISA");
  CpuAdam engine = make_engine("auto", 1, 1024);
  EXPECT_EQ(engine.isa(), supported_isas().front());
}

TEST(Engine, UnknownIsaIsAnErrorNamingWhatTheCpuSupports) {
  setenv("ZOE_ISA", "sse9", 1);
  Result<CpuAdam> e = CpuAdam::create({});
  unsetenv("ZOE_ISA");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(e.status().message().find("ZOE_ISA=sse9"), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("scalar"), std::string::npos) << e.status().message();
}

TEST(Engine, AnExplicitIsaWinsOverZoeIsa) {
  const Isa best = supported_isas().front();
  if (best == Isa::scalar) GTEST_SKIP() << "this CPU runs only scalar: nothing to tell apart";
  setenv("ZOE_ISA", std::string(isa_name(best)).c_str(), 1);
  CpuAdamOptions o;
  o.isa = "scalar";
  Result<CpuAdam> e = CpuAdam::create(o);
  unsetenv("ZOE_ISA");
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_EQ(e->isa(), Isa::scalar);
}

TEST(Engine, AnExplicitUnknownIsaIsAnErrorWhateverZoeIsaSays) {
  setenv("ZOE_ISA", "scalar", 1);
  CpuAdamOptions o;
  o.isa = "sse9";
  Result<CpuAdam> e = CpuAdam::create(o);
  unsetenv("ZOE_ISA");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(e.status().message().find("requested ISA=sse9"), std::string::npos) << e.status().message();
}

TEST(Engine, AnUnknownZoeIsaIsAnErrorEvenBesideAnExplicitIsa) {
  setenv("ZOE_ISA", "sse9", 1);
  CpuAdamOptions o;
  o.isa = "scalar";
  Result<CpuAdam> e = CpuAdam::create(o);
  unsetenv("ZOE_ISA");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("ZOE_ISA=sse9"), std::string::npos) << e.status().message();
}

TEST(Engine, UnsupportedIsaIsAnError) {
  for (Isa isa : {Isa::avx512, Isa::avx2, Isa::sve, Isa::neon}) {  // each architecture's and the other's
    if (simd::isa_supported(isa)) continue;
    CpuAdamOptions o;
    o.isa = std::string(isa_name(isa));
    Result<CpuAdam> e = CpuAdam::create(o);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::unsupported);
    EXPECT_NE(e.status().message().find("not supported by this CPU"), std::string::npos);
  }
}

TEST(Engine, ZoeThreadsCapsAndRejectsGarbage) {
  setenv("ZOE_THREADS", "1", 1);
  Result<CpuAdam> capped = CpuAdam::create({});
  setenv("ZOE_THREADS", "two", 1);
  Result<CpuAdam> bad = CpuAdam::create({});
  setenv("ZOE_THREADS", "0", 1);
  Result<CpuAdam> zero = CpuAdam::create({});
  unsetenv("ZOE_THREADS");
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(capped->threads(), 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("ZOE_THREADS=two"), std::string::npos);
  EXPECT_FALSE(zero.ok());
}

// Bad arguments: an invalid_argument naming the fault, and not one byte of state changed.
class EngineErrors : public ::testing::Test {
 protected:
  Model model{{1000, 500}, DType::f32, true, 3};
  CpuAdam engine = make_engine("auto", 2, 128);
  AdamHyper hyper;
  StepOptions options;

  void expect_refused(const std::string& fragment, StatusCode code = StatusCode::invalid_argument) {
    const auto before = model.bytes();
    const Status s = engine.step(hyper, options, model.tensors);
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(fragment), std::string::npos) << "message: " << s.message();
    EXPECT_EQ(model.bytes(), before) << "state changed by a refused step";
  }
};

TEST_F(EngineErrors, NullPointerWithElements) {
  model.tensors[1].exp_avg = nullptr;
  expect_refused("tensor 1: exp_avg is null");
}

TEST_F(EngineErrors, NullIsFineWithZeroElements) {
  model.tensors[1] = AdamTensor{};
  EXPECT_TRUE(engine.step(hyper, options, model.tensors).ok());
}

TEST_F(EngineErrors, OverlappingOutputsInOneTensor) {
  model.tensors[0].exp_avg = model.tensors[0].param + 10;
  expect_refused("overlaps");
}

TEST_F(EngineErrors, OutputOverlapsAnotherTensorsGradient) {
  model.tensors[1].grad = model.tensors[0].param;
  expect_refused("overlaps");
}

TEST_F(EngineErrors, SourceNeedsEveryArrayAndMayNotOverlapAnOutput) {
  std::vector<float> p(1000), m(1000), v(1000);
  model.tensors[0].from.param = p.data();
  expect_refused("tensor 0: from.exp_avg is null while from.param is set");
  model.tensors[0].from.exp_avg = m.data();
  model.tensors[0].from.exp_avg_sq = v.data();
  EXPECT_TRUE(engine.step(hyper, options, model.tensors).ok());
  model.tensors[0].from.exp_avg_sq = model.tensors[1].exp_avg;
  expect_refused("overlaps");
}

TEST_F(EngineErrors, UnknownDtype) {
  model.tensors[0].grad_dtype = static_cast<DType>(7);
  expect_refused("grad dtype 7");
}

TEST_F(EngineErrors, StateDtypeIsFp32OrBf16) {
  model.tensors[1].state_dtype = DType::f16;
  expect_refused("tensor 1: state dtype f16 is invalid");
}

TEST_F(EngineErrors, OutDtypeMustBeSixteenBit) {
  model.tensors[0].out_dtype = DType::f32;
  expect_refused("out dtype f32");
}

TEST_F(EngineErrors, StepBelowOne) {
  options.step = 0;
  expect_refused("step = 0");
}

TEST_F(EngineErrors, NegativeLearningRate) {
  hyper.lr = -1e-3f;
  expect_refused("lr = ");
}

TEST_F(EngineErrors, NegativeEps) {
  hyper.eps = -1e-8f;
  expect_refused("eps = ");
}

TEST_F(EngineErrors, NanLearningRateAndBadBetas) {
  hyper.lr = NAN;
  expect_refused("lr = ");
  hyper.lr = 1e-3f;
  hyper.beta2 = 1.0f;
  expect_refused("beta2");
}

TEST_F(EngineErrors, FiniteCheckRefusesNaNAndChangesNothing) {
  reinterpret_cast<float*>(model.g[1].data())[321] = NAN;
  reinterpret_cast<float*>(model.g[1].data())[400] = INFINITY;
  options.check_finite = true;
  expect_refused("tensor 1 at element 321", StatusCode::non_finite);
  expect_refused("2 NaN/Inf", StatusCode::non_finite);
}

TEST_F(EngineErrors, WithoutFiniteCheckNaNPropagatesAsInTorch) {
  reinterpret_cast<float*>(model.g[1].data())[321] = NAN;
  ASSERT_TRUE(engine.step(hyper, options, model.tensors).ok());
  EXPECT_TRUE(std::isnan(model.p[1][321]));
  EXPECT_FALSE(std::isnan(model.p[1][320]));
  EXPECT_FALSE(std::isnan(model.p[0][321]));
}

TEST(Engine, MatchesReferenceThroughThePublicApi) {
  Model model({4097}, DType::bf16, false, 9);
  test::RefState ref{std::vector<double>(model.p[0].begin(), model.p[0].end()), std::vector<double>(4097, 0.0),
                     std::vector<double>(4097, 0.0)};
  CpuAdam engine = make_engine("auto", 2, 256);
  AdamHyper h;
  h.weight_decay = 0.05f;
  Random rng(77);
  for (int s = 1; s <= 20; ++s) {
    test::GradData g = test::make_grad(DType::bf16, 4097, rng, 1e-2);
    model.tensors[0].grad = g.bytes.data();
    StepOptions o;
    o.step = s;
    ASSERT_TRUE(engine.step(h, o, model.tensors).ok());
    test::reference_step(h, o, ref, g.values);
  }
  for (std::size_t i = 0; i < 4097; ++i) {
    ASSERT_TRUE(test::kParamTol.accepts(model.p[0][i], ref.p[i])) << i;
    ASSERT_TRUE(test::kExpAvgTol.accepts(model.m[0][i], ref.m[i])) << i;
    ASSERT_TRUE(test::kExpAvgSqTol.accepts(model.v[0][i], ref.v[i])) << i;
  }
}

}  // namespace
}  // namespace zoe
