// Lion, Adagrad and AMSGrad through OffloadOptimizer (the optimizer table, zoe/optimizers.h): the offloaded
// step is the kernels' step of the group's rule; every tier and schedule gives the same bits; the tiers keep
// the rule's state arrays (one for Lion and Adagrad, three with amsgrad); checkpoints carry the rule and
// refuse another's; a DeepSpeed config names them.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "src/offload/checkpoint.h"
#include "src/offload/footprint.h"
#include "tests/offload/trainer.h"
#include "zoe/aligned_buffer.h"
#include "zoe/config.h"
#include "zoe/host_device.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

using test::cat;

const std::vector<std::size_t> kSizes = {1000, 37, 4096, 1};

// The trainer's two groups (parameter 2 in group 1) with the rule's hyper-parameters: weight decay in both,
// and for Adagrad lr_decay and a starting sum in one of them; Rule::adam is AMSGrad (AdamW and Adam's L2).
std::vector<ParamGroup> groups_of(Rule rule) {
  if (rule == Rule::adam) {
    std::vector<ParamGroup> g = test::two_groups();
    for (ParamGroup& x : g) x.hyper.amsgrad = true;
    return g;
  }
  std::vector<ParamGroup> g(2, ParamGroup{hyper_defaults(rule)});
  g[0].hyper.lr = rule == Rule::lion ? 1e-3f : 1e-2f;
  g[0].hyper.weight_decay = 0.01f;
  g[1].hyper.lr = rule == Rule::lion ? 5e-4f : 5e-3f;
  g[1].hyper.weight_decay = 0.1f;
  if (rule == Rule::adagrad) {
    g[0].hyper.lr_decay = 0.01f;
    g[1].hyper.initial_accumulator_value = 0.1f;
  }
  return g;
}

// The kernel's own step of each parameter, with its group's hyper-parameters, on a model made as the
// trainer's (the same seed), fed the same gradients: master and state as Trainer::result() lists them
// (master, then the state arrays), and the 16-bit weights the kernel writes.
test::RunResult kernel_reference(Rule rule, DType dtype, int steps, const test::GradFn& grads) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, dtype, kSizes, 42);
  model.specs[2].group = 1;
  const std::vector<ParamGroup> groups = groups_of(rule);
  Result<CpuAdam> engine = CpuAdam::create();
  EXPECT_TRUE(engine.ok());
  const std::size_t arrays = state_arrays(groups[0].hyper);
  std::vector<std::vector<float>> master, state[3];
  for (const ParamSpec& p : model.specs) {
    std::vector<float> w(p.n);
    for (std::size_t k = 0; k < p.n; ++k) w[k] = model.get(p.device_weights, k);
    master.push_back(w);
    state[0].emplace_back(p.n, groups[static_cast<std::size_t>(p.group)].hyper.initial_accumulator_value);
    state[1].emplace_back(arrays > 1 ? p.n : 0, 0.0f);
    state[2].emplace_back(arrays > 2 ? p.n : 0, 0.0f);
  }
  for (int t = 1; t <= steps; ++t) {
    grads(model, t, 1.0f);
    for (std::size_t i = 0; i < model.specs.size(); ++i) {
      const ParamSpec& p = model.specs[i];
      void* out = p.dtype == DType::f32 ? nullptr : p.device_weights;
      OneStateTensor x{master[i].data(), state[0][i].data(), DType::f32, p.device_grads, p.dtype, out, p.dtype, p.n, {}};
      AdamTensor a;
      a.param = master[i].data();
      a.exp_avg = state[0][i].data();
      a.exp_avg_sq = state[1][i].data();
      a.max_exp_avg_sq = state[2][i].data();
      a.grad = p.device_grads;
      a.grad_dtype = p.dtype;
      a.out = out;
      a.out_dtype = p.dtype;
      a.n = p.n;
      StepOptions o;
      o.step = t;
      const OptimizerHyper& h = groups[static_cast<std::size_t>(p.group)].hyper;
      const bool adam = h.rule == Rule::adam;
      EXPECT_TRUE(step_rule(engine.value(), h, o, std::span<const AdamTensor>(&a, adam ? 1 : 0),
                            std::span<const OneStateTensor>(&x, adam ? 0 : 1)).ok());
      if (p.dtype == DType::f32) std::memcpy(p.device_weights, master[i].data(), p.n * 4);
    }
  }
  test::RunResult r;
  for (std::size_t i = 0; i < model.specs.size(); ++i) {
    for (const std::vector<float>* a : {&master[i], &state[0][i], &state[1][i], &state[2][i]}) {
      r.state.insert(r.state.end(), a->begin(), a->end());
    }
  }
  r.device_weights = model.weights();
  r.scales.assign(static_cast<std::size_t>(steps), 1.0f);  // no loss scaling
  r.steps = steps;
  return r;
}

