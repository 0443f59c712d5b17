// Training with the weights in a parameter tier equals training with them resident, bit for bit: a
// 12-layer model on the test device (the host stand-in, or a GPU: param_test_device.h) whose 16-bit weights
// are 8x the device pool. Each "forward" and "backward" fetches a layer's block and computes from the
// weights it finds there, so a wrong or stale fetch changes the gradients and shows. Faults on the NVMe home
// (a failed read during a fetch, a failed write of the updated weights) are retried and give the
// uninterrupted result. A trainer may keep one block's worth of gradient memory on a device with memory of
// its own and hand it from block to block: each gradient leaves the device when reported (the CPU as the
// device reads gradients in place at step(), so there the cases that share gradient memory skip).
#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <memory>
#include <vector>

#include "zoe/offload.h"
#include "tests/param/param_test_device.h"
#include "zoe/param_tier.h"
#ifdef ZOE_HAVE_AIO
#include "tests/aio/aio_test_util.h"
#endif

namespace zoe {
namespace {

using ParamTraining = OnTestDevice;

constexpr std::size_t kLayers = 12;
constexpr int kSteps = 20;

std::size_t weight_n(std::size_t layer) { return 30000 + 17 * layer; }
constexpr std::size_t kBiasN = 64;

struct Model {
  std::unique_ptr<Device> device = make_test_device();
  std::vector<void*> grads;                // per parameter (2 per layer), device memory
  // One weight and one bias gradient buffer for every layer (the trainer reuses them block after block),
  // with a slow d2h stream: a gradient overwritten before the optimizer's copy of it has run shows.
  bool shared_grads = false;
  std::vector<std::vector<std::uint16_t>> host_grads;  // sources of this iteration's enqueued gradient copies
  std::vector<void*> resident;             // per parameter, device memory; empty with a tier
  std::unique_ptr<ParamTier> tier;
  std::vector<ParamSpec> specs;
  std::vector<double> losses;

  std::size_t n(std::size_t i) const { return i % 2 == 0 ? weight_n(i / 2) : kBiasN; }

  static std::vector<std::uint16_t> initial(std::size_t i, std::size_t count) {
    std::vector<std::uint16_t> w(count);
    for (std::size_t j = 0; j < count; ++j) w[j] = float_to_bf16(std::sin(0.37f * j + 1.3f * i) * 0.5f);
    return w;
  }

  Status build(const ParamTierOptions* tier_options) {
    if (shared_grads) {
      for (std::size_t i : {2 * kLayers - 2, 2 * kLayers - 1}) grads.push_back(device->allocate(n(i) * 2).value());
    }
    for (std::size_t i = 0; i < 2 * kLayers; ++i) {
      if (!shared_grads) grads.push_back(device->allocate(n(i) * 2).value());
      ParamSpec p;
      p.n = n(i);
      p.dtype = DType::bf16;
      p.device_grads = grads[shared_grads ? i % 2 : i];
      p.name = "layer." + std::to_string(i / 2) + (i % 2 == 0 ? ".weight" : ".bias");
      specs.push_back(p);
    }
    if (tier_options == nullptr) {
      for (std::size_t i = 0; i < specs.size(); ++i) {
        resident.push_back(device->allocate(n(i) * 2).value());
        const std::vector<std::uint16_t> w = initial(i, n(i));
        if (Status s = device->copy_to_device(resident[i], w.data(), w.size() * 2, Stream::h2d); !s.ok()) return s;
        if (Status s = device->synchronize(); !s.ok()) return s;  // w leaves scope
        specs[i].device_weights = resident[i];
      }
      return Status::success();
    }
    std::vector<ParamBlockSpec> blocks;
    for (std::size_t l = 0; l < kLayers; ++l) blocks.push_back({"layer." + std::to_string(l), {n(2 * l) * 2, kBiasN * 2}});
    Result<ParamTier> made = ParamTier::create(*device, blocks, *tier_options);
    if (!made.ok()) return made.status();
    tier = std::make_unique<ParamTier>(std::move(made).value());
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::vector<std::uint16_t> w = initial(i, n(i));
      if (Status s = tier->write(i / 2, i % 2, w.data(), 0, w.size() * 2); !s.ok()) return s;
      specs[i].tier = tier.get();
      specs[i].tier_block = i / 2;
      specs[i].tier_entry = i % 2;
    }
    return Status::success();
  }

