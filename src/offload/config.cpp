// The config reader (zoe/config.h): the JSON parsed with duplicate keys and depth checked, the parser's typed
// getters and its top level, which hands each section to its reader in config_sections.cpp.
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
#include "src/offload/config_parser.h"

namespace zoe {
namespace config_reader {
namespace {

bool matches(std::string_view pattern, std::string_view key) {
  if (!pattern.empty() && pattern.back() == '*') return key.substr(0, pattern.size() - 1) == pattern.substr(0, pattern.size() - 1);
  return pattern == key;
}

}  // namespace

std::string join(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : prefix + "." + std::string(key);
}

std::string show(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  return s.size() > 60 ? std::string(utf8_prefix(s, 57)) + "..." : s;
}

void Parser::check_keys(const Json& obj, const std::string& prefix, const std::vector<std::string_view>& mapped,
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

}  // namespace config_reader

namespace {

using config_reader::Json;
using config_reader::join;
using config_reader::Parser;

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
