// The parameter tier (ZeRO-Infinity's parameter offload): the 16-bit weights of a model too large for its
// device live in pinned host RAM or in an NVMe swap file, as blocks — one block is the parameters (entries)
// of one module — and come to the device only while a forward or backward uses them.
//
//  - fetch(b) makes block b resident in a device pool of budget_bytes and returns its device address; the
//    copy runs on the device's h2d stream and the compute stream waits for it, so the host does not. Each
//    fetch also starts the next `prefetch` blocks of the execution order (set_order(); the reverse order in
//    backward), so that their copies (and NVMe reads, on a worker thread) overlap the compute of this one.
//  - release(b) ends one use. A released block stays in the pool until its room is needed (least recently
//    used first); its memory is reused only after the compute stream has passed the release, so a reuse
//    never waits for compute that does not need it. Blocks in use are never evicted: a fetch that cannot
//    find room fails with the blocks in use and the budget, it does not wait.
//  - write(b, e, ...) replaces bytes of entry e in the home (the optimizer's copy-out of updated weights),
//    after any copy still reading it. A pooled copy of the block is dropped — at its last release if it is in
//    use, so that work already using the block keeps a whole copy — and a fetch waits while a write runs.
//  - NVMe home: one file per path (`<name>.zoe-params`, blocks spread over the paths), two slots per entry.
//    A write goes to the slot not holding the valid copy and flips the entry only once it completed; every
//    read is checked against the entry's CRC-32C. A failed read or write (EIO, ENOSPC, a short transfer, a
//    checksum) is an error naming the block, the entry, the file and the offset, and leaves every valid
//    copy as it was: the fetch, or the optimizer's step, can be retried once the fault is cleared. The file
//    is scratch for one run — the checkpoint's fp32 masters are the state that outlives it — so it is
//    created anew (replacing one a crashed run left) and removed when the tier is destroyed (or earlier,
//    by remove_files()), unless keep_files asks otherwise.
//  - Room: create() computes what the tier will hold — host RAM (the RAM home, the pool where the device's
//    memory is host memory, bounces) and each path's file — and refuses, before allocating or creating
//    anything, when that is more than is free (zoe/space.h), naming both figures and a `zoe plan` command.
//
// Thread-safe: the trainer's hooks fetch and release while the optimizer writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zoe/device.h"
#include "zoe/space.h"
#include "zoe/status.h"
#include "zoe/swap.h"

namespace zoe {

enum class ParamHome { ram, nvme };
std::string_view param_home_name(ParamHome home);
Result<ParamHome> parse_param_home(std::string_view name);  // "cpu" and "ram" are the same home

struct ParamBlockSpec {
  std::string name;                     // for errors and statistics: the module's name
  std::vector<std::size_t> entry_bytes;  // one per parameter of the module, in the module's order
};

struct ParamBlockWrite {
  std::size_t block = 0;
  std::vector<const void*> src;  // per entry of the block: its new bytes (whole entry), or null
};

struct ParamTierOptions {
  ParamHome home = ParamHome::ram;     // DeepSpeed: offload_param.device (cpu | nvme)
  std::vector<std::string> nvme_paths; // DeepSpeed: offload_param.nvme_path (one or a list)
  std::string name = "zoe-params";     // the NVMe file's name under each path
  // Bytes of device memory for fetched blocks. 0: room for the largest block times (prefetch + 2) — the
  // block in use, the one released before it and `prefetch` ahead.
  std::size_t budget_bytes = 0;
  int prefetch = 2;                    // blocks fetched ahead in execution order (DeepSpeed: buffer_count - 1)
  std::size_t request_bytes = 1 << 20; // NVMe: bytes per I/O request (aio.block_size)
  int queue_depth = 8;                 // NVMe: requests in flight (aio.queue_depth)
  std::size_t alignment = 0;           // NVMe: O_DIRECT block, 0 = 4096
  // The work that reads fetched blocks is not enqueued on the device's compute stream — it runs on the host
  // (always so on a device whose memory is host memory), or on another library's stream: fetch() returns only
  // once the block has arrived, and release() must be called once that work has finished.
  bool host_consumer = false;
  // NVMe: the files stay when the tier is destroyed (their owner locks go), for a user who asked to keep
  // them; they hold the last weights written, two slots per entry, and nothing that says which is valid.
  bool keep_files = false;
  IoFaultHook fault_hook;              // tests only
};

struct ParamTierStats {
  std::size_t budget_bytes = 0;
  std::size_t pool_peak_bytes = 0;     // most bytes of the pool held by resident blocks at once
  std::uint64_t fetches = 0;           // fetch() calls
  std::uint64_t hits = 0;              // ... that found the block resident or on its way (prefetched)
  std::uint64_t loads = 0;             // blocks brought into the pool (by fetch or prefetch)
  std::uint64_t evictions = 0;
  std::uint64_t loaded_bytes = 0;      // bytes copied into the pool
  double fetch_wait_s = 0;             // host time fetch() waited for an NVMe read it needed (not prefetched in time)
  std::uint64_t read_bytes = 0, write_bytes = 0;  // NVMe home
  double read_busy_s = 0, write_busy_s = 0;       // NVMe: wall seconds with a request of that kind in flight
};

class ParamTier {
 public:
  // Every block must fit the budget (an error names the block and both sizes). The home is allocated now
  // (NVMe: the file preallocated, so a full path fails here); its contents are undefined until written.
  static Result<ParamTier> create(Device& device, std::vector<ParamBlockSpec> blocks, const ParamTierOptions& options);
  // What create() would hold with these blocks and options (zoe/space.h), allocating and creating nothing.
  static Result<SpaceNeed> footprint(const Device& device, std::vector<ParamBlockSpec> blocks,
                                     const ParamTierOptions& options);
  ParamTier(ParamTier&&) noexcept;
  ParamTier& operator=(ParamTier&&) noexcept;
  ~ParamTier();  // waits for copies in flight, frees the pool, removes the NVMe file (unless keep_files)

