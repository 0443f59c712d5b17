// Defaults: where a DeepSpeed key is absent, zoe's own default applies (include/zoe/adam.h, offload.h).
// Those equal DeepSpeed's for lr/betas/eps, the fp16 loss-scale knobs (2^16 initial scale, window 1000,
// hysteresis 2, min 1), buffer_count 4, aio.block_size 1 MiB and queue_depth 8. They differ for:
//  - optimizer.type "Adam" without adam_w_mode: zoe applies L2 decay as torch.optim.Adam does; DeepSpeed's
//    CPU Adam defaults to decoupled decay (adam_w_mode true). Following torch keeps parity tests exact; the
//    difference is noted whenever it applies.
//  - no offload_optimizer section: zoe offloads to pinned RAM anyway (offloading is all it does).
//  - sub_group_size (DeepSpeed 1e9 elements) is not zoe's tile (default 2^20): zoe holds buffer_count tiles
//    in flight, so a DeepSpeed-sized tile would pin tens of GB.
#include "zoe/config.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "base/utf8.h"

namespace zoe {
namespace {

using Json = nlohmann::json;

// A key DeepSpeed knows and zoe has no use for, with the reason given in the note. A name ending in '*'
// matches every key with that prefix.
struct Ignored {
  std::string_view key;
  std::string_view why;
};

struct Check {
  bool (*valid)(double);
  const char* want;
};
constexpr Check kNonNegative{[](double x) { return x >= 0; }, "need a finite number >= 0"};
constexpr Check kPositive{[](double x) { return x > 0; }, "need a finite number > 0"};
constexpr Check kUnit{[](double x) { return x >= 0 && x < 1; }, "need a number in [0, 1)"};
constexpr Check kFraction{[](double x) { return x >= 0 && x <= 1; }, "need a number in [0, 1]"};

std::string join(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : prefix + "." + std::string(key);
}

// dump() with `replace` writes valid UTF-8; the excerpt is cut on a character boundary so it stays so.
std::string show(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  return s.size() > 60 ? std::string(utf8_prefix(s, 57)) + "..." : s;
}

bool matches(std::string_view pattern, std::string_view key) {
  if (!pattern.empty() && pattern.back() == '*') return key.substr(0, pattern.size() - 1) == pattern.substr(0, pattern.size() - 1);
  return pattern == key;
}

class Parser {
 public:
  Parser(std::string_view source, LoadedConfig* out) : source_(source), out_(out) {}
  Status run(const Json& root);

 private:
  Status optimizer(const Json& section);
  Status optimizer_params(const Json& params, bool adamw_type);
  Status scheduler(const Json& section);
  Status scheduler_params(const Json& params, LrSchedule& l);
  Status fp16(const Json& section);
  Status zero(const Json& section);
  Status offload_optimizer(const Json& section);
  Status nvme_path(const Json& v, const std::string& path, std::vector<std::string>* out = nullptr);
  Status offload_param(const Json& section);
  Status aio(const Json& section);
  Status zoe_section(const Json& section);

  void note(const std::string& path, std::string_view text) {
    out_->notes.push_back("'" + path + "' in " + source_ + ": " + std::string(text));
  }
  Status bad(const std::string& path, const Json& v, std::string_view want) const {
    std::string m = path + " = " + show(v) + " in " + source_ + " is invalid: " + std::string(want);
    if (v.is_string() && v.get_ref<const std::string&>() == "auto") {
      m += " (\"auto\" is filled in by the Hugging Face Trainer before DeepSpeed sees it; give zoe the value)";
    }
    return invalid_argument(std::move(m));
  }
  void check_keys(const Json& obj, const std::string& prefix, std::initializer_list<std::string_view> mapped,
                  std::initializer_list<Ignored> ignored = {});
  // Each reads obj[key] when present (else leaves *out as it is) and checks its type and range.
  Status section(const Json& obj, const std::string& prefix, const char* key, const Json** out) const;
  Status get(const Json& obj, const std::string& prefix, const char* key, bool* out) const;
  Status get(const Json& obj, const std::string& prefix, const char* key, Check check, double* out) const;
  Status get(const Json& obj, const std::string& prefix, const char* key, Check check, float* out) const;
  Status get(const Json& obj, const std::string& prefix, const char* key, std::string* out) const;
  Status get_int(const Json& v, const std::string& path, std::int64_t lo, std::int64_t hi, std::int64_t* out) const;
  template <typename T>
  Status get(const Json& obj, const std::string& prefix, const char* key, std::int64_t lo, std::int64_t hi,
             T* out) const {
    const auto it = obj.find(key);
    if (it == obj.end()) return Status::success();
    std::int64_t v = 0;
    if (Status s = get_int(*it, join(prefix, key), lo, hi, &v); !s.ok()) return s;
    *out = static_cast<T>(v);
    return Status::success();
  }

