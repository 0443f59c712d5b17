// CpuAdam::accumulate, gradient accumulation on the engine's threads: the float64 oracle bit for bit through
// the public API, no bit changed by the thread count or the tile, and bad input refused with nothing changed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "simd/dispatch.h"
#include "tests/engine/engine_isa.h"
#include "tests/reference.h"
#include "zoe/adam.h"

namespace zoe {
namespace {

using test::make_engine;

using test::Random;


// Accumulators and one micro-batch's gradients for tensors of the given sizes and gradient dtypes.
struct Batch {
  std::vector<std::vector<float>> acc;
  std::vector<test::GradData> grads;
  std::vector<AccumulateTensor> tensors;

  Batch(const std::vector<std::size_t>& sizes, const std::vector<DType>& dtypes) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      acc.emplace_back(sizes[i], 0.0f);
      grads.emplace_back();
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      tensors.push_back({acc[i].data(), nullptr, dtypes[i % dtypes.size()], sizes[i]});
    }
  }
  // New gradients for the next micro-batch, uniform in [-1, 1) (any scale: the addition's rounding is
  // relative).
  void fill_grads(Random& rng) {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      grads[i] = test::make_grad(tensors[i].grad_dtype, tensors[i].n, rng, 1.0);
      tensors[i].grad = grads[i].bytes.data();
    }
  }
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> b;
    for (std::size_t i = 0; i < acc.size(); ++i) {
      const auto* a = reinterpret_cast<const unsigned char*>(acc[i].data());
      b.insert(b.end(), a, a + acc[i].size() * 4);
      b.insert(b.end(), grads[i].bytes.begin(), grads[i].bytes.end());
    }
    return b;
  }
};

const std::vector<std::size_t> kSizes = {100'003, 0, 17, 4096, 1};
const std::vector<DType> kDtypes = {DType::bf16, DType::f32, DType::f16};

AccumulateOptions options(bool first, bool zero_source) {
  AccumulateOptions o;
  o.first = first;
  o.zero_source = zero_source;
  return o;
}

// Four micro-batches (the first with `first`), zeroing the source in every other one; all bytes after.
std::vector<unsigned char> accumulate_four(CpuAdam& engine, Batch& batch) {
  Random rng(21);
  for (int k = 0; k < 4; ++k) {
    batch.fill_grads(rng);
    EXPECT_TRUE(engine.accumulate(batch.tensors, options(k == 0, k % 2 == 1)).ok());
  }
  return batch.bytes();
}

class AccumulateIsa : public test::EngineIsa {};

// Each fp32 addition is one correctly rounded IEEE addition, and float(double(a) + double(b)) is that value
// (double's 53 bits >= 2 x 24 + 2: Figueroa, "When is double rounding innocuous?", 1995), so the oracle
// equals the engine bit for bit after every micro-batch.
TEST_P(AccumulateIsa, MatchesTheOracleBitForBitThroughThePublicApi) {
  CpuAdam engine = make_engine(isa(), 2, 1000);
  Batch batch(kSizes, kDtypes);
  for (auto& a : batch.acc) std::fill(a.begin(), a.end(), NAN);  // the first micro-batch must not read it
  std::vector<std::vector<float>> want(kSizes.size());
  Random rng(5);
  for (int k = 0; k < 5; ++k) {
    batch.fill_grads(rng);
    std::vector<std::vector<unsigned char>> made;
    for (const test::GradData& g : batch.grads) made.push_back(g.bytes);
    const bool zero_source = k >= 3;
    ASSERT_TRUE(engine.accumulate(batch.tensors, options(k == 0, zero_source)).ok());
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      want[t].resize(kSizes[t]);
      for (std::size_t i = 0; i < kSizes[t]; ++i) {
        const double g = batch.grads[t].values[i];
        want[t][i] = k == 0 ? static_cast<float>(g) : static_cast<float>(static_cast<double>(want[t][i]) + g);
        ASSERT_EQ(std::memcmp(&batch.acc[t][i], &want[t][i], 4), 0)
            << "tensor " << t << " acc[" << i << "] = " << batch.acc[t][i] << ", oracle " << want[t][i]
            << " after micro-batch " << k;
      }
      // Zeroed, all-zero bytes are +0 in every dtype; otherwise the gradients are only read.
      const std::vector<unsigned char> want_grad =
          zero_source ? std::vector<unsigned char>(made[t].size(), 0) : made[t];
      ASSERT_EQ(batch.grads[t].bytes, want_grad) << "tensor " << t << " grad after micro-batch " << k;
    }
  }
}

