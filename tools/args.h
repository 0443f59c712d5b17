// Small command-line helpers shared by the zoe subcommands: --name value / --name=value options, counts with
// K/M/G suffixes, comma lists, and one-line JSON objects.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zoe/device.h"
#include "zoe/status.h"

namespace zoe::cli {

struct Option {
  std::string_view name;   // without the leading "--"
  std::string* value;      // set for options that take a value
  bool* flag;              // set for options that take none
  std::string_view help;
};

// Fills the options from args; an unknown option, a missing value or a stray word is an error.
Status parse_options(std::span<char* const> args, std::span<const Option> options);
std::string options_help(std::span<const Option> options);

// "64M" -> 67108864: suffixes K, M, G, T are powers of 1024; plain digits are taken as they are.
Result<std::uint64_t> parse_count(std::string_view text, std::string_view what);
std::vector<std::string> split_list(std::string_view text);

// Refuses a count below `min` with a message naming the option and what it counts: a benchmark of 0
// parameters or 0 repetitions measures nothing, and every rate it printed would be 0/0.
Status require_at_least(std::uint64_t value, std::uint64_t min, std::string_view option, std::string_view counts);
// Refuses a comma list with no items ("--isa ''" would run nothing and exit 0).
Status require_items(const std::vector<std::string>& items, std::string_view option, std::string_view choices);

// --device for the benches: "host" (the stand-in), "cpu" (the CPU itself: device memory is host memory, as
// for a CPU-only PyTorch model) or "cuda" (the first GPU).
Result<std::unique_ptr<Device>> open_bench_device(const std::string& name);

// Exit status for a failed subcommand: 2 when the command line was at fault, 1 when the run failed.
inline int exit_status(const Status& s) { return s.code() == StatusCode::invalid_argument ? 2 : 1; }

// One JSON object on one line, fields in the order they are added.
class JsonLine {
 public:
  JsonLine& add(std::string_view key, std::string_view value);
  JsonLine& add(std::string_view key, const char* value) { return add(key, std::string_view(value)); }
  JsonLine& add(std::string_view key, double value);
  JsonLine& add(std::string_view key, std::uint64_t value);
  JsonLine& add(std::string_view key, std::int64_t value);
  JsonLine& add(std::string_view key, int value) { return add(key, static_cast<std::int64_t>(value)); }
  JsonLine& add(std::string_view key, bool value);
  // A value that is already JSON text (an array or object made elsewhere), added as it is.
  JsonLine& add_json(std::string_view key, std::string_view json_text);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(std::string_view k);
  std::string body_;
};

std::string json_escape(std::string_view s);

}  // namespace zoe::cli
