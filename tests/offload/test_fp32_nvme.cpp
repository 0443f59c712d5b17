// f32 parameters on tier nvme (an fp32 model; PEFT's fp32 adapters on a 16-bit base): the store keeps their
// masters as it keeps any other, and each step copies the stepped master into the copy the device receives.
// Every schedule and state dtype must give tier ram's bits — weights and read_state — and checkpoints must
// carry them across tiers.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zoe/host_device.h"
#include "tests/offload/trainer.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

using test::cat;

class Fp32OnNvme : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / cat("zoe_fp32_nvme_", std::to_string(::getpid()));
    fs::create_directories(dir_ / "a");
    fs::create_directories(dir_ / "b");
  }
  void TearDown() override { fs::remove_all(dir_); }

  OffloadOptions nvme(OffloadOptions o, int paths = 1) const {
    o.tier = Tier::nvme;
    o.nvme.paths = {(dir_ / "a").string()};
    if (paths > 1) o.nvme.paths.push_back((dir_ / "b").string());
    o.nvme.buffer_count = 3;  // the trainer's 6 tiles stream through 3 buffers
    return o;
  }

  fs::path dir_;
};

std::string what(Schedule schedule, DType state, bool clipped) {
  return cat(schedule_name(schedule), ", ", state_dtype_name(state), " moments", clipped ? ", clipping that bites" : "");
}

OffloadOptions with(DType state, bool clipped) {
  OffloadOptions o;
  o.state_dtype = state;
  if (clipped) o.max_grad_norm = 0.05f;  // overlap redoes its speculation (tier nvme: discards it)
  return o;
}

// An all-f32 model (the trainer's, two groups, AdamW and Adam with L2) on the host stand-in: every schedule
// and state dtype, with and without clipping, gives tier ram's bits on tier nvme.
TEST_F(Fp32OnNvme, EveryScheduleAndStateDtypeEqualsRamBitwise) {
  const test::GradFn grads = test::random_grads(1e-2);
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    for (DType state : {DType::f32, DType::bf16, DType::i8}) {
      for (bool clipped : {false, true}) {
        SCOPED_TRACE(what(schedule, state, clipped));
        const int warmup = schedule == Schedule::delayed ? 2 : 0;
        const OffloadOptions o = with(state, clipped);
        test::Trainer ram(schedule, DType::f32, o, warmup);
        ram.run(1, 6, grads);
        test::Trainer disk(schedule, DType::f32, nvme(o, 2), warmup);
        ASSERT_TRUE(disk.created());
        disk.run(1, 6, grads);
        const test::RunResult a = ram.result(), b = disk.result();
        test::expect_bitwise_equal(a, b);
        EXPECT_GT(b.stats.nvme_read_bytes, 0u);
        EXPECT_GT(b.stats.nvme_write_bytes, 0u);
        if (schedule == Schedule::overlap) {
          if (clipped) {
            EXPECT_GT(b.stats.redone, 0) << "the speculation was discarded";
          } else {
            EXPECT_EQ(b.stats.redone, 0) << "the speculation was committed";
          }
        }
      }
    }
  }
}

// The CPU as the device: tier ram steps an f32 parameter's weights in place as its master (sync, overlap);
// tier nvme keeps the master in the store and copies it into the model's weights. Same bits; and a state
// that stays resident in the store's buffers gives them too.
TEST_F(Fp32OnNvme, OnTheCpuDeviceAndResidentEqualsRamBitwise) {
  const test::GradFn grads = test::random_grads(1e-2);
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    for (bool resident : {false, true}) {
      SCOPED_TRACE(cat(schedule_name(schedule), resident ? ", resident" : ", streamed"));
      const int warmup = schedule == Schedule::delayed ? 2 : 0;
      const OffloadOptions o = with(DType::f32, false);
      OffloadOptions on_disk = nvme(o);
      if (resident) on_disk.nvme.buffer_count = 8;
      test::Trainer ram(schedule, DType::f32, o, warmup, {1000, 37, 4096, 1}, nullptr, 0, true);
      ram.run(1, 6, grads);
      test::Trainer disk(schedule, DType::f32, on_disk, warmup, {1000, 37, 4096, 1}, nullptr, 0, true);
      ASSERT_TRUE(disk.created());
      disk.run(1, 6, grads);
      const test::RunResult a = ram.result(), b = disk.result();
      test::expect_bitwise_equal(a, b);
      if (resident) {
        EXPECT_EQ(b.stats.nvme_read_bytes, 0u) << "a resident state is never read back";
      }
    }
  }
}

