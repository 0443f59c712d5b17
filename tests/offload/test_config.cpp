#include <gtest/gtest.h>

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "base/utf8.h"
#include "zoe/config.h"

namespace zoe {
namespace {

// The example of /work/shared/reference/deepspeed-config.md, verbatim.
constexpr const char* kDeepSpeedExample = R"({
  "train_batch_size": 16,
  "gradient_accumulation_steps": 1,
  "gradient_clipping": 1.0,
  "optimizer": { "type": "AdamW",
                 "params": { "lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 3e-7 } },
  "fp16": { "enabled": true, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 1000,
            "hysteresis": 2, "consecutive_hysteresis": false, "min_loss_scale": 1 },
  "bf16": { "enabled": false },
  "zero_optimization": {
    "stage": 2,
    "sub_group_size": 1e9,
    "offload_optimizer": { "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                           "buffer_count": 4, "pipeline_read": false, "pipeline_write": false,
                           "fast_init": false, "ratio": 1.0 }
  },
  "aio": { "block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
           "single_submit": false, "overlap_events": true, "use_gds": false }
})";

// The one note that mentions `needle`; fails the test when there is none or more than one.
std::string note_about(const LoadedConfig& c, const std::string& needle) {
  std::string found;
  int count = 0;
  for (const std::string& n : c.notes) {
    if (n.find(needle) != std::string::npos) {
      found = n;
      ++count;
    }
  }
  EXPECT_EQ(count, 1) << "notes mentioning " << needle;
  return found;
}

std::string all_notes(const LoadedConfig& c) {
  std::string s;
  for (const std::string& n : c.notes) s += n + "\n";
  return s;
}

LoadedConfig parse_ok(const std::string& json) {
  Result<LoadedConfig> r = parse_config(json, "test.json");
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? r.value() : LoadedConfig{};
}

// Expects invalid_argument (or `code`) with a message naming the file and every one of `words`.
void expect_error(const std::string& json, const std::vector<std::string>& words,
                  StatusCode code = StatusCode::invalid_argument) {
  Result<LoadedConfig> r = parse_config(json, "test.json");
  ASSERT_FALSE(r.ok()) << json;
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find("test.json"), std::string::npos) << r.status().message();
  for (const std::string& w : words) {
    EXPECT_NE(r.status().message().find(w), std::string::npos) << "'" << w << "' not in: " << r.status().message();
  }
}

TEST(Config, DeepSpeedExampleValues) {
  const LoadedConfig c = parse_ok(kDeepSpeedExample);
  EXPECT_FLOAT_EQ(c.hyper.lr, 3e-5f);
  EXPECT_FLOAT_EQ(c.hyper.beta1, 0.9f);
  EXPECT_FLOAT_EQ(c.hyper.beta2, 0.999f);
  EXPECT_FLOAT_EQ(c.hyper.eps, 1e-8f);
  EXPECT_FLOAT_EQ(c.hyper.weight_decay, 3e-7f);
  EXPECT_TRUE(c.hyper.adamw);
  EXPECT_TRUE(c.hyper.bias_correction);
  const OffloadOptions& o = c.options;
  EXPECT_FLOAT_EQ(o.max_grad_norm, 1.0f);
  EXPECT_TRUE(o.loss_scale.enabled);
  EXPECT_TRUE(o.loss_scale.dynamic);
  EXPECT_EQ(o.loss_scale.initial_scale, 4294967296.0f);  // 2^32
  EXPECT_EQ(o.loss_scale.growth_interval, 1000);
  EXPECT_EQ(o.loss_scale.hysteresis, 2);
  EXPECT_FALSE(o.loss_scale.consecutive_hysteresis);
  EXPECT_EQ(o.loss_scale.min_scale, 1.0f);
  EXPECT_EQ(o.tier, Tier::nvme);
  EXPECT_EQ(o.nvme.paths, std::vector<std::string>{"/local_nvme"});
  EXPECT_EQ(o.nvme.buffer_count, 4);
  EXPECT_EQ(o.nvme.block_size, std::size_t(1048576));
  EXPECT_EQ(o.nvme.queue_depth, 8);
  EXPECT_EQ(o.tile, OffloadOptions{}.tile) << "sub_group_size must not become the tile";
  EXPECT_EQ(o.schedule, Schedule::sync);
}

TEST(Config, DeepSpeedExampleNotes) {
  const LoadedConfig c = parse_ok(kDeepSpeedExample);
  for (const char* key : {"'train_batch_size'", "'zero_optimization.sub_group_size'",
                          "'zero_optimization.offload_optimizer.pipeline_read'",
                          "'zero_optimization.offload_optimizer.pipeline_write'",
                          "'zero_optimization.offload_optimizer.fast_init'",
                          "'zero_optimization.offload_optimizer.ratio'", "'aio.intra_op_parallelism'",
                          "'aio.single_submit'", "'aio.overlap_events'", "'aio.use_gds'"}) {
    const std::string n = note_about(c, key);
    EXPECT_NE(n.find("test.json"), std::string::npos) << n;
  }
  EXPECT_EQ(c.notes.size(), 10u) << all_notes(c);  // stage 2, pin_memory true, matching values: nothing to say
  EXPECT_EQ(c.options.gradient_accumulation_steps, 1);
  EXPECT_EQ(all_notes(c).find("unknown key"), std::string::npos) << all_notes(c);
}

TEST(Config, GradientAccumulationStepsIsRead) {
  EXPECT_EQ(parse_ok(R"({"gradient_accumulation_steps": 8})").options.gradient_accumulation_steps, 8);
  for (const char* bad : {R"({"gradient_accumulation_steps": 0})", R"({"gradient_accumulation_steps": 2.5})",
                          R"({"gradient_accumulation_steps": "4"})"}) {
    EXPECT_FALSE(parse_config(bad, "test.json").ok()) << bad;
  }
}

TEST(Config, EmptyObjectGivesZoeDefaults) {
  const LoadedConfig c = parse_ok("{}");
  EXPECT_TRUE(c.notes.empty());
  EXPECT_EQ(c.options.tier, Tier::ram);
  EXPECT_FALSE(c.options.loss_scale.enabled);
  EXPECT_FLOAT_EQ(c.hyper.lr, AdamHyper{}.lr);
}

TEST(Config, UnknownKeysAreReported) {
  const LoadedConfig c = parse_ok(R"({"foo": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "momentum": 0.9}},
      "zero_optimization": {"offload_optimizer": {"device": "cpu", "speed": "fast"}},
      "zoe": {"schedul": "sync"}, "bf16": {"enabled": true, "x": 1}})");
  for (const char* key : {"'foo'", "'optimizer.params.momentum'", "'zero_optimization.offload_optimizer.speed'",
                          "'zoe.schedul'", "'bf16.x'"}) {
    const std::string n = note_about(c, std::string("unknown key ") + key);
    EXPECT_NE(n.find("test.json: ignored"), std::string::npos) << n;
  }
  EXPECT_EQ(c.notes.size(), 5u) << all_notes(c);
}

