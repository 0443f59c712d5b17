#include "aio/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace zoe {

std::string_view io_op_name(IoOp op) {
  switch (op) {
    case IoOp::open: return "open";
    case IoOp::allocate: return "allocate";
    case IoOp::read: return "read";
    case IoOp::write: return "write";
    case IoOp::sync: return "sync";
  }
  return "unknown";
}

}  // namespace zoe

namespace zoe::aio {

namespace {

int hook_error(const IoFaultHook& hook, IoOp op, const std::string& path, std::uint64_t bytes, bool direct) {
  if (!hook) return 0;
  IoSite site;
  site.op = op;
  site.path = path;
  site.bytes = bytes;
  site.direct = direct;
  return hook(site).error;
}

}  // namespace

Result<OpenedFile> open_swap_file(const Folder& folder, const std::string& name, bool create, const IoFaultHook& hook) {
  const std::string path = folder.path_of(name);
  auto open_error = [&](const Status& s) -> Status {
    const int err = s.sys_errno();
    if (err == EEXIST) {
      return Status(StatusCode::invalid_argument,
                    "swap file " + path + " already exists: open the store, or remove it first", err);
    }
    if (err == EROFS) {
      return Status(StatusCode::io_error,
                    "cannot open swap file " + path +
                        " for writing: the filesystem is mounted read-only; choose another nvme_path",
                    err);
    }
    return s;
  };
  if (const int err = hook_error(hook, IoOp::open, path, 0, false)) {
    return open_error(sys_error(create ? "cannot create swap file" : "cannot open swap file", path, err));
  }
  Result<UniqueFd> fd = create ? folder.create(name, O_RDWR, 0600) : folder.open_file(name, O_RDWR);
  if (!fd.ok()) return open_error(fd.status());
  // O_DIRECT on the descriptor already open: the kernel checks it as open(2) would, and a filesystem that
  // refuses it (ramfs, some overlay and FUSE mounts) answers EINVAL: buffered I/O there. (The hook is asked
  // a second time, as an open with O_DIRECT, so that tests can refuse just that.)
  int err = hook_error(hook, IoOp::open, path, 0, true);
  if (err == 0) {
    const int flags = ::fcntl(fd->get(), F_GETFL);
    err = flags >= 0 && ::fcntl(fd->get(), F_SETFL, flags | O_DIRECT) == 0 ? 0 : errno;
  }
  if (err != 0 && err != EINVAL) return open_error(sys_error("cannot set O_DIRECT on swap file", path, err));
  return OpenedFile{std::move(fd).value(), err == 0};
}

Status allocate_file(int fd, const std::string& path, std::uint64_t bytes, const IoFaultHook& hook) {
  int err = hook_error(hook, IoOp::allocate, path, bytes, false);
  if (err == 0 && bytes > 0) {
    int r;
    do {
      r = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
    } while (r != 0 && errno == EINTR);
    err = r == 0 ? 0 : errno;
    if (err == EOPNOTSUPP) err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));  // writes zeros instead
  }
  if (err == ENOSPC) {
    return Status(StatusCode::io_error, "no space for swap file " + path + ": it needs " + format_bytes(bytes) +
                                            "; free space there, or use more or larger nvme_path folders",
                  err);
  }
  if (err != 0) return sys_error("cannot preallocate " + format_bytes(bytes) + " for swap file", path, err);
  return Status::success();
}

Status sync_file(int fd, const std::string& path, const IoFaultHook& hook) {
  if (const int err = hook_error(hook, IoOp::sync, path, 0, false)) return sys_error("fdatasync of", path, err);
  int r;
  do {
    r = ::fdatasync(fd);
  } while (r != 0 && errno == EINTR);
  if (r != 0) return sys_error("fdatasync of", path, errno);
  return Status::success();
}

