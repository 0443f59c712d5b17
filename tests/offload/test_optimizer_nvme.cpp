// OffloadOptimizer with tier nvme: p, m and v in a swap store instead of RAM. Every schedule must give the
// bits of tier ram's sync schedule, save/load must cross tiers, and bad configurations are refused.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "zoe/host_device.h"
#include "tests/offload/trainer.h"
#include "zoe/swap.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

class NvmeTier : public ::testing::Test {
 protected:
  void SetUp() override {
    // Where /tmp is tmpfs the store falls back to buffered I/O (with a warning): the results are the same.
    dir_ = fs::path(::testing::TempDir()) / ("zoe_nvme_tier_" + std::to_string(::getpid()));
    fs::create_directories(dir_ / "a");
    fs::create_directories(dir_ / "b");
  }
  void TearDown() override { fs::remove_all(dir_); }

  OffloadOptions nvme(OffloadOptions o, int paths = 1) const {
    o.tier = Tier::nvme;
    o.nvme.paths = {(dir_ / "a").string()};
    if (paths > 1) o.nvme.paths.push_back((dir_ / "b").string());
    o.nvme.buffer_count = 3;
    return o;
  }

  fs::path dir_;
};

// Gradients the trainer changed after reporting them come down again (tier nvme copies them during backward).
TEST_F(NvmeTier, ChangedGradsAreTakenAgain) {
  const test::GradFn grads = test::random_grads(1e-2);
  const test::GradFn halved = [grads](test::DeviceParams& model, int t, float scale) { grads(model, t, scale * 0.5f); };
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    SCOPED_TRACE(std::string(schedule_name(schedule)));
    const test::RunResult reference = test::train(schedule, DType::bf16, nvme({}), 6, halved, 2);
    test::Trainer trainer(schedule, DType::bf16, nvme({}), 2);
    trainer.run(1, 6, grads, [](test::DeviceParams& model, OffloadOptimizer& opt) {
      for (const ParamSpec& p : model.specs) {
        for (std::size_t k = 0; k < p.n; ++k) model.set(const_cast<void*>(p.device_grads), k, model.get(p.device_grads, k) * 0.5f);
      }
      ASSERT_TRUE(opt.grads_changed().ok());
    });
    test::expect_bitwise_equal(reference, trainer.result());
  }
}

// Accumulated micro-batches: the swap store's step reads the fp32 sums as tier ram's does.
// The CPU as the device: a trainer reads the weights on the host as soon as step() returns, with nothing
// ordering it after the engine's copies (tier nvme with the overlap schedule steps out of place and copies
// the new weights from its staging). Chaos delays every copy, so a step that returned before its copies
// were done would show the old weights here.
TEST_F(NvmeTier, OnTheCpuStepReturnsWithTheNewWeightsInPlace) {
  HostDeviceOptions ho;
  ho.cpu = true;
  ho.chaos_seed = 9;
  ho.chaos_max_s = 2e-3;
  std::unique_ptr<Device> device = make_host_device(ho);
  test::DeviceParams model(*device, DType::bf16, {1000, 37, 4096}, 42);
  OffloadOptions o;
  o.schedule = Schedule::overlap;
  Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, nvme(o));
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  OffloadOptimizer& opt = made.value();
  for (int t = 0; t < 3; ++t) {
    test::random_grads(1e-2)(model, t, 1.0f);
    ASSERT_TRUE(opt.step().ok());
    const std::vector<unsigned char> seen = model.weights();  // at once, as the trainer reads them
    ASSERT_TRUE(opt.wait().ok());
    std::vector<unsigned char> want;
    for (std::size_t i = 0; i < model.specs.size(); ++i) {
      std::vector<float> master(model.specs[i].n);
      ASSERT_TRUE(opt.read_state(i, master.data(), nullptr, nullptr).ok());
      for (float x : master) {
        const std::uint16_t b = float_to_bf16(x);
        want.push_back(static_cast<unsigned char>(b & 0xff));
        want.push_back(static_cast<unsigned char>(b >> 8));
      }
    }
    EXPECT_EQ(seen, want) << "step " << t;
  }
}

TEST_F(NvmeTier, AccumulationEqualsRam) {
  OffloadOptions o;
  o.gradient_accumulation_steps = 2;
  test::Trainer ram(Schedule::sync, DType::bf16, o, 0);
  ram.run_accumulating(1, 4, 2, test::random_grads(1e-2));
  const test::RunResult reference = ram.result();
  for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
    SCOPED_TRACE(std::string(schedule_name(schedule)));
    test::Trainer trainer(schedule, DType::bf16, nvme(o), 0);
    trainer.run_accumulating(1, 4, 2, test::random_grads(1e-2));
    test::expect_bitwise_equal(reference, trainer.result());
  }
}