  // NVMe: removes the home files' names (and their owner locks) now, keep_files or not. The tier keeps
  // working on the open files, whose room the system frees when the tier is destroyed; the destructor then
  // removes nothing more. For an exit path that cannot wait for the tier's users to let it go (Python's
  // interpreter exit, an optimizer still holding the tier).
  Status remove_files();

  // Host memory to and from the home: bytes [byte_offset, byte_offset + bytes) of entry `entry` of `block`.
  Status write(std::size_t block, std::size_t entry, const void* src, std::size_t byte_offset, std::size_t bytes);
  Status read(std::size_t block, std::size_t entry, void* dst, std::size_t byte_offset, std::size_t bytes);
  // Whole entries of several blocks (src[e] for entry e, null: unchanged; one source per entry; each block
  // once): the NVMe home has a block's writes in flight together, and the next block's behind them. An
  // entry whose write fails keeps its previous copy; the first error is returned.
  Status write_blocks(const std::vector<ParamBlockWrite>& writes);

  // The forward's block order (each block at most once); prefetch follows it, backward in reverse. Blocks
  // not in it are fetched on demand only. Default: 0, 1, 2, ...
  Status set_order(std::vector<std::size_t> order);
  // Block `block` on the device: its address (entries at entry_offset()), valid for work enqueued on the
  // compute stream after this call and until release(). Counts one use.
  Result<void*> fetch(std::size_t block, bool backward = false);
  Status release(std::size_t block);
  // Starts bringing `block` into the pool without using it (no use counted); a full pool is not an error.
  Status prefetch(std::size_t block);
  std::size_t entry_offset(std::size_t block, std::size_t entry) const;  // bytes from the block's address
  // Waits for every copy and read in flight (stats are exact after it).
  Status synchronize();

  std::size_t blocks() const;
  std::size_t block_bytes(std::size_t block) const;  // device bytes of the block, entries aligned
  std::size_t entries(std::size_t block) const;
  std::size_t entry_bytes(std::size_t block, std::size_t entry) const;
  const std::string& block_name(std::size_t block) const;
  std::size_t in_use(std::size_t block) const;
  ParamTierStats stats() const;
  std::vector<std::string> files() const;  // NVMe: the home files
  bool direct_io() const;                  // NVMe: O_DIRECT in effect on every file

  struct Impl;

 private:
  explicit ParamTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The ceiling of the NVMe home's fetches (zoe bench step --offload-param nvme reports against it): raw
// O_DIRECT reads of `bytes` in all, spread evenly over `files` from the start of each, with the tier's
// request size and queue depth. Its buffer is allocated and touched when opened, as the tier's bounces
// are: pass() times the disk, not first-touch page faults. Defined only in builds with libaio (ZOE_HAVE_AIO),
// as the NVMe home is.
class RawReadCeiling {
 public:
  static Result<RawReadCeiling> open(const std::vector<std::string>& files, std::uint64_t bytes,
                                     const ParamTierOptions& options);
  RawReadCeiling(RawReadCeiling&&) noexcept;
  RawReadCeiling& operator=(RawReadCeiling&&) noexcept;
  ~RawReadCeiling();

  // One pass over the bytes: its seconds.
  Result<double> pass();

  struct Impl;

 private:
  explicit RawReadCeiling(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoe
