// The NVMe home of a parameter tier (zoe/param_tier.h): one file per path, `<name>.zoe-params`, block b on
// path b % P. Every entry has two slots of its aligned size, one in each half of the file; a write goes to the slot that does not hold the
// valid copy and the entry flips to it only once the write completed, so a failed write (EIO, ENOSPC, a
// short transfer) leaves the valid copy as it was and the caller can retry. Every read is checked against
// the entry's CRC-32C. The file is scratch for one run (the checkpoint's fp32 masters outlive it): created
// anew, replacing one a crashed run left, preallocated so that a full path fails at set-up, and removed
// with the tier.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "aio/files.h"
#include "aio/io_engine.h"
#include "base/crc32c.h"
#include "src/nvme/swap_inventory.h"
#include "src/param/param_home.h"
#include "zoe/aligned_buffer.h"

namespace zoe {
namespace {

struct EntrySlots {
  std::uint64_t offset[2] = {0, 0};  // file offsets of the two slots
  int slot = 0;
  bool written = false;
  std::uint32_t crc = 0;  // of the entry's bytes (padding excluded)
};

class NvmeParamHome final : public ParamHomeStore {
 public:
  NvmeParamHome(const std::vector<ParamBlockLayout>& blocks, const ParamTierOptions& options, std::size_t alignment)
      : blocks_(blocks), options_(options), alignment_(alignment) {}

  ~NvmeParamHome() override {
    if (engine_) (void)engine_->wait_all();
    engine_.reset();
    for (File& f : files_) f.fd.reset();
    if (!options_.keep_files) (void)remove_files();
    // Nothing else outlives a run: the lock files go too, while still held (swap_inventory.h).
    if (!names_removed_) remove_locks();
  }

  // The names go while the files stay open: reads and writes go on, and the system frees their room when
  // the descriptors close. The destructor then removes nothing, so that a tier created since under the same
  // name keeps its files.
  Status remove_files() override {
    if (names_removed_) return Status::success();
    Status first;
    for (std::size_t k = 0; k < files_.size(); ++k) {
      Status s = folders_[k].remove(file_name());
      if (first.ok() && !s.ok()) first = s;
    }
    remove_locks();
    names_removed_ = true;
    return first;
  }

  Status open() {
    if (options_.nvme_paths.empty()) return invalid_argument("parameter tier nvme: no nvme_path given");
    for (const std::string& dir : options_.nvme_paths) {
      Result<Folder> folder = aio::open_swap_dir(dir, "parameter path");
      if (!folder.ok()) return folder.status();
      folders_.push_back(std::move(folder).value());
    }
    // Another tier's live file of the same name is never replaced under it.
    Result<std::vector<aio::FileHandle>> owned =
        aio::take_ownership(folders_, file_name(), "parameter store " + options_.name);
    if (!owned.ok()) return owned.status();
    owner_locks_ = std::move(owned).value();
    for (const Folder& folder : folders_) files_.push_back(File{folder.path_of(file_name()), {}, false, -1, 0});
    // Each file holds two halves, one slot of every entry in each, entries in block order: the valid
    // copies lie back to back while the entries flip together (every step writes every entry), so a
    // forward reads its file sequentially.
    entries_.resize(blocks_.size());
    std::size_t largest = 0;
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      File& f = files_[b % files_.size()];
      for (std::size_t e = 0; e < blocks_[b].entry_bytes.size(); ++e) {
        const std::size_t slot = round_up(blocks_[b].entry_bytes[e]);
        EntrySlots es;
        es.offset[0] = f.bytes;
        f.bytes += slot;
        entries_[b].push_back(es);
        largest = std::max(largest, slot);
      }
    }
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      for (EntrySlots& es : entries_[b]) es.offset[1] = es.offset[0] + files_[b % files_.size()].bytes;
    }
    for (File& f : files_) f.bytes *= 2;
    for (std::size_t k = 0; k < files_.size(); ++k) {
      File& f = files_[k];
      // A crashed run's scratch file: nothing in it outlives a run (a link there goes, not its target).
      (void)folders_[k].remove(file_name());
      Result<aio::OpenedFile> opened = aio::open_swap_file(folders_[k], file_name(), true, options_.fault_hook);
      if (!opened.ok()) return opened.status();
      f.fd = std::move(opened->fd);
      f.direct = opened->direct;
      const auto [offset_align, mem_align] = aio::dio_alignment(f.fd.get());
      if (std::max<std::size_t>(offset_align, mem_align) > alignment_) {
        return invalid_argument("parameter file " + f.path + " needs O_DIRECT alignment " +
                                std::to_string(std::max(offset_align, mem_align)) + " > " +
                                std::to_string(alignment_) + " bytes; set the alignment option to it");
      }
      if (Status s = aio::allocate_file(f.fd.get(), f.path, f.bytes, options_.fault_hook); !s.ok()) return s;
    }
    aio::EngineOptions eo;
    eo.queue_depth = static_cast<unsigned>(std::max(1, options_.queue_depth));
    eo.request_bytes = std::max(alignment_, options_.request_bytes / alignment_ * alignment_);
    eo.alignment = alignment_;
    eo.fault_hook = options_.fault_hook;
    Result<std::unique_ptr<aio::IoEngine>> engine = aio::IoEngine::create(eo);
    if (!engine.ok()) return engine.status();
    engine_ = std::move(engine.value());
    for (File& f : files_) f.engine_file = engine_->add_file(f.fd.get(), f.path);
    Result<AlignedBuffer> bounce = AlignedBuffer::allocate_for_io(std::max(largest, alignment_), alignment_);
    if (!bounce.ok()) return bounce.status();
    bounce_ = std::move(bounce.value());
    return Status::success();
  }