class OptimizerRules : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / cat("zoe_rules_", std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Tier nvme in a folder of its own for each optimizer: one store serves one optimizer at a time.
  OffloadOptions tier(bool nvme, DType state = DType::f32) {
    OffloadOptions o;
    o.state_dtype = state;
    if (!nvme) return o;
    const fs::path own = dir_ / cat("store", std::to_string(stores_++));
    fs::create_directories(own);
    o.tier = Tier::nvme;
    o.nvme.paths = {own.string()};
    o.nvme.buffer_count = 3;
    return o;
  }

  test::RunResult run(Rule rule, Schedule schedule, const OffloadOptions& o, int steps = 6, DType dtype = DType::bf16) {
    test::Trainer t(schedule, dtype, o, schedule == Schedule::delayed ? 2 : 0, kSizes, nullptr, 0, false, groups_of(rule));
    EXPECT_TRUE(t.created());
    if (!t.created()) return {};
    t.run(1, steps, test::random_grads(1e-2));
    return t.result();
  }

  // Steps 1-4 of `rule` with the trainer's gradients, saved to `path`.
  void save_halfway(Rule rule, const OffloadOptions& o, const std::string& path) {
    test::Trainer first(Schedule::sync, DType::bf16, o, 0, kSizes, nullptr, 0, false, groups_of(rule));
    ASSERT_TRUE(first.created());
    first.run(1, 4, test::random_grads(1e-2));
    ASSERT_TRUE(first.opt().save(path).ok());
  }

  // A new optimizer of `rule` loads `path` and runs steps 5-8: it ends bit for bit as `whole`, the 8 steps
  // uninterrupted. Returned for further loads.
  std::unique_ptr<test::Trainer> expect_resumes(Rule rule, const OffloadOptions& o, const std::string& path,
                                                const test::RunResult& whole) {
    auto second = std::make_unique<test::Trainer>(Schedule::sync, DType::bf16, o, 0, kSizes, nullptr, 0, false,
                                                  groups_of(rule));
    EXPECT_TRUE(second->created());
    if (!second->created()) return second;
    const Status loaded = second->opt().load(path);
    EXPECT_TRUE(loaded.ok()) << loaded.to_string();
    second->run(5, 8, test::random_grads(1e-2));
    test::RunResult resumed = second->result();
    resumed.scales = whole.scales;
    test::expect_bitwise_equal(whole, resumed);
    return second;
  }

  fs::path dir_;
  int stores_ = 0;
};

TEST_F(OptimizerRules, SyncOnTierRamIsTheKernelsStepOfTheGroupsRule) {
  for (Rule rule : {Rule::lion, Rule::adagrad, Rule::adam}) {
    for (DType dtype : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(cat(optimizer_rule(rule).name, ", ", dtype_name(dtype)));
      const test::RunResult engine = run(rule, Schedule::sync, tier(false), 6, dtype);
      const test::RunResult kernel = kernel_reference(rule, dtype, 6, test::random_grads(1e-2));
      test::expect_bitwise_equal(engine, kernel);
      EXPECT_EQ(engine.steps, 6);
    }
  }
}