// fp16 loss scaling that backs off at the first overflow, and clipping that bites: every branch of a step.
OffloadOptions fp16_scaled_and_clipped() {
  OffloadOptions o;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  o.max_grad_norm = 0.1f;
  return o;
}

TEST_F(NvmeTier, EveryScheduleEqualsRamSyncBitwise) {
  const OffloadOptions o = fp16_scaled_and_clipped();
  const test::GradFn grads = test::random_grads(1e-2, {5});  // an overflow at step 5
  const test::RunResult ram = test::train(Schedule::sync, DType::f16, o, 12, grads);
  EXPECT_EQ(ram.stats.skipped, 1);
  for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
    SCOPED_TRACE(std::string(schedule_name(schedule)));
    const test::RunResult on_disk = test::train(schedule, DType::f16, nvme(o, 2), 12, grads);
    test::expect_bitwise_equal(ram, on_disk);
    EXPECT_GT(on_disk.stats.nvme_read_bytes, 0u);
    EXPECT_GT(on_disk.stats.nvme_write_bytes, 0u);
  }
  // delayed against delayed: the schedule's own staleness, same bits from either tier.
  const test::RunResult ram_delayed = test::train(Schedule::delayed, DType::bf16, o, 12, grads, 3);
  const test::RunResult nvme_delayed = test::train(Schedule::delayed, DType::bf16, nvme(o), 12, grads, 3);
  test::expect_bitwise_equal(ram_delayed, nvme_delayed);
}

// Overlap on tier nvme steps the store during backward (SwapStore::speculate) and commits at step(): without
// clipping or an overflow it moves the bytes sync moves and redoes nothing, for every state dtype; an
// overflow stops the speculation (the step is skipped, what it wrote dropped) — sync's bits either way.
TEST_F(NvmeTier, OverlapCommitsItsSpeculationWithSyncsBytes) {
  for (DType state : {DType::f32, DType::bf16, DType::i8}) {
    for (bool overflow : {false, true}) {
      SCOPED_TRACE(std::string(state_dtype_name(state)) + (overflow ? ", an overflow at step 5" : ""));
      OffloadOptions o;
      o.state_dtype = state;
      o.loss_scale.enabled = true;
      o.loss_scale.initial_scale = 1024;
      o.loss_scale.hysteresis = 1;
      const test::GradFn grads = overflow ? test::random_grads(1e-2, {5}) : test::random_grads(1e-2);
      const test::RunResult sync = test::train(Schedule::sync, DType::f16, nvme(o, 2), 8, grads);
      const test::RunResult overlap = test::train(Schedule::overlap, DType::f16, nvme(o, 2), 8, grads);
      test::expect_bitwise_equal(sync, overlap);
      const std::uint64_t per_step = sync.stats.nvme_read_bytes / static_cast<std::uint64_t>(sync.steps);
      if (!overflow) {
        EXPECT_EQ(overlap.stats.redone, 0);
        EXPECT_EQ(overlap.stats.nvme_read_bytes, sync.stats.nvme_read_bytes);
        EXPECT_EQ(overlap.stats.nvme_write_bytes, sync.stats.nvme_write_bytes);
      } else {
        EXPECT_EQ(overlap.stats.redone, 1);
        // What the stopped speculation read of step 5 before the overflow was seen: at most a step.
        EXPECT_GE(overlap.stats.nvme_read_bytes, sync.stats.nvme_read_bytes);
        EXPECT_LE(overlap.stats.nvme_read_bytes, sync.stats.nvme_read_bytes + per_step);
      }
    }
  }
}

