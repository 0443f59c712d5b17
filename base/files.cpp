#include "base/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

namespace zoe {

namespace {
constexpr std::size_t kMaxWrite = std::size_t{1} << 30;  // Linux writes at most ~2 GiB per call
}  // namespace

Status sys_error(const std::string& what, const std::string& path, int err) {
  return Status(StatusCode::io_error, what + " " + path + ": " + std::strerror(err), err);
}

std::string parent_dir(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

Status sync_dir(const std::string& dir) {
  UniqueFd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dfd.valid() || ::fsync(dfd.get()) != 0) return sys_error("fsync of folder", dir, errno);
  return Status::success();
}

Result<std::string> read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return sys_error("cannot read", path, errno ? errno : ENOENT);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return sys_error("cannot read", path, EIO);
  return ss.str();
}

Result<AtomicFile> AtomicFile::create(std::string path, std::string temp, Options options) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (options.exclusive ? O_EXCL : O_TRUNC);
  UniqueFd fd(::open(temp.c_str(), flags, options.mode));
  if (!fd.valid()) return sys_error("cannot create", temp, errno);
  return AtomicFile(std::move(path), std::move(temp), std::move(fd));
}

AtomicFile::AtomicFile(AtomicFile&& o) noexcept
    : path_(std::move(o.path_)), temp_(std::exchange(o.temp_, std::string())), fd_(std::move(o.fd_)),
      offset_(o.offset_), committed_(o.committed_) {}

AtomicFile::~AtomicFile() {
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

Status AtomicFile::write(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t w = ::write(fd_.get(), p, std::min(bytes, kMaxWrite));
    if (w < 0) {
      if (errno == EINTR) continue;
      return sys_error("writing at offset " + std::to_string(offset_) + " failed:", temp_, errno);
    }
    if (w == 0) return sys_error("writing at offset " + std::to_string(offset_) + " made no progress:", temp_, ENOSPC);
    p += w;
    bytes -= static_cast<std::size_t>(w);
    offset_ += static_cast<std::uint64_t>(w);
  }
  return Status::success();
}

Status AtomicFile::commit() {
  // Data reaches the disk before the rename does, else a crash could leave `path` naming a partial file.
  if (::fsync(fd_.get()) != 0) return sys_error("fsync of", temp_, errno);
  if (Status s = fd_.close(temp_); !s.ok()) return s;
  if (::rename(temp_.c_str(), path_.c_str()) != 0) return sys_error("cannot rename " + temp_ + " to", path_, errno);
  committed_ = true;
  const std::string dir = parent_dir(path_);
  if (Status s = sync_dir(dir); !s.ok()) {
    return Status(s.code(), path_ + " is in place, but " + s.message() + ": the rename may not survive a crash",
                  s.sys_errno());
  }
  return Status::success();
}

Status replace_file(const std::string& path, const std::string& data) {
  static std::atomic<std::uint64_t> sequence{0};
  const std::string temp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(sequence.fetch_add(1));
  Result<AtomicFile> file = AtomicFile::create(path, temp, AtomicFile::Options{0600, true});
  if (!file.ok()) return file.status();
  if (Status s = file->write(data.data(), data.size()); !s.ok()) return s;
  return file->commit();
}

}  // namespace zoe