// Overlap's speculative steps write the second state set and are kept; tier nvme streams [p | m] slots; the
// delayed schedule's background step: each equal bit for bit to its counterpart on the other tier, and
// overlap to sync.
TEST_F(OptimizerRules, EveryTierAndScheduleGivesTheSameBits) {
  for (Rule rule : {Rule::lion, Rule::adagrad, Rule::adam}) {
    for (DType state : {DType::f32, DType::bf16}) {
      const test::RunResult sync = run(rule, Schedule::sync, tier(false, state));
      for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
        SCOPED_TRACE(cat(optimizer_rule(rule).name, ", ", schedule_name(schedule), ", ", state_dtype_name(state)));
        const test::RunResult ram = run(rule, schedule, tier(false, state));
        const test::RunResult nvme = run(rule, schedule, tier(true, state));
        test::expect_bitwise_equal(ram, nvme);
        if (schedule != Schedule::delayed) {
          test::expect_bitwise_equal(ram, sync);
        }
        if (schedule == Schedule::overlap) {
          EXPECT_EQ(ram.stats.redone, 0) << "the speculation was kept";
        }
      }
    }
  }
}

// One state array: tier ram allocates one moment array fewer than Adam (the footprint says so and the
// optimizer holds what it says), and tier nvme's slots are [p | m].
TEST_F(OptimizerRules, TheTiersHoldOneStateArray) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, kSizes, 42);
  std::size_t total = 0;
  for (const ParamSpec& p : model.specs) total += p.n;
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "nvme" : "ram");
    Result<SpaceNeed> adam = optimizer_footprint(*device, model.specs, tier(nvme), "rules", hyper_defaults(Rule::adam));
    Result<SpaceNeed> lion = optimizer_footprint(*device, model.specs, tier(nvme), "rules", hyper_defaults(Rule::lion));
    ASSERT_TRUE(adam.ok() && lion.ok());
    if (!nvme) {
      EXPECT_EQ(adam->ram - lion->ram, AlignedBuffer::size_for(total * 4)) << "one fp32 moment array fewer";
    } else {
      ASSERT_EQ(lion->disk.size(), 1u);
      ASSERT_EQ(adam->disk.size(), 1u);
      EXPECT_LT(lion->disk[0].bytes, adam->disk[0].bytes) << "slots of [p | m] against [p | m | v]";
      const NvmeStoreShape shape = nvme_store_shape(model.specs, tier(true), 1);
      EXPECT_EQ(shape.options.state_arrays, 1u);
    }
  }
}

// Lion's one moment in 8 bits (m's code, a scale per block): tier nvme's [p | m codes | m scales] slots step
// as tier ram does, overlap as sync; checkpoints hold the codes and scales (no v) and resume bit for bit; the
// state takes one byte per element and one scale array. (Blocks are counted from each piece a rank holds,
// so a ZeRO partition's i8 run equals one rank's only where its cuts fall on blocks, as for Adam's codes.)
TEST_F(OptimizerRules, LionKeepsItsMomentInEightBits) {
  const test::RunResult sync = run(Rule::lion, Schedule::sync, tier(false, DType::i8));
  const test::RunResult f32 = run(Rule::lion, Schedule::sync, tier(false));
  EXPECT_NE(sync.state, f32.state) << "the codes are in effect";
  for (Schedule schedule : {Schedule::sync, Schedule::overlap, Schedule::delayed}) {
    SCOPED_TRACE(schedule_name(schedule));
    const test::RunResult ram = run(Rule::lion, schedule, tier(false, DType::i8));
    test::expect_bitwise_equal(ram, run(Rule::lion, schedule, tier(true, DType::i8)));
    if (schedule != Schedule::delayed) test::expect_bitwise_equal(ram, sync);
    if (schedule == Schedule::overlap) {
      EXPECT_EQ(ram.stats.redone, 0) << "the speculation was kept";
    }
  }
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "nvme" : "ram");
    const test::RunResult whole = run(Rule::lion, Schedule::sync, tier(nvme, DType::i8), 8);
    const std::string path = (dir_ / "lion_i8.zoeckpt").string();
    save_halfway(Rule::lion, tier(nvme, DType::i8), path);
    Result<CheckpointReader> saved = CheckpointReader::open(path);
    ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    EXPECT_TRUE(saved->has("exp_avg_q8") && saved->has("exp_avg_scale"));
    EXPECT_FALSE(saved->has("exp_avg_sq_q8") || saved->has("exp_avg_sq_scale"));
    expect_resumes(Rule::lion, tier(nvme, DType::i8), path, whole);
  }
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, kSizes, 42);
  std::size_t total = 0, blocks = 0;
  for (const ParamSpec& p : model.specs) {
    total += p.n;
    blocks += moment_blocks(p.n);
  }
  Result<SpaceNeed> lion = optimizer_footprint(*device, model.specs, tier(false, DType::i8), "rules",
                                               hyper_defaults(Rule::lion));
  Result<SpaceNeed> master = optimizer_footprint(*device, model.specs, tier(false, DType::i8), "rules",
                                                 hyper_defaults(Rule::adam));
  ASSERT_TRUE(lion.ok() && master.ok());
  EXPECT_EQ(master->ram - lion->ram, AlignedBuffer::size_for(total) + AlignedBuffer::size_for(blocks * 4))
      << "Adam's v codes and scales, which Lion does not keep";
}