  // The weights of parameter i as the compute stream sees them now (fetched, or resident).
  std::vector<std::uint16_t> weights_on_device(std::size_t i, void* block) {
    const void* at = tier ? static_cast<unsigned char*>(block) + tier->entry_offset(i / 2, i % 2) : resident[i];
    std::vector<std::uint16_t> w(n(i));
    EXPECT_TRUE(device->copy_to_host(w.data(), at, w.size() * 2, Stream::compute).ok());
    Result<EventId> e = device->record(Stream::compute);
    EXPECT_TRUE(e.ok() && device->synchronize(e.value()).ok());
    return w;
  }

  Result<void*> use(std::size_t layer, bool backward) {
    if (!tier) return static_cast<void*>(nullptr);
    return tier->fetch(layer, backward);
  }
  Status done(std::size_t layer) { return tier ? tier->release(layer) : Status::success(); }

  // One forward and backward: the loss sums the weights, each gradient is a function of the weights the
  // backward fetched, of the iteration and of the micro-batch.
  Status iteration(OffloadOptimizer& opt, int t, bool report, int micro = 0) {
    double loss = 0;
    if (!host_grads.empty()) {  // the copies from them were enqueued on the compute stream
      Result<EventId> copied = device->record(Stream::compute);
      if (!copied.ok()) return copied.status();
      if (Status s = device->synchronize(copied.value()); !s.ok()) return s;
      host_grads.clear();
    }
    for (std::size_t l = 0; l < kLayers; ++l) {
      Result<void*> block = use(l, false);
      if (!block.ok()) return block.status();
      for (std::size_t i : {2 * l, 2 * l + 1}) {
        for (std::uint16_t h : weights_on_device(i, block.value())) loss += bf16_to_float(h);
      }
      if (Status s = done(l); !s.ok()) return s;
    }
    for (std::size_t l = kLayers; l-- > 0;) {
      Result<void*> block = use(l, true);
      if (!block.ok()) return block.status();
      for (std::size_t i : {2 * l + 1, 2 * l}) {
        const std::vector<std::uint16_t> w = weights_on_device(i, block.value());
        std::vector<std::uint16_t> g(w.size());
        for (std::size_t j = 0; j < w.size(); ++j) {
          g[j] = float_to_bf16(bf16_to_float(w[j]) * 0.3f + std::cos(0.01f * j + t + 0.5f * micro) * 0.02f);
        }
        void* to = const_cast<void*>(specs[i].device_grads);
        if (Status s = device->copy_to_device(to, g.data(), g.size() * 2, Stream::compute); !s.ok()) return s;
        if (shared_grads) {
          // No synchronize(): it would wait for the d2h stream too, and hide a missing wait for the copy.
          host_grads.push_back(std::move(g));
          if (Status s = device->simulate_compute(0.0005, Stream::d2h); !s.ok()) return s;
        } else if (Status s = device->synchronize(); !s.ok()) {  // g leaves scope
          return s;
        }
        if (report) {
          if (Status s = opt.grad_ready(i); !s.ok()) return s;
        }
      }
      if (Status s = done(l); !s.ok()) return s;
    }
    losses.push_back(loss);
    return Status::success();
  }

  std::vector<std::uint16_t> final_weights(std::size_t i) {
    std::vector<std::uint16_t> w(n(i));
    if (tier) {
      EXPECT_TRUE(tier->read(i / 2, i % 2, w.data(), 0, w.size() * 2).ok());
    } else {
      EXPECT_TRUE(device->copy_to_host(w.data(), resident[i], w.size() * 2, Stream::h2d).ok());
      EXPECT_TRUE(device->synchronize().ok());
    }
    return w;
  }

