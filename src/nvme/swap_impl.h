// The swap store's private state, shared by swap_store.cpp (files, manifest), swap_table.cpp (the tile
// table's file), swap_pipeline.cpp (the tile pipeline), swap_step.cpp (the step, read/write and the other
// calls built on the pipeline) and swap_segments.cpp (a step's checks).
#pragma once

#include "src/private.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "aio/files.h"
#include "aio/io_engine.h"
#include "zoe/aligned_buffer.h"
#include "zoe/swap.h"

namespace zoe {

inline constexpr int kSwapFormatVersion = 1;

// A tile's entry in the tile table: which slot holds its valid copy, the step that copy is at, and the
// CRC-32C of its p, m and v (count elements each in their own sizes, padding excluded; i8 moments: the codes
// followed by the tile's block scales).
struct TileEntry {
  std::int64_t step = -1;  // -1: never written
  std::uint32_t slot = 0;
  std::uint32_t crc[3] = {0, 0, 0};
};

// One tile's trip through the pipeline: read its valid slot (or not: the compute fills the buffer), run the
// compute, write the other slot (or not) and flip the entry to `new_step`.
struct TileTask {
  std::size_t tile = 0;
  bool read = true;
  bool write = true;
  std::int64_t new_step = 0;
  bool speculative = false;  // its new entry goes to Impl::speculated, not the table (SwapStore::speculate)
};

// A tile's arrays in its buffer (and slot): [p | m | v | vmax | m_scale | v_scale], v with two state arrays or
// more and vmax (amsgrad's max_exp_avg_sq) with three (SwapOptions::state_arrays; null otherwise). m, v and vmax
// are in the store's state
// dtype (moment_bytes each); the scales exist for i8 moments only (one fp32 per kMomentBlock elements of the
// tile, blocks counted from the tile's first element, which is also a block boundary of the store's range;
// v_scale with v only: Lion's one moment has m_scale alone).
struct TileArrays {
  float* p;
  unsigned char* m;
  unsigned char* v;
  float* m_scale;  // null unless i8
  float* v_scale;
  unsigned char* vmax = nullptr;
};

// The compute stage: the tile's arrays (count valid elements each).
using TileCompute = std::function<Status(const TileTask&, const TileArrays&, std::size_t count)>;

struct SwapStore::Impl {
  struct PathFile {
    std::string dir;            // the swap path as given
    std::string data_name;      // <name>.zoe-swap, in folders[k]
    std::string data_path;      // dir/<name>.zoe-swap, for messages
    aio::FileHandle fd;
    bool direct = false;
    int engine_file = -1;
    std::size_t tiles_here = 0;  // tiles t with t % P == this path's index
    std::uint64_t bytes = 0;     // file size: two slots per tile
  };

  ~Impl();  // settles the durability of what was written (best effort: a close cannot fail)

