// The NVMe tier's swap store: fp32 master weights p and Adam moments m, v of a flattened range of n elements,
// kept in preallocated swap files under one or more paths and streamed through a few RAM buffers by a
// pipelined optimizer step (read tile i+1 while Adam runs on tile i while tile i-1 is written back).
//
// Layout and safety (the why is in src/nvme/swap_store.cpp):
//  - The range is cut into tiles of `tile` elements; tile t lives on path t % P, so P paths on P disks give
//    P times the bandwidth. Each path holds one data file `<name>.zoe-swap` (0600), preallocated.
//  - Every tile has two slots. A step reads the tile's current slot and writes the other one; the tile's
//    entry in the tile table (step, slot, CRC-32C of p, m and v) flips only after that write completed, so
//    the only valid copy of a tile is never overwritten. The table is persisted atomically, when
//    SwapOptions::durability says (after each call by default).
//  - Every read is checked against the table's checksums: a swap file truncated or altered between steps is
//    refused, naming the file and the tile, and never used.
//  - A manifest `<name>.zoe-swap.json` (versioned) in every path describes the layout, so the next run
//    opens the store or refuses it with the reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zoe/adam.h"
#include "zoe/optimizers.h"
#include "zoe/dtype.h"
#include "zoe/io_fault.h"
#include "zoe/offload.h"
#include "zoe/space.h"
#include "zoe/status.h"

namespace zoe {

// When a call's writes become durable: fdatasync'ed, and then the tile table naming them persisted. Within a
// run, every mode keeps the in-memory table exact, so a failed call can be retried and completes exactly
// what is missing; the modes differ in what a crash (power loss, kill -9) leaves on disk.
enum class SwapDurability {
  // Before the call returns: the swap files always hold the last call's state. Each call pays one
  // fdatasync per path plus a table write and its fdatasync on its critical path.
  each_call,
  // In the background once the call returns, overlapping what the caller does next (the next forward and
  // backward) and the next call's reads; the next call's first write waits for it, so a slot the table on
  // disk names is never overwritten. The table on disk names the last durable call: a crash reopens the
  // store at the last call or the one before, never a mix.
  next_call,
  // Only at flush() (and when the store is closed): no per-call sync. Between flushes the table on disk may
  // name slots that later calls overwrote; after a crash those tiles fail their checksums and the store is
  // refused (restore from a checkpoint), never silently used.
  on_flush,
};

struct SwapOptions {
  std::vector<std::string> paths;      // DeepSpeed: offload_optimizer.nvme_path (one or a list)
  int buffer_count = 4;                // DeepSpeed: offload_optimizer.buffer_count; tiles held in RAM (>= 2)
  std::size_t block_size = 1 << 20;    // DeepSpeed: aio.block_size; bytes per I/O request
  int queue_depth = 8;                 // DeepSpeed: aio.queue_depth; requests in flight at once
  std::size_t alignment = 0;           // O_DIRECT block: 0 = 4096, or more where a filesystem asks for more
  bool durable = true;                 // fdatasync the swap files before each table update (crash safety)
  SwapDurability durability = SwapDurability::each_call;
  CpuAdam* adam = nullptr;             // the Adam engine to use (not owned); null: the store makes its own
  CpuAdamOptions cpu;                  // for the store's own engine when `adam` is null
  // How a slot holds the moments m and v: f32; bf16 (8 bytes of I/O per element instead of 12); or i8 (6 bytes
  // per element, plus an fp32 scale per moment and kMomentBlock elements: zoe/adam.h), whose blocks are
  // counted from element 0, so the tile must be a multiple of kMomentBlock and every SwapSegment must start
  // on a block. The kernel steps them as AdamTensor::state_dtype. Recorded in the manifest: open() refuses
  // another.
  DType state_dtype = DType::f32;
  // State arrays per element beside the master (zoe/optimizers.h, state_arrays()): 2, Adam's m and v; 3 with
  // amsgrad (vmax, v's running maximum, after v); 1, Lion's or Adagrad's (a slot is then [p | m]). read/write
  // take only the arrays the store keeps. Every segment's rule must keep as many. Recorded in the manifest:
  // open() refuses another.
  std::size_t state_arrays = 2;
  // When every tile has a buffer (tiles <= buffer_count), the tiles stay in their buffers between calls: a
  // call reads none it holds, and with durability next_call / on_flush its writes finish after it returns.
  // The next call waits for them before it touches a buffer and rewrites from RAM any that failed, so a
  // failed write loses nothing and the swap files still end up exact (reopening works as before). Costs no
  // RAM beyond the buffers. false: every call streams its tiles from the files.
  bool keep_resident = true;
  IoFaultHook fault_hook;              // tests only

