// The swap store's tile pipeline: each tile read from its valid slot and verified against its checksums, the
// compute run on it, and its new state written to the other slot, with reads and writes overlapping the
// compute (run_tiles), or over tiles kept in RAM (run_resident_tiles), and the raw I/O pass that measures
// the same reads and writes without the compute. The calls built on it are in swap_step.cpp.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "base/crc32c.h"
#include "src/nvme/swap_impl.h"

namespace zoe {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string hex32(std::uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

// The first failure of a call: later ones are consequences of it (or of the call giving up).
struct FirstFailure {
  Status status;
  void note(Status s) {
    if (status.ok() && !s.ok()) status = std::move(s);
  }
  bool ok() const { return status.ok(); }
};

}  // namespace

// The CRC-32C of a tile's p, m and v (count elements each, in their own sizes; i8: each moment's codes then
// its block scales).
void SwapStore::Impl::checksum(const TileArrays& a, std::size_t count, std::uint32_t out[3]) const {
  if (moment_bytes == 4 && a.v != nullptr && a.vmax == nullptr) {
    crc32c_x3(a.p, a.m, a.v, count * 4, out);  // three interleaved streams of one length
    return;
  }
  out[0] = crc32c(a.p, count * 4);
  out[1] = crc32c(a.m, count * moment_bytes);
  out[2] = a.v == nullptr ? 0 : crc32c(a.v, count * moment_bytes);  // one state array: no v
  if (a.vmax != nullptr) out[2] = crc32c(a.vmax, count * moment_bytes, out[2]);  // amsgrad: v's entry covers vmax
  if (scale_count > 0) {
    const std::size_t scales = moment_blocks(count) * 4;
    out[1] = crc32c(a.m_scale, scales, out[1]);
    if (a.v_scale != nullptr) out[2] = crc32c(a.v_scale, scales, out[2]);
  }
}

void SwapStore::Impl::zero_padding(const TileArrays& a, std::size_t count) const {
  if (count == tile) return;
  std::memset(a.p + count, 0, (tile - count) * 4);
  for (unsigned char* x : {a.m, a.v, a.vmax}) {
    if (x != nullptr) std::memset(x + count * moment_bytes, 0, (tile - count) * moment_bytes);
  }
  if (scale_count == 0) return;
  const std::size_t used = moment_blocks(count);
  for (float* x : {a.m_scale, a.v_scale}) {
    if (x != nullptr) std::memset(x + used, 0, (scale_count - used) * 4);
  }
}

Status SwapStore::Impl::verify_tile(std::size_t t, const TileArrays& a, std::size_t count) {
  const TileEntry& entry = table[t];
  const auto t0 = Clock::now();
  std::uint32_t got[3];
  checksum(a, count, got);
  stats.crc_s += since(t0);
  for (int k = 0; k < 3; ++k) {
    if (got[k] != entry.crc[k]) {
      static const char* kArray[3] = {"p", "m", "v"};
      return Status(StatusCode::corrupt,
                    tile_name(t) + ", slot " + std::to_string(entry.slot) + " at offset " +
                        std::to_string(file_offset(t, entry.slot)) + ", fails its checksum (" + kArray[k] + ": stored " +
                        hex32(entry.crc[k]) + ", read " + hex32(got[k]) + "): the swap file was altered after step " +
                        std::to_string(entry.step) + " was written; the store refuses it -- restore from a checkpoint");
    }
  }
  return Status::success();
}

namespace {

// run_resident_tiles' stages.
void submit_resident_reads(SwapStore::Impl& im, std::span<const TileTask> tasks,
                           std::vector<aio::IoEngine::Ticket>& reads, FirstFailure& failure) {
  for (std::size_t j = 0; j < tasks.size() && failure.ok(); ++j) {
    const std::size_t t = tasks[j].tile;
    if (!tasks[j].read || im.resident[t]) continue;
    Result<aio::IoEngine::Ticket> r = im.engine->submit(IoOp::read, im.file_of(t).engine_file,
                                                        im.file_offset(t, im.table[t].slot), im.buffers[t].data(),
                                                        im.slot_bytes);
    if (r.ok()) reads[j] = r.value();
    failure.note(r.status());
  }
}

// Each tile verified (if read) and computed; resident[t] drops while its buffer is ahead of its entry.
void compute_resident(SwapStore::Impl& im, std::span<const TileTask> tasks, const TileCompute& compute,
                      std::vector<aio::IoEngine::Ticket>& reads, FirstFailure& failure) {
  for (std::size_t j = 0; j < tasks.size() && failure.ok(); ++j) {
    const TileTask& task = tasks[j];
    const std::size_t t = task.tile, count = im.tile_count(t);
    const TileArrays a = im.arrays(t);
    if (reads[j] != 0) {
      const auto t0 = Clock::now();
      Status s = im.engine->wait(reads[j]);
      im.stats.wait_s += since(t0);
      reads[j] = 0;
      if (!s.ok()) {
        failure.note(Status(s.code(), "reading " + im.tile_name(t) + ": " + s.message(), s.sys_errno()));
        break;
      }
      if (Status bad = im.verify_tile(t, a, count); !bad.ok()) {
        failure.note(std::move(bad));
        break;
      }
    } else if (task.read) {
      ++im.stats.tiles_resident;
    }
    im.resident[t] = 0;
    if (Status s = compute(task, a, count); !s.ok()) {
      failure.note(std::move(s));
      break;
    }
    if (!task.write) im.resident[t] = 1;
    if (task.write) im.zero_padding(a, count);
  }
}

// The new entries. Writes left in flight get their checksums in the background task (launch_background);
// writes this call waits for get them now, one tile per thread at a time.
std::vector<TileEntry> next_entries(SwapStore::Impl& im, std::span<const TileTask> tasks, bool behind) {
  const std::size_t T = tasks.size();
  std::vector<TileEntry> next(T);
  for (std::size_t j = 0; j < T; ++j) next[j] = {tasks[j].new_step, 1 - im.table[tasks[j].tile].slot, {0, 0, 0}};
  if (!behind) {
    const auto t0 = Clock::now();
    im.adam->parallel_for(T, [&](std::size_t j) {
      if (!tasks[j].write) return;
      im.checksum(im.arrays(tasks[j].tile), im.tile_count(tasks[j].tile), next[j].crc);
    });
    im.stats.crc_s += since(t0);
  }
  return next;
}

// `behind`: a write is left in flight and its entry flips at once (the state is in RAM); otherwise its
// ticket goes into `writes`, for wait_resident_writes.
void submit_resident_writes(SwapStore::Impl& im, std::span<const TileTask> tasks, const std::vector<TileEntry>& next,
                            bool behind, std::vector<aio::IoEngine::Ticket>& writes, FirstFailure& failure) {
  for (std::size_t j = 0; j < tasks.size() && failure.ok(); ++j) {
    if (!tasks[j].write) continue;
    const std::size_t t = tasks[j].tile;
    Result<aio::IoEngine::Ticket> w = im.engine->submit(IoOp::write, im.file_of(t).engine_file,
                                                        im.file_offset(t, next[j].slot), im.buffers[t].data(),
                                                        im.slot_bytes);
    if (!w.ok()) {
      failure.note(w.status());
      break;
    }
    if (behind) {
      im.table[t] = next[j];
      im.resident[t] = 1;
      im.pending_writes.push_back({t, w.value(), false, Status::success()});
    } else {
      writes[j] = w.value();
    }
  }
}

void wait_resident_writes(SwapStore::Impl& im, std::span<const TileTask> tasks, const std::vector<TileEntry>& next,
                          const std::vector<aio::IoEngine::Ticket>& writes, FirstFailure& failure) {
  for (std::size_t j = 0; j < tasks.size(); ++j) {
    if (writes[j] == 0) continue;
    const std::size_t t = tasks[j].tile;
    const auto w0 = Clock::now();
    Status s = im.engine->wait(writes[j]);
    im.stats.wait_s += since(w0);
    if (!s.ok()) {  // the buffer is ahead of the valid copy, which a retry reads again
      failure.note(Status(s.code(),
                          "writing " + im.tile_name(t) + ": " + s.message() + "; its previous copy stays the valid one",
                          s.sys_errno()));
      continue;
    }
    im.wrote_tile(tasks[j], next[j]);
    im.resident[t] = 1;  // the buffer holds what the entry (or the speculative one) names
  }
}

}  // namespace

// Every tile in its own buffer (keeps_resident()): a task reads its tile only when the buffer does not hold
// it, so no read waits for a write and a step of a resident store moves no bytes in. With durability
// next_call / on_flush the writes are left in flight: the tile's entry names the new slot at once (the
// state is in RAM), and settle() waits for them — and rewrites any that failed — before the next call
// touches a buffer or a slot.
Status SwapStore::Impl::run_resident_tiles(std::span<const TileTask> tasks, const TileCompute& compute) {
  // streaming_call() has settled the last call: no write is in flight from any buffer.
  FirstFailure failure;
  std::vector<aio::IoEngine::Ticket> reads(tasks.size(), 0);
  submit_resident_reads(*this, tasks, reads, failure);
  compute_resident(*this, tasks, compute, reads, failure);
  for (aio::IoEngine::Ticket r : reads) {
    if (r != 0) (void)engine->wait(r);
  }
  if (!failure.ok()) return failure.status;  // tiles computed but not written are read again by a retry
  if (!tasks.empty() && tasks.front().speculative) {
    // The new state stays in RAM, unwritten, until commit_speculation() writes it as a step's (behind it,
    // with durability next_call / on_flush); a discard marks the buffer stale.
    for (const TileTask& task : tasks) {
      if (!task.write) continue;
      speculated[task.tile] = {task.new_step, 1 - table[task.tile].slot, {0, 0, 0}};
      resident[task.tile] = 1;
    }
    return Status::success();
  }
  return write_resident_tiles(tasks);
}

Status SwapStore::Impl::write_resident_tiles(std::span<const TileTask> tasks) {
  const bool behind = options.durability != SwapDurability::each_call;
  FirstFailure failure;
  const std::vector<TileEntry> next = next_entries(*this, tasks, behind);
  std::vector<aio::IoEngine::Ticket> writes(tasks.size(), 0);  // durability each_call: waited before the call returns
  submit_resident_writes(*this, tasks, next, behind, writes, failure);
  wait_resident_writes(*this, tasks, next, writes, failure);
  return failure.status;
}

namespace {

// run_tiles over the store's K buffers (see there for the order of reads, compute and writes).
class TilePipeline {
 public:
  TilePipeline(SwapStore::Impl& im, std::span<const TileTask> tasks, const TileCompute& compute)
      : im_(im), tasks_(tasks), compute_(compute), K_(im.buffers.size()), state_(K_) {}