// ZeRO partitioned over two ranks (each steps its shard with the rule, then all-gather), every rank fed the
// same gradients: every rank's weights are the unpartitioned optimizer's.
TEST_F(OptimizerRules, PartitionedRanksStepTheRule) {
  for (Rule rule : {Rule::lion, Rule::adagrad, Rule::adam}) {
    SCOPED_TRACE(optimizer_rule(rule).name);
    const test::RunResult whole = run(rule, Schedule::sync, tier(false), 5);
    std::shared_ptr<HostGroup> group = make_host_group(2);
    std::vector<std::vector<unsigned char>> weights(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        test::Trainer t(Schedule::sync, DType::bf16, OffloadOptions{}, 0, kSizes, group, r, false, groups_of(rule));
        if (!t.created()) return;
        t.run(1, 5, test::random_grads(1e-2));
        weights[r] = t.device_weights();
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < 2; ++r) EXPECT_EQ(weights[r], whole.device_weights) << "rank " << r;
  }
}

TEST_F(OptimizerRules, CheckpointsCarryTheRuleAndRefuseAnothers) {
  const test::GradFn grads = test::random_grads(1e-2);
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "nvme" : "ram");
    const test::RunResult whole = run(Rule::adagrad, Schedule::sync, tier(nvme), 8);
    const std::string path = (dir_ / "adagrad.zoeckpt").string();
    save_halfway(Rule::adagrad, tier(nvme), path);
    Result<CheckpointReader> saved = CheckpointReader::open(path);
    ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    EXPECT_NE(saved->manifest().find("\"optimizer\":\"adagrad\""), std::string::npos) << saved->manifest();
    EXPECT_TRUE(saved->has("sum"));
    EXPECT_FALSE(saved->has("exp_avg_sq"));
    expect_resumes(Rule::adagrad, tier(nvme), path, whole);

    // Another rule's optimizer, and Adam's, refuse the file by name and keep their state.
    for (Rule other : {Rule::lion, Rule::adam}) {
      test::Trainer t(Schedule::sync, DType::bf16, tier(nvme), 0, kSizes, nullptr, 0, false,
                      other == Rule::adam ? test::two_groups() : groups_of(other));
      ASSERT_TRUE(t.created());
      t.run(1, 2, grads);
      const test::RunResult before = t.result();
      const Status refused = t.opt().load(path);
      EXPECT_EQ(refused.code(), StatusCode::invalid_argument) << refused.to_string();
      EXPECT_NE(refused.message().find("the state of adagrad"), std::string::npos) << refused.message();
      EXPECT_NE(refused.message().find(std::string("runs ") + std::string(optimizer_rule(other).name)), std::string::npos)
          << refused.message();
      test::expect_bitwise_equal(before, t.result());
    }
  }
}