  // The owner locks (swap_inventory.h: take_ownership), first so that they are released last, once the
  // destructor has settled everything else.
  std::vector<aio::FileHandle> owner_locks;
  SwapOptions options;
  bool reopened = false;  // open()ed from what an earlier run left, not create()d by this one
  // Why tile t has no state: never written by this store, or (reopened) never made durable by its writer.
  std::string unwritten(std::size_t t) const;
  std::string name;
  std::size_t n = 0, tile = 0, ntiles = 0, alignment = 4096;
  std::size_t tile_bytes = 0;  // the master p of a tile: tile * 4
  std::size_t moment_bytes = 4;  // per element of m and of v (SwapOptions::state_dtype)
  std::size_t state_arrays = 2;  // m; m and v; m, v and vmax (SwapOptions::state_arrays)
  std::size_t scale_count = 0;   // i8: block scales per tile and moment (tile / kMomentBlock); else 0
  std::size_t slot_bytes = 0;  // p, m, v (and scales) of a tile, rounded up to the alignment
  std::vector<PathFile> files;
  std::vector<std::string> paths;
  // Each path opened once (aio::open_swap_dir): every file of the store is reached through these.
  std::vector<Folder> folders;
  std::unique_ptr<aio::IoEngine> engine;
  std::vector<AlignedBuffer> buffers;
  std::vector<TileEntry> table;
  std::unique_ptr<CpuAdam> own_adam;
  CpuAdam* adam = nullptr;
  SwapStats stats;
  aio::FileHandle table_fd;
  std::uint64_t table_seq = 0;  // of the newest table copy on disk
  bool table_dirty = false;  // the in-memory table is ahead of the persisted one (its update failed)
  // Durability next_call / on_flush: calls wrote since the last durable table; and (next_call) the last
  // call's fdatasync and table update running in the background, with the sequence number it writes.
  bool unsynced = false;
  // A step split across calls (SwapStore::step with last = false): the table before its first call and
  // whether any of them wrote; after_call makes them durable with the step's last call.
  bool defer = false;
  std::optional<std::vector<TileEntry>> deferred_before;
  bool deferred_wrote = false;
  std::future<Status> persisting;
  std::uint64_t persisting_seq = 0;
  bool persisting_durable = false;  // the background task makes the call durable (next_call), or only waits
  // Tiles kept in RAM (SwapOptions::keep_resident, every tile with a buffer): tile t lives in buffers[t], and
  // resident[t] says that buffer holds the state table[t] names. Writes a call left in flight are waited
  // (by the background durability task, or by settle()) before any buffer or slot is touched again.
  // Their checksums are computed there too, off the call's critical path; settle() copies them into the table.
  struct PendingWrite {
    std::size_t tile = 0;
    aio::IoEngine::Ticket ticket = 0;
    bool waited = false;  // and checksummed
    Status result;
    std::uint32_t crc[3] = {0, 0, 0};
  };
  std::vector<char> resident;
  std::vector<PendingWrite> pending_writes;
  // A speculative step (SwapStore::speculate) awaiting commit or discard: each tile it wrote has its new entry
  // here (step -1: not written), naming the slot the table does not; every other call is refused meanwhile.
  std::vector<TileEntry> speculated;
  bool speculating = false;
  Status refuse_while_speculating(const char* call) const;
  // A tile's write completed: its entry flips, or (speculative) waits in `speculated`.
  void wrote_tile(const TileTask& task, const TileEntry& entry) {
    (task.speculative ? speculated : table)[task.tile] = entry;
  }

  PathFile& file_of(std::size_t t) { return files[t % files.size()]; }
  std::uint64_t file_offset(std::size_t t, std::uint32_t slot) const {
    const PathFile& f = files[t % files.size()];
    // Slot 0 of every tile in the first half of the file, slot 1 in the second: both a step's reads and
    // its writes then walk their half in order.
    return slot * (f.bytes / 2) + static_cast<std::uint64_t>(t / files.size()) * slot_bytes;
  }
  std::size_t tile_begin(std::size_t t) const { return t * tile; }
  std::size_t tile_count(std::size_t t) const { return std::min(tile, n - t * tile); }
  std::string table_name() const;  // in folders[0]
  std::string manifest_name() const;  // in every folder
  std::string table_path() const;
  std::string manifest_path(std::size_t k) const;
  std::string tile_name(std::size_t t) const;  // "tile 7 (elements [7340032, 8388608)) on /p/x.zoe-swap"

