// Shared helpers of the NVMe tier's tests: temporary folders, small mounts (root only), fault hooks.
#pragma once

#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "zoe/swap.h"

namespace zoe::testing {

// A fresh folder under the system temp dir (on the root filesystem here, where O_DIRECT works), removed
// with its contents at the end.
class TempDir {
 public:
  explicit TempDir(const char* tag = "zoe-aio") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (std::string(tag) + "-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    if (!path_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const {
    const std::string p = path_ + "/" + name;
    std::filesystem::create_directories(p);
    return p;
  }

 private:
  std::string path_;
};

// A filesystem mounted for one test (tmpfs with a size, ramfs, read-only): needs root and a kernel that
// lets this process mount; ok() is false (with the reason) where it cannot.
class TestMount {
 public:
  TestMount(const std::string& dir, const char* type, const char* data, bool read_only = false) : dir_(dir) {
    if (::mount(type, dir.c_str(), type, 0, data) != 0) {
      reason_ = std::string("cannot mount ") + type + " (" + std::strerror(errno) + "): needs root";
      return;
    }
    mounted_ = true;
    if (read_only && ::mount(nullptr, dir.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, data) != 0) {
      reason_ = std::string("cannot remount read-only: ") + std::strerror(errno);
    }
  }
  ~TestMount() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  TestMount(const TestMount&) = delete;
  TestMount& operator=(const TestMount&) = delete;
  bool ok() const { return mounted_ && reason_.empty(); }
  const std::string& reason() const { return reason_; }

 private:
  std::string dir_;
  bool mounted_ = false;
  std::string reason_;
};

// Whether O_DIRECT works in `dir` (a small aligned write through it succeeds).
inline bool direct_io_works(const std::string& dir) {
  const std::string p = dir + "/.odirect-check";
  const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd < 0) return false;
  void* buf = std::aligned_alloc(4096, 4096);
  std::memset(buf, 0, 4096);
  const bool ok = ::pwrite(fd, buf, 4096, 0) == 4096;
  std::free(buf);
  ::close(fd);
  ::unlink(p.c_str());
  return ok;
}

// Arms one fault: the `nth` (0-based) request of kind `op` seen after arm() gets `error`, or a short
// transfer of `transferred` bytes. Thread-safe: the I/O engine calls hooks from its reaper thread.
struct FaultPlan {
  std::atomic<bool> armed{false};
  std::atomic<int> seen{0};
  std::atomic<int> fired{0};
  IoOp op = IoOp::read;
  int nth = 0;
  int error = 0;
  std::int64_t transferred = -1;
  bool every = false;  // fail every matching request from the nth on (a fault that persists)
  std::int64_t at_offset = -1;  // >= 0: only requests at this file offset count
  // The file offset of the last request of `op` the engine finished, armed or not. The hook runs as requests
  // complete, in whatever order the kernel finishes them: with several in flight, a test that means one of
  // them learns its offset first (a request of its own) and arms at_offset, rather than counting to it.
  std::atomic<std::int64_t> last_offset{-1};

  void arm(IoOp o, int n, int err, std::int64_t short_bytes = -1, bool persist = false) {
    op = o;
    nth = n;
    error = err;
    transferred = short_bytes;
    every = persist;
    at_offset = -1;
    seen = 0;
    fired = 0;
    armed = true;
  }
  void clear() { armed = false; }

  IoFaultHook hook() {
    return [this](const IoSite& site) -> IoFault {
      if (site.op == op) last_offset = static_cast<std::int64_t>(site.offset);
      if (!armed || site.op != op) return {};
      if (at_offset >= 0 && site.offset != static_cast<std::uint64_t>(at_offset)) return {};
      const int k = seen++;
      if (k == nth || (every && k > nth)) {
        ++fired;
        return {error, transferred};
      }
      return {};
    };
  }
};

}  // namespace zoe::testing