// A 16-bit base with fp32 adapters beside it (PEFT's LoRA): 16-bit and f32 parameters interleaved in one
// optimizer, in two groups; the base's gradients from `base_grads`. Returns master, m, v of every parameter
// and the device's weights.
test::RunResult train_mixed(Schedule schedule, const OffloadOptions& base, int steps, int warmup,
                            DType base_dtype = DType::bf16, const test::GradFn& base_grads = test::random_grads(1e-2)) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams bf16(*device, base_dtype, {1000, 4096}, 42);
  test::DeviceParams f32(*device, DType::f32, {37, 2100}, 43);
  std::vector<ParamSpec> specs = {bf16.specs[0], f32.specs[0], bf16.specs[1], f32.specs[1]};
  specs[2].group = 1;
  specs[3].group = 1;
  OffloadOptions o = base;
  o.schedule = schedule;
  o.delayed_warmup_steps = warmup;
  o.cpu.threads = 2;
  o.cpu.tile = 512;
  o.tile = 700;
  std::vector<ParamGroup> groups = test::two_groups();
  test::RunResult r;
  Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, groups, specs, o);
  EXPECT_TRUE(made.ok()) << made.status().to_string();
  if (!made.ok()) return r;
  OffloadOptimizer& opt = made.value();
  for (int t = 1; t <= steps; ++t) {
    EXPECT_TRUE(device->synchronize().ok());
    base_grads(bf16, t, opt.loss_scale());
    test::random_grads(1e-2)(f32, 100 + t, opt.loss_scale());
    for (std::size_t b = specs.size(); b-- > 0;) {
      EXPECT_TRUE(device->simulate_compute(1e-4, Stream::compute).ok());
      EXPECT_TRUE(opt.grad_ready(b).ok());
    }
    const Status s = opt.step();
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  EXPECT_TRUE(opt.wait().ok());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    std::vector<float> p(specs[i].n), m(p.size()), v(p.size());
    EXPECT_TRUE(opt.read_state(i, p.data(), m.data(), v.data()).ok());
    for (const auto* a : {&p, &m, &v}) r.state.insert(r.state.end(), a->begin(), a->end());
  }
  r.device_weights = bf16.weights();
  const std::vector<unsigned char> w32 = f32.weights();
  r.device_weights.insert(r.device_weights.end(), w32.begin(), w32.end());
  r.stats = opt.stats();
  r.steps = opt.step_count();
  return r;
}

TEST_F(Fp32OnNvme, Fp32AdaptersOnA16BitBaseEqualRamBitwise) {
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    for (DType state : {DType::f32, DType::bf16, DType::i8}) {
      for (bool clipped : {false, true}) {
        SCOPED_TRACE(what(schedule, state, clipped));
        const int warmup = schedule == Schedule::delayed ? 2 : 0;
        const OffloadOptions o = with(state, clipped);
        const test::RunResult ram = train_mixed(schedule, o, 6, warmup);
        const test::RunResult disk = train_mixed(schedule, nvme(o), 6, warmup);
        test::expect_bitwise_equal(ram, disk);
        EXPECT_GT(disk.stats.nvme_read_bytes, 0u);
      }
    }
  }
}

// An fp16 base with fp32 adapters, fp16 loss scaling and an overflow at step 3: the overlap schedule's
// speculation is dropped and the step skipped, so the adapters' copies are put back from the masters the
// store kept — the weights the device holds — as tier ram's are.
TEST_F(Fp32OnNvme, Fp32AdaptersBesideAnFp16BaseThroughAnOverflow) {
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  const test::GradFn grads = test::random_grads(1e-2, {3});
  for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
    SCOPED_TRACE(schedule_name(schedule));
    const test::RunResult ram = train_mixed(schedule, o, 6, 0, DType::f16, grads);
    const test::RunResult disk = train_mixed(schedule, nvme(o), 6, 0, DType::f16, grads);
    test::expect_bitwise_equal(ram, disk);
    EXPECT_EQ(disk.stats.skipped, 1);
    if (schedule == Schedule::overlap) {
      EXPECT_EQ(disk.stats.redone, 1);
    }
  }
}

