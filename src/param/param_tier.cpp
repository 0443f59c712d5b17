// The parameter tier (zoe/param_tier.h): a device pool of resident blocks, their copies and prefetches. The
// pool is one device allocation cut first-fit; residency, uses and events are kept per block under one
// mutex. Ordering rides on device events, so that the host waits only where it must:
//  - `ready`   (h2d, after the block's copy): the compute stream waits for it at the block's first fetch;
//  - `home_read` (h2d, RAM home): a write of the home waits for it on the host, so a copy never reads a
//    half-written block;
//  - `released` (compute, at the last release): when the block's room is given to another, the h2d stream
//    waits for it before copying there (a "fence" on that range).
// NVMe loads run on a worker thread into pinned bounce buffers and are then copied like RAM blocks — or,
// where the device's memory is host memory (the CPU as the device), straight into the block's room.
#include "zoe/param_tier.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

#include "base/work_queue.h"
#include "src/param/param_home.h"

namespace zoe {
namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

}  // namespace

struct ParamTier::Impl {
  enum class State { absent, loading, loaded };
  struct BlockState {
    State state = State::absent;
    std::size_t pool_offset = kNone;
    EventId ready = 0, home_read = 0, released = 0;
    int uses = 0;
    bool writing = false;    // the home is being rewritten: no load may read it meanwhile
    bool stale = false;      // rewritten while in use: the pooled copy goes at the last release
    std::uint64_t last_use = 0;
    Status load_error;       // of the last load, when it failed
  };
  struct Fence {
    std::size_t offset, bytes;
    EventId released;
  };
  struct Bounce {
    void* host = nullptr;
    EventId copied = 0;  // its last copy to the device; the next read into it waits for it
    bool busy = false;
  };

  Impl(Device& d, const ParamTierOptions& o) : device(d), options(o) {}
  ~Impl() {
    loaders.clear();  // finish the loads queued
    (void)device.synchronize();
    if (pool != nullptr) device.free(pool);
    for (Bounce& b : bounces) device.free_host(b.host);
  }

  Device& device;
  ParamTierOptions options;
  std::vector<ParamBlockLayout> layout;
  std::unique_ptr<ParamHomeStore> home;
  unsigned char* pool = nullptr;
  std::size_t budget = 0;
  std::map<std::size_t, std::size_t> free_ranges;  // offset -> bytes, coalesced
  std::vector<Fence> fences;
  std::vector<BlockState> blocks;
  std::vector<std::size_t> order, position;
  std::size_t pool_used = 0;
  std::uint64_t clock = 0;
  ParamTierStats stats;
  mutable std::mutex mutex;
  std::condition_variable changed;  // a load finished, or a write did
  // NVMe: two loader threads, so that one block's checksum and copy overlap the next one's read.
  std::vector<std::unique_ptr<WorkQueue>> loaders;
  std::size_t next_loader = 0;
  // NVMe on a device whose memory is host memory: reads land in the pool, with no bounce and no copy (on
  // the host that copy is the CPU's own memcpy, competing with the checksums and the trainer's threads).
  bool read_into_pool = false;
  std::vector<Bounce> bounces;  // pinned; taken and given back under the mutex

  // Device events recorded on h2d that nobody else needs: an h2d wait on them is a no-op for ordering and
  // lets the device forget them.
  void drop_h2d_event(EventId& e) {
    if (e != 0) (void)device.wait(Stream::h2d, e);
    e = 0;
  }

