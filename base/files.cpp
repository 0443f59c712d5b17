#include "base/files.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

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

std::string random_hex() {
  unsigned char bytes[8];
  std::size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t r = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (r > 0) got += static_cast<std::size_t>(r);
    else if (errno != EINTR) break;
  }
  if (got < sizeof bytes) {
    // No getrandom (a kernel before 3.17, a seccomp filter): the library's own source of randomness.
    std::random_device rd;
    for (std::size_t i = got; i < sizeof bytes; ++i) bytes[i] = static_cast<unsigned char>(rd());
  }
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

std::string base_name(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// ---- Folder ----

Result<Folder> Folder::open(const std::string& path) {
  const std::string p = path.empty() ? "." : path;
  UniqueFd fd(::open(p.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return sys_error("cannot open folder", p, errno);
  return Folder(p, std::move(fd));
}

Result<Folder> Folder::dup() const {
  const int fd = ::fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return sys_error("cannot duplicate the descriptor of folder", path_, errno);
  return Folder(path_, UniqueFd(fd));
}

std::string Folder::path_of(const std::string& name) const {
  if (path_ == ".") return name;  // a bare name stays as it was given
  return path_ == "/" ? "/" + name : path_ + "/" + name;
}

Result<UniqueFd> Folder::create(const std::string& name, int flags, mode_t mode) const {
  int fd;
  do {
    fd = ::openat(fd_.get(), name.c_str(), flags | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return sys_error("cannot create", path_of(name), errno);
  return UniqueFd(fd);
}

Result<UniqueFd> Folder::open_file(const std::string& name, int flags) const {
  int fd;
  do {
    fd = ::openat(fd_.get(), name.c_str(), (flags & ~O_CREAT) | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0 && errno == ELOOP) {  // with O_NOFOLLOW: a symlink is at the name
    return Status(StatusCode::io_error, path_of(name) + " is a symbolic link: zoe follows no link at the name of a file "
                                        "of its own; remove it", ELOOP);
  }
  if (fd < 0) return sys_error("cannot open", path_of(name), errno);
  UniqueFd owned(fd);
  struct stat st{};
  if (::fstat(fd, &st) != 0) return sys_error("cannot stat", path_of(name), errno);
  if (!S_ISREG(st.st_mode)) {
    return Status(StatusCode::io_error, path_of(name) + " is not a regular file: remove it, zoe's files are plain files",
                  EINVAL);
  }
  // O_NONBLOCK only kept a FIFO at the name from blocking the open; regular files ignore it, but take it off.
  (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return owned;
}

Status Folder::remove(const std::string& name) const {
  if (::unlinkat(fd_.get(), name.c_str(), 0) != 0 && errno != ENOENT) return sys_error("cannot remove", path_of(name), errno);
  return Status::success();
}

Status Folder::rename(const std::string& from, const std::string& to) const {
  if (::renameat(fd_.get(), from.c_str(), fd_.get(), to.c_str()) != 0) {
    return sys_error("cannot rename " + path_of(from) + " to", path_of(to), errno);
  }
  return Status::success();
}

Result<std::string> Folder::read(const std::string& name) const {
  Result<UniqueFd> fd = open_file(name, O_RDONLY);
  if (!fd.ok()) return fd.status();
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd->get(), buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return sys_error("cannot read", path_of(name), errno);
    if (r == 0) return out;
    out.append(buf, static_cast<std::size_t>(r));
  }
}

bool Folder::exists(const std::string& name) const {
  struct stat st{};
  return ::fstatat(fd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
}

Status Folder::sync() const {
  if (::fsync(fd_.get()) != 0) return sys_error("fsync of folder", path_, errno);
  return Status::success();
}

namespace {

// Whether the group `gid` may hold another user than this one: it lists members other than this user, or it
// is not this process's own group (whose other users cannot be listed without walking every account).
// The account name of `uid`, "" when there is none (the reentrant call: any thread may check a folder).
std::string user_name(uid_t uid) {
  struct passwd pw{};
  struct passwd* found = nullptr;
  char buf[4096];
  if (::getpwuid_r(uid, &pw, buf, sizeof buf, &found) != 0 || found == nullptr) return "";
  return pw.pw_name;
}

bool group_has_others(gid_t gid) {
  if (gid != ::getegid()) return true;
  struct group g{};
  struct group* found = nullptr;
  std::vector<char> buf(1 << 16);
  if (::getgrgid_r(gid, &g, buf.data(), buf.size(), &found) != 0 || found == nullptr) return true;
  const std::string me = user_name(::geteuid());
  for (char** m = g.gr_mem; *m != nullptr; ++m) {
    if (me.empty() || me != *m) return true;
  }
  return false;
}

std::string owner_name(uid_t uid) {
  const std::string name = user_name(uid);
  return name.empty() ? "uid " + std::to_string(uid) : name + " (uid " + std::to_string(uid) + ")";
}

}  // namespace

Status Folder::check_private(const std::string& what) const {
  struct stat st{};
  if (::fstat(fd_.get(), &st) != 0) return sys_error("cannot stat", path_, errno);
  const uid_t me = ::geteuid();
  const bool sticky = (st.st_mode & S_ISVTX) != 0;
  std::string who;
  if (st.st_uid != me && st.st_uid != 0) {
    who = "it belongs to " + owner_name(st.st_uid) + ", who can rename or replace any file in it";
  } else if ((st.st_mode & S_IWOTH) != 0 && !sticky) {
    who = "everyone can write it and it has no sticky bit, so any user can rename or replace the files in it";
  } else if ((st.st_mode & S_IWGRP) != 0 && !sticky && group_has_others(st.st_gid)) {
    who = "its group (gid " + std::to_string(st.st_gid) + ") can write it and it has no sticky bit, so the group's "
          "users can rename or replace the files in it";
  }
  if (who.empty()) return Status::success();
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return Status(StatusCode::invalid_argument,
                what + " " + path_ + " is not safe for zoe's files: " + who + " (owner " + owner_name(st.st_uid) +
                    ", mode " + mode + "). Use a folder of your own (mkdir -m 700), or make this one private "
                    "(chmod go-w " + path_ + ", or chmod +t for a shared one, as /tmp is)",
                EPERM);
}

// ---- AtomicFile ----

Result<AtomicFile> AtomicFile::create(const std::string& path, Options options) {
  Result<Folder> folder = Folder::open(parent_dir(path));
  if (!folder.ok()) return sys_error("cannot create " + path + ":", "its folder " + parent_dir(path), folder.status().sys_errno());
  return create_in(*folder, base_name(path), std::move(options));
}

Result<AtomicFile> AtomicFile::create_in(const Folder& folder, const std::string& name, Options options) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    return invalid_argument(folder.path_of(name) + " names no file (a file name is needed)");
  }
  Result<Folder> own = folder.dup();
  if (!own.ok()) return own.status();
  const std::string prefix = name + ".tmp-" + (options.tag.empty() ? "" : options.tag + "-");
  // The random part is 64 bits: a name that exists all the same is someone else's (never reused, never
  // followed): another draw.
  for (int attempt = 0;; ++attempt) {
    std::string temp = prefix + random_hex();
    Result<UniqueFd> fd = own->create(temp, O_WRONLY, options.mode);
    if (fd.ok()) {
      return AtomicFile(own->path_of(name), std::move(own).value(), name, std::move(temp), std::move(fd).value());
    }
    if (fd.status().sys_errno() != EEXIST || attempt == 16) return fd.status();
  }
}

AtomicFile::AtomicFile(AtomicFile&& o) noexcept
    : path_(std::move(o.path_)), folder_(std::move(o.folder_)), name_(std::move(o.name_)),
      temp_(std::exchange(o.temp_, std::string())), fd_(std::move(o.fd_)), offset_(o.offset_), committed_(o.committed_) {}

AtomicFile::~AtomicFile() {
  if (!committed_ && !temp_.empty()) (void)folder_.remove(temp_);
}

Status AtomicFile::write(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t w = ::write(fd_.get(), p, std::min(bytes, kMaxWrite));
    if (w < 0) {
      if (errno == EINTR) continue;
      return sys_error("writing at offset " + std::to_string(offset_) + " failed:", temp_path(), errno);
    }
    if (w == 0) return sys_error("writing at offset " + std::to_string(offset_) + " made no progress:", temp_path(), ENOSPC);
    p += w;
    bytes -= static_cast<std::size_t>(w);
    offset_ += static_cast<std::uint64_t>(w);
  }
  return Status::success();
}

Status AtomicFile::commit() {
  // Data reaches the disk before the rename does, else a crash could leave `path` naming a partial file.
  if (::fsync(fd_.get()) != 0) return sys_error("fsync of", temp_path(), errno);
  if (Status s = folder_.rename(temp_, name_); !s.ok()) return s;
  committed_ = true;
  // Someone who can write the folder could have put something else at the temporary's name before the
  // rename: then that, not this file, is at the path now. It is taken away again, and the save fails.
  struct stat mine{}, named{};
  if (::fstat(fd_.get(), &mine) != 0 || ::fstatat(folder_.fd(), name_.c_str(), &named, AT_SYMLINK_NOFOLLOW) != 0 ||
      mine.st_ino != named.st_ino || mine.st_dev != named.st_dev) {
    (void)folder_.remove(name_);
    return Status(StatusCode::io_error,
                  "another process replaced " + temp_path() + " while zoe wrote it, so " + path_ +
                      " was not written; write into a folder no other user can write",
                  EPERM);
  }
  if (Status s = fd_.close(temp_path()); !s.ok()) return s;
  if (Status s = folder_.sync(); !s.ok()) {
    return Status(s.code(), path_ + " is in place, but " + s.message() + ": the rename may not survive a crash",
                  s.sys_errno());
  }
  return Status::success();
}

namespace {
Status write_and_commit(Result<AtomicFile> file, const std::string& data) {
  if (!file.ok()) return file.status();
  if (Status s = file->write(data.data(), data.size()); !s.ok()) return s;
  return file->commit();
}
}  // namespace

Status replace_file(const std::string& path, const std::string& data) {
  return write_and_commit(AtomicFile::create(path, AtomicFile::Options{0600, std::to_string(::getpid())}), data);
}

Status replace_file(const Folder& folder, const std::string& name, const std::string& data) {
  return write_and_commit(AtomicFile::create_in(folder, name, AtomicFile::Options{0600, std::to_string(::getpid())}), data);
}

}  // namespace zoe
