// The one error model of the library: every fallible call returns a Status (or a Result<T>) that carries a
// code, the errno where the OS gave one, and a message naming the file, offset or parameter at fault.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace zoe {

enum class StatusCode {
  ok = 0,
  invalid_argument,  // the caller passed something the call cannot accept; nothing was changed
  unsupported,       // the machine or build lacks what was asked (an ISA, O_DIRECT, a GPU)
  non_finite,        // a finite check found NaN/Inf; nothing was changed
  io_error,          // the OS reported an I/O failure (errno is set)
  corrupt,           // stored data failed a check (checksum, manifest, size)
  out_of_memory,
  internal,
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message, int sys_errno = 0)
      : code_(code), errno_(sys_errno), message_(std::move(message)) {}

  static Status success() { return {}; }

  bool ok() const { return code_ == StatusCode::ok; }
  explicit operator bool() const { return ok(); }
  StatusCode code() const { return code_; }
  int sys_errno() const { return errno_; }
  const std::string& message() const { return message_; }
  // "<code>: <message>[ (errno N: text)]", for logs and CLI output.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::ok;
  int errno_ = 0;
  std::string message_;
};

inline Status invalid_argument(std::string message) {
  return {StatusCode::invalid_argument, std::move(message)};
}

// A value or the Status saying why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  T& operator*() & { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace zoe
