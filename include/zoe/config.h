// DeepSpeed-compatible JSON configuration: reads the keys of a DeepSpeed config that mean something to zoe
// (optimizer, scheduler, gradient_clipping, fp16/bf16, zero_optimization.offload_optimizer and offload_param,
// aio) plus
// zoe's own "zoe"
// section, and turns them into OffloadOptions and a param group's OptimizerHyper (optimizer.type: each rule of the
// optimizer table, zoe/optimizers.h, by its DeepSpeed names). Keys zoe has no use for are reported in
// `notes`, never dropped silently; invalid values are errors naming the key and the file.
// docs/config.md lists the mapping and where zoe's defaults differ from DeepSpeed's.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "zoe/adam.h"
#include "zoe/lr_schedule.h"
#include "zoe/offload.h"
#include "zoe/optimizers.h"
#include "zoe/param_tier.h"
#include "zoe/status.h"

namespace zoe {

struct LoadedConfig {
  OffloadOptions options;
  OptimizerHyper hyper;
  // zero_optimization.offload_param: the 16-bit weights in a parameter tier (zoe/param_tier.h). device
  // cpu|nvme, nvme_path, buffer_count (prefetch = buffer_count - 1) and buffer_size (budget = buffer_count x
  // buffer_size) are read; the aio section's block_size and queue_depth apply to it too.
  bool offload_param = false;
  ParamTierOptions param_tier;
  // scheduler: DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle (zoe/lr_schedule.h), for the
  // trainer to apply before each step (LrSchedule::apply).
  bool has_scheduler = false;
  LrSchedule scheduler;
  // One line per key that was ignored or read differently from DeepSpeed, naming the key, the file and why.
  std::vector<std::string> notes;
};

// `source` names the text in messages (a file name, or something like "<string>").
Result<LoadedConfig> parse_config(std::string_view json_text, std::string_view source);
Result<LoadedConfig> load_config_file(const std::string& path);

}  // namespace zoe
