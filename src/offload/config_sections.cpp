// The config reader's sections (config_parser.h): optimizer, scheduler, fp16, zero_optimization with its
// offload_optimizer and offload_param, aio, and zoe's own section; each checks its keys and values and fills
// in LoadedConfig.
//
// Defaults: where a DeepSpeed key is absent, zoe's own default applies (include/zoe/adam.h, offload.h).
// Those equal DeepSpeed's for lr/betas/eps, the fp16 loss-scale knobs (2^16 initial scale, window 1000,
// hysteresis 2, min 1), buffer_count 4, aio.block_size 1 MiB and queue_depth 8. They differ for:
//  - optimizer.type "Adam" without adam_w_mode: zoe applies L2 decay as torch.optim.Adam does; DeepSpeed's
//    CPU Adam defaults to decoupled decay (adam_w_mode true). Following torch keeps parity tests exact; the
//    difference is noted whenever it applies.
//  - no offload_optimizer section: zoe offloads to pinned RAM anyway (offloading is all it does).
//  - sub_group_size (DeepSpeed 1e9 elements) is not zoe's tile (default 2^20): zoe holds buffer_count tiles
//    in flight, so a DeepSpeed-sized tile would pin tens of GB.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "src/offload/config_parser.h"

namespace zoe::config_reader {

namespace {

// The DeepSpeed optimizer.type values of the optimizer table (zoe/optimizers.h), for messages.
std::string optimizer_types() {
  std::string all;
  for (const OptimizerRule& r : optimizer_rules()) {
    for (std::string_view t : r.deepspeed_types) all += (all.empty() ? "\"" : ", \"") + std::string(t) + "\"";
  }
  return all;
}

}  // namespace

Status Parser::optimizer(const Json& section) {
  check_keys(section, "optimizer", {"type", "params"});
  const auto it = section.find("type");
  const std::string want = "need one of " + optimizer_types();
  if (it == section.end()) return invalid_argument("optimizer.type is missing in " + source_ + ": " + want);
  if (!it->is_string()) return bad("optimizer.type", *it, want.c_str());
  // DeepSpeed compares optimizer names case-insensitively; so does the table's lookup.
  const std::string type = it->get<std::string>();
  const OptimizerRule* rule = find_optimizer_rule(type);
  if (rule == nullptr) {
    return Status(StatusCode::unsupported, "optimizer.type = " + show(*it) + " in " + source_ +
                                               " is not supported: zoe runs " + optimizer_types());
  }
  const Json* params = nullptr;
  if (Status s = this->section(section, "optimizer", "params", &params); !s.ok()) return s;
  OptimizerHyper& h = out_->hyper;
  h = hyper_defaults(rule->rule);
  std::string lower = type;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool adamw_type = lower == "adamw";  // Adam's rule, decoupled decay unless adam_w_mode says otherwise
  if (rule->rule == Rule::adam) h.adamw = adamw_type;
  if (params != nullptr) {
    if (Status s = optimizer_params(*params, *rule, adamw_type); !s.ok()) return s;
  }
  if (rule->rule == Rule::adam && !adamw_type && (params == nullptr || !params->contains("adam_w_mode"))) {
    note("optimizer.type", std::string("\"Adam\" means L2 weight decay in zoe (torch.optim.Adam); DeepSpeed's CPU "
                                       "Adam defaults to decoupled decay. Set optimizer.params.adam_w_mode or use "
                                       "\"AdamW\" to choose") +
                               (h.weight_decay == 0 ? " (no effect here: weight_decay is 0)" : ""));
  }
  return Status::success();
}

Status Parser::scheduler(const Json& section) {
  check_keys(section, "scheduler", {"type", "params"});
  const auto it = section.find("type");
  const char* types = "need \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\" or \"OneCycle\"";
  if (it == section.end()) return invalid_argument("scheduler.type is missing in " + source_ + ": " + types);
  LrSchedule& l = out_->scheduler;
  bool known = false;
  for (LrSchedule::Type t : {LrSchedule::Type::warmup_lr, LrSchedule::Type::warmup_decay_lr,
                             LrSchedule::Type::warmup_cosine_lr, LrSchedule::Type::one_cycle}) {
    if (it->is_string() && it->get<std::string>() == lr_schedule_name(t)) {
      l.type = t;
      known = true;
    }
  }
  if (!known) {
    if (it->is_string() && it->get<std::string>() == "LRRangeTest") {
      return Status(StatusCode::unsupported, "scheduler.type \"LRRangeTest\" in " + source_ +
                                                 " is not supported: zoe runs WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle");
    }
    return bad("scheduler.type", *it, types);
  }
  const Json* params = nullptr;
  if (Status s = this->section(section, "scheduler", "params", &params); !s.ok()) return s;
  const Json empty = Json::object();
  if (Status s = scheduler_params(params != nullptr ? *params : empty, l); !s.ok()) return s;
  out_->has_scheduler = true;
  return Status::success();
}

Status Parser::scheduler_params(const Json& params, LrSchedule& l) {
  const std::string p = "scheduler.params";
  using T = LrSchedule::Type;
  auto need = [&](const char* key) -> Status {
    if (params.contains(key)) return Status::success();
    return invalid_argument(p + "." + key + " is missing in " + source_ + ": " + std::string(lr_schedule_name(l.type)) +
                            " needs it");
  };
  const Ignored resumed{"last_batch_iteration", "zoe's schedule follows the optimizer's applied steps, which load() restores"};
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  if (l.type == T::one_cycle) {
    check_keys(params, p, {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                           "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                           "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"},
               {resumed});
    for (const char* key : {"cycle_min_lr", "cycle_max_lr"}) {
      if (Status s = need(key); !s.ok()) return s;
    }
    for (const auto& [key, out] : {std::pair{"cycle_min_lr", &l.cycle_min_lr}, {"cycle_max_lr", &l.cycle_max_lr},
                                   {"decay_lr_rate", &l.decay_lr_rate}, {"decay_step_size", &l.decay_step_size},
                                   {"cycle_min_mom", &l.cycle_min_mom}, {"cycle_max_mom", &l.cycle_max_mom},
                                   {"decay_mom_rate", &l.decay_mom_rate}}) {
      if (Status s = get(params, p, key, kNonNegative, out); !s.ok()) return s;
    }
    for (const auto& [key, out] : {std::pair{"cycle_first_step_size", &l.cycle_first_step_size},
                                   {"cycle_second_step_size", &l.cycle_second_step_size}}) {
      if (Status s = get(params, p, key, kPositive, out); !s.ok()) return s;
    }
    return get(params, p, "cycle_momentum", &l.cycle_momentum);
  }
  if (l.type == T::warmup_cosine_lr) {
    check_keys(params, p, {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"}, {resumed});
    if (Status s = get(params, p, "warmup_min_ratio", kFraction, &l.warmup_min_ratio); !s.ok()) return s;
    if (Status s = get(params, p, "cos_min_ratio", kFraction, &l.cos_min_ratio); !s.ok()) return s;
  } else {
    check_keys(params, p, {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"}, {resumed});
    if (Status s = get(params, p, "warmup_min_lr", kNonNegative, &l.warmup_min_lr); !s.ok()) return s;
    if (Status s = get(params, p, "warmup_max_lr", kNonNegative, &l.warmup_max_lr); !s.ok()) return s;
  }
  if (Status s = get(params, p, "warmup_num_steps", 0, kMax, &l.warmup_num_steps); !s.ok()) return s;
  std::string warmup_type = l.warmup_linear ? "linear" : "log";
  if (Status s = get(params, p, "warmup_type", &warmup_type); !s.ok()) return s;
  if (warmup_type != "log" && warmup_type != "linear") return bad(p + ".warmup_type", params.at("warmup_type"), "need \"log\" or \"linear\"");
  l.warmup_linear = warmup_type == "linear";
  if (l.type == T::warmup_lr) {
    if (params.contains("total_num_steps")) note(p + ".total_num_steps", "WarmupLR does not decay: ignored");
    return Status::success();
  }
  if (Status s = need("total_num_steps"); !s.ok()) return s;
  if (Status s = get(params, p, "total_num_steps", 1, kMax, &l.total_num_steps); !s.ok()) return s;
  if (l.type == T::warmup_cosine_lr && l.total_num_steps <= std::max<std::int64_t>(2, l.warmup_num_steps)) {
    return invalid_argument(p + ".total_num_steps = " + std::to_string(l.total_num_steps) + " in " + source_ +
                            " must exceed warmup_num_steps (at least 2): the cosine runs over the steps between them");
  }
  return Status::success();
}

// The rule's fields by their DeepSpeed keys (the optimizer table): numbers in the field's range, flags, and
// the pair `betas`.
Status Parser::optimizer_params(const Json& params, const OptimizerRule& rule, bool adamw_type) {
  const std::string p = "optimizer.params";
  std::vector<std::string_view> keys;
  for (const HyperField& f : rule.fields) {
    if (!f.deepspeed.empty() && std::find(keys.begin(), keys.end(), f.deepspeed) == keys.end()) keys.push_back(f.deepspeed);
  }
  check_keys(params, p, keys, {{"torch_adam", "zoe always runs its own CPU kernel"}});
  OptimizerHyper& h = out_->hyper;
  for (const HyperField& f : rule.fields) {
    if (f.deepspeed.empty() || f.pair_index > 0) continue;
    const std::string key(f.deepspeed);
    if (f.pair_index == 0) {  // betas: both fields of the pair
      const auto it = params.find(key);
      if (it == params.end()) continue;
      const Json& b = *it;
      const char* want = "need two numbers, each in [0, 1)";
      if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number()) return bad(p + "." + key, b, want);
      const double b1 = b[0].get<double>(), b2 = b[1].get<double>();
      if (!kUnit.valid(b1) || !kUnit.valid(b2)) return bad(p + "." + key, b, want);
      h.*f.number = static_cast<float>(b1);
      h.*rule.fields[static_cast<std::size_t>(&f - rule.fields.data()) + 1].number = static_cast<float>(b2);
    } else if (f.number != nullptr) {
      if (Status s = get(params, p, key.c_str(), f.range == HyperRange::beta ? kUnit : kNonNegative, &(h.*f.number));
          !s.ok()) {
        return s;
      }
    } else if (Status s = get(params, p, key.c_str(), &(h.*f.flag)); !s.ok()) {
      return s;
    }
  }
  if (h.rule == Rule::adam && adamw_type && !h.adamw) {
    return invalid_argument(p + ".adam_w_mode = false contradicts optimizer.type \"AdamW\" in " + source_ +
                            ": use type \"Adam\" for L2 weight decay");
  }
  return Status::success();
}

Status Parser::fp16(const Json& section) {
  const std::string p = "fp16";
  check_keys(section, p,
             {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale"},
             {{"auto_cast", "zoe does not run the model: autocasting is the trainer's"},
              {"fp16_master_weights_and_grads", "zoe always keeps fp32 master weights"}});
  LossScaleOptions& ls = out_->options.loss_scale;
  if (Status s = get(section, p, "enabled", &ls.enabled); !s.ok()) return s;
  double scale = 0;
  if (Status s = get(section, p, "loss_scale", kNonNegative, &scale); !s.ok()) return s;
  // DeepSpeed: 0 selects dynamic scaling; any positive value is a fixed scale.
  ls.dynamic = scale == 0;
  if (!ls.dynamic) {
    if (Status s = get(section, p, "loss_scale", kPositive, &ls.static_scale); !s.ok()) return s;
  }
  if (section.contains("initial_scale_power")) {
    int power = 0;
    if (Status s = get(section, p, "initial_scale_power", 0, 127, &power); !s.ok()) return s;
    ls.initial_scale = std::ldexp(1.0f, power);
  }
  if (Status s = get(section, p, "loss_scale_window", 1, std::numeric_limits<int>::max(), &ls.growth_interval);
      !s.ok()) {
    return s;
  }
  if (Status s = get(section, p, "hysteresis", 1, std::numeric_limits<int>::max(), &ls.hysteresis); !s.ok()) return s;
  if (Status s = get(section, p, "consecutive_hysteresis", &ls.consecutive_hysteresis); !s.ok()) return s;
  return get(section, p, "min_loss_scale", kPositive, &ls.min_scale);
}

Status Parser::zero(const Json& section) {
  const std::string p = "zero_optimization";
  constexpr std::string_view kComm = "gradient communication and bucketing are the trainer's (torch.distributed)";
  check_keys(section, p, {"stage", "sub_group_size", "offload_optimizer", "offload_param"},
             {{"contiguous_gradients", kComm}, {"overlap_comm", kComm}, {"reduce_scatter", kComm},
              {"reduce_bucket_size", kComm}, {"allgather_partitions", kComm}, {"allgather_bucket_size", kComm},
              {"round_robin_gradients", kComm},
              {"stage3_*", "ZeRO stage 3 is not supported"}});
  if (const auto it = section.find("stage"); it != section.end()) {
    std::int64_t stage = 0;
    if (Status s = get_int(*it, p + ".stage", 0, 3, &stage); !s.ok()) return s;
    if (stage == 0) {
      note(p + ".stage", "zoe holds the optimizer state of whatever parameters this rank gives it; ZeRO "
                         "partitioning (stages 1, 2) comes from giving each rank its shard");
    } else if (stage == 3) {
      note(p + ".stage", "stage 3: the 16-bit weights are partitioned by torch FSDP2 (fully_shard), not by zoe; zoe "
                         "steps each rank's shards, and with offload_param keeps them in each rank's own parameter "
                         "tier (zoe.torch.offload_parameters on the fully_shard model)");
    }
  }
  if (const auto it = section.find("sub_group_size"); it != section.end()) {
    std::int64_t elements = 0;
    if (Status s = get_int(*it, p + ".sub_group_size", 1, std::numeric_limits<std::int64_t>::max(), &elements);
        !s.ok()) {
      return s;
    }
    note(p + ".sub_group_size", "not used as zoe's tile: zoe pipelines tiles of zoe.tile elements (default " +
                                    std::to_string(OffloadOptions{}.tile) +
                                    ") with buffer_count in flight, so a sub-group-sized tile would pin far more "
                                    "memory; set zoe.tile to change it");
  }
  const Json* params = nullptr;
  if (Status s = this->section(section, p, "offload_param", &params); !s.ok()) return s;
  if (params != nullptr) {
    if (Status s = offload_param(*params); !s.ok()) return s;
  }
  const Json* offload = nullptr;
  if (Status s = this->section(section, p, "offload_optimizer", &offload); !s.ok()) return s;
  return offload == nullptr ? Status::success() : offload_optimizer(*offload);
}

Status Parser::offload_param(const Json& section) {
  const std::string p = "zero_optimization.offload_param";
  check_keys(section, p, {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}, {});
  ParamTierOptions& t = out_->param_tier;
  std::string device = "cpu";
  if (Status s = get(section, p, "device", &device); !s.ok()) return s;
  if (device == "none") {
    note(p + ".device", "\"none\": parameters stay on the device");
    return Status::success();
  }
  Result<ParamHome> home = parse_param_home(device);
  if (!home.ok()) return bad(p + ".device", section.at("device"), "need \"none\", \"cpu\" or \"nvme\"");
  out_->offload_param = true;
  t.home = home.value();
  if (const auto it = section.find("nvme_path"); it != section.end()) {
    if (Status s = nvme_path(*it, p + ".nvme_path", &t.nvme_paths); !s.ok()) return s;
  }
  if (t.home == ParamHome::nvme && t.nvme_paths.empty()) {
    return invalid_argument(p + ".device is \"nvme\" in " + source_ + " but " + p +
                            ".nvme_path is missing: give a directory (or a list of them)");
  }
  if (t.home == ParamHome::ram && !t.nvme_paths.empty()) note(p + ".nvme_path", "unused: device is not \"nvme\"");
  int buffers = 5;  // DeepSpeed's default buffer_count
  if (Status s = get(section, p, "buffer_count", 1, 1024, &buffers); !s.ok()) return s;
  t.prefetch = std::max(0, buffers - 2);  // one block in use and one released beside those fetched ahead
  if (const auto it = section.find("buffer_size"); it != section.end()) {
    std::int64_t elements = 0;
    if (Status s = get_int(*it, p + ".buffer_size", 1, std::int64_t{1} << 50, &elements); !s.ok()) return s;
    // DeepSpeed sizes its buffers in 16-bit elements.
    t.budget_bytes = static_cast<std::size_t>(buffers) * static_cast<std::size_t>(elements) * 2;
  }
  if (section.contains("max_in_cpu")) {
    std::int64_t elements = 0;
    if (Status s = get_int(section.at("max_in_cpu"), p + ".max_in_cpu", 0, std::int64_t{1} << 50, &elements); !s.ok()) {
      return s;
    }
    note(p + ".max_in_cpu", "not used: zoe's nvme home keeps no parameters in RAM beyond its two bounce buffers "
                            "per loader; the cpu home keeps them all");
  }
  bool pin = true;
  if (Status s = get(section, p, "pin_memory", &pin); !s.ok()) return s;
  if (!pin) note(p + ".pin_memory", "false ignored: zoe always page-locks the parameter home it copies from");
  return Status::success();
}

Status Parser::offload_optimizer(const Json& section) {
  const std::string p = "zero_optimization.offload_optimizer";
  check_keys(section, p, {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write"},
             {{"fast_init", "a DeepSpeed start-up shortcut for its swap files"},
              {"ratio", "zoe offloads all of the optimizer state (a ratio < 1 keeps part of it on the GPU)"},
              {"pipeline", "zoe always overlaps NVMe reads and writes with the step"}});
  OffloadOptions& o = out_->options;
  std::string device = "cpu";
  if (Status s = get(section, p, "device", &device); !s.ok()) return s;
  if (device == "cpu") {
    o.tier = Tier::ram;
  } else if (device == "nvme") {
    o.tier = Tier::nvme;
  } else if (device == "none") {
    o.tier = Tier::ram;
    note(p + ".device", "\"none\": zoe always offloads the optimizer state; using the pinned RAM tier (as \"cpu\")");
  } else {
    return bad(p + ".device", section.at("device"), "need \"none\", \"cpu\" or \"nvme\"");
  }
  if (const auto it = section.find("nvme_path"); it != section.end()) {
    if (Status s = nvme_path(*it, p + ".nvme_path"); !s.ok()) return s;
  }
  if (o.tier == Tier::nvme && o.nvme.paths.empty()) {
    return invalid_argument(p + ".device is \"nvme\" in " + source_ + " but " + p +
                            ".nvme_path is missing: give a directory (or a list of them)");
  }
  if (o.tier == Tier::ram && !o.nvme.paths.empty()) note(p + ".nvme_path", "unused: device is not \"nvme\"");
  if (Status s = get(section, p, "buffer_count", 1, 1024, &o.nvme.buffer_count); !s.ok()) return s;
  bool pin = true, read = true, write = true;
  if (Status s = get(section, p, "pin_memory", &pin); !s.ok()) return s;
  if (Status s = get(section, p, "pipeline_read", &read); !s.ok()) return s;
  if (Status s = get(section, p, "pipeline_write", &write); !s.ok()) return s;
  if (!pin) note(p + ".pin_memory", "false ignored: zoe always page-locks its staging buffers (asynchronous copies need it)");
  if (!read) note(p + ".pipeline_read", "false ignored: zoe always reads the next tile during the step");
  if (!write) note(p + ".pipeline_write", "false ignored: zoe always writes the previous tile during the step");
  return Status::success();
}

Status Parser::nvme_path(const Json& v, const std::string& path, std::vector<std::string>* out) {
  const char* want = "need a directory or a non-empty list of directories";
  std::vector<std::string> paths;
  if (v.is_string()) {
    paths.push_back(v.get<std::string>());
  } else if (v.is_array() && !v.empty()) {
    for (const Json& e : v) {
      if (!e.is_string()) return bad(path, v, want);
      paths.push_back(e.get<std::string>());
    }
  } else {
    return bad(path, v, want);
  }
  for (const std::string& d : paths) {
    if (d.empty()) return bad(path, v, "an empty directory name");
  }
  if (std::set<std::string>(paths.begin(), paths.end()).size() != paths.size()) {
    return bad(path, v, "a directory is listed twice");
  }
  (out != nullptr ? *out : out_->options.nvme.paths) = std::move(paths);
  return Status::success();
}

Status Parser::aio(const Json& section) {
  const std::string p = "aio";
  constexpr std::string_view kThreads = "zoe's libaio engine gets its parallelism from queue_depth and the nvme paths, not I/O threads";
  check_keys(section, p, {"block_size", "queue_depth"},
             {{"intra_op_parallelism", kThreads}, {"thread_count", kThreads},
              {"single_submit", "zoe batches submissions and handles partial submits itself"},
              {"overlap_events", "zoe always keeps the queue full"},
              {"use_gds", "GPUDirect Storage is not supported: data moves through pinned host memory"}});
  NvmeOptions& n = out_->options.nvme;
  constexpr std::int64_t kBlock = 4096;  // O_DIRECT needs 4 KiB-aligned lengths
  std::size_t block = n.block_size;
  if (Status s = get(section, p, "block_size", kBlock, std::int64_t(1) << 30, &block); !s.ok()) return s;
  if (block % kBlock != 0) return bad(p + ".block_size", section.at("block_size"), "need a multiple of 4096 (O_DIRECT)");
  n.block_size = block;
  return get(section, p, "queue_depth", 1, 4096, &n.queue_depth);
}

Status Parser::zoe_section(const Json& section) {
  const std::string p = "zoe";
  check_keys(section, p, {"schedule", "delayed_warmup_steps", "tile", "threads", "isa", "pin_threads", "cpu_tile",
                          "nvme_durability", "nvme_keep_resident", "state_dtype", "spill_grads"});
  OffloadOptions& o = out_->options;
  if (Status s = get(section, p, "spill_grads", &o.spill_grads); !s.ok()) return s;
  if (const auto it = section.find("state_dtype"); it != section.end()) {
    Result<DType> state = parse_state_dtype(it->is_string() ? it->get<std::string>() : std::string());
    if (!state.ok()) return bad(p + ".state_dtype", *it, "need \"fp32\", \"bf16\" or \"int8\"");
    o.state_dtype = state.value();
  }
  if (const auto it = section.find("nvme_durability"); it != section.end()) {
    Result<Durability> d = parse_durability(it->is_string() ? it->get<std::string>() : std::string());
    if (!d.ok()) return bad(p + ".nvme_durability", *it, "need \"step\" or \"checkpoint\"");
    o.nvme.durability = d.value();
  }
  if (Status s = get(section, p, "nvme_keep_resident", &o.nvme.keep_resident); !s.ok()) return s;
  if (const auto it = section.find("schedule"); it != section.end()) {
    Result<Schedule> schedule = parse_schedule(it->is_string() ? it->get<std::string>() : std::string());
    if (!schedule.ok()) return bad(p + ".schedule", *it, "need \"sync\", \"overlap\" or \"delayed\"");
    o.schedule = schedule.value();
  }
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  if (Status s = get(section, p, "delayed_warmup_steps", 0, kIntMax, &o.delayed_warmup_steps); !s.ok()) return s;
  if (Status s = get(section, p, "tile", 1, std::int64_t(1) << 40, &o.tile); !s.ok()) return s;
  if (Status s = get(section, p, "threads", 0, 1 << 16, &o.cpu.threads); !s.ok()) return s;
  if (Status s = get(section, p, "pin_threads", &o.cpu.pin_threads); !s.ok()) return s;
  if (Status s = get(section, p, "cpu_tile", 1, std::int64_t(1) << 40, &o.cpu.tile); !s.ok()) return s;
  if (const auto it = section.find("isa"); it != section.end()) {
    // Whether this CPU runs the ISA is checked where the kernels are chosen (CpuAdam::create).
    const std::string v = it->is_string() ? it->get<std::string>() : std::string();
    if (v != "auto" && v != "scalar" && v != "avx2" && v != "avx512" && v != "neon" && v != "sve") {
      return bad(p + ".isa", *it, "need \"auto\", \"scalar\", \"avx2\", \"avx512\", \"neon\" or \"sve\"");
    }
    o.cpu.isa = v;
  }
  return Status::success();
}

}  // namespace zoe::config_reader