  Status run() {
    const std::size_t T = tasks_.size();
    const std::size_t ahead = std::min(K_ - 1, T);
    for (std::size_t j = 0; j < ahead && failure_.ok(); ++j) failure_.note(issue_read(j));
    for (std::size_t j = 0; j < T && failure_.ok(); ++j) {
      if (Status s = process(j); !s.ok()) {
        failure_.note(std::move(s));
        break;
      }
      if (const std::size_t r = j + K_ - 1; r < T) {
        failure_.note(finish_write(state_[r % K_]));
        if (!failure_.ok()) break;
        failure_.note(issue_read(r));
      }
    }
    drain();
    return failure_.status;
  }

 private:
  struct BufferState {
    aio::IoEngine::Ticket read = 0, write = 0;
    std::size_t task = 0;
    TileEntry next;
  };

  Status wait_timed(aio::IoEngine::Ticket t) {
    const auto t0 = Clock::now();
    Status s = im_.engine->wait(t);
    im_.stats.wait_s += since(t0);
    return s;
  }

  Status issue_read(std::size_t j) {
    BufferState& b = state_[j % K_];
    b = BufferState{};
    b.task = j;
    const TileTask& task = tasks_[j];
    if (!task.read) return Status::success();
    Result<aio::IoEngine::Ticket> r = im_.engine->submit(IoOp::read, im_.file_of(task.tile).engine_file,
                                                         im_.file_offset(task.tile, im_.table[task.tile].slot),
                                                         im_.buffers[j % K_].data(), im_.slot_bytes);
    if (!r.ok()) return r.status();
    b.read = r.value();
    return Status::success();
  }