// A parameter without a gradient (frozen) is left out of the next speculation: the tiles only it covers are
// not read and rewritten unchanged, so from the second step on overlap moves sync's bytes — and when it has a
// gradient again, the step is redone with it. Sync's bits throughout.
TEST_F(NvmeTier, AParameterWithoutGradientsCostsOverlapNoIo) {
  struct Run {
    std::vector<unsigned char> weights;
    std::vector<float> state;
    StepStats after_first, last;
  };
  auto run = [&](Schedule schedule) {
    std::unique_ptr<Device> device = make_host_device();
    test::DeviceParams model(*device, DType::bf16, {1000, 8192, 37, 4096}, 42);
    OffloadOptions o = nvme({});
    o.schedule = schedule;
    o.tile = 1024;  // 14 tiles through 3 buffers: streamed, not resident
    Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
    EXPECT_TRUE(made.ok()) << made.status().to_string();
    Run r;
    if (!made.ok()) return r;
    OffloadOptimizer& opt = made.value();
    for (int t = 1; t <= 6; ++t) {
      EXPECT_TRUE(device->synchronize().ok());
      test::random_grads(1e-2)(model, t, 1.0f);
      const bool frozen = t != 5;  // parameter 1 (seven tiles of its own) has a gradient at step 5 only
      for (std::size_t b = model.specs.size(); b-- > 0;) {
        if (b == 1 && frozen) continue;
        EXPECT_TRUE(opt.grad_ready(b).ok());
      }
      if (frozen) {
        EXPECT_TRUE(opt.set_grads_absent({1}).ok());
      }
      const Status s = opt.step();
      EXPECT_TRUE(s.ok()) << s.to_string();
      if (t == 1) r.after_first = opt.stats();
    }
    EXPECT_TRUE(opt.wait().ok());
    r.last = opt.stats();
    r.weights = model.weights();
    for (std::size_t i = 0; i < model.specs.size(); ++i) {
      std::vector<float> p(model.specs[i].n), m(p.size()), v(p.size());
      EXPECT_TRUE(opt.read_state(i, p.data(), m.data(), v.data()).ok());
      for (const auto* a : {&p, &m, &v}) r.state.insert(r.state.end(), a->begin(), a->end());
    }
    return r;
  };
  const Run sync = run(Schedule::sync), overlap = run(Schedule::overlap);
  EXPECT_EQ(sync.weights, overlap.weights);
  ASSERT_EQ(sync.state.size(), overlap.state.size());
  EXPECT_EQ(std::memcmp(sync.state.data(), overlap.state.data(), sync.state.size() * 4), 0);
  EXPECT_EQ(overlap.last.redone, 1) << "step 5, where parameter 1 has its gradient again";
  // Steps 2-6 but 5 and 6 (redone; and 6 speculates parameter 1 in, as it had a gradient at 5): sync's bytes.
  const auto read = [](const Run& r) { return r.last.nvme_read_bytes - r.after_first.nvme_read_bytes; };
  EXPECT_GT(read(overlap), 0u);
  EXPECT_LE(read(overlap), read(sync) + (read(sync) / 5) * 2);
  EXPECT_GT(overlap.after_first.nvme_read_bytes, sync.after_first.nvme_read_bytes)
      << "the first speculation knows nothing yet: it reads parameter 1's tiles";
}

// A model laid out in two buckets (as Python lays one per dtype or param group) whose backward reports across
// both: the first speculation knows no order and reads the last tiles first; from the second on the tiles are
// read in the order their gradients came last iteration, so none waits behind a tile reported late. Six
// parameters of one tile each; reads (one request per tile) seen through the store's I/O hook.
TEST_F(NvmeTier, OverlapSpeculatesTilesInTheOrderGradientsCameLastIteration) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, {1024, 1024, 1024, 1024, 1024, 1024}, 42);
  OffloadOptions o = nvme({});
  o.schedule = Schedule::overlap;
  o.tile = 1024;  // 6 tiles through 3 buffers: streamed, every tile read each step
  std::mutex mu;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> reads;  // (request index, file offset)
  o.nvme.fault_hook = [&](const IoSite& site) {
    if (site.op == IoOp::read) {
      const std::lock_guard lock(mu);
      reads.emplace_back(site.index, site.offset);
    }
    return IoFault{};
  };
  Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  OffloadOptimizer& opt = made.value();
  const std::vector<std::size_t> backward = {2, 5, 1, 4, 0, 3};  // buckets {0, 1, 2} and {3, 4, 5}, interleaved
  for (int t = 1; t <= 4; ++t) {
    SCOPED_TRACE("step " + std::to_string(t));
    ASSERT_TRUE(device->synchronize().ok());
    test::random_grads(1e-2)(model, t, 1.0f);
    {
      const std::lock_guard lock(mu);
      reads.clear();
    }
    for (std::size_t i : backward) ASSERT_TRUE(opt.grad_ready(i).ok());
    ASSERT_TRUE(opt.step().ok());
    ASSERT_TRUE(opt.wait().ok());
    // Tiles by their offsets (all in one half of the file: every tile moves to its other slot each step).
    std::vector<std::pair<std::uint64_t, std::uint64_t>> seen;
    {
      const std::lock_guard lock(mu);
      seen = reads;
    }
    std::sort(seen.begin(), seen.end());
    std::vector<std::uint64_t> offsets;
    for (const auto& r : seen) offsets.push_back(r.second);
    std::vector<std::uint64_t> by_tile = offsets;
    std::sort(by_tile.begin(), by_tile.end());
    ASSERT_EQ(by_tile.size(), 6u);
    std::vector<std::size_t> order;
    for (std::uint64_t off : offsets) {
      order.push_back(static_cast<std::size_t>(std::find(by_tile.begin(), by_tile.end(), off) - by_tile.begin()));
    }
    const std::vector<std::size_t> descending = {5, 4, 3, 2, 1, 0};
    EXPECT_EQ(order, t == 1 ? descending : backward);
  }
  EXPECT_EQ(opt.stats().redone, 0);
}