TEST(Config, DuplicateKeysAreReported) {
  const LoadedConfig c = parse_ok(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "lr": 0.2}}})");
  EXPECT_FLOAT_EQ(c.hyper.lr, 0.2f);
  note_about(c, "duplicate key 'optimizer.params.lr'");
}

TEST(Config, NvmePathStringOrList) {
  const std::string head = R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": )";
  EXPECT_EQ(parse_ok(head + R"("/a"}}})").options.nvme.paths, (std::vector<std::string>{"/a"}));
  EXPECT_EQ(parse_ok(head + R"(["/a", "/b"]}}})").options.nvme.paths, (std::vector<std::string>{"/a", "/b"}));
  expect_error(head + R"([]}}})", {"zero_optimization.offload_optimizer.nvme_path"});
  expect_error(head + R"(["/a", 3]}}})", {"zero_optimization.offload_optimizer.nvme_path"});
  expect_error(head + R"(["/a", "/a"]}}})", {"nvme_path", "twice"});
  expect_error(head + R"(""}}})", {"nvme_path"});
  expect_error(head + R"(7}}})", {"nvme_path"});
}

TEST(Config, NvmeWithoutPathIsAnError) {
  expect_error(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})",
               {"zero_optimization.offload_optimizer.nvme_path", "missing"});
}