  static SwapOptions from(const NvmeOptions& nvme);
};

// One run of the flattened range stepped with one set of hyper-parameters. Gradients in host memory;
// `out`, when not null, receives the updated weights as f16/bf16 (the copy the device receives) or, f32, the
// updated master itself (an fp32 parameter's device weights).
struct SwapSegment {
  std::size_t offset = 0;  // first element, in the store's range
  std::size_t n = 0;
  const OptimizerHyper* hyper = nullptr;  // the rule and its hyper-parameters
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  void* out = nullptr;
  DType out_dtype = DType::bf16;
  // Adam's bias-correction step for this segment (its parameter's own count, as torch keeps one per
  // parameter); 0: StepOptions::step. The tile table records StepOptions::step whatever this is.
  std::int64_t step = 0;
};

// What the last call that streamed tiles (initialize, step, read, write) did. read_s / write_s are wall
// seconds during which at least one read / write was in flight, so they overlap each other and adam_s.
// Writes a call leaves in flight (SwapOptions::keep_resident) count in its write_bytes, not in write_s.
struct SwapStats {
  std::uint64_t read_bytes = 0, write_bytes = 0;
  double read_s = 0, write_s = 0;
  double adam_s = 0;      // CpuAdam (and f16/bf16 copy-out)
  double crc_s = 0;       // verifying what was read and checksumming what is written
  double wait_s = 0;      // the compute thread waiting for a read or a free buffer: the step is I/O-bound there
  double gate_s = 0;      // speculate(): the compute thread waiting at the gate for gradients
  double sync_s = 0;      // fdatasync and the tile table update
  double total_s = 0;     // the whole call
  std::size_t tiles_stepped = 0;   // tiles this call moved to the new step
  std::size_t tiles_skipped = 0;   // tiles already at the step (a retried call): only their `out` was refilled
  std::size_t tiles_resident = 0;  // tiles this call found in RAM (SwapOptions::keep_resident): not read
};

// A contiguous run of tiles sharing a step number, for reporting which state is valid.
struct TileRun {
  std::size_t first_tile = 0, tiles = 0;
  std::size_t offset = 0, n = 0;  // the elements they hold
  std::int64_t step = 0;          // -1: never written (initialize() not run or not finished)
};

// Not thread-safe: one call at a time. Move-only.
class SwapStore {
 public:
  // A new store of n elements in tiles of `tile` elements (a multiple of alignment / 4). Refuses if a
  // store of that name exists under a path (open() it or remove() it). Files are preallocated: a path
  // without room fails here (ENOSPC, naming path and bytes), not in the middle of a step.
  static Result<SwapStore> create(const SwapOptions& options, const std::string& name, std::size_t n,
                                  std::size_t tile);
  // The store a previous run left: refuses, with the reason, a different n, tile, path list or format
  // version, a missing or resized swap file, or a tile table that fails its checksum.
  static Result<SwapStore> open(const SwapOptions& options, const std::string& name, std::size_t n,
                                std::size_t tile);
  // open() when the manifest exists, else create().
  static Result<SwapStore> open_or_create(const SwapOptions& options, const std::string& name, std::size_t n,
                                          std::size_t tile);
  // Deletes the store's files under every path (missing files are not an error).
  static Status remove(const SwapOptions& options, const std::string& name);
  // What create() would hold, creating and allocating nothing: its buffers in RAM, and under each path its
  // swap file (two slots per tile; under the first, the tile table too), as created at the alignment the
  // options ask for (a path whose O_DIRECT asks for more gets larger slots, which create() checks again).
  // Each path's entry names the files a remove() first would free there.
  static Result<SpaceNeed> footprint(const SwapOptions& options, const std::string& name, std::size_t n,
                                     std::size_t tile);

  SwapStore(SwapStore&&) noexcept;
  SwapStore& operator=(SwapStore&&) noexcept;
  ~SwapStore();

  // Writes every tile: p from fill(offset, count, p) (count <= tile; p is 4 KiB-aligned), m = v = 0, and
  // sets every tile to `step` (0 for a fresh model). Nothing of the model needs to be in RAM at once.
  Status initialize(const std::function<Status(std::size_t offset, std::size_t count, float* p)>& fill,
                    std::int64_t step = 0);

  // One pipelined Adam step over the segments (sorted by offset, not overlapping, inside [0, n)). Tiles no
  // segment touches are not read or written; elements of a touched tile outside every segment keep their
  // values. A tile must be touched by at most one call per step number: split a step across calls on tile
  // boundaries. Each touched tile must be at step options.step - 1 (or older: parameters that were frozen)
  // and moves to options.step. A tile already at options.step is a retry of a failed call: it is not
  // stepped again, but its `out` copy is refilled from the stored weights — so calling step() again with
  // the same gradients after a failure completes exactly the missing tiles and gives the result of an
  // uninterrupted run. On failure the Status says which tiles are at which step (also: tile_runs()).
  Status step(std::span<const SwapSegment> segments, const StepOptions& options);
  // One call of a step split across several on tile boundaries (tier nvme's windows): `last` false for every
  // call but the step's last, whose durability (each_call, next_call) then covers them all — the table on
  // disk moves from the old step to the new one at once, never naming a mix of the two.
  Status step(std::span<const SwapSegment> segments, const StepOptions& options, bool last);