  Status write(std::size_t block, std::size_t entry, const void* src, std::size_t offset, std::size_t bytes) override {
    std::lock_guard lock(mutex_);
    EntrySlots& es = entries_[block][entry];
    const std::size_t n = blocks_[block].entry_bytes[entry];
    const std::size_t slot = round_up(n);
    if (offset != 0 || bytes != n) {
      // A part of the entry: the rest comes from the valid copy (zeros if there is none yet).
      if (es.written) {
        if (Status s = read_slot(block, entry, bounce_.data()); !s.ok()) return s;
      } else {
        std::memset(bounce_.data(), 0, slot);
      }
    }
    std::memcpy(bounce_.as<unsigned char>() + offset, src, bytes);
    if (slot > n) std::memset(bounce_.as<unsigned char>() + n, 0, slot - n);
    const int target = es.written ? 1 - es.slot : 0;
    const File& f = files_[block % files_.size()];
    Status s = transfer(IoOp::write, f, es.offset[target], bounce_.data(), slot);
    if (!s.ok()) return located(s, IoOp::write, block, entry, f, es.offset[target]);
    es.crc = crc32c(bounce_.data(), n);
    es.slot = target;
    es.written = true;
    return Status::success();
  }

  // A block's entries in flight together from one bounce, the next block's from the other behind them;
  // each entry flips to its new slot once its own write completed.
  Status write_blocks(const std::vector<ParamBlockWrite>& writes) override {
    std::lock_guard lock(mutex_);
    std::size_t largest = alignment_;
    for (const ParamBlockWrite& w : writes) largest = std::max(largest, blocks_[w.block].bytes);
    for (AlignedBuffer& b : block_bounce_) {
      if (b.size() >= largest) continue;
      Result<AlignedBuffer> grown = AlignedBuffer::allocate_for_io(largest, alignment_);
      if (!grown.ok()) return grown.status();
      b = std::move(grown.value());
    }
    std::vector<Pending> in_flight[2];
    Status first;
    for (std::size_t k = 0; k < writes.size(); ++k) {
      finish_writes(in_flight[k % 2], first);
      if (!first.ok()) break;  // what is not submitted keeps its previous copy
      submit_writes(writes[k], block_bounce_[k % 2].as<unsigned char>(), in_flight[k % 2], first);
    }
    for (std::vector<Pending>& p : in_flight) finish_writes(p, first);
    return first;
  }

  std::size_t entry_bytes(std::size_t block, std::size_t entry) const override {
    return blocks_[block].entry_bytes[entry];
  }

  Status read(std::size_t block, std::size_t entry, void* dst, std::size_t offset, std::size_t bytes) override {
    std::lock_guard lock(mutex_);
    if (Status s = read_slot(block, entry, bounce_.data()); !s.ok()) return s;
    std::memcpy(dst, bounce_.as<unsigned char>() + offset, bytes);
    return Status::success();
  }

  const void* block_memory(std::size_t) override { return nullptr; }

