#include "tools/args.h"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace zoe::cli {

Status parse_options(std::span<char* const> args, std::span<const Option> options) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (!arg.starts_with("--")) return invalid_argument("unexpected argument '" + std::string(arg) + "'");
    arg.remove_prefix(2);
    std::string_view inline_value;
    bool has_inline = false;
    if (const auto eq = arg.find('='); eq != std::string_view::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_inline = true;
    }
    const Option* match = nullptr;
    for (const Option& o : options) {
      if (o.name == arg) match = &o;
    }
    if (match == nullptr) return invalid_argument("unknown option --" + std::string(arg) + " (see --help)");
    if (match->flag != nullptr) {
      if (has_inline) return invalid_argument("option --" + std::string(arg) + " takes no value");
      *match->flag = true;
      continue;
    }
    if (has_inline) {
      *match->value = std::string(inline_value);
    } else if (i + 1 < args.size()) {
      *match->value = args[++i];
    } else {
      return invalid_argument("option --" + std::string(arg) + " needs a value");
    }
  }
  return Status::success();
}

std::string options_help(std::span<const Option> options) {
  std::string s;
  for (const Option& o : options) {
    std::string left = "  --" + std::string(o.name) + (o.value != nullptr ? " VALUE" : "");
    if (left.size() < 24) left.resize(24, ' ');
    s += left + " " + std::string(o.help);
    if (o.value != nullptr && !o.value->empty()) s += " [" + *o.value + "]";
    s += "\n";
  }
  return s;
}

Result<std::uint64_t> parse_count(std::string_view text, std::string_view what) {
  std::uint64_t multiplier = 1;
  std::string_view digits = text;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': case 'k': multiplier = 1ull << 10; break;
      case 'M': case 'm': multiplier = 1ull << 20; break;
      case 'G': case 'g': multiplier = 1ull << 30; break;
      case 'T': case 't': multiplier = 1ull << 40; break;
      default: break;
    }
    if (multiplier != 1) digits.remove_suffix(1);
  }
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() ||
      value > UINT64_MAX / multiplier) {
    return invalid_argument(std::string(what) + " '" + std::string(text) +
                            "' is not a count (digits with an optional K, M, G or T suffix)");
  }
  return value * multiplier;
}

std::vector<std::string> split_list(std::string_view text) {
  std::vector<std::string> items;
  while (!text.empty()) {
    const auto comma = text.find(',');
    items.emplace_back(text.substr(0, comma));
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return items;
}

Status require_at_least(std::uint64_t value, std::uint64_t min, std::string_view option, std::string_view counts) {
  if (value >= min) return Status::success();
  return invalid_argument(std::string(option) + " " + std::to_string(value) + ": need at least " +
                          std::to_string(min) + " (" + std::string(counts) + ")");
}

Status require_items(const std::vector<std::string>& items, std::string_view option, std::string_view choices) {
  if (!items.empty()) return Status::success();
  return invalid_argument(std::string(option) + " is empty: give one or more of " + std::string(choices));
}

Result<std::unique_ptr<Device>> open_bench_device(const std::string& name) {
  if (name == "host") return make_host_device();
  if (name == "cpu") return make_cpu_device();
  if (name == "cuda") return make_cuda_device(0);
  return invalid_argument("--device " + name + " is not host, cpu or cuda");
}

std::string json_escape(std::string_view s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", ch);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out;
}

void JsonLine::key(std::string_view k) {
  if (!body_.empty()) body_ += ", ";
  body_ += '"';
  body_ += json_escape(k);
  body_ += "\": ";
}

JsonLine& JsonLine::add(std::string_view k, std::string_view value) {
  key(k);
  body_ += '"';
  body_ += json_escape(value);
  body_ += '"';
  return *this;
}

JsonLine& JsonLine::add(std::string_view k, double value) {
  key(k);
  if (!std::isfinite(value)) {
    body_ += "null";
  } else {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", value);
    body_ += buf;
  }
  return *this;
}

JsonLine& JsonLine::add(std::string_view k, std::uint64_t value) {
  key(k);
  body_ += std::to_string(value);
  return *this;
}

JsonLine& JsonLine::add(std::string_view k, std::int64_t value) {
  key(k);
  body_ += std::to_string(value);
  return *this;
}

JsonLine& JsonLine::add_json(std::string_view k, std::string_view json_text) {
  key(k);
  body_ += json_text;
  return *this;
}

JsonLine& JsonLine::add(std::string_view k, bool value) {
  key(k);
  body_ += value ? "true" : "false";
  return *this;
}

}  // namespace zoe::cli
