#include "tools/report.h"

#include <cstdarg>
#include <cstdio>

namespace zoe::cli {

std::string format(const char* fmt, ...) {
  std::va_list args;
  va_start(args, fmt);
  std::va_list again;
  va_copy(again, args);
  const int size = std::vsnprintf(nullptr, 0, fmt, args);
  va_end(args);
  std::string out(size > 0 ? static_cast<std::size_t>(size) : 0, '\0');
  if (size > 0) std::vsnprintf(out.data(), out.size() + 1, fmt, again);
  va_end(again);
  return out;
}

void print_help(std::string_view head, std::span<const Option> options, std::string_view tail) {
  std::fputs((std::string(head) + options_help(options) + std::string(tail)).c_str(), stdout);
}

int fail(std::string_view command, const Status& s) {
  std::fprintf(stderr, "%s: %s\n", std::string(command).c_str(), s.to_string().c_str());
  return exit_status(s);
}

int fail_message(std::string_view command, const Status& s) {
  std::fprintf(stderr, "%s: %s\n", std::string(command).c_str(), s.message().c_str());
  return exit_status(s);
}

void Report::result(std::string_view json_object, std::string_view text) {
  if (json_) {
    std::fwrite(json_object.data(), 1, json_object.size(), stdout);
    std::fputc('\n', stdout);
  } else {
    this->text(header_);
    header_.clear();
    this->text(text);
  }
  std::fflush(stdout);
}

void Report::lines(std::string_view text) {
  if (!json_) this->text(text);
}

void Report::progress(std::string_view what) const {
  if (!json_) std::fprintf(stderr, "%s: %s\n", command_.c_str(), std::string(what).c_str());
}

void Report::text(std::string_view text) { std::fwrite(text.data(), 1, text.size(), stdout); }

}  // namespace zoe::cli