TEST(Config, OffloadDevices) {
  const std::string head = R"({"zero_optimization": {"offload_optimizer": {"device": )";
  EXPECT_EQ(parse_ok(head + R"("cpu"}}})").options.tier, Tier::ram);
  const LoadedConfig none = parse_ok(head + R"("none"}}})");
  EXPECT_EQ(none.options.tier, Tier::ram);
  note_about(none, "always offloads");
  const LoadedConfig unused = parse_ok(head + R"("cpu", "nvme_path": "/x", "pin_memory": false}}})");
  note_about(unused, "nvme_path' in test.json: unused");
  note_about(unused, "page-locks");
  expect_error(head + R"("gpu"}}})", {"zero_optimization.offload_optimizer.device", "\"gpu\""});
}

TEST(Config, StaticAndDynamicLossScale) {
  const LoadedConfig dynamic = parse_ok(R"({"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}})");
  EXPECT_TRUE(dynamic.options.loss_scale.enabled);
  EXPECT_TRUE(dynamic.options.loss_scale.dynamic);
  EXPECT_EQ(dynamic.options.loss_scale.initial_scale, 65536.0f);
  const LoadedConfig fixed = parse_ok(R"({"fp16": {"enabled": true, "loss_scale": 128}})");
  EXPECT_TRUE(fixed.options.loss_scale.enabled);
  EXPECT_FALSE(fixed.options.loss_scale.dynamic);
  EXPECT_EQ(fixed.options.loss_scale.static_scale, 128.0f);
  const LoadedConfig bf16 = parse_ok(R"({"fp16": {"enabled": false}, "bf16": {"enabled": true}})");
  EXPECT_FALSE(bf16.options.loss_scale.enabled);
  expect_error(R"({"fp16": {"loss_scale": -1}})", {"fp16.loss_scale"});
  expect_error(R"({"fp16": {"initial_scale_power": 200}})", {"fp16.initial_scale_power", "0 to 127"});
  expect_error(R"({"fp16": {"loss_scale_window": 0}})", {"fp16.loss_scale_window"});
  expect_error(R"({"fp16": {"min_loss_scale": 0}})", {"fp16.min_loss_scale"});
  expect_error(R"({"fp16": {"hysteresis": 1.5}})", {"fp16.hysteresis"});
  // Issue 32: an infinite scale overflows every gradient, so every step would be skipped. JSON has no inf:
  // 1e400 is refused by the parser, and 1e39, finite as a double, would become inf as a float.
  for (const char* key : {"loss_scale", "min_loss_scale"}) {
    expect_error(std::string(R"({"fp16": {")") + key + "\": 1e39}}", {std::string("fp16.") + key, "float range"});
    expect_error(std::string(R"({"fp16": {")") + key + "\": 1e400}}", {"not valid JSON", "1e400"});
  }
}

TEST(Config, Fp16AndBf16TogetherIsAnError) {
  expect_error(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", {"fp16.enabled", "bf16.enabled"});
}

TEST(Config, AdamVersusAdamW) {
  const LoadedConfig adam = parse_ok(R"({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.01}}})");
  EXPECT_FALSE(adam.hyper.adamw);
  EXPECT_EQ(note_about(adam, "'optimizer.type'").find("no effect"), std::string::npos);
  const LoadedConfig no_decay = parse_ok(R"({"optimizer": {"type": "adam"}})");
  EXPECT_FALSE(no_decay.hyper.adamw);
  EXPECT_NE(note_about(no_decay, "'optimizer.type'").find("no effect"), std::string::npos);
  const LoadedConfig w_mode = parse_ok(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": true}}})");
  EXPECT_TRUE(w_mode.hyper.adamw);
  EXPECT_TRUE(w_mode.notes.empty()) << all_notes(w_mode);
  const LoadedConfig l2 = parse_ok(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "bias_correction": false}}})");
  EXPECT_FALSE(l2.hyper.adamw);
  EXPECT_FALSE(l2.hyper.bias_correction);
  EXPECT_TRUE(parse_ok(R"({"optimizer": {"type": "AdamW"}})").hyper.adamw);
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})", {"adam_w_mode", "AdamW"});
  expect_error(R"({"optimizer": {"type": "Lamb"}})", {"optimizer.type", "Lamb"}, StatusCode::unsupported);
  expect_error(R"({"optimizer": {"params": {}}})", {"optimizer.type", "missing"});
  EXPECT_TRUE(parse_ok(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})").hyper.amsgrad);
}

