// Whether a folder can hold swap files, and how fast (what `zoe probe` reports): filesystem type, O_DIRECT,
// logical block size, free bytes, a short measured write and read bandwidth, the swap stores already there
// (in use, or left by runs that crashed or ended, with the command that removes them), and a verdict.
// Leftover stores are a warning, not a reason to call the path unusable: the space is freed with one rm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zoe {

enum class SwapStoreState {
  in_use,     // its owner lock is held, or its owner runs in this scope
  abandoned,  // not locked, and its owner is gone from this scope
  unknown,    // not locked, and its owner cannot be judged here (another host or container, or none recorded)
};

// A swap store found in a folder (by its manifest, `<name>.zoe-swap.json`).
struct SwapStoreFound {
  std::string name;
  std::vector<std::string> files;  // the store's files that exist, on every path, manifests first
  std::uint64_t bytes = 0;         // their total size
  SwapStoreState state = SwapStoreState::unknown;
  std::string who;                 // "in use by pid 12 on host a", "left by pid 9 on host a, which is not running"
  std::string remove_command;      // a shell command that removes it (manifests first), paths quoted
};

struct SwapPathProbe {
  std::string path, fs_type = "unknown";
  // "ok", "usable with a warning: ..." or "unusable: ..." (why).
  std::string verdict;
  bool usable = false, direct = false;  // direct: O_DIRECT works there (else swap I/O is buffered)
  std::uint32_t logical_block = 0;      // 0: unknown (no block device under it)
  std::uint32_t dio_alignment = 0;
  std::uint64_t free_bytes = 0;
  double write_gbps = 0, read_gbps = 0;  // fdatasync included in the write's time
  std::vector<SwapStoreFound> stores;    // empty where the path could not be looked into
};

// Writes then reads `bytes` (rounded up to whole MiB) in a scratch file of `path` that nobody can guess, created
// exclusively and removed after, through the libaio engine (1 MiB requests, queue depth 8), and looks at the
// stores already there. Never fails: an unusable path says why in `verdict`. Builds without libaio have no
// NVMe tier and no probe.
SwapPathProbe probe_swap_path(const std::string& path, std::size_t bytes);

// "1.50 GiB (1610612736 bytes)": how zoe writes a size in its messages.
std::string format_bytes(std::uint64_t bytes);

}  // namespace zoe