  bool take_range(std::size_t bytes, std::size_t* offset) {
    for (auto it = free_ranges.begin(); it != free_ranges.end(); ++it) {
      if (it->second < bytes) continue;
      *offset = it->first;
      const std::size_t rest = it->second - bytes;
      free_ranges.erase(it);
      if (rest > 0) free_ranges[*offset + bytes] = rest;
      return true;
    }
    return false;
  }
  void give_range(std::size_t offset, std::size_t bytes) {
    auto next = free_ranges.lower_bound(offset);
    if (next != free_ranges.end() && next->first == offset + bytes) {
      bytes += next->second;
      next = free_ranges.erase(next);
    }
    if (next != free_ranges.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += bytes;
        return;
      }
    }
    free_ranges[offset] = bytes;
  }

  // Block b's room goes back to the pool; whoever gets it next copies there only after the compute stream
  // passed b's last release. `for_room`: counted as an eviction (not a stale copy dropped after a write).
  void evict(std::size_t b, bool for_room = true) {
    BlockState& s = blocks[b];
    drop_h2d_event(s.ready);
    drop_h2d_event(s.home_read);
    if (s.released != 0) fences.push_back({s.pool_offset, layout[b].bytes, s.released});
    s.released = 0;
    give_range(s.pool_offset, layout[b].bytes);
    pool_used -= layout[b].bytes;
    s.pool_offset = kNone;
    s.state = State::absent;
    if (for_room) ++stats.evictions;
  }

  // Room for `bytes`, evicting blocks not in use, least recently used first. With `lock` (a fetch), blocks
  // on their way that nobody uses yet (prefetched) are waited for and then evicted too; false when the
  // blocks in use leave no room.
  bool make_room(std::size_t bytes, std::size_t* offset, std::unique_lock<std::mutex>* lock) {
    while (!take_range(bytes, offset)) {
      std::size_t victim = kNone;
      bool prefetching = false;
      for (std::size_t b = 0; b < blocks.size(); ++b) {
        const BlockState& s = blocks[b];
        prefetching = prefetching || (s.state == State::loading && s.uses == 0);
        if (s.state != State::loaded || s.uses > 0) continue;
        if (victim == kNone || s.last_use < blocks[victim].last_use) victim = b;
      }
      if (victim != kNone) {
        evict(victim);
      } else if (lock != nullptr && prefetching) {
        changed.wait(*lock);
      } else {
        return false;
      }
    }
    return true;
  }

  std::string in_use_list() const {
    std::string out;
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      if (blocks[b].uses == 0) continue;
      out += (out.empty() ? "" : ", ") + ("'" + layout[b].name + "' (" + std::to_string(layout[b].bytes) + " bytes)");
    }
    return out.empty() ? "none" : out;
  }

  Status no_room(std::size_t b) const {
    return Status(StatusCode::out_of_memory,
                  "parameter tier: no room in the device pool of " + std::to_string(budget) + " bytes for block '" +
                      layout[b].name + "' (" + std::to_string(layout[b].bytes) + " bytes): blocks in use: " +
                      in_use_list() + "; release blocks after use, or give a larger budget");
  }

  // Starts bringing absent block b into `offset` of the pool, made room for (lock held). False, with
  // *error set where given, when the copy could not be enqueued.
  bool start_load(std::size_t b, std::size_t offset, Status* error) {
    BlockState& s = blocks[b];
    // The room's previous occupants must be done with before the copy lands there; a read into the pool
    // waits for them on its loader thread.
    std::vector<EventId> after;
    for (auto it = fences.begin(); it != fences.end();) {
      if (it->offset < offset + layout[b].bytes && offset < it->offset + it->bytes) {
        if (read_into_pool) {
          after.push_back(it->released);
        } else {
          (void)device.wait(Stream::h2d, it->released);
        }
        it = fences.erase(it);
      } else {
        ++it;
      }
    }
    s.pool_offset = offset;
    s.load_error = Status::success();
    pool_used += layout[b].bytes;
    stats.pool_peak_bytes = std::max(stats.pool_peak_bytes, pool_used);
    ++stats.loads;
    stats.loaded_bytes += layout[b].bytes;
    s.last_use = ++clock;
    if (const void* memory = home->block_memory(b)) {
      Status st = device.copy_to_device(pool + offset, memory, layout[b].bytes, Stream::h2d);
      Result<EventId> ready = st.ok() ? device.record(Stream::h2d) : Result<EventId>(st);
      Result<EventId> read = ready.ok() ? device.record(Stream::h2d) : ready;
      if (!read.ok()) {
        if (ready.ok()) drop_h2d_event(ready.value());
        s.load_error = read.status();
        give_range(offset, layout[b].bytes);
        pool_used -= layout[b].bytes;
        s.pool_offset = kNone;
        if (error != nullptr) *error = read.status();
        return false;
      }
      s.ready = ready.value();
      s.home_read = read.value();
      s.state = State::loaded;
      return true;
    }
    s.state = State::loading;
    loaders[next_loader++ % loaders.size()]->enqueue(
        [this, b, offset, after = std::move(after)] { load_from_home(b, offset, after); });
    return true;
  }

  // On a loader thread: block b read from the home into its room at `offset`, checked.
  void load_from_home(std::size_t b, std::size_t offset, const std::vector<EventId>& after) {
    Result<EventId> ready = read_into_pool ? read_in_place(b, offset, after) : read_through_bounce(b, offset);
    std::lock_guard lock(mutex);
    BlockState& st = blocks[b];
    if (ready.ok()) {
      st.ready = ready.value();
      st.state = State::loaded;
    } else {
      st.load_error = ready.status();
      give_range(offset, layout[b].bytes);
      pool_used -= layout[b].bytes;
      st.pool_offset = kNone;
      st.state = State::absent;
    }
    changed.notify_all();
  }

  // Host memory as the device: the room itself is the destination, once the work that read its previous
  // occupants (`after`, each consumed here) is done. Nothing is left for the device to do: no ready event.
  Result<EventId> read_in_place(std::size_t b, std::size_t offset, const std::vector<EventId>& after) {
    Status s;
    for (EventId e : after) {
      if (Status w = device.synchronize(e); !w.ok() && s.ok()) s = w;
    }
    if (s.ok()) s = home->read_block(b, pool + offset);
    if (!s.ok()) return s;
    return EventId{0};
  }

  // Into a free bounce buffer, then copied to the room on h2d: the event after that copy.
  Result<EventId> read_through_bounce(std::size_t b, std::size_t offset) {
    Bounce* bounce = nullptr;
    {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] {
        for (Bounce& x : bounces) {
          if (!x.busy) bounce = &x;
        }
        return bounce != nullptr;
      });
      bounce->busy = true;
    }
    Status s;
    if (bounce->copied != 0) s = device.synchronize(bounce->copied);  // its previous copy has left it
    bounce->copied = 0;
    if (s.ok()) s = home->read_block(b, bounce->host);
    if (s.ok()) s = device.copy_to_device(pool + offset, bounce->host, layout[b].bytes, Stream::h2d);
    Result<EventId> ready = s.ok() ? device.record(Stream::h2d) : Result<EventId>(s);
    Result<EventId> copied = ready.ok() ? device.record(Stream::h2d) : ready;
    std::lock_guard lock(mutex);
    if (copied.ok()) bounce->copied = copied.value();
    bounce->busy = false;
    if (!copied.ok()) {
      if (ready.ok()) drop_h2d_event(ready.value());
      return copied.status();
    }
    return ready;
  }

  void prefetch_locked(std::size_t b) {
    BlockState& s = blocks[b];
    if (s.state != State::absent) {
      s.last_use = ++clock;
      return;
    }
    std::size_t offset = 0;
    if (s.writing || !make_room(layout[b].bytes, &offset, nullptr)) return;  // the fetch will load it
    start_load(b, offset, nullptr);
  }

  // Before a write of block b's home (mutex held): waits for a load or write of it, and drops its pooled copy
  // (at its last release if in use). end_write() lets fetches of it go on.
  Status begin_write(std::unique_lock<std::mutex>& lock, std::size_t b);
  void end_write(std::size_t b);

  Status check_block(std::size_t b) const {
    if (b >= blocks.size()) {
      return invalid_argument("parameter tier: block " + std::to_string(b) + " does not exist (" +
                              std::to_string(blocks.size()) + " blocks)");
    }
    return Status::success();
  }
  Status check_entry(std::size_t b, std::size_t entry, std::size_t offset, std::size_t bytes) const {
    if (Status s = check_block(b); !s.ok()) return s;
    if (entry >= layout[b].entry_bytes.size()) {
      return invalid_argument("parameter tier: block '" + layout[b].name + "' has " +
                              std::to_string(layout[b].entry_bytes.size()) + " entries, not entry " + std::to_string(entry));
    }
    const std::size_t n = layout[b].entry_bytes[entry];
    if (offset > n || bytes > n - offset) {
      return invalid_argument("parameter tier: bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
                              ") are outside " + describe_entry(layout[b], b, entry) + " of " + std::to_string(n) + " bytes");
    }
    return Status::success();
  }
};