// AMSGrad's third array: checkpoints hold max_exp_avg_sq and resume bit for bit, and a checkpoint with it and
// one without refuse each other's optimizer by name.
TEST_F(OptimizerRules, AmsgradCheckpointsKeepTheMaximum) {
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "nvme" : "ram");
    const test::RunResult whole = run(Rule::adam, Schedule::sync, tier(nvme), 8);
    const std::string path = (dir_ / "amsgrad.zoeckpt").string();
    save_halfway(Rule::adam, tier(nvme), path);
    Result<CheckpointReader> saved = CheckpointReader::open(path);
    ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    EXPECT_TRUE(saved->has("max_exp_avg_sq"));
    EXPECT_NE(saved->manifest().find("\"amsgrad\":true"), std::string::npos) << saved->manifest();
    // Version 2: a reader from before amsgrad would take the file for plain Adam's.
    EXPECT_NE(saved->manifest().find("\"version\":2"), std::string::npos) << saved->manifest();
    const std::unique_ptr<test::Trainer> second = expect_resumes(Rule::adam, tier(nvme), path, whole);
    ASSERT_TRUE(second->created());

    test::Trainer plain(Schedule::sync, DType::bf16, tier(nvme));
    ASSERT_TRUE(plain.created());
    const Status refused = plain.opt().load(path);
    EXPECT_NE(refused.message().find("written with amsgrad = true"), std::string::npos) << refused.to_string();
    const std::string plain_path = (dir_ / "plain.zoeckpt").string();
    ASSERT_TRUE(plain.opt().save(plain_path).ok());
    EXPECT_NE(second->opt().load(plain_path).message().find("written with amsgrad = false"), std::string::npos);
  }
}

TEST_F(OptimizerRules, WhatTheEngineCannotHoldIsRefusedByName) {
  std::unique_ptr<Device> device = make_host_device();
  test::DeviceParams model(*device, DType::bf16, kSizes, 42);
  model.specs[2].group = 1;
  std::vector<ParamGroup> mixed = groups_of(Rule::lion);
  mixed[1].hyper = hyper_defaults(Rule::adagrad);
  Result<OffloadOptimizer> made = OffloadOptimizer::create(*device, mixed, model.specs, OffloadOptions{});
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("param group 1 runs adagrad, the optimizer lion"), std::string::npos)
      << made.status().to_string();

  std::vector<ParamGroup> half = groups_of(Rule::adam);
  half[1].hyper.amsgrad = false;
  made = OffloadOptimizer::create(*device, half, model.specs, OffloadOptions{});
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("param group 1 has amsgrad = false, the optimizer true"), std::string::npos)
      << made.status().to_string();

  OffloadOptions q8;
  q8.state_dtype = DType::i8;
  made = OffloadOptimizer::create(*device, groups_of(Rule::adam), model.specs, q8);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), StatusCode::unsupported) << made.status().to_string();
  made = OffloadOptimizer::create(*device, groups_of(Rule::adagrad), model.specs, q8);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), StatusCode::unsupported);
  EXPECT_NE(made.status().message().find("state_dtype i8 is not supported for adagrad"), std::string::npos);

  std::vector<ParamGroup> bad = groups_of(Rule::lion);
  bad[0].hyper.beta2 = 1.0f;
  made = OffloadOptimizer::create(*device, bad, model.specs, OffloadOptions{});
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("beta2"), std::string::npos) << made.status().to_string();

  test::Trainer t(Schedule::sync, DType::bf16, OffloadOptions{}, 0, kSizes, nullptr, 0, false, groups_of(Rule::lion));
  t.run(1, 2, test::random_grads(1e-2));
  const test::RunResult before = t.result();
  std::vector<float> p(kSizes[0]), m(kSizes[0]), v(kSizes[0]);
  const Status two = t.opt().read_state(0, p.data(), m.data(), v.data());
  EXPECT_NE(two.message().find("lion keeps one state array (exp_avg)"), std::string::npos) << two.to_string();
  EXPECT_FALSE(t.opt().write_state(0, nullptr, nullptr, v.data()).ok());
  // The rule cannot change under a running optimizer: step() and save() refuse and nothing moves.
  t.opt().group_hyper(1) = hyper_defaults(Rule::adam);
  const Status saved = t.opt().save((dir_ / "changed.zoeckpt").string());
  EXPECT_NE(saved.message().find("save: param group 1 runs adam, the optimizer lion"), std::string::npos)
      << saved.to_string();
  EXPECT_FALSE(fs::exists(dir_ / "changed.zoeckpt"));
  EXPECT_EQ(t.iteration(3, test::random_grads(1e-2)).code(), StatusCode::invalid_argument);
  t.opt().group_hyper(1) = groups_of(Rule::lion)[1].hyper;
  test::expect_bitwise_equal(before, t.result());
}

