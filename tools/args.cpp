#include "tools/args.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>


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

Result<std::uint64_t> parse_count_in(std::string_view text, std::string_view option, std::uint64_t min,
                                     std::uint64_t max, std::string_view counts) {
  Result<std::uint64_t> v = parse_count(text, option);
  if (!v.ok()) {
    return invalid_argument(v.status().message() + "; give " + count_text(min) + " to " + count_text(max) + " (" +
                            std::string(counts) + ")");
  }
  if (*v < min || *v > max) {
    return invalid_argument(std::string(option) + " " + std::string(text) + " is out of range: give " +
                            count_text(min) + " to " + count_text(max) + " (" + std::string(counts) + ")");
  }
  return v;
}

Result<double> parse_number_in(std::string_view text, std::string_view option, double min, double max,
                               std::string_view what) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  char range[96];
  std::snprintf(range, sizeof range, "give %g to %g", min, max);
  if (text.empty() || ec == std::errc::invalid_argument || end != text.data() + text.size()) {
    return invalid_argument(std::string(option) + " '" + std::string(text) + "' is not a number; " + range + " (" +
                            std::string(what) + ")");
  }
  // from_chars reports 1e400 as out of range; nan and inf parse but are no time, ratio or rate.
  if (ec == std::errc::result_out_of_range || !std::isfinite(v) || v < min || v > max) {
    return invalid_argument(std::string(option) + " " + std::string(text) + " is out of range: " + range + " (" +
                            std::string(what) + ")");
  }
  return v;
}

std::string count_text(std::uint64_t value) {
  // Below 4096 the digits read better than a suffix: "1024 threads", not "1K threads".
  static constexpr struct { char suffix; int shift; } kSuffixes[] = {{'T', 40}, {'G', 30}, {'M', 20}, {'K', 10}};
  for (const auto& s : kSuffixes) {
    const std::uint64_t unit = std::uint64_t{1} << s.shift;
    if (value >= 4096 && value >= unit && value % unit == 0) return std::to_string(value / unit) + s.suffix;
  }
  return std::to_string(value);
}

std::uint64_t physical_ram() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

Status require_memory(std::uint64_t bytes, std::string_view option, std::string_view text) {
  const std::uint64_t ram = physical_ram();
  if (ram == 0 || bytes <= ram) return Status::success();
  char figure[64];
  std::snprintf(figure, sizeof figure, "%.1f GiB, and this machine has %.1f GiB of RAM",
                static_cast<double>(bytes) / (1ull << 30), static_cast<double>(ram) / (1ull << 30));
  return invalid_argument(std::string(option) + " " + std::string(text) + " needs buffers of " + figure +
                          ": give a smaller " + std::string(option));
}

Result<std::string> read_small_file(const std::string& path, std::string_view option, std::uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer before fstat could refuse it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return Status(StatusCode::invalid_argument,
                  std::string(option) + ": cannot read " + path + ": " + std::strerror(errno), errno);
  }
  const std::unique_ptr<const int, void (*)(const int*)> closed_on_return(&fd, [](const int* f) { ::close(*f); });
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return Status(StatusCode::invalid_argument, std::string(option) + ": cannot stat " + path, errno);
  }
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode) ? "a folder" : S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISCHR(st.st_mode) ? "a character device"
                       : S_ISBLK(st.st_mode) ? "a block device" : S_ISSOCK(st.st_mode) ? "a socket" : "not a file";
    return invalid_argument(std::string(option) + ": " + path + " is " + kind + ", not a regular file");
  }
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    return invalid_argument(std::string(option) + ": " + path + " has " + std::to_string(st.st_size) +
                            " bytes, more than the " + count_text(max_bytes) + " a config file may have");
  }
  // Read up to one byte past the limit: a file that grew since fstat is refused too, never read without end.
  std::string text(static_cast<std::size_t>(max_bytes) + 1, '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::read(fd, text.data() + got, text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status(StatusCode::io_error, std::string(option) + ": reading " + path + " failed", errno);
    if (r == 0) break;
    got += static_cast<std::size_t>(r);
  }
  if (got > max_bytes) {
    return invalid_argument(std::string(option) + ": " + path + " grew past the " + count_text(max_bytes) +
                            " a config file may have while it was read");
  }
  text.resize(got);
  return text;
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