TEST_P(AccumulateIsa, BitIdenticalForAnyThreadCountAndTile) {
  CpuAdam one = make_engine(isa(), 1, 1 << 20);
  Batch base(kSizes, kDtypes);
  const auto want = accumulate_four(one, base);
  for (int threads : {1, 2}) {
    for (std::size_t tile : {std::size_t(1), std::size_t(7), std::size_t(1000), std::size_t(65536)}) {
      CpuAdam engine = make_engine(isa(), threads, tile);
      Batch batch(kSizes, kDtypes);
      EXPECT_EQ(accumulate_four(engine, batch), want) << threads << " threads, tile " << tile;
    }
  }
}

TEST_P(AccumulateIsa, StreamsPassCoversTheSameElements) {
  CpuAdam engine = make_engine(isa(), 2, 1000);
  Batch batch(kSizes, kDtypes);
  Random rng(6);
  batch.fill_grads(rng);
  ASSERT_TRUE(engine.accumulate_streams_pass(batch.tensors, options(false, true)).ok());
  for (const test::GradData& g : batch.grads) {
    for (unsigned char byte : g.bytes) ASSERT_EQ(byte, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, AccumulateIsa, ::testing::ValuesIn(test::kBuildIsas),
                         test::isa_test_name);

TEST(Accumulate, NanAndInfPropagateAsIeeeAddition) {
  CpuAdam engine = make_engine("auto", 2, 16);
  std::vector<float> acc = {1.0f, NAN, INFINITY, INFINITY, 2.0f, -1.0f};
  std::vector<float> grad = {NAN, 1.0f, -INFINITY, 1.0f, INFINITY, 1.0f};
  ASSERT_TRUE(engine.accumulate(AccumulateTensor{acc.data(), grad.data(), DType::f32, acc.size()}).ok());
  EXPECT_TRUE(std::isnan(acc[0]));
  EXPECT_TRUE(std::isnan(acc[1]));
  EXPECT_TRUE(std::isnan(acc[2]));  // Inf - Inf
  EXPECT_EQ(acc[3], INFINITY);
  EXPECT_EQ(acc[4], INFINITY);
  EXPECT_EQ(acc[5], 0.0f);
}

// Bad arguments: an invalid_argument naming the tensor and array at fault, and not one byte changed.
class AccumulateErrors : public ::testing::Test {
 protected:
  Batch batch{{1000, 500}, {DType::f32, DType::bf16}};
  CpuAdam engine = make_engine("auto", 2, 128);
  AccumulateOptions opts;

  void SetUp() override {
    Random rng(3);
    batch.fill_grads(rng);
  }

  void expect_refused(const std::string& fragment) {
    const auto before = batch.bytes();
    for (bool streams : {false, true}) {
      const Status s = streams ? engine.accumulate_streams_pass(batch.tensors, opts)
                               : engine.accumulate(batch.tensors, opts);
      EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
      EXPECT_NE(s.message().find(fragment), std::string::npos) << "message: " << s.message();
      EXPECT_EQ(batch.bytes(), before) << "state changed by a refused call";
    }
  }
};

TEST_F(AccumulateErrors, NullAccumulatorWithElements) {
  batch.tensors[1].acc = nullptr;
  expect_refused("tensor 1: acc is null with n = 500");
}

TEST_F(AccumulateErrors, NullGradientWithElements) {
  batch.tensors[0].grad = nullptr;
  expect_refused("tensor 0: grad is null with n = 1000");
}

TEST_F(AccumulateErrors, NullIsFineWithZeroElements) {
  batch.tensors[1] = AccumulateTensor{};
  EXPECT_TRUE(engine.accumulate(batch.tensors, opts).ok());
  EXPECT_TRUE(engine.accumulate(std::span<const AccumulateTensor>()).ok());
}

TEST_F(AccumulateErrors, UnknownDtype) {
  batch.tensors[1].grad_dtype = static_cast<DType>(7);
  expect_refused("tensor 1: grad dtype 7");
}

TEST_F(AccumulateErrors, AccumulatorOverlapsItsGradient) {
  batch.tensors[0].grad = batch.tensors[0].acc + 10;
  expect_refused("overlaps");
}

TEST_F(AccumulateErrors, AccumulatorsOverlap) {
  batch.tensors[1].acc = batch.tensors[0].acc + 600;
  expect_refused("tensor 0 acc overlaps tensor 1 acc");
}

// A gradient only read may feed two accumulators; one that is zeroed is written, so it may not.
TEST_F(AccumulateErrors, SharedGradientIsRefusedOnlyWhenZeroed) {
  batch.tensors[1].grad = batch.tensors[0].grad;
  batch.tensors[1].grad_dtype = DType::f32;
  EXPECT_TRUE(engine.accumulate(batch.tensors, opts).ok());
  opts.zero_source = true;
  expect_refused("grad overlaps");
}

}  // namespace
}  // namespace zoe
