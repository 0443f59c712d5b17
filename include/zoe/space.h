// Room before allocation (issue 51): what a part of zoe will hold — host RAM, and bytes of new files under
// each NVMe path — is computed before it allocates anything and compared with what this machine has free, so
// that a run that cannot fit is refused with both numbers and a `zoe plan` command to size it, instead of
// being killed by the OOM killer half-way through its set-up (which prints nothing) or failing on a full disk
// after writing gigabytes.
//
// Free RAM is the smaller of MemAvailable (/proc/meminfo) and the room left under the tightest memory limit
// of the process's cgroup and its ancestors (v2: memory.max - memory.current; v1: memory.limit_in_bytes -
// memory.usage_in_bytes; inactive file pages are added back, as reclaimable). Swap is not counted: a state
// swapped out trains at the disk's pace without the pipelining tier nvme gives the same disk. Free disk is
// statvfs's f_bavail * f_frsize of each path's filesystem (paths on one filesystem share it), plus what the
// files the creation replaces hold there. Nothing is added as a margin: a run is refused only when it needs
// more than is free.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zoe/status.h"

namespace zoe {

struct SpaceNeed {
  struct Part {
    std::string what;  // "fp32 master and moments", "pinned staging", ...
    std::uint64_t bytes = 0;
  };
  struct Disk {
    std::string dir;                    // an NVMe path
    std::uint64_t bytes = 0;            // of the files created there, preallocated
    std::vector<std::string> replaces;  // names of files in `dir` the creation removes first: their room is free
  };
  std::uint64_t ram = 0;  // host memory, pageable or pinned: the sum of ram_parts
  std::vector<Part> ram_parts;
  std::vector<Disk> disk;

  void add_ram(std::string what, std::uint64_t bytes);
  void add_disk(std::string dir, std::uint64_t bytes, std::vector<std::string> replaces = {});
  SpaceNeed& operator+=(const SpaceNeed& other);
};

struct FreeRam {
  std::uint64_t bytes = 0;
  std::string source;  // where the figure comes from: "MemAvailable", "cgroup /x (memory.max ...)", ...
};
FreeRam free_ram();
// Bytes this user may still allocate on the filesystem of `dir` (f_bavail * f_frsize).
Result<std::uint64_t> free_disk(const std::string& dir);

// Tests only: the free figures every check uses from now on in this process (an unset field: the machine's
// own), so that a refusal can be tested without allocating or writing what the machine really has.
// std::nullopt goes back to the machine's figures for both.
struct FreeSpaceOverride {
  std::optional<std::uint64_t> ram;
  std::optional<std::uint64_t> disk;  // for every filesystem, before replaced files are added
};
void set_free_space_override(std::optional<FreeSpaceOverride> override_for_tests);

// OK when `need` fits what is free; else out_of_memory (RAM) or io_error with ENOSPC (a path's filesystem),
// the message naming `what` ("the optimizer", "the parameter tier"), the place, the bytes needed (RAM: by
// part) and free, and `plan`, a `zoe plan` command line that sizes the run.
Status check_space(const SpaceNeed& need, std::string_view what, std::string_view plan);

// A parameter count as `zoe plan --params` takes it: 1.80B, 350M, 12345.
std::string plan_count(std::uint64_t params);
// " --nvme 'p1' 'p2'" (empty for none), each path quoted for a POSIX shell.
std::string plan_nvme_paths(const std::vector<std::string>& paths);

}  // namespace zoe
