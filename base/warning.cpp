#include "base/warning.h"

#include <cstdio>
#include <mutex>
#include <utility>

namespace zoe {
namespace {

std::mutex& sink_mutex() {
  static std::mutex m;
  return m;
}

WarningSink& sink() {
  static WarningSink s;
  return s;
}

}  // namespace

void set_warning_sink(WarningSink s) {
  const std::lock_guard lock(sink_mutex());
  sink() = std::move(s);
}

void warn(std::string_view message) {
  const std::lock_guard lock(sink_mutex());
  if (sink()) {
    sink()(message);
    return;
  }
  std::fprintf(stderr, "zoe: warning: %.*s\n", static_cast<int>(message.size()), message.data());
}

}  // namespace zoe