ParamTier::ParamTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<SpaceNeed> ParamTier::footprint(const Device& device, std::vector<ParamBlockSpec> specs,
                                       const ParamTierOptions& options) {
  Result<ParamTierLayout> laid = lay_out_param_tier(std::move(specs), options);
  if (!laid.ok()) return laid.status();
  return param_tier_footprint(device, laid.value(), options);
}

Status ParamTier::remove_files() { return impl_->home->remove_files(); }

ParamTier::ParamTier(ParamTier&&) noexcept = default;
ParamTier& ParamTier::operator=(ParamTier&&) noexcept = default;
ParamTier::~ParamTier() = default;

Result<ParamTier> ParamTier::create(Device& device, std::vector<ParamBlockSpec> specs, const ParamTierOptions& options) {
  Result<ParamTierLayout> laid = lay_out_param_tier(std::move(specs), options);
  if (!laid.ok()) return laid.status();
  // Before anything is allocated or created: a tier that does not fit is refused, not killed part-way.
  if (Status s = check_param_tier_space(device, laid.value(), options); !s.ok()) return s;
  const std::size_t alignment = laid->alignment, largest = laid->largest;
  auto impl = std::make_unique<Impl>(device, options);
  impl->layout = std::move(laid->blocks);
  impl->budget = laid->budget;
  Result<std::unique_ptr<ParamHomeStore>> home = options.home == ParamHome::nvme
                                                     ? make_nvme_param_home(impl->layout, options, alignment)
                                                     : make_ram_param_home(device, impl->layout);
  if (!home.ok()) return home.status();
  impl->home = std::move(home.value());
  // keep_files keeps a tier's files, not those of a creation that fails from here on.
  struct DropFiles {
    ParamHomeStore* home;
    ~DropFiles() {
      if (home != nullptr) (void)home->remove_files();
    }
  } drop{impl->home.get()};
  if (impl->budget > 0) {
    Result<void*> pool = device.allocate(impl->budget);
    if (!pool.ok()) return pool.status();
    impl->pool = static_cast<unsigned char*>(pool.value());
    impl->free_ranges[0] = impl->budget;
  }
  impl->stats.budget_bytes = impl->budget;
  impl->blocks.resize(impl->layout.size());
  impl->position.assign(impl->layout.size(), kNone);
  for (std::size_t b = 0; b < impl->layout.size(); ++b) {
    impl->order.push_back(b);
    impl->position[b] = b;
  }
  impl->read_into_pool =
      reads_into_pool(device, laid.value(), options) && reinterpret_cast<std::uintptr_t>(impl->pool) % alignment == 0;
  if (options.home == ParamHome::nvme && !impl->read_into_pool) {
    // Two bounce buffers per loader thread: a loader reads into one while the other's copy to the device
    // runs.
    for (int k = 0; k < kParamBounces; ++k) {
      Result<void*> host = device.allocate_host(std::max(largest, alignment));
      if (!host.ok()) return host.status();
      impl->bounces.push_back({host.value(), 0, false});
    }
  }
  if (options.home == ParamHome::nvme) {
    for (int k = 0; k < 2; ++k) impl->loaders.push_back(std::make_unique<WorkQueue>());
  }
  drop.home = nullptr;
  return ParamTier(std::move(impl));
}