// A write that fails inside the speculation (the disk, not the gradients) stops it: step() drops what it
// wrote and steps as sync from the state the store kept, which then writes again — sync's bits.
TEST_F(NvmeTier, AFailedWriteDuringTheSpeculationIsRedoneWithSyncsBits) {
  OffloadOptions o = nvme({});
  o.tile = 1024;  // streamed: the speculation writes its tiles itself
  const test::RunResult reference = test::train(Schedule::sync, DType::bf16, o, 5, test::random_grads(1e-2));
  std::atomic<int> failed{0};
  std::atomic<bool> armed{false};
  o.nvme.fault_hook = [&](const IoSite& site) {
    if (site.op == IoOp::write && armed.load() && failed.fetch_add(1) == 0) return IoFault{EIO, -1};
    return IoFault{};
  };
  test::Trainer trainer(Schedule::overlap, DType::bf16, o, 0);
  trainer.run(1, 5, test::random_grads(1e-2), [&](test::DeviceParams&, OffloadOptimizer&) { armed = true; });
  const test::RunResult overlap = trainer.result();
  EXPECT_GE(failed.load(), 1) << "the fault was never hit";
  test::expect_bitwise_equal(reference, overlap);
  EXPECT_EQ(overlap.stats.redone, 1);
}

// What makes a speculation wrong after backward — a learning rate set late, a parameter named absent after it
// was reported, clipping that bites — has it dropped and the step redone from the state the store kept. A
// parameter that had no gradient last step is left out of the next speculation, so naming it absent again
// costs a redo only the first time.
TEST_F(NvmeTier, AWrongSpeculationIsRedoneWithSyncsBits) {
  using After = test::Trainer::AfterBackward;
  struct Case {
    const char* what;
    After after;
    std::int64_t redone;  // of 5 steps
  };
  const std::vector<Case> cases = {
      {"a late learning rate", [](test::DeviceParams&, OffloadOptimizer& opt) { opt.group_hyper(0).lr *= 0.9f; }, 5},
      {"named absent after its report",
       [](test::DeviceParams&, OffloadOptimizer& opt) { ASSERT_TRUE(opt.set_grads_absent({1}).ok()); }, 1},
      {"clipping", [](test::DeviceParams&, OffloadOptimizer& opt) { ASSERT_TRUE(opt.set_max_grad_norm(0.05f).ok()); },
       5},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto run = [&](Schedule schedule) {  // one at a time: a swap store has one owner
      test::Trainer t(schedule, DType::bf16, nvme({}), 0);
      t.run(1, 5, test::random_grads(1e-2), c.after);
      return t.result();
    };
    const test::RunResult a = run(Schedule::sync), b = run(Schedule::overlap);
    test::expect_bitwise_equal(a, b);
    EXPECT_EQ(b.stats.redone, c.redone);
  }
}

// A state that fits in the store's buffers stays resident (NvmeOptions::keep_resident): no reads after the
// first, writes finished after step() returns; the same bits as tier ram, on the host stand-in (staged) and
// on the CPU device (sync steps tier nvme in place there), with loss scaling and clipping.
TEST_F(NvmeTier, ResidentStateGivesTheBitsOfRamAndReadsNothing) {
  const OffloadOptions o = fp16_scaled_and_clipped();
  const test::GradFn grads = test::random_grads(1e-2, {5});  // an overflow at step 5
  for (bool cpu_device : {false, true}) {
    for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
      SCOPED_TRACE(std::string(schedule_name(schedule)) + (cpu_device ? " on the CPU device" : " staged"));
      const int warmup = schedule == Schedule::delayed ? 3 : 0;
      test::Trainer ram(schedule, DType::f16, o, warmup, {1000, 37, 4096, 1}, nullptr, 0, cpu_device);
      ram.run(1, 12, grads);
      OffloadOptions on_disk = nvme(o);
      on_disk.nvme.buffer_count = 8;  // the 6 tiles of 1024 elements (Trainer's tile 700, aligned) all fit
      test::Trainer trainer(schedule, DType::f16, on_disk, warmup, {1000, 37, 4096, 1}, nullptr, 0, cpu_device);
      trainer.run(1, 12, grads);
      const test::RunResult a = ram.result(), b = trainer.result();
      test::expect_bitwise_equal(a, b);
      EXPECT_EQ(b.stats.nvme_read_bytes, 0u) << "a resident state is never read back";
      EXPECT_GT(b.stats.nvme_write_bytes, 0u);
    }
  }
}