  Status setup_runtime();   // engine, buffers, Adam engine; after files are open
  std::size_t table_region_bytes() const;
  Status create_table();
  Status persist_table();   // the current table, now (fdatasync'ed)
  // One table copy with sequence number `seq` written and fdatasync'ed; touches no member but the file.
  Status write_table(const std::vector<TileEntry>& entries, std::uint64_t seq) const;
  // Every data file fdatasync'ed, then `entries` written as table copy `seq` (swap_durability.cpp).
  Status make_durable(const std::vector<TileEntry>& entries, std::uint64_t seq) const;
  // After a call's tiles: what `durability` asks of the call (before = the table when it started).
  Status after_call(const std::vector<TileEntry>& before, bool wrote);
  // The background task after a call: the pending writes checksummed and waited, then (durable) the call
  // made durable as table copy persisting_seq.
  void launch_background(bool durable);
  // Before a call overwrites any slot: the last call's durability settled (next_call), retried now if the
  // background attempt failed. Cheap when nothing is pending.
  Status settle();
  bool keeps_resident() const { return options.keep_resident && ntiles <= buffers.size(); }
  // Waits the writes left in flight and rewrites from RAM each that failed; an error leaves them pending.
  Status finish_pending_writes();
  Status run_resident_tiles(std::span<const TileTask> tasks, const TileCompute& compute);
  // The write half of a resident call: the tiles' buffers to their other slots, each entry flipped as
  // durability allows (at once with the write left in flight, or once it completed).
  Status write_resident_tiles(std::span<const TileTask> tasks);
  // The arrays of the tile held in buffer b (a resident store: tile t in buffers[t]).
  TileArrays arrays(std::size_t b) {
    unsigned char* base = buffers[b].as<unsigned char>();
    unsigned char* m = base + tile * 4;
    unsigned char* after = m + state_arrays * tile * moment_bytes;
    unsigned char* v = state_arrays > 1 ? m + tile * moment_bytes : nullptr;
    unsigned char* vmax = state_arrays > 2 ? m + 2 * tile * moment_bytes : nullptr;
    float* m_scale = scale_count == 0 ? nullptr : reinterpret_cast<float*>(after);
    float* v_scale = m_scale == nullptr || v == nullptr ? nullptr : m_scale + scale_count;
    return {reinterpret_cast<float*>(base), m, v, m_scale, v_scale, vmax};
  }
  // Bytes of one slot for the store's shape and state dtype, before rounding up to the alignment (i8: a
  // scale per block and moment, Adam's two or Lion's one).
  std::size_t slot_payload() const {
    return tile * (4 + state_arrays * moment_bytes) + state_arrays * scale_count * 4;
  }
  // The last tile's padding (elements count..tile, and their blocks' scales) set to zeros, so that no stale
  // buffer bytes are ever written.
  void zero_padding(const TileArrays& a, std::size_t count) const;
  // A tile just read from its slot against its table entry's checksums.
  Status verify_tile(std::size_t t, const TileArrays& a, std::size_t count);
  Status flush();
  Status load_table();
  Status check_file_sizes();
  Status sync_and_persist(const std::vector<TileEntry>& before, bool wrote);  // durability each_call
  Status ready_for_io();    // files intact and the persisted table current
  Status run_tiles(std::span<const TileTask> tasks, const TileCompute& compute);
  void checksum(const TileArrays& a, std::size_t count, std::uint32_t out[3]) const;
  std::string describe() const;       // which tiles are at which step
  Status with_state(Status s) const;  // appends describe() to an error
};

// One Adam step over the segments (SwapStore::step; with `gate`, SwapStore::speculate: each tile waits for
// gate(begin, end) before it is computed, and is written beside its valid copy; tiles in `rank`'s order).
Status step_tiles(SwapStore::Impl& im, std::span<const SwapSegment> segments, const StepOptions& options,
                  const SwapStore::TileGate* gate, const SwapStore::TileRank* rank = nullptr);

// Checks and the copy-out of a step (swap_segments.cpp).
// Whether every gradient element is finite (f32, f16, bf16 bit patterns).
bool all_finite(const void* grad, DType dtype, std::size_t n);
// Elements [offset, offset + count) inside [0, n); `what` names the call.
Status check_range(std::size_t offset, std::size_t count, std::size_t n, const char* what);
// Sorted, disjoint segments inside the store, each starting a block with i8 moments (`blocks`), each with
// valid hyper-parameters of a rule that keeps the store's `state_arrays`.
Status check_segments(std::span<const SwapSegment> segments, std::size_t n, bool blocks, std::size_t state_arrays);
// check_finite: every segment's gradient finite, else non_finite naming the first that is not.
Status check_finite_grads(std::span<const SwapSegment> segments);
// A stepped master out as the device's weights: f16/bf16 rounded, f32 copied.
void copy_out(const float* p, void* out, DType dtype, std::size_t count);

}  // namespace zoe