  // Without the mutex, so that loads of several blocks overlap: the tier never reads a block while it
  // writes that block, and the engine takes requests from any thread.
  Status read_block(std::size_t block, void* dst) override {
    const ParamBlockLayout& layout = blocks_[block];
    const File& f = files_[block % files_.size()];
    // Every entry's request in flight at once, then each checked. The engine serves jobs in the order
    // they came: a block's entries go in together, so that the block completes ahead of the one another
    // loader queues next, not along with it (its small entries behind that block's large one).
    std::vector<aio::IoEngine::Ticket> tickets;
    Status first;
    std::unique_lock submitting(submit_mutex_);
    for (std::size_t e = 0; e < layout.entry_bytes.size(); ++e) {
      const EntrySlots& es = entries_[block][e];
      if (!es.written) {
        first = invalid_argument(describe_entry(layout, block, e) + " was never written to the parameter tier");
        break;
      }
      auto* at = static_cast<unsigned char*>(dst) + layout.offsets[e];
      Result<aio::IoEngine::Ticket> t =
          engine_->submit(IoOp::read, f.engine_file, es.offset[es.slot], at, round_up(layout.entry_bytes[e]));
      if (!t.ok()) {
        first = located(t.status(), IoOp::read, block, e, f, es.offset[es.slot]);
        break;
      }
      tickets.push_back(t.value());
    }
    submitting.unlock();
    for (std::size_t e = 0; e < tickets.size(); ++e) {
      const EntrySlots& es = entries_[block][e];
      Status s = engine_->wait(tickets[e]);
      if (!s.ok() && first.ok()) first = located(s, IoOp::read, block, e, f, es.offset[es.slot]);
      if (s.ok() && first.ok()) first = verify(block, e, static_cast<unsigned char*>(dst) + layout.offsets[e]);
    }
    return first;
  }

  void add_stats(ParamTierStats& st) const override {
    const aio::EngineCounters c = engine_->counters();
    st.read_bytes = c.read_bytes;
    st.write_bytes = c.write_bytes;
    st.read_busy_s = c.read_busy_s;
    st.write_busy_s = c.write_busy_s;
  }
  std::vector<std::string> files() const override {
    std::vector<std::string> out;
    for (const File& f : files_) out.push_back(f.path);
    return out;
  }
  bool direct_io() const override {
    return std::all_of(files_.begin(), files_.end(), [](const File& f) { return f.direct; });
  }

 private:
  std::string file_name() const { return options_.name + ".zoe-params"; }
  void remove_locks() {
    for (std::size_t k = 0; k < owner_locks_.size(); ++k) (void)folders_[k].remove(aio::owner_lock_name(file_name()));
  }

  struct File {
    std::string path;  // for messages: the file is reached through its folder's descriptor
    aio::FileHandle fd;
    bool direct = false;
    int engine_file = -1;
    std::uint64_t bytes = 0;
  };

  std::size_t round_up(std::size_t n) const { return (n + alignment_ - 1) / alignment_ * alignment_; }

  struct Pending {  // an entry's write in flight, from its place in a block bounce
    std::size_t block, entry;
    int target;
    const unsigned char* data;
    aio::IoEngine::Ticket ticket;
  };

  void submit_writes(const ParamBlockWrite& w, unsigned char* bounce, std::vector<Pending>& out, Status& first) {
    const ParamBlockLayout& layout = blocks_[w.block];
    const File& f = files_[w.block % files_.size()];
    for (std::size_t e = 0; e < w.src.size(); ++e) {
      if (w.src[e] == nullptr) continue;
      const EntrySlots& es = entries_[w.block][e];
      const std::size_t n = layout.entry_bytes[e], slot = round_up(n);
      unsigned char* at = bounce + layout.offsets[e];
      std::memcpy(at, w.src[e], n);
      if (slot > n) std::memset(at + n, 0, slot - n);
      const int target = es.written ? 1 - es.slot : 0;
      Result<aio::IoEngine::Ticket> t = engine_->submit(IoOp::write, f.engine_file, es.offset[target], at, slot);
      if (!t.ok()) {
        first = located(t.status(), IoOp::write, w.block, e, f, es.offset[target]);
        return;
      }
      out.push_back({w.block, e, target, at, t.value()});
    }
  }

  void finish_writes(std::vector<Pending>& pending, Status& first) {
    for (const Pending& p : pending) {
      EntrySlots& es = entries_[p.block][p.entry];
      Status s = engine_->wait(p.ticket);
      if (!s.ok()) {
        if (first.ok()) first = located(s, IoOp::write, p.block, p.entry, files_[p.block % files_.size()], es.offset[p.target]);
        continue;
      }
      es.crc = crc32c(p.data, blocks_[p.block].entry_bytes[p.entry]);
      es.slot = p.target;
      es.written = true;
    }
    pending.clear();
  }

  Status transfer(IoOp op, const File& f, std::uint64_t offset, void* buffer, std::size_t bytes) {
    Result<aio::IoEngine::Ticket> t = engine_->submit(op, f.engine_file, offset, buffer, bytes);
    if (!t.ok()) return t.status();
    return engine_->wait(t.value());
  }