  Status finish_write(BufferState& b) {
    if (b.write == 0) return Status::success();
    Status s = wait_timed(b.write);
    b.write = 0;
    const std::size_t t = tasks_[b.task].tile;
    if (!s.ok()) {
      return Status(s.code(), "writing " + im_.tile_name(t) + ": " + s.message() + "; its previous copy stays the valid one",
                    s.sys_errno());
    }
    im_.wrote_tile(tasks_[b.task], b.next);
    return Status::success();
  }

  // Tile task j in its buffer: waited for and verified (if read), computed, its write issued (if written).
  Status process(std::size_t j) {
    const TileTask& task = tasks_[j];
    const TileArrays a = im_.arrays(j % K_);
    const std::size_t count = im_.tile_count(task.tile);
    if (task.read) {
      BufferState& b = state_[j % K_];
      Status s = wait_timed(b.read);
      b.read = 0;
      if (!s.ok()) return Status(s.code(), "reading " + im_.tile_name(task.tile) + ": " + s.message(), s.sys_errno());
      if (Status bad = im_.verify_tile(task.tile, a, count); !bad.ok()) return bad;
    }
    if (Status s = compute_(task, a, count); !s.ok()) return s;
    return task.write ? issue_write(j, a, count) : Status::success();
  }

  Status issue_write(std::size_t j, const TileArrays& a, std::size_t count) {
    const TileTask& task = tasks_[j];
    BufferState& b = state_[j % K_];
    // The last call's slots must be durable before this call rewrites any (next_call: its background
    // sync has overlapped the reads issued so far).
    if (!settled_) {
      settled_ = true;
      if (Status st = im_.settle(); !st.ok()) return st;
    }
    im_.zero_padding(a, count);
    const auto t0 = Clock::now();
    b.next.step = task.new_step;
    b.next.slot = 1 - im_.table[task.tile].slot;
    im_.checksum(a, count, b.next.crc);
    im_.stats.crc_s += since(t0);
    Result<aio::IoEngine::Ticket> w = im_.engine->submit(IoOp::write, im_.file_of(task.tile).engine_file,
                                                         im_.file_offset(task.tile, b.next.slot), a.p, im_.slot_bytes);
    if (!w.ok()) return w.status();
    b.write = w.value();
    return Status::success();
  }