Status ParamTier::Impl::begin_write(std::unique_lock<std::mutex>& lock, std::size_t block) {
  BlockState& st = blocks[block];
  changed.wait(lock, [&] { return st.state != State::loading && !st.writing; });
  if (st.state == State::loaded && st.home_read != 0) {
    if (Status s = device.synchronize(st.home_read); !s.ok()) return s;
    st.home_read = 0;
  }
  if (st.uses > 0) {
    st.stale = true;  // the device keeps the whole old copy while it is used; dropped at the last release
  } else if (st.state == State::loaded) {
    evict(block, false);
  }
  st.writing = true;
  return Status::success();
}

void ParamTier::Impl::end_write(std::size_t block) {
  std::lock_guard lock(mutex);
  blocks[block].writing = false;
  changed.notify_all();
}

Status ParamTier::write(std::size_t block, std::size_t entry, const void* src, std::size_t byte_offset, std::size_t bytes) {
  Impl& m = *impl_;
  {
    std::unique_lock lock(m.mutex);
    if (Status s = m.check_entry(block, entry, byte_offset, bytes); !s.ok()) return s;
    if (Status s = m.begin_write(lock, block); !s.ok()) return s;
  }
  Status s = m.home->write(block, entry, src, byte_offset, bytes);
  m.end_write(block);
  return s;
}

