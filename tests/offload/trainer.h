// A trainer for OffloadOptimizer tests on the host stand-in device: parameters in its memory, gradients
// written per iteration, iterations issued as a trainer issues them, and the resulting state.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tests/reference.h"
#include "zoe/offload.h"
#include "zoe/partition.h"

namespace zoe::test {

// A label joined with += (GCC 12's -Wrestrict misreads some chains of string operator+).
template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::string s;
  ((s += std::string_view(parts)), ...);
  return s;
}

// The trainer's two param groups: AdamW with decay, and Adam's L2 at another learning rate.
inline std::vector<ParamGroup> two_groups() {
  std::vector<ParamGroup> groups(2);
  groups[0].hyper.lr = 1e-2f;
  groups[0].hyper.weight_decay = 0.01f;
  groups[1].hyper.lr = 5e-3f;
  groups[1].hyper.adamw = false;
  groups[1].hyper.weight_decay = 0.1f;
  return groups;
}


// Parameters of assorted sizes living in a host stand-in device's memory.
class DeviceParams {
 public:
  DeviceParams(Device& device, DType dtype, const std::vector<std::size_t>& sizes, std::uint64_t seed)
      : device_(device), dtype_(dtype) {
    Random rng(seed);
    for (std::size_t n : sizes) {
      ParamSpec p;
      p.n = n;
      p.dtype = dtype;
      p.device_weights = device.allocate(n * dtype_size(dtype) + 1).value();
      p.device_grads = device.allocate(n * dtype_size(dtype) + 1).value();
      for (std::size_t i = 0; i < n; ++i) set(p.device_weights, i, static_cast<float>(rng.uniform(-1, 1)));
      specs.push_back(p);
    }
  }
  ~DeviceParams() {
    for (const ParamSpec& p : specs) {
      device_.free(p.device_weights);
      device_.free(const_cast<void*>(p.device_grads));
    }
  }

  void set(void* base, std::size_t i, float x) const {
    if (dtype_ == DType::f32) {
      static_cast<float*>(base)[i] = x;
    } else {
      static_cast<std::uint16_t*>(base)[i] = dtype_ == DType::f16 ? float_to_f16(x) : float_to_bf16(x);
    }
  }
  float get(const void* base, std::size_t i) const {
    if (dtype_ == DType::f32) return static_cast<const float*>(base)[i];
    const std::uint16_t h = static_cast<const std::uint16_t*>(base)[i];
    return dtype_ == DType::f16 ? f16_to_float(h) : bf16_to_float(h);
  }
  std::vector<unsigned char> weights() const {
    std::vector<unsigned char> out;
    for (const ParamSpec& p : specs) {
      const auto* b = static_cast<const unsigned char*>(p.device_weights);
      out.insert(out.end(), b, b + p.n * dtype_size(dtype_));
    }
    return out;
  }

  std::vector<ParamSpec> specs;

 private:
  Device& device_;
  DType dtype_;
};

struct RunResult {
  std::vector<float> state;  // master, m, v of every parameter
  std::vector<unsigned char> device_weights;
  StepStats stats;
  std::vector<float> scales;  // loss scale seen by each iteration
  std::int64_t steps = 0;
};

// Writes iteration t's gradients: deterministic, times the loss scale the trainer used; `poison` makes one
// value infinite (an fp16 overflow).
using GradFn = std::function<void(DeviceParams&, int t, float scale)>;

inline GradFn random_grads(double magnitude, std::vector<int> overflow_at = {}) {
  return [magnitude, overflow_at](DeviceParams& model, int t, float scale) {
    Random rng(1000 + t);
    for (const ParamSpec& p : model.specs) {
      for (std::size_t i = 0; i < p.n; ++i) {
        model.set(const_cast<void*>(p.device_grads), i, static_cast<float>(rng.uniform(-magnitude, magnitude) * scale));
      }
    }
    for (int at : overflow_at) {
      if (at == t) model.set(const_cast<void*>(model.specs[1].device_grads), 3, INFINITY);
    }
  };
}