  std::string source_;
  LoadedConfig* out_;
};

void Parser::check_keys(const Json& obj, const std::string& prefix, std::initializer_list<std::string_view> mapped,
                        std::initializer_list<Ignored> ignored) {
  for (const auto& [key, value] : obj.items()) {
    bool known = false;
    for (std::string_view m : mapped) known = known || m == key;
    for (const Ignored& i : ignored) {
      if (!known && matches(i.key, key)) {
        note(join(prefix, key), "no zoe equivalent, ignored: " + std::string(i.why));
        known = true;
      }
    }
    if (!known) out_->notes.push_back("unknown key '" + join(prefix, key) + "' in " + source_ + ": ignored");
  }
}

Status Parser::section(const Json& obj, const std::string& prefix, const char* key, const Json** out) const {
  *out = nullptr;
  const auto it = obj.find(key);
  if (it == obj.end()) return Status::success();
  if (!it->is_object()) return bad(join(prefix, key), *it, "need a JSON object");
  *out = &*it;
  return Status::success();
}

Status Parser::get(const Json& obj, const std::string& prefix, const char* key, bool* out) const {
  const auto it = obj.find(key);
  if (it == obj.end()) return Status::success();
  if (!it->is_boolean()) return bad(join(prefix, key), *it, "need true or false");
  *out = it->get<bool>();
  return Status::success();
}

Status Parser::get(const Json& obj, const std::string& prefix, const char* key, Check check, double* out) const {
  const auto it = obj.find(key);
  if (it == obj.end()) return Status::success();
  const double v = it->is_number() ? it->get<double>() : std::nan("");
  if (!std::isfinite(v) || !check.valid(v)) return bad(join(prefix, key), *it, check.want);
  *out = v;
  return Status::success();
}

Status Parser::get(const Json& obj, const std::string& prefix, const char* key, Check check, float* out) const {
  double v = *out;
  if (Status s = get(obj, prefix, key, check, &v); !s.ok()) return s;
  if (std::fabs(v) > std::numeric_limits<float>::max()) return bad(join(prefix, key), obj.at(key), "out of float range");
  *out = static_cast<float>(v);
  return Status::success();
}

Status Parser::get(const Json& obj, const std::string& prefix, const char* key, std::string* out) const {
  const auto it = obj.find(key);
  if (it == obj.end()) return Status::success();
  if (!it->is_string()) return bad(join(prefix, key), *it, "need a string");
  *out = it->get<std::string>();
  return Status::success();
}

// Integers may be written as 1e9 (DeepSpeed's own examples do): an integral float is accepted.
Status Parser::get_int(const Json& v, const std::string& path, std::int64_t lo, std::int64_t hi,
                       std::int64_t* out) const {
  const std::string want = "need an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(hi)) return bad(path, v, want);
    *out = static_cast<std::int64_t>(u);
  } else if (v.is_number_integer()) {
    *out = v.get<std::int64_t>();
  } else if (v.is_number_float()) {
    // Compared in double before converting: (double)INT64_MAX rounds up to 2^63, which int64 cannot hold.
    const double d = v.get<double>();
    if (!(d >= -0x1p63 && d < 0x1p63) || d != std::floor(d)) return bad(path, v, want);
    *out = static_cast<std::int64_t>(d);
  } else {
    return bad(path, v, want);
  }
  if (*out < lo || *out > hi) return bad(path, v, want);
  return Status::success();
}

Status Parser::run(const Json& root) {
  if (!root.is_object()) return invalid_argument(source_ + ": the top level must be a JSON object, not " + show(root));
  constexpr std::string_view kTrainer = "batch sizes are the trainer's; zoe steps once per step() call";
  check_keys(root, "", {"optimizer", "scheduler", "gradient_clipping", "gradient_accumulation_steps", "fp16", "bf16",
                        "zero_optimization", "aio", "zoe"},
             {{"train_batch_size", kTrainer},
              {"train_micro_batch_size_per_gpu", kTrainer},
              {"steps_per_print", "DeepSpeed engine logging; zoe reports through StepStats"},
              {"wall_clock_breakdown", "DeepSpeed engine logging; zoe reports through StepStats"},
              {"zero_allow_untested_optimizer", "zoe runs only its own CPU Adam/AdamW"},
              {"prescale_gradients", "gradient communication is the trainer's (torch.distributed)"},
              {"gradient_predivide_factor", "gradient communication is the trainer's (torch.distributed)"},
              {"communication_data_type", "gradient communication is the trainer's (torch.distributed)"},
              {"activation_checkpointing", "a model-side setting, not the optimizer's"}});
  const Json* s = nullptr;
  if (Status st = section(root, "", "optimizer", &s); !st.ok()) return st;
  if (s != nullptr) {
    if (Status st = optimizer(*s); !st.ok()) return st;
  }
  if (Status st = section(root, "", "scheduler", &s); !st.ok()) return st;
  if (s != nullptr) {
    if (Status st = scheduler(*s); !st.ok()) return st;
  }
  if (Status st = get(root, "", "gradient_clipping", kNonNegative, &out_->options.max_grad_norm); !st.ok()) return st;
  if (Status st = get(root, "", "gradient_accumulation_steps", 1, std::numeric_limits<int>::max(),
                      &out_->options.gradient_accumulation_steps);
      !st.ok()) {
    return st;
  }
  if (Status st = section(root, "", "fp16", &s); !st.ok()) return st;
  if (s != nullptr) {
    if (Status st = fp16(*s); !st.ok()) return st;
  }
  bool bf16 = false;
  if (Status st = section(root, "", "bf16", &s); !st.ok()) return st;
  if (s != nullptr) {
    check_keys(*s, "bf16", {"enabled"});
    if (Status st = get(*s, "bf16", "enabled", &bf16); !st.ok()) return st;
  }
  if (bf16 && out_->options.loss_scale.enabled) {
    return invalid_argument("fp16.enabled and bf16.enabled are both true in " + source_ + ": choose one");
  }
  if (Status st = section(root, "", "zero_optimization", &s); !st.ok()) return st;
  if (s != nullptr) {
    if (Status st = zero(*s); !st.ok()) return st;
  }
  if (Status st = section(root, "", "aio", &s); !st.ok()) return st;
  if (s != nullptr) {
    if (Status st = aio(*s); !st.ok()) return st;
  }
  // One aio section serves both NVMe users, as in DeepSpeed.
  out_->param_tier.request_bytes = out_->options.nvme.block_size;
  out_->param_tier.queue_depth = out_->options.nvme.queue_depth;
  if (Status st = section(root, "", "zoe", &s); !st.ok()) return st;
  if (s != nullptr) return zoe_section(*s);
  return Status::success();
}

Status Parser::optimizer(const Json& section) {
  check_keys(section, "optimizer", {"type", "params"});
  const auto it = section.find("type");
  if (it == section.end()) return invalid_argument("optimizer.type is missing in " + source_ + ": need \"Adam\" or \"AdamW\"");
  if (!it->is_string()) return bad("optimizer.type", *it, "need \"Adam\" or \"AdamW\"");
  // DeepSpeed compares optimizer names case-insensitively.
  std::string type = it->get<std::string>();
  for (char& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (type != "adam" && type != "adamw") {
    return Status(StatusCode::unsupported, "optimizer.type = " + show(*it) + " in " + source_ +
                                               " is not supported: zoe runs Adam and AdamW");
  }
  const Json* params = nullptr;
  if (Status s = this->section(section, "optimizer", "params", &params); !s.ok()) return s;
  AdamHyper& h = out_->hyper;
  h.adamw = type == "adamw";
  if (params != nullptr) {
    if (Status s = optimizer_params(*params, h.adamw); !s.ok()) return s;
  }
  if (type == "adam" && (params == nullptr || !params->contains("adam_w_mode"))) {
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

Status Parser::optimizer_params(const Json& params, bool adamw_type) {
  const std::string p = "optimizer.params";
  check_keys(params, p, {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "amsgrad"},
             {{"torch_adam", "zoe always runs its own CPU kernel"}});
  AdamHyper& h = out_->hyper;
  if (Status s = get(params, p, "lr", kNonNegative, &h.lr); !s.ok()) return s;
  if (Status s = get(params, p, "eps", kNonNegative, &h.eps); !s.ok()) return s;
  if (Status s = get(params, p, "weight_decay", kNonNegative, &h.weight_decay); !s.ok()) return s;
  if (Status s = get(params, p, "bias_correction", &h.bias_correction); !s.ok()) return s;
  if (const auto it = params.find("betas"); it != params.end()) {
    const Json& b = *it;
    const char* want = "need two numbers, each in [0, 1)";
    if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number()) return bad(p + ".betas", b, want);
    const double b1 = b[0].get<double>(), b2 = b[1].get<double>();
    if (!kUnit.valid(b1) || !kUnit.valid(b2)) return bad(p + ".betas", b, want);
    h.beta1 = static_cast<float>(b1);
    h.beta2 = static_cast<float>(b2);
  }
  bool amsgrad = false;
  if (Status s = get(params, p, "amsgrad", &amsgrad); !s.ok()) return s;
  if (amsgrad) return Status(StatusCode::unsupported, p + ".amsgrad = true in " + source_ + " is not supported by zoe");
  if (params.contains("adam_w_mode")) {
    bool mode = true;
    if (Status s = get(params, p, "adam_w_mode", &mode); !s.ok()) return s;
    if (adamw_type && !mode) {
      return invalid_argument(p + ".adam_w_mode = false contradicts optimizer.type \"AdamW\" in " + source_ +
                              ": use type \"Adam\" for L2 weight decay");
    }
    h.adamw = mode;
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
      note(p + ".stage", "stage 3: zoe does not partition parameters across ranks; each rank holds every "
                         "parameter, in its device's memory or, with offload_param, in its own parameter tier");
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
                          "nvme_durability", "nvme_keep_resident", "state_dtype"});
  OffloadOptions& o = out_->options;
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
    if (v != "auto" && v != "scalar" && v != "avx2" && v != "avx512") {
      return bad(p + ".isa", *it, "need \"auto\", \"scalar\", \"avx2\" or \"avx512\"");
    }
    o.cpu.isa = v;
  }
  return Status::success();
}

// A config nests a few levels (zero_optimization.offload_optimizer.nvme_path[]). Text nested far deeper is
// refused: the paths kept per level below would grow with the square of its depth (a 40 KB file of nested
// arrays took a GB), and printing such a value recurses once per level.
constexpr int kMaxDepth = 64;

// Duplicate keys: JSON parsers keep one of the values (nlohmann and Python the last); say which.
struct DuplicateKeys {
  struct Frame {
    std::string path;
    bool array;
    std::set<std::string> keys;
    std::string key;
  };
  std::vector<Frame> frames;
  std::vector<std::string> found;
  bool too_deep = false;