TEST(Config, InvalidOptimizerValues) {
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"lr": -0.1}}})", {"optimizer.params.lr", "-0.1"});
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"lr": "0.1"}}})", {"optimizer.params.lr", "number"});
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"eps": -1}}})", {"optimizer.params.eps"});
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"weight_decay": -1}}})", {"weight_decay"});
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}})", {"optimizer.params.betas"});
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"betas": [-0.1, 0.9]}}})", {"optimizer.params.betas"});
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})", {"optimizer.params.betas"});
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"bias_correction": 1}}})", {"bias_correction", "true or false"});
  expect_error(R"({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})", {"optimizer.params.lr", "Hugging Face"});
  expect_error(R"({"optimizer": "AdamW"})", {"optimizer", "object"});
  expect_error(R"({"gradient_clipping": -1})", {"gradient_clipping"});
}

TEST(Config, ZeroStageAndAio) {
  const LoadedConfig stage3 = parse_ok(R"({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}})");
  EXPECT_NE(note_about(stage3, "'zero_optimization.stage'").find("stage 3"), std::string::npos);
  EXPECT_NE(note_about(stage3, "'zero_optimization.stage3_max_live_parameters'").find("not supported"), std::string::npos);
  EXPECT_TRUE(parse_ok(R"({"zero_optimization": {"stage": 1}})").notes.empty());
  expect_error(R"({"zero_optimization": {"stage": 4}})", {"zero_optimization.stage"});
  expect_error(R"({"zero_optimization": {"sub_group_size": -5}})", {"zero_optimization.sub_group_size"});
  expect_error(R"({"aio": {"block_size": 1000}})", {"aio.block_size", "4096"});
  expect_error(R"({"aio": {"queue_depth": 0}})", {"aio.queue_depth"});
  const LoadedConfig c = parse_ok(R"({"aio": {"thread_count": 2, "block_size": 8192}})");
  EXPECT_EQ(c.options.nvme.block_size, 8192u);
  note_about(c, "'aio.thread_count'");
}

TEST(Config, ZoeSection) {
  const LoadedConfig c = parse_ok(
      R"({"zoe": {"schedule": "delayed", "delayed_warmup_steps": 5, "tile": 4096, "threads": 3, "isa": "scalar",
                  "pin_threads": false, "cpu_tile": 1024}})");
  EXPECT_EQ(c.options.schedule, Schedule::delayed);
  EXPECT_EQ(c.options.delayed_warmup_steps, 5);
  EXPECT_EQ(c.options.tile, 4096u);
  EXPECT_EQ(c.options.cpu.threads, 3);
  EXPECT_EQ(c.options.cpu.isa, "scalar");
  EXPECT_FALSE(c.options.cpu.pin_threads);
  EXPECT_EQ(c.options.cpu.tile, 1024u);
  EXPECT_EQ(parse_ok(R"({"zoe": {"schedule": "overlap"}})").options.schedule, Schedule::overlap);
  expect_error(R"({"zoe": {"schedule": "async"}})", {"zoe.schedule", "async"});
  expect_error(R"({"zoe": {"schedule": 1}})", {"zoe.schedule"});
  expect_error(R"({"zoe": {"isa": "sse2"}})", {"zoe.isa"});
  expect_error(R"({"zoe": {"tile": 0}})", {"zoe.tile"});
  expect_error(R"({"zoe": {"delayed_warmup_steps": -1}})", {"zoe.delayed_warmup_steps"});
}

