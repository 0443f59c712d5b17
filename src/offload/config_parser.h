// The config reader's parser (config.cpp: the JSON, the typed getters, the top level; config_sections.cpp:
// each DeepSpeed section and zoe's own), shared by the files it is split over.
#pragma once

#include "src/private.h"

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "zoe/config.h"

namespace zoe::config_reader {

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

std::string join(const std::string& prefix, std::string_view key);
// dump() with `replace` writes valid UTF-8; the excerpt is cut on a character boundary so it stays so.
std::string show(const Json& v);

class Parser {
 public:
  Parser(std::string_view source, LoadedConfig* out) : source_(source), out_(out) {}
  Status run(const Json& root);

 private:
  Status optimizer(const Json& section);
  Status optimizer_params(const Json& params, const OptimizerRule& rule, bool adamw_type);
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
                  std::initializer_list<Ignored> ignored = {}) {
    check_keys(obj, prefix, std::vector<std::string_view>(mapped), ignored);
  }
  void check_keys(const Json& obj, const std::string& prefix, const std::vector<std::string_view>& mapped,
                  std::initializer_list<Ignored> ignored);
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

}  // namespace zoe::config_reader