Status ParamTier::write_blocks(const std::vector<ParamBlockWrite>& writes) {
  Impl& m = *impl_;
  std::size_t begun = 0;
  Status s;
  {
    std::unique_lock lock(m.mutex);
    std::vector<char> seen(m.blocks.size(), 0);
    for (const ParamBlockWrite& w : writes) {
      if (s = m.check_block(w.block); !s.ok()) return s;
      const ParamBlockLayout& layout = m.layout[w.block];
      if (w.src.size() != layout.entry_bytes.size()) {
        return invalid_argument("parameter tier: write_blocks gives block '" + layout.name + "' " +
                                std::to_string(w.src.size()) + " sources for its " +
                                std::to_string(layout.entry_bytes.size()) + " entries");
      }
      if (std::exchange(seen[w.block], 1)) {
        return invalid_argument("parameter tier: write_blocks names block '" + layout.name + "' twice");
      }
    }
    for (; begun < writes.size() && s.ok(); ++begun) s = m.begin_write(lock, writes[begun].block);
    if (!s.ok()) --begun;  // the one that failed did not begin
  }
  if (s.ok()) s = m.home->write_blocks(writes);
  for (std::size_t k = 0; k < begun; ++k) m.end_write(writes[k].block);
  return s;
}

Status ParamTier::read(std::size_t block, std::size_t entry, void* dst, std::size_t byte_offset, std::size_t bytes) {
  {
    std::lock_guard lock(impl_->mutex);
    if (Status s = impl_->check_entry(block, entry, byte_offset, bytes); !s.ok()) return s;
  }
  return impl_->home->read(block, entry, dst, byte_offset, bytes);
}

Status ParamTier::set_order(std::vector<std::size_t> order) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  std::vector<std::size_t> position(m.blocks.size(), kNone);
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (Status s = m.check_block(order[i]); !s.ok()) return s;
    if (position[order[i]] != kNone) {
      return invalid_argument("parameter tier: block '" + m.layout[order[i]].name + "' appears twice in the order");
    }
    position[order[i]] = i;
  }
  m.order = std::move(order);
  m.position = std::move(position);
  return Status::success();
}