  ~Model() {
    tier.reset();
    for (void* p : grads) device->free(p);
    for (void* p : resident) device->free(p);
  }
};

OffloadOptions options_for(Schedule schedule) {
  OffloadOptions o;
  o.schedule = schedule;
  o.max_grad_norm = 5.0f;  // clipping: the overlap schedule redoes when it bites
  o.tile = 1024;
  return o;
}

AdamHyper hyper() {
  AdamHyper h;
  h.lr = 1e-2f;
  h.weight_decay = 0.01f;
  return h;
}

std::size_t total_weight_bytes() {
  std::size_t t = 0;
  for (std::size_t l = 0; l < kLayers; ++l) t += (weight_n(l) + kBiasN) * 2;
  return t;
}

void expect_same_training(Model& tiered, OffloadOptimizer& tiered_opt, Model& resident, OffloadOptimizer& resident_opt) {
  ASSERT_EQ(tiered.losses, resident.losses);
  for (std::size_t i = 0; i < 2 * kLayers; ++i) {
    std::vector<float> a(3 * tiered.n(i)), b(3 * tiered.n(i));
    const std::size_t k = tiered.n(i);
    ASSERT_TRUE(tiered_opt.read_state(i, a.data(), a.data() + k, a.data() + 2 * k).ok());
    ASSERT_TRUE(resident_opt.read_state(i, b.data(), b.data() + k, b.data() + 2 * k).ok());
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "state of parameter " << i;
    ASSERT_EQ(tiered.final_weights(i), resident.final_weights(i)) << "weights of parameter " << i;
  }
}

struct TrainingRun {
  Model model;
  std::unique_ptr<OffloadOptimizer> opt;
  int micro_batches = 1;  // backward passes per step, summed by the optimizer
  std::string state_dir;  // set: the optimizer's state on tier nvme there (sync: the streamed step)
  Status start(const ParamTierOptions* tier, Schedule schedule) {
    if (Status s = model.build(tier); !s.ok()) return s;
    OffloadOptions o = options_for(schedule);
    o.gradient_accumulation_steps = micro_batches;
    if (!state_dir.empty()) {
      o.tier = Tier::nvme;
      o.nvme.paths = {state_dir};
      o.step_window = 1;  // windows of the largest parameter and two tiles: parameters straddle them
      o.grads_stay_on_device = true;  // as FSDP2's: every gradient stays where the model keeps it until step()
    }
    Result<OffloadOptimizer> made = OffloadOptimizer::create(*model.device, {ParamGroup{hyper()}}, model.specs, o);
    if (!made.ok()) return made.status();
    opt = std::make_unique<OffloadOptimizer>(std::move(made).value());
    return Status::success();
  }
  // Gradients are reported where the optimizer needs them: overlap and delayed, micro-batches, and
  // gradient memory handed from block to block.
  bool reports(Schedule schedule) const { return schedule != Schedule::sync || micro_batches > 1 || model.shared_grads; }
  Status train(int steps, Schedule schedule) {
    for (int t = 0; t < steps; ++t) {
      for (int k = 0; k < micro_batches; ++k) {
        if (Status s = model.iteration(*opt, t, reports(schedule), k); !s.ok()) return s;
      }
      if (Status s = opt->step(); !s.ok()) return s;
    }
    return opt->wait();
  }
};

// `shared_grads`: the offloaded run keeps one layer's gradients on the device (the resident run keeps all).
void train_and_compare(const ParamTierOptions& tier_options, Schedule schedule, bool shared_grads = false,
                       int micro_batches = 1) {
  TrainingRun resident, tiered;
  resident.micro_batches = tiered.micro_batches = micro_batches;
  tiered.model.shared_grads = shared_grads;
  ASSERT_TRUE(resident.start(nullptr, schedule).ok());
  Status s = tiered.start(&tier_options, schedule);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(resident.train(kSteps, schedule).ok());
  s = tiered.train(kSteps, schedule);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(tiered.opt->step_count(), kSteps);
  expect_same_training(tiered.model, *tiered.opt, resident.model, *resident.opt);
  ASSERT_TRUE(tiered.model.tier->synchronize().ok());
  const ParamTierStats st = tiered.model.tier->stats();
  EXPECT_LE(st.pool_peak_bytes, st.budget_bytes);
  EXPECT_GE(total_weight_bytes(), 8 * st.budget_bytes);
  EXPECT_GT(st.evictions, 0u);
}

ParamTierOptions eighth_of_the_model() {
  ParamTierOptions o;
  o.budget_bytes = total_weight_bytes() / 8;
  o.prefetch = 2;
  return o;
}

#ifdef ZOE_HAVE_AIO
ParamTierOptions eighth_on_nvme(const std::string& dir, IoFaultHook hook = nullptr) {
  ParamTierOptions o = eighth_of_the_model();
  o.home = ParamHome::nvme;
  o.nvme_paths = {dir};
  o.fault_hook = std::move(hook);
  return o;
}
#endif

TEST_F(ParamTraining, RamTierSyncEqualsResident) { train_and_compare(eighth_of_the_model(), Schedule::sync); }
TEST_F(ParamTraining, RamTierOverlapEqualsResident) { train_and_compare(eighth_of_the_model(), Schedule::overlap); }
TEST_F(ParamTraining, RamTierDelayedEqualsResident) { train_and_compare(eighth_of_the_model(), Schedule::delayed); }

// Gradients leave only a device with memory of its own: the CPU as the device reads them where they are.
bool gradients_leave_the_device() { return !test_device_is_cpu(); }
constexpr const char* kInPlaceGradients =
    "the CPU as the device reads gradients in place at step(): they never leave it, so their memory cannot be "
    "handed from block to block";

TEST_F(ParamTraining, GradientsLeaveTheDeviceWhenReportedInEverySchedule) {
  if (!gradients_leave_the_device()) GTEST_SKIP() << kInPlaceGradients;
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    SCOPED_TRACE(schedule_name(schedule));
    train_and_compare(eighth_of_the_model(), schedule, /*shared_grads=*/true);
  }
}