Status check_swap_dir(const std::string& path) {
  struct stat st{};
  if (path.empty()) return invalid_argument("a swap path is empty: give nvme_path a folder");
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      return Status(StatusCode::invalid_argument,
                    "swap path " + path + " does not exist: create the folder (mkdir -p) or fix nvme_path", err);
    }
    return sys_error("cannot stat swap path", path, err);
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status(StatusCode::invalid_argument, "swap path " + path + " is not a directory: nvme_path names folders",
                  ENOTDIR);
  }
  struct statvfs vfs{};
  if (::statvfs(path.c_str(), &vfs) == 0 && (vfs.f_flag & ST_RDONLY) != 0) {
    return Status(StatusCode::io_error,
                  "swap path " + path + " is on a read-only filesystem: choose a writable nvme_path", EROFS);
  }
  if (::access(path.c_str(), W_OK | X_OK) != 0) {
    return sys_error("swap path is not writable by this user:", path, errno);
  }
  return Status::success();
}

Result<Folder> open_swap_dir(const std::string& path, const std::string& what) {
  if (Status s = check_swap_dir(path); !s.ok()) return s;
  Result<Folder> folder = Folder::open(path);
  if (!folder.ok()) return folder.status();
  if (Status s = folder->check_private(what); !s.ok()) return s;
  return folder;
}

std::string fs_type_name(std::uint64_t magic) {
  switch (magic) {
    case 0xEF53: return "ext4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0xF2F52010: return "f2fs";
    case 0x2FC12FC1: return "zfs";
    case 0x01021994: return "tmpfs";
    case 0x858458F6: return "ramfs";
    case 0x794C7630: return "overlayfs";
    case 0x65735546: return "fuse";
    case 0x6969: return "nfs";
    case 0xFF534D42: return "cifs";
    case 0x01021997: return "9p";
    case 0x0BD00BD0: return "lustre";
    case 0x47504653: return "gpfs";
    case 0x00C36400: return "ceph";
    case 0x73717368: return "squashfs";
    case 0x4D44: return "vfat";
    case 0x2011BAB0: return "exfat";
    case 0x9FA0: return "proc";
    case 0x62656572: return "sysfs";
    default: {
      char buf[40];
      std::snprintf(buf, sizeof buf, "unknown (0x%llx)", static_cast<unsigned long long>(magic));
      return buf;
    }
  }
}

Result<FsInfo> fs_info(const std::string& dir) {
  struct statfs fs{};
  if (::statfs(dir.c_str(), &fs) != 0) return sys_error("statfs of", dir, errno);
  FsInfo info;
  info.type = fs_type_name(static_cast<std::uint64_t>(fs.f_type));
  info.free_bytes = static_cast<std::uint64_t>(fs.f_bavail) * static_cast<std::uint64_t>(fs.f_bsize);
  info.total_bytes = static_cast<std::uint64_t>(fs.f_blocks) * static_cast<std::uint64_t>(fs.f_bsize);
  info.read_only = (fs.f_flags & ST_RDONLY) != 0;
  return info;
}

std::pair<std::uint32_t, std::uint32_t> dio_alignment(int fd) {
  struct statx st{};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) != 0 || (st.stx_mask & STATX_DIOALIGN) == 0) {
    return {0, 0};
  }
  return {st.stx_dio_offset_align, st.stx_dio_mem_align};
}

std::uint32_t device_logical_block(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return 0;
  const std::string base = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  // A partition keeps its queue limits in its parent disk's folder.
  for (const char* rel : {"/queue/logical_block_size", "/../queue/logical_block_size"}) {
    std::ifstream in(base + rel);
    std::uint32_t v = 0;
    if (in >> v && v > 0) return v;
  }
  return 0;
}

std::string format_bytes(std::uint64_t bytes) {
  char buf[64];
  const double gib = static_cast<double>(bytes) / static_cast<double>(1ull << 30);
  if (gib >= 1.0) {
    std::snprintf(buf, sizeof buf, "%.2f GiB (%llu bytes)", gib, static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f MiB (%llu bytes)", static_cast<double>(bytes) / (1 << 20),
                  static_cast<unsigned long long>(bytes));
  }
  return buf;
}

}  // namespace zoe::aio