// zoe.nvme_durability: step (the default) or checkpoint; anything else is an error naming the key and the choices.
TEST(Config, NvmeDurability) {
  EXPECT_EQ(parse_ok("{}").options.nvme.durability, Durability::step);
  EXPECT_EQ(parse_ok(R"({"zoe": {"nvme_durability": "checkpoint"}})").options.nvme.durability, Durability::checkpoint);
  EXPECT_EQ(parse_ok(R"({"zoe": {"nvme_durability": "step"}})").options.nvme.durability, Durability::step);
  expect_error(R"({"zoe": {"nvme_durability": "never"}})", {"zoe.nvme_durability", "never", "\"step\" or \"checkpoint\""});
  expect_error(R"({"zoe": {"nvme_durability": true}})", {"zoe.nvme_durability"});
  EXPECT_TRUE(parse_ok("{}").options.nvme.keep_resident);
  EXPECT_FALSE(parse_ok(R"({"zoe": {"nvme_keep_resident": false}})").options.nvme.keep_resident);
  expect_error(R"({"zoe": {"nvme_keep_resident": "no"}})", {"zoe.nvme_keep_resident"});
  EXPECT_TRUE(parse_ok(R"({"zoe": {"spill_grads": true}})").options.spill_grads);
  EXPECT_FALSE(parse_ok(R"({})").options.spill_grads);
  expect_error(R"({"zoe": {"spill_grads": 1}})", {"zoe.spill_grads"});
  EXPECT_EQ(parse_durability("checkpoint").value(), Durability::checkpoint);
  const Result<Durability> bad = parse_durability("always");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("use step"), std::string::npos) << bad.status().to_string();
}

TEST(Config, MalformedJson) {
  expect_error("{\"optimizer\": {", {"not valid JSON", "line"});
  expect_error("", {"not valid JSON"});
  expect_error("[1, 2]", {"top level"});
}

// Issue 32: the parser's "last read" excerpt ended inside the two bytes of "é", so Python, decoding the
// message strictly, raised UnicodeDecodeError instead of zoe's error. Bytes that are not UTF-8 are shown
// as \xNN; a long value is cut between characters.
TEST(Config, MessagesAreUtf8WhateverTheInput) {
  const std::string e_acute = "\xC3\xA9";
  for (const std::string& text : {"{\"zoe\": t" + e_acute + "}", "{\"zoe\": \"" + std::string("\xC3\x28") + "\"}",
                                  std::string("{\"zoe\": \xFF}")}) {
    Result<LoadedConfig> r = parse_config(text, "cfg.json");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_TRUE(utf8_valid(r.status().message())) << r.status().message();
    EXPECT_NE(r.status().message().find("cfg.json is not valid JSON"), std::string::npos) << r.status().message();
  }
  EXPECT_NE(parse_config("{\"zoe\": \xFF}", "cfg.json").status().message().find("\\xFF"), std::string::npos);
  // show() keeps 57 bytes of a value: after '"a', each "é" (2 bytes) starts at an even byte, so the 57th
  // (byte 56) is the first half of one.
  std::string long_value = "\"a";
  for (int i = 0; i < 40; ++i) long_value += e_acute;
  long_value += "\"";
  Result<LoadedConfig> r = parse_config(R"({"zoe": {"isa": )" + long_value + "}}", "cfg.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("zoe.isa"), std::string::npos) << r.status().message();
  EXPECT_TRUE(utf8_valid(r.status().message())) << r.status().message();
}

// Found by the fuzzer (test_fuzz_readers): 2^63 passed a range check against (double)INT64_MAX, which
// rounds up to 2^63, and was then converted to int64 (undefined behaviour).
TEST(Config, IntegerWrittenAsFloatAtTheInt64EdgeIsRefused) {
  expect_error(R"({"zero_optimization": {"sub_group_size": 9.2233720368547758e18}})", {"zero_optimization.sub_group_size"});
  expect_error(R"({"zero_optimization": {"sub_group_size": -9.2233720368547758e18}})", {"zero_optimization.sub_group_size"});
  parse_ok(R"({"zero_optimization": {"sub_group_size": 9.2233720368547748e18}})");  // the last double below 2^63
}

// Found by the fuzzer: 40 KB of nested arrays cost a GB in the duplicate-key tracker (a path per level).
TEST(Config, DeepNestingIsRefusedWithoutGrowing) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_error(R"({"optimizer": )" + deep + "}", {"levels deep"});
  expect_error(deep, {"levels deep"});
  std::string objects;
  for (int i = 0; i < 70; ++i) objects += R"({"a": )";
  objects += "1" + std::string(70, '}');
  expect_error(R"({"zoe": )" + objects + "}", {"levels deep"});
}