TEST_F(ParamTraining, MicroBatchesOfOffloadedBlocksAreSummedOnTheHost) {
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    SCOPED_TRACE(schedule_name(schedule));
    train_and_compare(eighth_of_the_model(), schedule, /*shared_grads=*/true, /*micro_batches=*/2);
  }
}

// The trainer cannot change a gradient that left the device (its buffer holds another block's by then):
// grads_changed() says so and changes nothing; the training goes on as if it had not been called.
TEST_F(ParamTraining, ChangingGradientsThatLeftTheDeviceIsRefused) {
  if (!gradients_leave_the_device()) GTEST_SKIP() << kInPlaceGradients;
  ParamTierOptions o = eighth_of_the_model();
  TrainingRun resident, tiered;
  tiered.model.shared_grads = true;
  ASSERT_TRUE(resident.start(nullptr, Schedule::overlap).ok());
  ASSERT_TRUE(tiered.start(&o, Schedule::overlap).ok());
  ASSERT_TRUE(resident.train(kSteps, Schedule::overlap).ok());
  for (int t = 0; t < kSteps; ++t) {
    ASSERT_TRUE(tiered.model.iteration(*tiered.opt, t, true).ok());
    if (t == 4) {
      Status s = tiered.opt->grads_changed();
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), StatusCode::invalid_argument);
      EXPECT_NE(s.message().find("of offloaded parameter 'layer.0.weight' (0) left the device when it was reported"),
                std::string::npos) << s.message();
    }
    ASSERT_TRUE(tiered.opt->step().ok());
  }
  ASSERT_TRUE(tiered.opt->wait().ok());
  expect_same_training(tiered.model, *tiered.opt, resident.model, *resident.opt);
}

