// When the swap store's writes become durable (SwapDurability in zoe/swap.h).
//
// The invariant every mode keeps: a slot that the table on disk names as a tile's valid copy is never
// overwritten. A step writes each tile's other slot, so the table naming the last call's slots must be on
// disk (after the data it names) before the next call's first write — not before the call returns. next_call
// moves that fdatasync and table update off the call's critical path into a background task; the next call
// issues its first reads, then settle()s before its first write. on_flush skips it until flush(), accepting
// that a crash leaves a table whose slots later calls may have overwritten (detected by the tile checksums).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>

#include "base/warning.h"
#include "src/nvme/swap_impl.h"

namespace zoe {
namespace {

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Status SwapStore::Impl::make_durable(const std::vector<TileEntry>& entries, std::uint64_t seq) const {
  if (options.durable) {
    for (const PathFile& f : files) {
      if (Status s = aio::sync_file(f.fd.get(), f.data_path, options.fault_hook); !s.ok()) return s;
    }
  }
  return write_table(entries, seq);
}

Status SwapStore::Impl::sync_and_persist(const std::vector<TileEntry>& before, bool wrote) {
  const auto t0 = std::chrono::steady_clock::now();
  Status s;
  if (wrote && options.durable) {
    for (const PathFile& f : files) {
      s = aio::sync_file(f.fd.get(), f.data_path, options.fault_hook);
      if (!s.ok()) break;
    }
    if (!s.ok()) {
      // The new slots may not be on the disk: fall back to the old ones, which nothing has touched.
      table = before;
      std::fill(resident.begin(), resident.end(), 0);  // the buffers hold the rolled-back call's state
      s = Status(s.code(), s.message() + "; this call's tiles were rolled back to their previous step", s.sys_errno());
    }
  }
  if (s.ok() && (wrote || table_dirty)) s = persist_table();
  stats.sync_s += since(t0);
  return s;
}

Status SwapStore::Impl::after_call(const std::vector<TileEntry>& call_before, bool call_wrote) {
  if (defer) {  // an earlier call of a split step: durable with the step's last call
    if (!deferred_before) deferred_before = call_before;
    deferred_wrote = deferred_wrote || call_wrote;
    if (call_wrote) unsynced = true;
    return Status::success();
  }
  const std::vector<TileEntry> before = deferred_before ? std::move(*deferred_before) : call_before;
  deferred_before.reset();
  const bool wrote = call_wrote || std::exchange(deferred_wrote, false);
  switch (options.durability) {
    case SwapDurability::each_call:
      return sync_and_persist(before, wrote);
    case SwapDurability::next_call:
      if (!wrote) return Status::success();
      unsynced = true;
      launch_background(true);
      return Status::success();
    case SwapDurability::on_flush:
      if (wrote) unsynced = true;
      if (!pending_writes.empty()) launch_background(false);
      return Status::success();
  }
  return Status::success();
}

// A step split across calls (tier nvme's windows): durable as one step, with its last call (after_call).
Status SwapStore::step(std::span<const SwapSegment> segments, const StepOptions& options, bool last) {
  // A resident store keeps its writes in flight between calls: each call settles the last one's itself.
  impl_->defer = !last && !impl_->keeps_resident();
  Status s = step_tiles(*impl_, segments, options, nullptr);
  impl_->defer = false;
  return s;
}

void SwapStore::Impl::launch_background(bool durable) {
  persisting_durable = durable;
  persisting_seq = table_seq + 1;
  // A snapshot of the table: the next call may change entries once settle() has returned, never before.
  persisting = std::async(std::launch::async, [this, entries = table, seq = persisting_seq, durable]() mutable {
    // Writes left in flight (a resident store): checksummed, then waited — what is synced must be on disk.
    for (PendingWrite& w : pending_writes) {
      checksum(arrays(w.tile), tile_count(w.tile), w.crc);
      std::copy(w.crc, w.crc + 3, entries[w.tile].crc);
    }
    Status failed;
    for (PendingWrite& w : pending_writes) {
      w.result = engine->wait(w.ticket);
      w.waited = true;
      if (failed.ok() && !w.result.ok()) failed = w.result;
    }
    if (!failed.ok() || !durable) return failed;
    return make_durable(entries, seq);
  });
}

Status SwapStore::Impl::finish_pending_writes() {
  for (PendingWrite& w : pending_writes) {
    if (w.waited) continue;
    checksum(arrays(w.tile), tile_count(w.tile), w.crc);
    w.result = engine->wait(w.ticket);
    w.waited = true;
  }
  for (const PendingWrite& w : pending_writes) std::copy(w.crc, w.crc + 3, table[w.tile].crc);
  for (PendingWrite& w : pending_writes) {
    if (w.result.ok()) continue;
    // Nothing has touched the tile's buffer since: write it again to the slot its entry names.
    const std::size_t t = w.tile;
    warn("writing " + tile_name(t) + " after the call returned failed (" + w.result.message() +
         "); writing it again from RAM");
    Result<aio::IoEngine::Ticket> r =
        engine->submit(IoOp::write, file_of(t).engine_file, file_offset(t, table[t].slot), buffers[t].data(), slot_bytes);
    Status again = r.ok() ? engine->wait(r.value()) : r.status();
    if (!again.ok()) {
      return Status(again.code(), "writing " + tile_name(t) + " (step " + std::to_string(table[t].step) +
                                      ", held in RAM) failed after the last call returned, and again now: " + again.message() +
                                      "; this call changed nothing -- call again once the cause is fixed",
                    again.sys_errno());
    }
    w.result = Status::success();
    unsynced = true;  // the rewritten tile still has to be made durable
  }
  pending_writes.clear();
  return Status::success();
}

Status SwapStore::Impl::settle() {
  if (persisting.valid()) {
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = persisting.get();
    stats.sync_s += since(t0);
    for (const PendingWrite& w : pending_writes) std::copy(w.crc, w.crc + 3, table[w.tile].crc);
    if (s.ok()) {
      if (persisting_durable) {
        table_seq = persisting_seq;
        unsynced = false;
        table_dirty = false;
      }
      pending_writes.clear();  // the background task waited each, and each succeeded
      return s;
    }
    warn(std::string(persisting_durable ? "making durable" : "finishing the writes of") + " the last call on " + name +
         " failed (" + s.message() + "); retrying before this call writes");
  }
  if (Status s = finish_pending_writes(); !s.ok()) return s;
  if (!unsynced || options.durability != SwapDurability::next_call) return Status::success();
  // Nothing has been written since the background attempt: the table is still the one it tried to persist.
  const auto t0 = std::chrono::steady_clock::now();
  const std::uint64_t seq = table_seq + 1;
  const Status s = make_durable(table, seq);
  stats.sync_s += since(t0);
  if (!s.ok()) {
    return Status(s.code(), "the previous call's writes could not be made durable, so no slot may be rewritten yet "
                            "(this call wrote nothing; call again once the cause is fixed): " + s.message(),
                  s.sys_errno());
  }
  table_seq = seq;
  unsynced = false;
  table_dirty = false;
  return s;
}

Status SwapStore::Impl::flush() {
  if (Status s = settle(); !s.ok()) return s;
  if (!unsynced && !table_dirty) return Status::success();
  const std::uint64_t seq = table_seq + 1;
  const Status s = make_durable(table, seq);
  if (!s.ok()) return s;
  table_seq = seq;
  unsynced = false;
  table_dirty = false;
  return s;
}

SwapStore::Impl::~Impl() {
  if (!persisting.valid() && !unsynced && pending_writes.empty()) return;
  if (Status s = flush(); !s.ok()) {
    warn("closing swap store " + name + ": its last writes could not be made durable: " + s.message());
  }
}

Status SwapStore::flush() { return impl_->flush(); }

}  // namespace zoe
