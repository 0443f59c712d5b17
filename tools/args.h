// Small command-line helpers shared by the zoe subcommands: --name value / --name=value options, counts with
// K/M/G/T suffixes and their ranges, decimal numbers, small files read whole, comma lists, one-line JSON objects.
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

// "64M" -> 67108864: suffixes K, M, G, T are powers of 1024; plain digits are taken as they are. A value that
// does not fit 64 bits, a sign, a space, hex or anything else after the digits is refused.
Result<std::uint64_t> parse_count(std::string_view text, std::string_view what);
// The same with the option's documented range [min, max] (docs/cli.md): outside it the message names the
// option, the range and what it counts. Ranges keep every size the commands compute from the count (times a
// dtype width, times a repetition) well inside 64 bits; a minimum of 1 refuses a benchmark of 0 parameters or
// 0 repetitions, which would measure nothing and print every rate as 0/0.
Result<std::uint64_t> parse_count_in(std::string_view text, std::string_view option, std::uint64_t min,
                                     std::uint64_t max, std::string_view counts);
// A decimal number (a time, a ratio, a rate): all of the text, finite, in [min, max]; "nan", "inf" and
// "1e400" are refused by name.
Result<double> parse_number_in(std::string_view text, std::string_view option, double min, double max,
                               std::string_view what);
// The ranges the benchmarks share (docs/cli.md): parameters (and elements per tile) up to 2^40, times any
// dtype width and repetition count, stay far inside 64 bits.
constexpr std::uint64_t kMaxBenchParams = std::uint64_t{1} << 40;  // 1T
constexpr std::uint64_t kMaxThreads = 1024;
constexpr std::uint64_t kMaxReps = std::uint64_t{1} << 20;  // 1M

// A count as the options take it, for messages: 1099511627776 -> "1T", 4096 -> "4K", 1024 -> "1024".
std::string count_text(std::uint64_t value);
// This machine's RAM in bytes (0 when unknown).
std::uint64_t physical_ram();
// Refuses a benchmark whose buffers would not fit this machine's RAM before it allocates them: a size that
// passes its range can still ask for terabytes, and touching memory the kernel overcommitted ends in the
// OOM killer, not in an error.
Status require_memory(std::uint64_t bytes, std::string_view option, std::string_view text);
// A small file named on the command line (a model config): refused by name unless it is a regular file of
// at most `max_bytes` (a device, a FIFO or a folder is never read, and nothing waits on a FIFO's writer).
Result<std::string> read_small_file(const std::string& path, std::string_view option, std::uint64_t max_bytes);
std::vector<std::string> split_list(std::string_view text);

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