TEST(OptimizerRuleConfig, DeepSpeedTypesNameEveryRule) {
  Result<LoadedConfig> lion = parse_config(
      R"({"optimizer": {"type": "Lion", "params": {"lr": 3e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}}})", "<lion>");
  ASSERT_TRUE(lion.ok()) << lion.status().to_string();
  EXPECT_EQ(lion->hyper.rule, Rule::lion);
  EXPECT_FLOAT_EQ(lion->hyper.lr, 3e-4f);
  EXPECT_FLOAT_EQ(lion->hyper.beta1, 0.95f);
  EXPECT_FLOAT_EQ(lion->hyper.beta2, 0.98f);
  EXPECT_FLOAT_EQ(lion->hyper.weight_decay, 0.1f);

  Result<LoadedConfig> adagrad = parse_config(
      R"({"optimizer": {"type": "adagrad", "params": {"lr": 0.05, "eps": 1e-9, "initial_accumulator_value": 0.2}}})",
      "<adagrad>");
  ASSERT_TRUE(adagrad.ok()) << adagrad.status().to_string();
  EXPECT_EQ(adagrad->hyper.rule, Rule::adagrad);
  EXPECT_FLOAT_EQ(adagrad->hyper.lr, 0.05f);
  EXPECT_FLOAT_EQ(adagrad->hyper.eps, 1e-9f);
  EXPECT_FLOAT_EQ(adagrad->hyper.initial_accumulator_value, 0.2f);
  EXPECT_FLOAT_EQ(adagrad->hyper.lr_decay, 0.0f) << "torch's default";

  // A key of another rule is reported, not applied; an unknown type is refused with the table's names.
  Result<LoadedConfig> stray = parse_config(R"({"optimizer": {"type": "Lion", "params": {"eps": 1e-3}}})", "<stray>");
  ASSERT_TRUE(stray.ok());
  EXPECT_FLOAT_EQ(stray->hyper.eps, hyper_defaults(Rule::lion).eps);
  EXPECT_TRUE(std::any_of(stray->notes.begin(), stray->notes.end(),
                          [](const std::string& n) { return n.find("'optimizer.params.eps'") != std::string::npos; }));
  Result<LoadedConfig> unknown = parse_config(R"({"optimizer": {"type": "SGD"}})", "<sgd>");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("\"Adagrad\""), std::string::npos) << unknown.status().to_string();
}

TEST(OptimizerTable, NamesAndDefaultsAreTorchsAndThePapers) {
  const OptimizerHyper adagrad = hyper_defaults(Rule::adagrad);
  EXPECT_FLOAT_EQ(adagrad.lr, 1e-2f);  // torch.optim.Adagrad
  EXPECT_FLOAT_EQ(adagrad.eps, 1e-10f);
  const OptimizerHyper lion = hyper_defaults(Rule::lion);
  EXPECT_FLOAT_EQ(lion.lr, 1e-4f);  // arXiv 2302.06675's defaults
  EXPECT_FLOAT_EQ(lion.beta1, 0.9f);
  EXPECT_FLOAT_EQ(lion.beta2, 0.99f);
  EXPECT_EQ(state_arrays(lion), 1u);
  EXPECT_EQ(state_arrays(adagrad), 1u);
  EXPECT_EQ(state_arrays(OptimizerHyper{}), 2u);
  EXPECT_EQ(find_optimizer_rule("ADAMW")->rule, Rule::adam);
  EXPECT_EQ(find_optimizer_rule("lion")->rule, Rule::lion);
  EXPECT_EQ(find_optimizer_rule("sgd"), nullptr);
  for (const OptimizerRule& r : optimizer_rules()) {
    EXPECT_TRUE(validate_hyper(hyper_defaults(r.rule)).ok()) << r.name;
    EXPECT_EQ(&optimizer_rule(r.rule), &r);
  }
}

}  // namespace
}  // namespace zoe
