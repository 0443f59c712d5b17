// The one owner of a POSIX file descriptor in zoe (checkpoints, swap files): closes it on destruction.
#pragma once

#include "base/private.h"

#include <unistd.h>

#include <cerrno>
#include <string>
#include <utility>

#include "zoe/status.h"

namespace zoe {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closes the descriptor held and takes `fd`. A close error is lost here: where it matters (a file whose
  // data is not yet known to be durable), call close() and check it.
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // Closes and reports close's error (on NFS, the first report of a failed write may come only here).
  Status close(const std::string& path) {
    const int fd = std::exchange(fd_, -1);
    // Linux releases the descriptor even when close fails; retrying could close another thread's new fd.
    if (fd >= 0 && ::close(fd) != 0) return {StatusCode::io_error, "closing " + path + " failed", errno};
    return Status::success();
  }

 private:
  int fd_ = -1;
};

}  // namespace zoe
