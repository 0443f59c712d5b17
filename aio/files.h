// File-system plumbing of the NVMe tier: the fd owner, opening swap files with O_DIRECT (or buffered where
// a filesystem refuses it), preallocation, and what a path's filesystem is. Durable small-file replacement
// (a manifest's replace_file, whose temporaries a store's next owner removes: remove_stale_temps in
// swap_inventory.h) is base/files.h's.
// Every failure comes back as a Status naming the path; the fault hook (zoe/io_fault.h) can fail open,
// allocate and sync on demand.
#pragma once

#include "aio/private.h"

#include <cstdint>
#include <string>
#include <utility>

#include "base/files.h"
#include "base/unique_fd.h"
#include "zoe/status.h"
#include "zoe/io_fault.h"

namespace zoe::aio {

// Swap files are owned like every descriptor in zoe. A close error on one cannot lose data the store relies
// on: every write the tile table points to was fdatasync'ed before the table was updated.
using FileHandle = UniqueFd;

struct OpenedFile {
  FileHandle fd;
  bool direct = false;  // O_DIRECT in effect
};

// Opens `name` in `folder` read-write, with O_DIRECT unless the filesystem refuses it (EINVAL), then
// buffered. create: the file must not exist yet (O_EXCL; a symlink there counts) and is made with mode 0600;
// else it must be a regular file (no symlink followed). Opened once: O_DIRECT is set on that descriptor, so
// the name is never reopened (someone swapping it in between would redirect the writes).
Result<OpenedFile> open_swap_file(const Folder& folder, const std::string& name, bool create, const IoFaultHook& hook);

// Reserves `bytes` for the file now (fallocate), so that running out of space shows here, not mid-step.
Status allocate_file(int fd, const std::string& path, std::uint64_t bytes, const IoFaultHook& hook);

// fdatasync, with the hook's say.
Status sync_file(int fd, const std::string& path, const IoFaultHook& hook);

// The swap path exists, is a directory, and is writable (a read-only mount is reported as such).
Status check_swap_dir(const std::string& path);
// check_swap_dir, then the folder opened once, and refused where another user could swap names in it
// (Folder::check_private). `what` names it in messages ("swap path", "parameter path").
Result<Folder> open_swap_dir(const std::string& path, const std::string& what);


struct FsInfo {
  std::string type;              // "ext4", "xfs", "tmpfs", ... or "unknown (0x...)"
  std::uint64_t free_bytes = 0;  // available to this user
  std::uint64_t total_bytes = 0;
  bool read_only = false;
};
Result<FsInfo> fs_info(const std::string& dir);
std::string fs_type_name(std::uint64_t statfs_magic);

// O_DIRECT alignment the kernel reports for an open file (statx STATX_DIOALIGN, Linux 6.1+): offset and
// memory alignment in bytes, {0, 0} when it does not say.
std::pair<std::uint32_t, std::uint32_t> dio_alignment(int fd);
// The logical block size of the device under `path` from sysfs, 0 when it cannot be found.
std::uint32_t device_logical_block(const std::string& path);

std::string format_bytes(std::uint64_t bytes);  // "1.50 GiB (1610612736 bytes)"

}  // namespace zoe::aio