  Status read_slot(std::size_t block, std::size_t entry, void* dst) {
    const EntrySlots& es = entries_[block][entry];
    if (!es.written) {
      return invalid_argument(describe_entry(blocks_[block], block, entry) + " was never written to the parameter tier");
    }
    const File& f = files_[block % files_.size()];
    Status s = transfer(IoOp::read, f, es.offset[es.slot], dst, round_up(blocks_[block].entry_bytes[entry]));
    if (!s.ok()) return located(s, IoOp::read, block, entry, f, es.offset[es.slot]);
    return verify(block, entry, dst);
  }

  Status verify(std::size_t block, std::size_t entry, const void* data) const {
    const EntrySlots& es = entries_[block][entry];
    const std::uint32_t crc = crc32c(data, blocks_[block].entry_bytes[entry]);
    if (crc == es.crc) return Status::success();
    const File& f = files_[block % files_.size()];
    return Status(StatusCode::corrupt, describe_entry(blocks_[block], block, entry) + ": the copy in " + f.path +
                                           " at offset " + std::to_string(es.offset[es.slot]) +
                                           " fails its CRC-32C (the file was changed under the run, or the disk "
                                           "returned wrong data); the copy was not used");
  }

  // A failed transfer, named: which entry, file and offset; a write also says that nothing was lost.
  Status located(const Status& s, IoOp op, std::size_t block, std::size_t entry, const File& f,
                 std::uint64_t offset) const {
    const bool write = op == IoOp::write;
    return Status(s.code(), std::string(write ? "writing " : "reading ") + describe_entry(blocks_[block], block, entry) +
                                " in " + f.path + " at offset " + std::to_string(offset) + ": " + s.message() +
                                (write ? " (the entry keeps its previous copy; retry once the fault is cleared)" : ""),
                  s.sys_errno());
  }

  std::vector<ParamBlockLayout> blocks_;
  ParamTierOptions options_;
  std::size_t alignment_;
  std::vector<Folder> folders_;  // each nvme path, opened once (aio::open_swap_dir)
  std::vector<aio::FileHandle> owner_locks_;
  bool names_removed_ = false;  // remove_files() ran: the names may be another tier's now
  std::vector<File> files_;
  std::vector<std::vector<EntrySlots>> entries_;
  std::unique_ptr<aio::IoEngine> engine_;
  AlignedBuffer bounce_;           // one entry, for writes and single-entry reads
  AlignedBuffer block_bounce_[2];  // write_blocks(): two blocks, one in flight while the next is filled
  std::mutex mutex_;               // write(), write_blocks() and read() one at a time: the bounces
  std::mutex submit_mutex_;        // read_block(): one block's requests queued at a time
};

}  // namespace

// What open() and write_blocks() take: under path k, two slots of every entry of the blocks b with
// b % paths == k; in RAM the entry bounce and write_blocks()'s two block bounces.
Result<SpaceNeed> nvme_param_home_footprint(const std::vector<ParamBlockLayout>& blocks, const ParamTierOptions& options,
                                            std::size_t alignment) {
  SpaceNeed need;
  const std::size_t paths = options.nvme_paths.size();
  if (paths == 0) return need;  // open() refuses it, saying so
  std::vector<std::uint64_t> half(paths, 0);
  std::size_t largest_slot = alignment, largest_block = alignment;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    for (std::size_t n : blocks[b].entry_bytes) {
      const std::size_t slot = (n + alignment - 1) / alignment * alignment;
      half[b % paths] += slot;
      largest_slot = std::max(largest_slot, slot);
    }
    largest_block = std::max(largest_block, blocks[b].bytes);
  }
  const std::string name = options.name + ".zoe-params";
  for (std::size_t k = 0; k < paths; ++k) need.add_disk(options.nvme_paths[k], 2 * half[k], {name});
  need.add_ram("NVMe bounce buffers", AlignedBuffer::io_size(largest_slot, alignment) +
                                          2 * AlignedBuffer::io_size(largest_block, alignment));
  return need;
}

Result<std::unique_ptr<ParamHomeStore>> make_nvme_param_home(const std::vector<ParamBlockLayout>& blocks,
                                                             const ParamTierOptions& options, std::size_t alignment) {
  auto home = std::make_unique<NvmeParamHome>(blocks, options, alignment);
  if (Status s = home->open(); !s.ok()) {
    (void)home->remove_files();  // keep_files keeps a tier's files, not a failed creation's
    return s;
  }
  return std::unique_ptr<ParamHomeStore>(std::move(home));
}

}  // namespace zoe
