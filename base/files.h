// Small-file plumbing every layer uses: a folder opened once and every name in it reached through its
// descriptor (Folder), a file written beside its final path and renamed over it (AtomicFile), a folder
// synced, a file read whole. Every failure is a Status naming the path, errno kept.
// The NVMe tier's own file handling (O_DIRECT, preallocation, filesystems) is aio/files.h.
#pragma once

#include "base/private.h"

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

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

// 16 random hex digits (getrandom): the part of a temporary name nobody can predict.
std::string random_hex();

// A folder opened once. Every file zoe creates, opens for writing, renames or removes in a folder goes through
// one of these, relative to its descriptor (openat, renameat, unlinkat): a name is never reopened by path, no
// symlink at a name is followed, and the folder renamed (or a link planted above it) after the open redirects
// nothing. Paths are kept only for messages.
class Folder {
 public:
  static Result<Folder> open(const std::string& path);
  Folder() = default;
  Result<Folder> dup() const;  // a second descriptor of the same folder

  const std::string& path() const { return path_; }
  std::string path_of(const std::string& name) const;  // "<folder>/<name>", for messages and hooks
  int fd() const { return fd_.get(); }
  bool valid() const { return fd_.valid(); }

  // Creates `name` exclusively (O_CREAT | O_EXCL | O_NOFOLLOW, plus `flags`): a name that exists, a symlink
  // included, is EEXIST.
  Result<UniqueFd> create(const std::string& name, int flags, mode_t mode) const;
  // Opens an existing regular file without following a symlink at its name; anything else is refused.
  Result<UniqueFd> open_file(const std::string& name, int flags) const;
  // Removes `name` (never what a symlink there points to); a name that is not there is fine.
  Status remove(const std::string& name) const;
  Status rename(const std::string& from, const std::string& to) const;  // within this folder
  // A regular file's whole text, no symlink followed (manifests, lock records).
  Result<std::string> read(const std::string& name) const;
  bool exists(const std::string& name) const;  // anything at the name, a dangling symlink too
  Status sync() const;  // fsync, so that names created or renamed here survive a crash
  // Refuses a folder another user could use to swap names under zoe: owned by a user other than this one
  // or root, or writable by its group (other than this process's own group with no other member) or by
  // everyone without the sticky bit. The message names `what`, the folder, its owner and mode, and the remedy.
  Status check_private(const std::string& what) const;

 private:
  Folder(std::string path, UniqueFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}
  std::string path_;
  UniqueFd fd_;
};

// A file written under a temporary name of its own beside its final path (`<name>.tmp-<tag>-<random>`,
// created exclusively in the same folder, so the rename stays in one filesystem) and renamed over the path
// by commit(): the data is fsync'ed before the rename and the folder after it, so a crash leaves the old
// file or the new, never a mix. Not committed — a failure, or destroyed before commit() — the temporary is
// removed. The random part makes the name unpredictable: nobody can plant a link where it will be.
class AtomicFile {
 public:
  struct Options {
    // 0666 and the umask decide, as for torch.save; private files (manifests) pass 0600.
    mode_t mode = 0666;
    // Between ".tmp-" and the random part: who writes (a cleaner of crashed writers' files reads it).
    std::string tag;
  };
  static Result<AtomicFile> create(const std::string& path, Options options);
  static Result<AtomicFile> create(const std::string& path) { return create(path, Options{}); }
  // `name` in a folder already open.
  static Result<AtomicFile> create_in(const Folder& folder, const std::string& name, Options options);

  AtomicFile(AtomicFile&& o) noexcept;
  AtomicFile& operator=(AtomicFile&&) = delete;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  // All of `bytes`: short writes continued, EINTR retried; a write that makes no progress is ENOSPC.
  Status write(const void* data, std::size_t bytes);
  // fsync, rename over the path (in the folder opened at create()), a check that the name now holds this
  // very file (someone who can write the folder may have swapped the temporary), close, fsync of the folder.
  // Once the rename is done the file is in place even if the folder's sync fails (that error says so).
  Status commit();

  int fd() const { return fd_.get(); }  // for a lock on the temporary while it is written
  const std::string& path() const { return path_; }
  std::string temp_path() const { return folder_.path_of(temp_); }
  std::uint64_t offset() const { return offset_; }  // bytes written so far
  bool committed() const { return committed_; }  // renamed over the path

 private:
  AtomicFile(std::string path, Folder folder, std::string name, std::string temp, UniqueFd fd)
      : path_(std::move(path)), folder_(std::move(folder)), name_(std::move(name)), temp_(std::move(temp)),
        fd_(std::move(fd)) {}
  std::string path_;
  Folder folder_;
  std::string name_, temp_;  // the final and the temporary name in folder_
  UniqueFd fd_;
  std::uint64_t offset_ = 0;
  bool committed_ = false;
};

// Replaces `path` with `data` through an AtomicFile of mode 0600 whose temporary is
// `<path>.tmp-<pid>-<random>`.
Status replace_file(const std::string& path, const std::string& data);
Status replace_file(const Folder& folder, const std::string& name, const std::string& data);

// The last component of a path ("f" of "/a/f"); the folder is parent_dir().
std::string base_name(const std::string& path);

}  // namespace zoe
