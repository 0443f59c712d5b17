// The library's one channel for warnings: a fault it recovered from (a write retried, one damaged copy of
// a tile table used from the other), or a setting it had to change (buffered I/O where O_DIRECT is
// refused). Each goes to stderr as "zoe: warning: <message>" unless a program installs a sink of its own.
#pragma once

#include "base/private.h"

#include <functional>
#include <string_view>

namespace zoe {

using WarningSink = std::function<void(std::string_view message)>;

// The sink every later warning goes to, from any thread (one at a time); an empty one restores stderr.
void set_warning_sink(WarningSink sink);
void warn(std::string_view message);

}  // namespace zoe