TEST_F(ParamTraining, MismatchedEntriesAreRefused) {
  Model m;
  ParamTierOptions o = eighth_of_the_model();
  ASSERT_TRUE(m.build(&o).ok());
  std::vector<ParamSpec> wrong = m.specs;
  wrong[3].tier_entry = 0;  // the bias pointed at the weight's entry
  Result<OffloadOptimizer> opt = OffloadOptimizer::create(*m.device, {ParamGroup{hyper()}}, wrong, options_for(Schedule::sync));
  ASSERT_FALSE(opt.ok());
  EXPECT_NE(opt.status().message().find("entry 0 of block 'layer.1' holds"), std::string::npos) << opt.status().message();
}

#ifdef ZOE_HAVE_AIO
TEST_F(ParamTraining, NvmeTierEveryScheduleEqualsResident) {
  testing::TempDir dir("zoe-param");
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    SCOPED_TRACE(schedule_name(schedule));
    train_and_compare(eighth_on_nvme(dir.path()), schedule);
    if (gradients_leave_the_device()) train_and_compare(eighth_on_nvme(dir.path()), schedule, /*shared_grads=*/true);
  }
}

TEST_F(ParamTraining, NvmeFaultsDuringFetchAndCopyOutAreRetriedExactly) {
  testing::TempDir dir("zoe-param");
  testing::FaultPlan plan;
  const ParamTierOptions o = eighth_on_nvme(dir.path(), plan.hook());
  TrainingRun resident, tiered;
  ASSERT_TRUE(resident.start(nullptr, Schedule::sync).ok());
  ASSERT_TRUE(tiered.start(&o, Schedule::sync).ok());
  ASSERT_TRUE(resident.train(kSteps, Schedule::sync).ok());
  int read_faults = 0, write_faults = 0;
  for (int t = 0; t < kSteps; ++t) {
    if (t == 3) plan.arm(IoOp::read, 5, EIO);
    Status s = tiered.model.iteration(*tiered.opt, t, false);
    if (!s.ok()) {
      // A fetch failed mid-iteration: the trainer releases what it holds and runs the iteration again.
      EXPECT_EQ(s.sys_errno(), EIO) << s.to_string();
      EXPECT_NE(s.message().find("in " + tiered.model.tier->files()[0] + " at offset"), std::string::npos) << s.message();
      ++read_faults;
      plan.clear();
      for (std::size_t l = 0; l < kLayers; ++l) {
        while (tiered.model.tier->in_use(l) > 0) ASSERT_TRUE(tiered.model.tier->release(l).ok());
      }
      ASSERT_TRUE(tiered.model.iteration(*tiered.opt, t, false).ok());
    }
    if (t == 7 || t == 11) plan.arm(IoOp::write, t == 7 ? 3 : 0, t == 7 ? ENOSPC : EIO);
    s = tiered.opt->step();
    if (!s.ok()) {
      EXPECT_NE(s.message().find("the step was applied"), std::string::npos) << s.to_string();
      EXPECT_NE(s.message().find("keeps its previous copy"), std::string::npos) << s.to_string();
      EXPECT_EQ(tiered.opt->step_count(), t);  // not counted until its weights are written
      ++write_faults;
      plan.clear();
      s = tiered.opt->step();  // writes the weights, steps nothing again
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    ASSERT_EQ(tiered.opt->step_count(), t + 1);
  }
  EXPECT_EQ(read_faults, 1);
  EXPECT_EQ(write_faults, 2);
  expect_same_training(tiered.model, *tiered.opt, resident.model, *resident.opt);
}

// The optimizer's state on NVMe too (ZeRO-Infinity): the sync step streams it window by window, reading
// each window's gradients from the device (copied down on the stand-in, in place on the CPU) and writing each
// parameter's new weights into the parameter tier as its window ends. A failed write is tried again at the
// end of the step, from the masters; a fault that persists (a full disk) leaves the step applied and its
// weights pending, as with staging, and the next step() sends them. Equal to the resident run.
TEST_F(ParamTraining, StreamedStepOnNvmeStateEqualsResidentThroughWriteFaults) {
  testing::TempDir dir("zoe-param");
  testing::TempDir state("zoe-state");
  testing::FaultPlan plan;
  const ParamTierOptions o = eighth_on_nvme(dir.path(), plan.hook());
  TrainingRun resident, tiered;
  tiered.state_dir = state.path();
  ASSERT_TRUE(resident.start(nullptr, Schedule::sync).ok());
  Status s = tiered.start(&o, Schedule::sync);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(resident.train(kSteps, Schedule::sync).ok());
  int write_faults = 0, absorbed = 0;
  for (int t = 0; t < kSteps; ++t) {
    ASSERT_TRUE(tiered.model.iteration(*tiered.opt, t, false).ok());
    if (t == 5) plan.arm(IoOp::write, 2, ENOSPC, -1, /*persist=*/true);
    if (t == 8) plan.arm(IoOp::write, 1, EIO);  // once: the step's own retry writes it
    s = tiered.opt->step();
    if (t == 8) {
      absorbed = plan.fired;
      plan.clear();
    }
    if (!s.ok()) {
      EXPECT_NE(s.message().find("the step was applied"), std::string::npos) << s.to_string();
      EXPECT_EQ(tiered.opt->step_count(), t);
      ++write_faults;
      plan.clear();
      s = tiered.opt->step();
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    ASSERT_EQ(tiered.opt->step_count(), t + 1);
  }
  EXPECT_EQ(write_faults, 1);
  EXPECT_EQ(absorbed, 1);
  expect_same_training(tiered.model, *tiered.opt, resident.model, *resident.opt);
  // No gradient staging: on the stand-in each gradient came down once per step, into its window.
  const StepStats st = tiered.opt->stats();
  if (gradients_leave_the_device()) {
    EXPECT_GT(st.d2h_bytes, 0u);
  } else {
    EXPECT_EQ(st.d2h_bytes, 0u);
  }
}

// The delayed schedule writes each parameter's new weights while the next backward runs (or as its background
// step ends). A write the tier refuses is made again by the next step(), before any forward reads the block;
// if it fails again, that step() fails with nothing new stepped and is simply called again. Either way the
// training equals the resident run's.
TEST_F(ParamTraining, NvmeWriteFaultsUnderTheDelayedScheduleAreRetriedExactly) {
  testing::TempDir dir("zoe-param");
  testing::FaultPlan plan;
  const ParamTierOptions o = eighth_on_nvme(dir.path(), plan.hook());
  TrainingRun resident, tiered;
  ASSERT_TRUE(resident.start(nullptr, Schedule::delayed).ok());
  ASSERT_TRUE(tiered.start(&o, Schedule::delayed).ok());
  ASSERT_TRUE(resident.train(kSteps, Schedule::delayed).ok());
  int failed_steps = 0, fired = 0;
  for (int t = 0; t < kSteps; ++t) {
    if (t == 12) plan.arm(IoOp::write, 2, EIO);                       // once: the next step()'s retry succeeds
    if (t == 15) plan.arm(IoOp::write, 0, ENOSPC, -1, /*persist=*/true);  // until cleared
    ASSERT_TRUE(tiered.model.iteration(*tiered.opt, t, true).ok()) << "a refused write does not stop the backward";
    Status s = tiered.opt->step();
    if (t == 15 || t == 16) fired += plan.fired;
    if (!s.ok()) {
      EXPECT_NE(s.message().find("could not be written to the parameter tier"), std::string::npos) << s.to_string();
      EXPECT_NE(s.message().find("call step() again"), std::string::npos) << s.to_string();
      ++failed_steps;
      plan.clear();
      s = tiered.opt->step();
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
  }
  ASSERT_TRUE(tiered.opt->wait().ok());
  EXPECT_GT(fired, 0);
  EXPECT_GE(failed_steps, 1);
  expect_same_training(tiered.model, *tiered.opt, resident.model, *resident.opt);
}
#endif

}  // namespace
}  // namespace zoe