// A trainer on its own host device: the model, the optimizer, and iterations as a trainer issues them.
class Trainer {
 public:
  // With `group`, this trainer is rank `rank` of a partitioned optimizer (in-process collectives). With
  // `cpu_device`, the device is the CPU itself (make_cpu_device): the optimizer works in place. `groups`:
  // the param groups (parameter 2 is in group 1), of any rule.
  Trainer(Schedule schedule, DType dtype, const OffloadOptions& base, int warmup = 0,
          std::vector<std::size_t> sizes = {1000, 37, 4096, 1}, std::shared_ptr<HostGroup> group = nullptr,
          int rank = 0, bool cpu_device = false, std::vector<ParamGroup> groups = two_groups())
      : device_(cpu_device ? make_cpu_device() : make_host_device()), model_(*device_, dtype, sizes, 42) {
    if (group) {
      Result<std::unique_ptr<Collectives>> joined = make_host_collectives(group, *device_, rank);
      EXPECT_TRUE(joined.ok()) << joined.status().to_string();
      if (joined.ok()) collectives_ = std::move(joined).value();
    }
    OffloadOptions o = base;
    o.schedule = schedule;
    o.delayed_warmup_steps = warmup;
    o.cpu.threads = 2;
    o.cpu.tile = 512;  // several tiles per parameter
    o.tile = 700;      // several pieces per parameter in the overlap schedule, one with a short last piece
    if (model_.specs.size() > 2) model_.specs[2].group = 1;
    Result<OffloadOptimizer> made = OffloadOptimizer::create(*device_, groups, model_.specs, o, collectives_.get());
    EXPECT_TRUE(made.ok()) << made.status().to_string();
    if (made.ok()) opt_ = std::make_unique<OffloadOptimizer>(std::move(made).value());
  }

  OffloadOptimizer& opt() { return *opt_; }
  bool created() const { return opt_ != nullptr; }

  // One iteration whose step() result is returned rather than asserted.
  Status iteration(int t, const GradFn& grads) {
    grads(model_, t, opt_->loss_scale());
    for (std::size_t b = model_.specs.size(); b-- > 0;) {
      if (Status s = device_->simulate_compute(1e-4, Stream::compute); !s.ok()) return s;
      if (Status s = opt_->grad_ready(b); !s.ok()) return s;
    }
    return opt_->step();
  }
  Status device_synchronize() { return device_->synchronize(); }

  // What a trainer does between the end of backward and step() (clip, unscale, edit the gradients).
  using AfterBackward = std::function<void(DeviceParams&, OffloadOptimizer&)>;

  // What a trainer does as soon as step() has returned (the delayed schedule's step is still running).
  using AfterStep = std::function<void(OffloadOptimizer&)>;

  void run(int first, int last, const GradFn& grads, const AfterBackward& after_backward = nullptr,
           const AfterStep& after_step = nullptr) {
    for (int t = first; t <= last; ++t) {
      ASSERT_TRUE(device_->synchronize().ok());  // the previous iteration is done: gradients may be written
      result_.scales.push_back(opt_->loss_scale());
      grads(model_, t, opt_->loss_scale());
      for (std::size_t b = model_.specs.size(); b-- > 0;) {
        ASSERT_TRUE(device_->simulate_compute(1e-4, Stream::compute).ok());
        ASSERT_TRUE(opt_->grad_ready(b).ok());
      }
      if (after_backward) {
        // The stand-in's copies read the gradients on its own thread: the trainer's edit comes after them,
        // as a GPU trainer's comes after them on the compute stream.
        ASSERT_TRUE(device_->synchronize().ok());
        after_backward(model_, *opt_);
      }
      const Status s = opt_->step();
      ASSERT_TRUE(s.ok()) << s.to_string();
      if (after_step) after_step(*opt_);
    }
  }