// A parameter named absent after its gradient was reported: the speculation that stepped it is dropped and
// sync steps the rest, sending every parameter's weights — the absent one's copy put back from the master
// the store kept, as tier ram sends its untouched master.
TEST_F(Fp32OnNvme, AParameterNamedAbsentAfterItsReportSendsItsOldWeights) {
  const test::Trainer::AfterBackward absent = [](test::DeviceParams&, OffloadOptimizer& opt) {
    ASSERT_TRUE(opt.set_grads_absent({1}).ok());
  };
  test::Trainer ram(Schedule::overlap, DType::f32, OffloadOptions{});
  ram.run(1, 4, test::random_grads(1e-2), absent);
  test::Trainer disk(Schedule::overlap, DType::f32, nvme({}));
  disk.run(1, 4, test::random_grads(1e-2), absent);
  const test::RunResult a = ram.result(), b = disk.result();
  test::expect_bitwise_equal(a, b);
  EXPECT_GE(b.stats.redone, 1);
}

// Saved on one tier and loaded on either: the resumed run gives the uninterrupted run's bits, the device's
// f32 weights taken from the loaded masters.
TEST_F(Fp32OnNvme, SaveLoadCrossesTiers) {
  const test::GradFn grads = test::random_grads(1e-2);
  for (DType state : {DType::f32, DType::i8}) {
    OffloadOptions o = with(state, false);
    o.max_grad_norm = 0.5f;
    const test::RunResult whole = test::train(Schedule::sync, DType::f32, o, 10, grads);
    const std::string path = (dir_ / "state.zoeckpt").string();
    const std::pair<bool, bool> moves[] = {{true, true}, {true, false}, {false, true}};  // from nvme, to nvme
    for (auto [from_nvme, to_nvme] : moves) {
      SCOPED_TRACE(cat(state_dtype_name(state), from_nvme ? ": nvme -> " : ": ram -> ", to_nvme ? "nvme" : "ram"));
      {
        test::Trainer first(Schedule::sync, DType::f32, from_nvme ? nvme(o) : o);
        first.run(1, 5, grads);
        const Status saved = first.opt().save(path);
        ASSERT_TRUE(saved.ok()) << saved.to_string();
      }
      for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
        SCOPED_TRACE(schedule_name(schedule));
        test::Trainer second(schedule, DType::f32, to_nvme ? nvme(o) : o);
        const Status loaded = second.opt().load(path);
        ASSERT_TRUE(loaded.ok()) << loaded.to_string();
        second.run(6, 10, grads);
        const test::RunResult resumed = second.result();
        ASSERT_EQ(whole.state.size(), resumed.state.size());
        EXPECT_EQ(std::memcmp(whole.state.data(), resumed.state.data(), whole.state.size() * 4), 0);
        EXPECT_EQ(whole.device_weights, resumed.device_weights);
      }
    }
  }
}

// A loaded checkpoint and write_state reach the device's f32 weights at once (before any step): they are the
// master, copied out of the store.
TEST_F(Fp32OnNvme, LoadAndWriteStateSetTheDeviceWeights) {
  const std::string path = (dir_ / "early.zoeckpt").string();
  std::vector<unsigned char> saved_weights;
  {
    test::Trainer first(Schedule::sync, DType::f32, nvme({}));
    first.run(1, 3, test::random_grads(1e-2));
    ASSERT_TRUE(first.opt().save(path).ok());
    saved_weights = first.device_weights();
  }
  test::Trainer second(Schedule::overlap, DType::f32, nvme({}));
  ASSERT_NE(second.device_weights(), saved_weights);
  ASSERT_TRUE(second.opt().load(path).ok());
  EXPECT_EQ(second.device_weights(), saved_weights);

  const std::size_t n = second.model().specs[2].n;
  std::vector<float> master(n);
  for (std::size_t k = 0; k < n; ++k) master[k] = 0.25f + static_cast<float>(k) * 1e-3f;
  ASSERT_TRUE(second.opt().write_state(2, master.data(), nullptr, nullptr).ok());
  ASSERT_TRUE(second.opt().wait().ok());
  const auto* device = static_cast<const float*>(second.model().specs[2].device_weights);
  EXPECT_EQ(std::memcmp(device, master.data(), n * 4), 0);
  std::vector<float> read(n);
  ASSERT_TRUE(second.opt().read_state(2, read.data(), nullptr, nullptr).ok());
  EXPECT_EQ(std::memcmp(read.data(), master.data(), n * 4), 0);
}

}  // namespace
}  // namespace zoe