// Durability changes when the swap files are synced, never the result: checkpoint gives the bits of step
// (and of tier ram), and save() leaves the swap store durable (its manifest and table reopen at that step).
TEST_F(NvmeTier, BothDurabilitiesGiveTheSameBitsAndSaveMakesTheStoreDurable) {
  OffloadOptions o;
  o.max_grad_norm = 0.1f;
  const test::GradFn grads = test::random_grads(1e-2);
  const test::RunResult ram = test::train(Schedule::sync, DType::bf16, o, 6, grads);
  for (Durability durability : {Durability::step, Durability::checkpoint}) {
    SCOPED_TRACE(std::string(durability_name(durability)));
    OffloadOptions d = nvme(o);
    d.nvme.durability = durability;
    auto t = std::make_unique<test::Trainer>(Schedule::sync, DType::bf16, d);
    t->run(1, 6, grads);
    test::expect_bitwise_equal(ram, t->result());
    const std::string ckpt = (dir_ / ("save_" + std::string(durability_name(durability)))).string();
    ASSERT_TRUE(t->opt().save(ckpt).ok());
    // The store's files as they are on disk right after save() open at the saved step (as after a crash
    // now): copied aside while the optimizer holds them, put back once it has let go (it makes the store
    // durable again as it closes, which the copy does not see).
    const fs::path swap = dir_ / "a", aside = dir_ / "aside";
    fs::remove_all(aside);
    fs::copy(swap, aside);
    t.reset();
    fs::remove_all(swap);
    fs::copy(aside, swap);
    SwapOptions so = SwapOptions::from(d.nvme);
    const std::size_t total = 1000 + 37 + 4096 + 1;
    const std::size_t tile = 1024;  // the trainer's 700-element pieces, rounded up to whole 4 KiB blocks
    Result<SwapStore> on_disk = SwapStore::open(so, "zoe-optimizer", total, tile);
    ASSERT_TRUE(on_disk.ok()) << on_disk.status().to_string();
    EXPECT_EQ(on_disk->tile_step(0), 6);
    std::vector<float> p(total);
    const Status r = on_disk->read(0, total, p.data(), nullptr, nullptr);
    ASSERT_TRUE(r.ok()) << r.to_string();
  }
}

TEST_F(NvmeTier, SaveLoadCrossesTiers) {
  OffloadOptions o;
  o.max_grad_norm = 0.5f;
  const test::GradFn grads = test::random_grads(1e-2);
  const test::RunResult whole = test::train(Schedule::sync, DType::bf16, o, 10, grads);
  const std::string path = (dir_ / "state.zoeckpt").string();
  for (bool save_from_nvme : {true, false}) {
    SCOPED_TRACE(save_from_nvme ? "nvme -> ram" : "ram -> nvme");
    {
      test::Trainer first(Schedule::sync, DType::bf16, save_from_nvme ? nvme(o) : o);
      first.run(1, 5, grads);
      const Status saved = first.opt().save(path);
      ASSERT_TRUE(saved.ok()) << saved.to_string();
    }
    test::Trainer second(Schedule::sync, DType::bf16, save_from_nvme ? o : nvme(o));
    const Status loaded = second.opt().load(path);
    ASSERT_TRUE(loaded.ok()) << loaded.to_string();
    second.run(6, 10, grads);
    const test::RunResult resumed = second.result();
    EXPECT_EQ(std::memcmp(whole.state.data(), resumed.state.data(), whole.state.size() * 4), 0);
    EXPECT_EQ(whole.device_weights, resumed.device_weights);
  }
}

TEST_F(NvmeTier, BadConfigurationsAreRefusedNamingWhat) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, {100}, 1);
  OffloadOptions no_paths = nvme({});
  no_paths.nvme.paths.clear();
  EXPECT_EQ(OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, no_paths).status().code(),
            StatusCode::invalid_argument);

  OffloadOptions missing = nvme({});
  missing.nvme.paths = {(dir_ / "does-not-exist").string()};
  Result<OffloadOptimizer> m = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, missing);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("does-not-exist"), std::string::npos) << m.status().to_string();
}

}  // namespace
}  // namespace zoe
