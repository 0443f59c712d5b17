// Speculative steps (SwapStore::speculate): the tile pipeline's step with each tile's new state written beside
// the valid copy and named only in `speculated` until commit_speculation() flips the table — the same
// two-slot rule that makes a failed write harmless makes a wrong speculation free to drop.
#include <chrono>

#include "src/nvme/swap_impl.h"

namespace zoe {

Status SwapStore::Impl::refuse_while_speculating(const char* call) const {
  if (!speculating) return Status::success();
  return Status(StatusCode::invalid_argument, std::string(call) + " on swap store " + name +
                                                  ": a speculative step is pending; commit_speculation() or "
                                                  "discard_speculation() first");
}

Status SwapStore::speculate(std::span<const SwapSegment> segments, const StepOptions& options, const TileGate& gate,
                           const TileRank& rank) {
  Impl& im = *impl_;
  if (!gate) return invalid_argument("speculate: the gate is empty");
  if (Status s = im.refuse_while_speculating("speculate()"); !s.ok()) return s;
  im.speculated.assign(im.ntiles, TileEntry{});
  return step_tiles(im, segments, options, &gate, rank ? &rank : nullptr);
}

Status SwapStore::commit_speculation() {
  Impl& im = *impl_;
  if (!im.speculating) return invalid_argument("commit_speculation: no speculative step is pending");
  const auto t0 = std::chrono::steady_clock::now();
  im.stats = {};
  const std::vector<TileEntry> before = im.table;
  std::vector<TileTask> unwritten;  // a resident store's tiles: computed in their buffers, written now
  bool flipped = false;
  for (std::size_t t = 0; t < im.ntiles; ++t) {
    const TileEntry& e = im.speculated[t];
    if (e.step < 0) continue;
    if (im.keeps_resident()) {
      unwritten.push_back({t, false, true, e.step, false});
      im.resident[t] = 0;  // ahead of its entry until its write is issued (or has completed)
    } else {
      im.table[t] = e;
      flipped = true;
    }
  }
  const bool wrote = flipped || !unwritten.empty();
  im.speculating = false;
  im.speculated.clear();
  Status s = unwritten.empty() ? Status::success() : im.write_resident_tiles(unwritten);
  im.stats.write_bytes = unwritten.size() * im.slot_bytes;
  // As a step's own end: durable now (each_call; on failure rolled back to `before`), in the background
  // (next_call) or at flush().
  Status persisted = im.after_call(before, wrote);
  if (s.ok()) s = std::move(persisted);
  im.stats.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return im.with_state(std::move(s));
}

Status SwapStore::discard_speculation() {
  Impl& im = *impl_;
  if (!im.speculating) return Status::success();
  for (std::size_t t = 0; t < im.ntiles; ++t) {
    // A resident tile's buffer holds the dropped state: the next call reads the valid copy again.
    if (im.speculated[t].step >= 0 && !im.resident.empty()) im.resident[t] = 0;
  }
  // A retried tile (already at the step) computed in its buffer rewrote nothing, so it stays resident.
  im.speculating = false;
  im.speculated.clear();
  return Status::success();
}

bool SwapStore::speculating() const { return impl_->speculating; }

}  // namespace zoe
