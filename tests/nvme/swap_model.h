// A reference for the swap store's tests: the same segments stepped by CpuAdam on arrays in RAM. CpuAdam
// is element-wise and bit-identical for any tiling, so the store must match it bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "zoe/adam.h"
#include "zoe/swap.h"

namespace zoe::testing {

struct SegmentSpec {
  std::size_t offset = 0, n = 0;
  OptimizerHyper hyper;
  DType grad = DType::f32;
  bool has_out = false;
  DType out = DType::bf16;
};

inline float initial_weight(std::size_t i) {
  std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u + 12345u;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

inline Status fill_initial(std::size_t offset, std::size_t count, float* p) {
  for (std::size_t i = 0; i < count; ++i) p[i] = initial_weight(offset + i);
  return Status::success();
}

// Default segments over n elements: three runs with different hyper-parameters and dtypes, and a gap of
// elements no segment covers (they must keep their values).
inline std::vector<SegmentSpec> default_specs(std::size_t n) {
  const std::size_t a = n / 3, gap = 100, b = 2 * n / 3;
  SegmentSpec s0, s1, s2;
  s0 = {0, a, AdamHyper{}, DType::f16, true, DType::bf16};
  s0.hyper.lr = 1e-2f;
  s0.hyper.weight_decay = 0.01f;
  s1 = {a + gap, b - a - gap, AdamHyper{}, DType::bf16, true, DType::f16};
  s1.hyper.lr = 3e-3f;
  s1.hyper.adamw = false;
  s1.hyper.weight_decay = 0.1f;
  s2 = {b, n - b, AdamHyper{}, DType::f32, false, DType::bf16};
  s2.hyper.lr = 5e-3f;
  s2.hyper.beta1 = 0.8f;
  s2.hyper.bias_correction = false;
  return {s0, s1, s2};
}

class SwapModel {
 public:
  SwapModel(std::size_t n, std::vector<SegmentSpec> specs) : n_(n), specs_(std::move(specs)) {
    p_.resize(n);
    m_.assign(n, 0.0f);
    v_.assign(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) p_[i] = initial_weight(i);
    Result<CpuAdam> a = CpuAdam::create();
    EXPECT_TRUE(a.ok());
    adam_ = std::make_unique<CpuAdam>(std::move(a).value());
    grads_.resize(specs_.size());
    out_store_.resize(specs_.size());
    out_ref_.resize(specs_.size());
  }

  // Gradients of step `step`, deterministic; fresh (zeroed) out buffers for the store and the reference.
  void make_grads(std::int64_t step) {
    for (std::size_t k = 0; k < specs_.size(); ++k) {
      const SegmentSpec& s = specs_[k];
      grads_[k].assign(s.n * dtype_size(s.grad), 0);
      for (std::size_t i = 0; i < s.n; ++i) {
        const float g = 1e-2f * initial_weight((s.offset + i) * 7 + static_cast<std::size_t>(step) * 1000003u);
        if (s.grad == DType::f32) std::memcpy(grads_[k].data() + 4 * i, &g, 4);
        const std::uint16_t h = s.grad == DType::f16 ? float_to_f16(g) : float_to_bf16(g);
        if (s.grad != DType::f32) std::memcpy(grads_[k].data() + 2 * i, &h, 2);
      }
      out_store_[k].assign(s.has_out ? s.n : 0, 0xDEAD);
      out_ref_[k].assign(s.has_out ? s.n : 0, 0xBEEF);
    }
  }

  std::vector<SwapSegment> segments() {
    std::vector<SwapSegment> out;
    for (std::size_t k = 0; k < specs_.size(); ++k) {
      const SegmentSpec& s = specs_[k];
      SwapSegment seg;
      seg.offset = s.offset;
      seg.n = s.n;
      seg.hyper = &specs_[k].hyper;
      seg.grad = grads_[k].data();
      seg.grad_dtype = s.grad;
      seg.out = s.has_out ? out_store_[k].data() : nullptr;
      seg.out_dtype = s.out;
      out.push_back(seg);
    }
    return out;
  }

  void reference_step(std::int64_t step) {
    StepOptions o;
    o.step = step;
    for (std::size_t k = 0; k < specs_.size(); ++k) {
      const SegmentSpec& s = specs_[k];
      AdamTensor t;
      t.param = p_.data() + s.offset;
      t.exp_avg = m_.data() + s.offset;
      t.exp_avg_sq = v_.data() + s.offset;
      t.grad = grads_[k].data();
      t.grad_dtype = s.grad;
      t.out = s.has_out ? out_ref_[k].data() : nullptr;
      t.out_dtype = s.out;
      t.n = s.n;
      ASSERT_TRUE(adam_->step(s.hyper.adam(), o, t).ok());
    }
  }

  // Store state and copy-outs equal the reference, bit for bit.
  void expect_matches(SwapStore& store, bool check_out = true) {
    std::vector<float> p(n_), m(n_), v(n_);
    Status s = store.read(0, n_, p.data(), m.data(), v.data());
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(std::memcmp(p.data(), p_.data(), n_ * 4), 0) << "p differs";
    EXPECT_EQ(std::memcmp(m.data(), m_.data(), n_ * 4), 0) << "m differs";
    EXPECT_EQ(std::memcmp(v.data(), v_.data(), n_ * 4), 0) << "v differs";
    if (!check_out) return;
    for (std::size_t k = 0; k < specs_.size(); ++k) {
      EXPECT_EQ(out_store_[k], out_ref_[k]) << "out copy of segment " << k << " differs";
    }
  }

  const std::vector<float>& p() const { return p_; }

 private:
  std::size_t n_;
  std::vector<SegmentSpec> specs_;
  std::vector<float> p_, m_, v_;
  std::unique_ptr<CpuAdam> adam_;
  std::vector<std::vector<unsigned char>> grads_;
  std::vector<std::vector<std::uint16_t>> out_store_, out_ref_;
};

// One store step of the model's segments with step t's gradients (the reference is stepped separately).
inline Status step(SwapStore& store, SwapModel& model, std::int64_t t) {
  model.make_grads(t);
  auto segs = model.segments();
  StepOptions o;
  o.step = t;
  return store.step(segs, o);
}

inline std::string mode_name(SwapDurability d) {
  switch (d) {
    case SwapDurability::each_call: return "each_call";
    case SwapDurability::next_call: return "next_call";
    case SwapDurability::on_flush: return "on_flush";
  }
  return "?";
}

}  // namespace zoe::testing