  // A speculative step (the optimizer's overlap schedule steps tiles while backward still produces the
  // gradients of others): as step(), but before computing each tile it calls gate(begin, end) with the tile's
  // elements, which returns once every segment touching them has its gradient in place — it may set a
  // segment's `grad` (and `grad_dtype`) now, or to null to leave that segment out (its elements keep their
  // values) — or fails to stop the call. Tiles go in ascending rank(begin, end) — the order their gradients
  // are expected in — and, among equal ranks or without `rank`, in descending order (a backward pass reports
  // the last layers first); reads run ahead of the gate in that order. Each tile's new state is written to
  // its other slot, never over the valid copy, and the table keeps naming the old one: commit_speculation()
  // makes the new state the store's (durable as `durability` says), discard_speculation() drops it and the
  // store is as it was — a crash before the commit reopens at the last committed step. One of them must
  // follow, whether this call succeeded or not; every other call is refused until then. options.check_finite
  // is not applied: the caller checks gradients as they arrive. Not thread-safe with the store's other calls,
  // but the gate may block on another thread's work.
  using TileGate = std::function<Status(std::size_t begin, std::size_t end)>;
  using TileRank = std::function<std::size_t(std::size_t begin, std::size_t end)>;
  Status speculate(std::span<const SwapSegment> segments, const StepOptions& options, const TileGate& gate,
                   const TileRank& rank = {});
  Status commit_speculation();
  Status discard_speculation();
  bool speculating() const;

  // Copies [offset, offset + count) out of (read) or into (write) the store; a null array is skipped
  // (write: kept as stored). write() keeps each tile's step number; use set_step() after loading a
  // checkpoint. Both verify what they read; write() never overwrites a tile's only valid copy. i8 moments
  // are decoded to fp32 (read), or (write) each block touched is decoded, its covered part replaced and the
  // moment given encoded again with new scales.
  Status read(std::size_t offset, std::size_t count, float* p, float* m, float* v, float* vmax = nullptr);
  Status write(std::size_t offset, std::size_t count, const float* p, const float* m, const float* v,
               const float* vmax = nullptr);
  // State dtype i8: the moments exactly as stored, for checkpoints that keep them — the codes of elements
  // [offset, offset + count) and the scales of the kMomentBlock-element blocks those elements fall in (blocks
  // counted from element 0; the caller's scale arrays start at block offset / kMomentBlock). A null array is
  // skipped (write: kept as stored). read() and write() convert i8 moments to and from fp32 instead.
  Status read_q8(std::size_t offset, std::size_t count, std::int8_t* mq, std::uint8_t* vq, float* m_scale,
                 float* v_scale);
  Status write_q8(std::size_t offset, std::size_t count, const std::int8_t* mq, const std::uint8_t* vq,
                  const float* m_scale, const float* v_scale);
  // Makes every completed call durable now, whatever `durability` says: waits for a background sync, then
  // fdatasyncs the swap files and persists the tile table if any call wrote since the last durable table.
  Status flush();
  // Forgets what the store holds, ahead of write()s that cover every element (a checkpoint load replacing
  // the whole state): every tile becomes never written, so no write() reads its old contents to merge with —
  // and a store refused for a failed checksum is recovered in place by the load. Until every tile is written
  // again, read() and set_step() refuse the ones that are not; the valid slots on disk are not overwritten
  // before their replacements are.
  Status discard();
  // Labels every tile with `step` (after a checkpoint load) and makes the store durable (flush()). Refuses
  // while any tile was never written.
  Status set_step(std::int64_t step);

  std::size_t n() const;
  std::size_t tile() const;
  std::size_t tiles() const;
  std::size_t alignment() const;
  const std::string& name() const;
  const std::vector<std::string>& paths() const;
  std::vector<std::string> files() const;   // the swap data files, by path
  bool direct_io() const;                   // false when some path refused O_DIRECT (buffered I/O)
  std::int64_t tile_step(std::size_t tile) const;
  std::vector<TileRun> tile_runs() const;
  std::string describe_state() const;       // "tiles [0, 12) (elements [0, 12582912)) at step 4; ..."
  const SwapStats& last_stats() const;
  // Bytes of RAM the store holds for its buffers (buffer_count slots: tile x 12 bytes for fp32 moments,
  // rounded up to the alignment).
  std::size_t buffer_bytes() const;

  // The raw I/O ceiling: reads every tile's current slot and writes every tile's other slot, with the
  // store's files, request size and queue depth, moving no data through Adam and changing no valid state
  // (the other slot is never the valid copy between calls). Returns {read_s, write_s}; write_s includes the
  // fdatasync a durable step pays too. For benchmarks.
  Result<std::pair<double, double>> raw_io_pass();

  struct Impl;  // opaque; defined in aio/ (named here so the library's internal helpers can take it)

 private:
  explicit SwapStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoe
