#include <cstring>
#include <string>

#include "zoe/status.h"

namespace zoe {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::ok: return "ok";
    case StatusCode::invalid_argument: return "invalid argument";
    case StatusCode::unsupported: return "unsupported";
    case StatusCode::non_finite: return "non-finite gradient";
    case StatusCode::io_error: return "I/O error";
    case StatusCode::corrupt: return "corrupt data";
    case StatusCode::out_of_memory: return "out of memory";
    case StatusCode::internal: return "internal error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string s(status_code_name(code_));
  s += ": ";
  s += message_;
  if (errno_ != 0) {
    s += " (errno ";
    s += std::to_string(errno_);
    s += ": ";
    s += std::strerror(errno_);
    s += ")";
  }
  return s;
}

}  // namespace zoe