TEST(Config, LoadFile) {
  char dir_template[] = "/tmp/zoe_config_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string path = std::string(dir_template) + "/ds_config.json";
  std::ofstream(path) << kDeepSpeedExample;
  Result<LoadedConfig> r = load_config_file(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->options.tier, Tier::nvme);
  EXPECT_NE(r->notes.at(0).find(path), std::string::npos) << "notes name the file";

  Result<LoadedConfig> missing = load_config_file(std::string(dir_template) + "/absent.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::io_error);
  EXPECT_EQ(missing.status().sys_errno(), ENOENT);
  EXPECT_NE(missing.status().message().find("absent.json"), std::string::npos);
  std::remove(path.c_str());
  ::rmdir(dir_template);
}

}  // namespace
}  // namespace zoe

namespace zoe {
namespace {

TEST(ConfigOffloadParam, DeepSpeedKeysBecomeAParameterTier) {
  Result<LoadedConfig> c = parse_config(R"({"zero_optimization": {"offload_param": {
      "device": "nvme", "nvme_path": ["/a", "/b"], "buffer_count": 4, "buffer_size": 1e8, "max_in_cpu": 1e9,
      "pin_memory": true}}, "aio": {"block_size": 262144, "queue_depth": 16}})", "<test>");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->offload_param);
  EXPECT_EQ(c->param_tier.home, ParamHome::nvme);
  EXPECT_EQ(c->param_tier.nvme_paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(c->param_tier.prefetch, 2);                           // buffer_count 4: in use, released, 2 ahead
  EXPECT_EQ(c->param_tier.budget_bytes, std::size_t{800000000});  // 4 buffers of 1e8 16-bit elements
  EXPECT_EQ(c->param_tier.request_bytes, std::size_t{262144});
  EXPECT_EQ(c->param_tier.queue_depth, 16);
  bool noted = false;
  for (const std::string& n : c->notes) noted = noted || n.find("offload_param.max_in_cpu") != std::string::npos;
  EXPECT_TRUE(noted);
}

TEST(ConfigOffloadParam, BadValuesAndUnknownKeysAreNamed) {
  Result<LoadedConfig> c = parse_config(R"({"zero_optimization": {"offload_param": {"device": "gpu"}}})", "<test>");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("zero_optimization.offload_param.device"), std::string::npos) << c.status().message();
  c = parse_config(R"({"zero_optimization": {"offload_param": {"device": "nvme"}}})", "<test>");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("nvme_path is missing"), std::string::npos);
  c = parse_config(R"({"zero_optimization": {"offload_param": {"device": "cpu", "speed": 1}}})", "<test>");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->offload_param);
  bool noted = false;
  for (const std::string& n : c->notes) noted = noted || n.find("'zero_optimization.offload_param.speed'") != std::string::npos;
  EXPECT_TRUE(noted);
  c = parse_config(R"({"zero_optimization": {"offload_param": {"device": "none"}}})", "<test>");
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->offload_param);
}

}  // namespace
}  // namespace zoe

namespace zoe {
namespace {

TEST(ConfigStateDtype, ZoeStateDtypeIsRead) {
  Result<LoadedConfig> c = parse_config(R"({"zoe": {"state_dtype": "bf16"}})", "<test>");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->options.state_dtype, DType::bf16);
  c = parse_config(R"({"zoe": {"state_dtype": "int8"}})", "<test>");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->options.state_dtype, DType::i8);
  for (const char* bad : {R"({"zoe": {"state_dtype": 16}})", R"({"zoe": {"state_dtype": "int4"}})"}) {
    c = parse_config(bad, "<test>");
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_NE(c.status().message().find("zoe.state_dtype"), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("\"int8\""), std::string::npos) << c.status().message();
  }
}

}  // namespace
}  // namespace zoe