  std::string child_path() const {
    if (frames.empty()) return "";
    const Frame& f = frames.back();
    return f.array ? f.path : join(f.path, f.key);
  }
  bool operator()(int depth, Json::parse_event_t event, Json& parsed) {
    using E = Json::parse_event_t;
    // nlohmann gives a container's start and end the same depth, so frames stay balanced.
    if (depth >= kMaxDepth) {
      too_deep = true;
      return true;
    }
    if (event == E::object_start || event == E::array_start) {
      std::string path = child_path();
      if (event == E::array_start) path += "[]";
      frames.push_back({std::move(path), event == E::array_start, {}, {}});
    } else if ((event == E::object_end || event == E::array_end) && !frames.empty()) {
      frames.pop_back();
    } else if (event == E::key && !frames.empty()) {
      Frame& f = frames.back();
      f.key = parsed.get<std::string>();
      if (!f.keys.insert(f.key).second) found.push_back(join(f.path, f.key));
    }
    return true;
  }
};

Result<LoadedConfig> parse_json(std::string_view text, const std::string& source) {
  DuplicateKeys duplicates;
  Json root;
  try {
    root = Json::parse(text.begin(), text.end(), std::ref(duplicates));
  } catch (const Json::exception& e) {
    // what(): "[json.exception.parse_error.101] parse error at line L, column C: ..."
    std::string what = e.what();
    if (const std::size_t close = what.find("] "); what.rfind("[json.exception", 0) == 0 && close != std::string::npos) {
      what.erase(0, close + 2);
    }
    // The excerpt after "last read:" is the input's raw bytes, cut wherever the lexer stopped: possibly
    // inside a multi-byte character, or bytes that were never UTF-8.
    return invalid_argument(source + " is not valid JSON: " + utf8_escaped(what));
  }
  if (duplicates.too_deep) {
    return invalid_argument(source + " nests arrays or objects more than " + std::to_string(kMaxDepth) +
                            " levels deep: it is not a DeepSpeed or zoe config");
  }
  LoadedConfig config;
  for (const std::string& key : duplicates.found) {
    config.notes.push_back("duplicate key '" + key + "' in " + source + ": the last value is used");
  }
  Parser parser(source, &config);
  if (Status s = parser.run(root); !s.ok()) return s;
  return config;
}

}  // namespace

Result<LoadedConfig> parse_config(std::string_view json_text, std::string_view source) {
  // The library reports errors as Status; nothing thrown by the JSON library or the allocator leaves here.
  try {
    return parse_json(json_text, std::string(source));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::out_of_memory, "out of memory reading config " + std::string(source));
  } catch (const std::exception& e) {
    return Status(StatusCode::internal, "reading config " + std::string(source) + ": " + e.what());
  }
}

Result<LoadedConfig> load_config_file(const std::string& path) {
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (file == nullptr) return Status(StatusCode::io_error, "cannot open config file " + path, errno);
  std::string text;
  char buf[1 << 14];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, file.get())) > 0;) text.append(buf, n);
  if (std::ferror(file.get())) return Status(StatusCode::io_error, "reading config file " + path + " failed", errno);
  return parse_config(text, path);
}

}  // namespace zoe