  // Reads in flight are dropped; every write that completes is valid and flips its tile.
  void drain() {
    for (BufferState& b : state_) {
      failure_.note(finish_write(b));
      if (b.read != 0) (void)im_.engine->wait(b.read);
      b.read = 0;
    }
    (void)im_.engine->wait_all();
  }

  SwapStore::Impl& im_;
  std::span<const TileTask> tasks_;
  const TileCompute& compute_;
  const std::size_t K_;
  std::vector<BufferState> state_;
  FirstFailure failure_;
  bool settled_ = false;
};

}  // namespace

// Buffer b holds tile task j for j % K == b. With K buffers the compute works on tile j while the reads of
// tiles j+1 .. j+K-2 and the write of tile j-1 are in flight; the read of tile j+K-1 reuses tile j-1's
// buffer, so it is issued only once that write completed. A tile's table entry flips only when its write
// completed; after a failure nothing new is issued, and writes already in flight that complete still flip
// (their tiles are then validly at the new step).
Status SwapStore::Impl::run_tiles(std::span<const TileTask> tasks, const TileCompute& compute) {
  if (keeps_resident()) return run_resident_tiles(tasks, compute);
  return TilePipeline(*this, tasks, compute).run();
}

// The same reads and writes as a step of every tile, nothing computed: the ceiling benchmarks compare with.
Result<std::pair<double, double>> SwapStore::raw_io_pass() {
  Impl& im = *impl_;
  if (Status s = im.refuse_while_speculating("raw_io_pass()"); !s.ok()) return s;
  if (Status s = im.ready_for_io(); !s.ok()) return s;
  // Its writes go to the slots the table on disk may still name.
  if (Status s = im.settle(); !s.ok()) return s;
  std::fill(im.resident.begin(), im.resident.end(), 0);  // the buffers are its scratch
  const std::size_t K = im.buffers.size();
  std::vector<aio::IoEngine::Ticket> tickets(K, 0);
  double seconds[2] = {0, 0};
  for (int pass = 0; pass < 2; ++pass) {
    const IoOp op = pass == 0 ? IoOp::read : IoOp::write;
    const auto t0 = Clock::now();
    for (std::size_t t = 0; t < im.ntiles; ++t) {
      aio::IoEngine::Ticket& ticket = tickets[t % K];
      if (ticket != 0) {
        if (Status s = im.engine->wait(ticket); !s.ok()) {
          (void)im.engine->wait_all();
          return s;
        }
      }
      // Reads take the valid slot, writes the other one: the same bytes a step moves, and never the valid copy.
      const std::uint32_t slot = pass == 0 ? im.table[t].slot : 1 - im.table[t].slot;
      Result<aio::IoEngine::Ticket> r =
          im.engine->submit(op, im.file_of(t).engine_file, im.file_offset(t, slot), im.buffers[t % K].data(), im.slot_bytes);
      if (!r.ok()) {
        (void)im.engine->wait_all();
        return r.status();
      }
      ticket = r.value();
    }
    Status s = Status::success();
    for (auto& ticket : tickets) {
      if (ticket != 0) {
        Status w = im.engine->wait(ticket);
        if (s.ok()) s = std::move(w);
      }
      ticket = 0;
    }
    // The step makes its writes durable before it flips the table; the ceiling must pay the same flush.
    for (std::size_t k = 0; s.ok() && pass == 1 && im.options.durable && k < im.files.size(); ++k) {
      s = aio::sync_file(im.files[k].fd.get(), im.files[k].data_path, im.options.fault_hook);
    }
    if (!s.ok()) return s;
    seconds[pass] = since(t0);
  }
  return std::make_pair(seconds[0], seconds[1]);
}

}  // namespace zoe
