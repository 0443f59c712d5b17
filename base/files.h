// Small-file plumbing every layer uses: a file written beside its final path and renamed over it
// (AtomicFile), a folder synced, a file read whole. Every failure is a Status naming the path, errno kept.
// The NVMe tier's own file handling (O_DIRECT, preallocation, filesystems) is aio/files.h.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/unique_fd.h"
#include "zoe/status.h"

namespace zoe {

// A Status for a failed system call: "<what> <path>: <strerror>", io_error, errno kept.
Status sys_error(const std::string& what, const std::string& path, int err);

// The folder a path names a file in ("." for a bare name, "/" at the root).
std::string parent_dir(const std::string& path);

// fsync of a folder, so that names created or renamed in it survive a crash.
Status sync_dir(const std::string& dir);

Result<std::string> read_whole_file(const std::string& path);

// A file written under a temporary name the caller chooses (beside `path`, so the rename stays in one
// filesystem) and renamed over `path` by commit(): the data is fsync'ed before the rename and the folder
// after it, so a crash leaves the old file or the new, never a mix. Not committed — a failure, or destroyed
// before commit() — the temporary is removed.
class AtomicFile {
 public:
  struct Options {
    mode_t mode = 0644;
    // The temporary is created with O_EXCL: a name that exists comes back as an io_error with errno EEXIST,
    // and the caller may pick another. false: an existing file of that name is truncated and reused (a
    // name that only this process makes).
    bool exclusive = true;
  };
  static Result<AtomicFile> create(std::string path, std::string temp, Options options);
  static Result<AtomicFile> create(std::string path, std::string temp) {
    return create(std::move(path), std::move(temp), Options{});
  }

  AtomicFile(AtomicFile&& o) noexcept;
  AtomicFile& operator=(AtomicFile&&) = delete;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  // All of `bytes`: short writes continued, EINTR retried; a write that makes no progress is ENOSPC.
  Status write(const void* data, std::size_t bytes);
  // fsync, close (its error reported), rename over the path, fsync of the folder. Once the rename is done
  // the file is in place even if the folder's sync fails (that error says so).
  Status commit();

  int fd() const { return fd_.get(); }  // for a lock on the temporary while it is written
  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_; }
  std::uint64_t offset() const { return offset_; }  // bytes written so far
  bool committed() const { return committed_; }  // renamed over the path

 private:
  AtomicFile(std::string path, std::string temp, UniqueFd fd)
      : path_(std::move(path)), temp_(std::move(temp)), fd_(std::move(fd)) {}
  std::string path_, temp_;
  UniqueFd fd_;
  std::uint64_t offset_ = 0;
  bool committed_ = false;
};

// Replaces `path` with `data` through an AtomicFile (mode 0600) whose temporary is
// `<path>.tmp-<pid>-<n>`, unique per call: writers of the same file never share one.
Status replace_file(const std::string& path, const std::string& data);

}  // namespace zoe