Result<void*> ParamTier::fetch(std::size_t block, bool backward) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mutex);
  if (Status s = m.check_block(block); !s.ok()) return s;
  Impl::BlockState& st = m.blocks[block];
  ++m.stats.fetches;
  bool hit = true;
  for (;;) {
    m.changed.wait(lock, [&] { return !st.writing; });
    if (st.state != Impl::State::absent) break;
    hit = false;
    std::size_t offset = 0;
    if (!m.make_room(m.layout[block].bytes, &offset, &lock)) return m.no_room(block);
    if (st.state != Impl::State::absent || st.writing) {
      m.give_range(offset, m.layout[block].bytes);  // another thread moved the block while this one waited
      continue;
    }
    Status error;
    if (!m.start_load(block, offset, &error)) return error;
    break;
  }
  if (hit) ++m.stats.hits;
  if (st.state == Impl::State::loading) {
    const auto t0 = std::chrono::steady_clock::now();
    m.changed.wait(lock, [&] { return st.state != Impl::State::loading; });
    m.stats.fetch_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (st.state == Impl::State::absent) return st.load_error;
  }
  if (st.ready != 0) {
    // The host waits only where it is the one that reads the block.
    const bool host_reads = m.options.host_consumer || m.device.host_memory();
    if (Status s = host_reads ? m.device.synchronize(st.ready) : m.device.wait(Stream::compute, st.ready); !s.ok()) return s;
    st.ready = 0;
  }
  if (st.released != 0) {
    // Used again before its room was given away: the earlier release orders nothing any more.
    (void)m.device.wait(Stream::compute, st.released);
    st.released = 0;
  }
  ++st.uses;
  st.last_use = ++m.clock;
  void* address = m.pool + st.pool_offset;
  const std::size_t at = m.position[block];
  if (at != kNone) {
    for (int k = 1; k <= m.options.prefetch; ++k) {
      if (backward ? at < static_cast<std::size_t>(k) : at + k >= m.order.size()) break;
      m.prefetch_locked(m.order[backward ? at - k : at + k]);
    }
  }
  return address;
}

Status ParamTier::release(std::size_t block) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  if (Status s = m.check_block(block); !s.ok()) return s;
  Impl::BlockState& st = m.blocks[block];
  if (st.uses == 0) {
    return invalid_argument("parameter tier: block '" + m.layout[block].name + "' released more often than fetched");
  }
  if (--st.uses == 0) {
    Result<EventId> e = m.device.record(Stream::compute);
    if (!e.ok()) return e.status();
    st.released = e.value();
    if (std::exchange(st.stale, false)) m.evict(block, false);
  }
  return Status::success();
}

Status ParamTier::prefetch(std::size_t block) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  if (Status s = m.check_block(block); !s.ok()) return s;
  m.prefetch_locked(block);
  return Status::success();
}

std::size_t ParamTier::entry_offset(std::size_t block, std::size_t entry) const { return impl_->layout[block].offsets[entry]; }

Status ParamTier::synchronize() {
  for (auto& loader : impl_->loaders) loader->drain();
  return impl_->device.synchronize();
}

std::size_t ParamTier::blocks() const { return impl_->layout.size(); }
std::size_t ParamTier::block_bytes(std::size_t block) const { return impl_->layout[block].bytes; }
std::size_t ParamTier::entries(std::size_t block) const { return impl_->layout[block].entry_bytes.size(); }
std::size_t ParamTier::entry_bytes(std::size_t block, std::size_t entry) const {
  return impl_->layout[block].entry_bytes[entry];
}
const std::string& ParamTier::block_name(std::size_t block) const { return impl_->layout[block].name; }
std::size_t ParamTier::in_use(std::size_t block) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->blocks[block].uses;
}

ParamTierStats ParamTier::stats() const {
  std::lock_guard lock(impl_->mutex);
  ParamTierStats s = impl_->stats;
  impl_->home->add_stats(s);
  return s;
}

std::vector<std::string> ParamTier::files() const { return impl_->home->files(); }
bool ParamTier::direct_io() const { return impl_->home->direct_io(); }

}  // namespace zoe