  // Iterations of k micro-batches (OffloadOptions::gradient_accumulation_steps = k): micro-batch j of
  // iteration t writes the gradients grads(t * 100 + j) — into buffers the optimizer zeroed after the
  // previous micro-batch, so writing equals a backward's accumulating — and reports the parameters that
  // `reports(param, j)` picks (all by default).
  void run_accumulating(int first, int last, int k, const GradFn& grads, const AfterBackward& after_backward = nullptr,
                        const std::function<bool(std::size_t, int)>& reports = nullptr) {
    for (int t = first; t <= last; ++t) {
      ASSERT_TRUE(device_->synchronize().ok());
      result_.scales.push_back(opt_->loss_scale());
      for (int j = 1; j <= k; ++j) {
        ASSERT_TRUE(device_->synchronize().ok());
        if (j > 1) expect_zero_grads(reports, j - 1);
        grads(model_, t * 100 + j, opt_->loss_scale());
        for (std::size_t b = model_.specs.size(); b-- > 0;) {
          if (reports && !reports(b, j)) continue;
          ASSERT_TRUE(device_->simulate_compute(1e-5, Stream::compute).ok());
          const Status s = opt_->grad_ready(b);
          ASSERT_TRUE(s.ok()) << s.to_string();
        }
      }
      if (after_backward) {
        ASSERT_TRUE(device_->synchronize().ok());
        after_backward(model_, *opt_);
      }
      const Status s = opt_->step();
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
  }

  std::vector<unsigned char> device_weights() {
    EXPECT_TRUE(opt_->wait().ok());
    return model_.weights();
  }

  RunResult result() {
    EXPECT_TRUE(opt_->wait().ok());
    RunResult r = result_;
    for (std::size_t i = 0; i < model_.specs.size(); ++i) {
      const std::size_t n = model_.specs[i].n;
      // Lion and Adagrad keep m alone; amsgrad adds max_exp_avg_sq.
      const std::size_t arrays = state_arrays(opt_->group_hyper(0));
      std::vector<float> p(n), m(n), v(arrays > 1 ? n : 0), vmax(arrays > 2 ? n : 0);
      EXPECT_TRUE(opt_->read_state(i, p.data(), m.data(), arrays > 1 ? v.data() : nullptr,
                                   arrays > 2 ? vmax.data() : nullptr).ok());
      for (const std::vector<float>* a : {&p, &m, &v, &vmax}) r.state.insert(r.state.end(), a->begin(), a->end());
    }
    r.device_weights = model_.weights();
    r.stats = opt_->stats();
    r.steps = opt_->step_count();
    return r;
  }

  DeviceParams& model() { return model_; }
  Device& device() { return *device_; }

 private:
  // After a micro-batch that is not the last, every reported parameter's device gradients are zero.
  void expect_zero_grads(const std::function<bool(std::size_t, int)>& reports, int j) {
    for (std::size_t b = 0; b < model_.specs.size(); ++b) {
      if (reports && !reports(b, j)) continue;
      for (std::size_t i = 0; i < model_.specs[b].n; ++i) {
        ASSERT_EQ(model_.get(model_.specs[b].device_grads, i), 0.0f) << "parameter " << b << " element " << i;
      }
    }
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Collectives> collectives_;
  DeviceParams model_;
  std::unique_ptr<OffloadOptimizer> opt_;
  RunResult result_;
};

inline RunResult train(Schedule schedule, DType dtype, const OffloadOptions& base, int steps, const GradFn& grads,
                int warmup = 0) {
  Trainer trainer(schedule, dtype, base, warmup);
  trainer.run(1, steps, grads);
  return trainer.result();
}

inline void expect_bitwise_equal(const RunResult& a, const RunResult& b) {
  ASSERT_EQ(a.state.size(), b.state.size());
  // (memcmp of no bytes still takes two valid pointers: an empty state is equal without it)
  EXPECT_TRUE(a.state.empty() || std::memcmp(a.state.data(), b.state.data(), a.state.size() * 4) == 0)
      << "master/moments differ";
  EXPECT_EQ(a.device_weights, b.device_weights) << "device weights differ";
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.scales, b.scales);
}

}  // namespace zoe::test
