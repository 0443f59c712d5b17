// The swap store: files, manifest, the tile table's place in them (its file: swap_table.cpp), and the calls
// other than step (swap_step.cpp).
//
// Why this layout:
//  - One data file per path, holding p, m and v of each of its tiles side by side ([p | m | v] per slot):
//    a tile is one contiguous transfer per direction, and its bytes travel together.
//  - Two slots per tile (ping-pong) rather than in-place writes: a failed or torn write can only damage the
//    slot that is not the valid copy; the valid copy changes only when the tile table flips, after the
//    write completed (and was fdatasync'ed before the table is persisted). The price is twice the disk space.
//  - The tile table (step, slot, CRC-32C per tile) is a small binary file replaced atomically after each
//    call; the manifest (JSON) changes only at creation, so a bad table never hides the layout.
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>

#include "base/warning.h"
#include "src/nvme/swap_impl.h"
#include "src/nvme/swap_inventory.h"

namespace zoe {
namespace {

std::string data_file_name(const std::string& name) { return name + ".zoe-swap"; }

std::string canonical(const std::string& path) {
  std::error_code ec;
  const auto c = std::filesystem::weakly_canonical(path, ec);
  return ec ? path : c.string();
}

Status validate_shape(const SwapOptions& o, const std::string& name, std::size_t n, std::size_t tile) {
  if (o.paths.empty()) return invalid_argument("no swap path: give nvme_path one folder or more");
  if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') {
    return invalid_argument("store name '" + name + "' is invalid: use a plain file name such as rank0");
  }
  if (n == 0) return invalid_argument("n = 0: a swap store holds at least one element");
  if (o.buffer_count < 2) {
    return invalid_argument("buffer_count = " + std::to_string(o.buffer_count) +
                            ": the pipeline needs at least 2 (one tile in Adam while another is in I/O)");
  }
  if (o.queue_depth < 1) return invalid_argument("queue_depth = " + std::to_string(o.queue_depth) + ": need at least 1");
  if (tile == 0) return invalid_argument("tile = 0 elements: need a positive multiple of 1024");
  return Status::success();
}

}  // namespace

SwapOptions SwapOptions::from(const NvmeOptions& nvme) {
  SwapOptions o;
  o.paths = nvme.paths;
  o.buffer_count = nvme.buffer_count;
  o.block_size = nvme.block_size;
  o.queue_depth = nvme.queue_depth;
  o.alignment = nvme.alignment;
  o.durability = nvme.durability == Durability::step ? SwapDurability::next_call : SwapDurability::on_flush;
  o.keep_resident = nvme.keep_resident;
  o.fault_hook = nvme.fault_hook;
  return o;
}

std::string SwapStore::Impl::table_name() const { return name + ".zoe-swap.table"; }
std::string SwapStore::Impl::manifest_name() const { return name + ".zoe-swap.json"; }
std::string SwapStore::Impl::table_path() const { return folders[0].path_of(table_name()); }
std::string SwapStore::Impl::manifest_path(std::size_t k) const { return folders[k].path_of(manifest_name()); }

std::string SwapStore::Impl::unwritten(std::size_t t) const {
  if (!reopened) return tile_name(t) + " was never written: call initialize() first";
  return tile_name(t) + " holds no durable state: the run that wrote this store ended before its tile table named "
         "any (durability on_flush — zoe's durability=\"checkpoint\" — records it only at a flush or save, and the "
         "process was killed before the first): restore from a checkpoint";
}

std::string SwapStore::Impl::tile_name(std::size_t t) const {
  return "tile " + std::to_string(t) + " (elements [" + std::to_string(tile_begin(t)) + ", " +
         std::to_string(tile_begin(t) + tile_count(t)) + ")) in " + files[t % files.size()].data_path;
}

Status SwapStore::Impl::check_file_sizes() {
  for (const PathFile& f : files) {
    struct stat st{};
    if (::fstat(f.fd.get(), &st) != 0) return sys_error("cannot stat swap file", f.data_path, errno);
    if (static_cast<std::uint64_t>(st.st_size) != f.bytes) {
      return Status(StatusCode::corrupt, "swap file " + f.data_path + " is " + std::to_string(st.st_size) +
                                             " bytes, expected " + std::to_string(f.bytes) +
                                             ": it was truncated or replaced; the store refuses it (restore from a checkpoint)");
    }
  }
  return Status::success();
}

Status SwapStore::Impl::ready_for_io() {
  if (Status s = check_file_sizes(); !s.ok()) return s;
  // A table that failed to persist points at slots the next write would reuse: persist it first (or, with
  // a background update in flight, settle() does before the first write).
  if (table_dirty && !persisting.valid()) {
    if (Status s = persist_table(); !s.ok()) {
      return Status(s.code(), "the tile table could not be saved, so no tile may be rewritten yet: " + s.message(), s.sys_errno());
    }
  }
  return Status::success();
}

std::string SwapStore::Impl::describe() const {
  std::string out;
  std::size_t first = 0;
  for (std::size_t t = 1; t <= ntiles; ++t) {
    if (t == ntiles || table[t].step != table[first].step) {
      if (!out.empty()) out += "; ";
      const std::size_t end = std::min(n, tile_begin(t));
      out += "tiles [" + std::to_string(first) + ", " + std::to_string(t) + ") (elements [" +
             std::to_string(tile_begin(first)) + ", " + std::to_string(end) + ")) at step " +
             (table[first].step < 0 ? std::string("none (never written)") : std::to_string(table[first].step));
      first = t;
    }
  }
  return out;
}

Status SwapStore::Impl::with_state(Status s) const {
  if (s.ok()) return s;
  return Status(s.code(), s.message() + " -- valid state now: " + describe(), s.sys_errno());
}

Status SwapStore::Impl::setup_runtime() {
  aio::EngineOptions eo;
  eo.queue_depth = static_cast<unsigned>(options.queue_depth);
  eo.request_bytes = options.block_size;
  eo.alignment = alignment;
  eo.fault_hook = options.fault_hook;
  if (options.block_size == 0 || options.block_size % alignment != 0) {
    return invalid_argument("block_size = " + std::to_string(options.block_size) + " is not a positive multiple of the " +
                            std::to_string(alignment) + "-byte alignment");
  }
  Result<std::unique_ptr<aio::IoEngine>> e = aio::IoEngine::create(eo);
  if (!e.ok()) return e.status();
  engine = std::move(e).value();
  for (PathFile& f : files) f.engine_file = engine->add_file(f.fd.get(), f.data_path);
  for (int b = 0; b < options.buffer_count; ++b) {
    Result<AlignedBuffer> buf = AlignedBuffer::allocate_for_io(slot_bytes, std::max<std::size_t>(alignment, 4096));
    if (!buf.ok()) return buf.status();
    buffers.push_back(std::move(buf).value());
  }
  resident.assign(ntiles, 0);
  adam = options.adam;
  if (adam == nullptr) {
    Result<CpuAdam> a = CpuAdam::create(options.cpu);
    if (!a.ok()) return a.status();
    own_adam = std::make_unique<CpuAdam>(std::move(a).value());
    adam = own_adam.get();
  }
  std::vector<std::string> buffered;
  for (const PathFile& f : files) {
    if (!f.direct) buffered.push_back(f.dir);
  }
  if (!buffered.empty()) {
    std::string list;
    for (const auto& p : buffered) list += (list.empty() ? "" : ", ") + p;
    warn("swap path " + list + " refuses O_DIRECT (filesystem without direct I/O, e.g. tmpfs/ramfs/overlayfs): "
         "using buffered I/O through the page cache, which is slower and uses RAM; put nvme_path on a local "
         "NVMe filesystem (ext4, xfs)");
  }
  return Status::success();
}

namespace {

// Fills the parts of Impl that depend only on the options and the shape; checks the paths.
Result<std::unique_ptr<SwapStore::Impl>> make_impl(const SwapOptions& options, const std::string& name, std::size_t n,
                                                   std::size_t tile) {
  if (Status s = validate_shape(options, name, n, tile); !s.ok()) return s;
  if (options.state_dtype != DType::f32 && options.state_dtype != DType::bf16 && options.state_dtype != DType::i8) {
    return invalid_argument("swap store " + name + ": state_dtype " + std::string(dtype_name(options.state_dtype)) +
                            " is not a moment dtype (f32, bf16 or i8)");
  }
  const bool q8 = options.state_dtype == DType::i8;
  if (options.state_arrays < 1 || options.state_arrays > 3) {
    return invalid_argument("swap store " + name + ": state_arrays = " + std::to_string(options.state_arrays) +
                            " is invalid: need 1 (Lion, Adagrad), 2 (Adam) or 3 (Adam with amsgrad)");
  }
  if (q8 && options.state_arrays > 2) {
    return invalid_argument("swap store " + name + ": state_dtype i8 keeps Adam's two moments or Lion's one, not "
                            "amsgrad's third; state_arrays is " + std::to_string(options.state_arrays));
  }
  if (q8 && tile % kMomentBlock != 0) {
    return invalid_argument("swap store " + name + ": tile = " + std::to_string(tile) + " elements is not a multiple of " +
                            std::to_string(kMomentBlock) + ", the block of i8 moments (a block must lie in one tile)");
  }
  auto impl = std::make_unique<SwapStore::Impl>();
  impl->options = options;
  impl->moment_bytes = dtype_size(options.state_dtype);
  impl->state_arrays = options.state_arrays;
  impl->scale_count = q8 ? tile / kMomentBlock : 0;
  impl->name = name;
  impl->n = n;
  impl->tile = tile;
  impl->ntiles = (n + tile - 1) / tile;
  impl->alignment = options.alignment == 0 ? 4096 : options.alignment;
  impl->paths = options.paths;
  std::set<std::string> seen;
  const std::size_t P = options.paths.size();
  for (std::size_t k = 0; k < P; ++k) {
    const std::string& dir = options.paths[k];
    Result<Folder> folder = aio::open_swap_dir(dir, "swap path");
    if (!folder.ok()) return folder.status();
    if (!seen.insert(canonical(dir)).second) {
      return invalid_argument("swap path " + dir + " is listed twice: each path gets its own share of the tiles");
    }
    SwapStore::Impl::PathFile f;
    f.dir = dir;
    f.data_name = data_file_name(name);
    f.data_path = folder->path_of(f.data_name);
    impl->folders.push_back(std::move(folder).value());
    f.tiles_here = impl->ntiles > k ? (impl->ntiles - k + P - 1) / P : 0;
    impl->files.push_back(std::move(f));
  }
  return impl;
}

// Makes this store the one owner of its files (swap_inventory.h) before anything of them is read or
// written, and clears what a crashed owner left behind.
Status own(SwapStore::Impl& impl) {
  Result<std::vector<aio::FileHandle>> locks =
      aio::take_ownership(impl.folders, impl.name + ".zoe-swap", "swap store " + impl.name);
  if (!locks.ok()) return locks.status();
  impl.owner_locks = std::move(locks).value();
  for (const Folder& folder : impl.folders) aio::remove_stale_temps(folder, impl.name);
  return Status::success();
}

// A create() or open() that fails leaves no lock file where no store is: removed while still held (an
// opener that waited for it then sees it gone and starts again).
struct UnusedLocks {
  SwapStore::Impl& impl;
  ~UnusedLocks() {
    for (std::size_t k = 0; k < impl.owner_locks.size() && k < impl.folders.size(); ++k) {
      if (!impl.folders[k].exists(impl.manifest_name())) {
        (void)impl.folders[k].remove(aio::owner_lock_name(impl.name + ".zoe-swap"));
      }
    }
  }
};

// The alignment every path's O_DIRECT asks for, checked against the tile.
Status settle_alignment(SwapStore::Impl& impl) {
  for (const auto& f : impl.files) {
    const auto [offset_align, mem_align] = aio::dio_alignment(f.fd.get());
    impl.alignment = std::max<std::size_t>({impl.alignment, offset_align, mem_align});
  }
  if ((impl.alignment & (impl.alignment - 1)) != 0) {
    return invalid_argument("alignment = " + std::to_string(impl.alignment) + " is not a power of two");
  }
  if (impl.tile * 4 % impl.alignment != 0) {
    return invalid_argument("tile = " + std::to_string(impl.tile) + " elements is not a multiple of " +
                            std::to_string(impl.alignment / 4) + " (its " + std::to_string(impl.tile * 4) +
                            " bytes per array must be a multiple of the " + std::to_string(impl.alignment) +
                            "-byte O_DIRECT block)");
  }
  impl.tile_bytes = impl.tile * 4;
  impl.slot_bytes = (impl.slot_payload() + impl.alignment - 1) / impl.alignment * impl.alignment;
  for (auto& f : impl.files) f.bytes = 2ull * f.tiles_here * impl.slot_bytes;
  return Status::success();
}

// Manifest fields read with their types checked: json::value() throws on a wrong type (an exception out of
// open()) and converts an out-of-range float to an integer with undefined behaviour. nullopt when the field
// is missing or of another type; the writer stores every count as a non-negative JSON integer.
std::optional<std::uint64_t> manifest_count(const nlohmann::json& m, const char* key) {
  const auto it = m.find(key);
  if (it == m.end() || !it->is_number_unsigned()) return std::nullopt;
  return it->get<std::uint64_t>();
}

std::optional<std::vector<std::string>> manifest_strings(const nlohmann::json& m, const char* key) {
  const auto it = m.find(key);
  if (it == m.end() || !it->is_array()) return std::nullopt;
  std::vector<std::string> out;
  for (const nlohmann::json& e : *it) {
    if (!e.is_string()) return std::nullopt;
    out.push_back(e.get<std::string>());
  }
  return out;
}

std::string shown(const std::optional<std::uint64_t>& v) { return v ? std::to_string(*v) : "(missing or not a count)"; }

nlohmann::json manifest_json(const SwapStore::Impl& impl, std::size_t k) {
  nlohmann::json paths = nlohmann::json::array();
  for (const auto& f : impl.files) paths.push_back(canonical(f.dir));
  return {{"format", "zoe-swap"},
          {"version", kSwapFormatVersion},
          {"name", impl.name},
          {"n", impl.n},
          {"tile", impl.tile},
          {"state_dtype", std::string(dtype_name(impl.options.state_dtype))},
          {"state_arrays", impl.state_arrays},
          {"tiles", impl.ntiles},
          {"paths", paths},
          {"path_index", k},
          {"data_file", data_file_name(impl.name)},
          {"owner", aio::owner_record()},
          {"file_bytes", impl.files[k].bytes},
          {"slot_bytes", impl.slot_bytes},
          {"layout", "tile t on path t % len(paths); slot s of a tile at s * file_bytes / 2 + (t / len(paths)) * slot_bytes; "
                     "a slot is [p | m | v | vmax] (v with state_arrays 2 or 3, vmax with 3), tile elements each, p fp32 and m, v in state_dtype (i8: then [m scales | v scales], "
                     "one fp32 per 2048 elements), padded to the O_DIRECT alignment; the valid slot, step and CRC-32C per tile are in "
                     "<name>.zoe-swap.table under paths[0]"}};
}

}  // namespace

Result<SwapStore> SwapStore::create(const SwapOptions& options, const std::string& name, std::size_t n, std::size_t tile) {
  Result<std::unique_ptr<Impl>> made = make_impl(options, name, n, tile);
  if (!made.ok()) return made.status();
  Impl& impl = **made;
  if (Status s = own(impl); !s.ok()) return s;
  UnusedLocks unused{impl};
  for (std::size_t k = 0; k < impl.files.size(); ++k) {
    if (impl.folders[k].exists(impl.manifest_name())) {
      return invalid_argument("a swap store named " + name + " already exists in " + impl.files[k].dir +
                              ": open it, or remove it first");
    }
  }
  // Sizes are known only with the alignment, which needs an open file; a first pass at 4 KiB-alignment
  // sizes checks free space before anything is written.
  impl.tile_bytes = impl.tile * 4;
  impl.slot_bytes = (impl.slot_payload() + 4095) / 4096 * 4096;
  for (auto& f : impl.files) {
    const std::uint64_t need = 2ull * f.tiles_here * impl.slot_bytes;
    Result<aio::FsInfo> fs = aio::fs_info(f.dir);
    // ramfs reports no size at all (0 blocks): nothing to compare with there.
    if (fs.ok() && fs->total_bytes > 0 && fs->free_bytes < need) {
      return Status(StatusCode::io_error, "no space for swap file " + f.data_path + ": it needs " + aio::format_bytes(need) +
                                              ", " + aio::format_bytes(fs->free_bytes) + " are free there",
                    ENOSPC);
    }
  }
  auto cleanup = [&impl] {
    for (std::size_t k = 0; k < impl.files.size(); ++k) {
      if (impl.files[k].fd.valid()) {
        impl.files[k].fd.reset();
        (void)impl.folders[k].remove(impl.files[k].data_name);
      }
    }
  };
  for (std::size_t k = 0; k < impl.files.size(); ++k) {
    auto& f = impl.files[k];
    // No manifest: whatever is there is an unfinished creation (removed, never followed: a link goes, not
    // what it points to).
    (void)impl.folders[k].remove(f.data_name);
    Result<aio::OpenedFile> opened = aio::open_swap_file(impl.folders[k], f.data_name, true, options.fault_hook);
    if (!opened.ok()) {
      cleanup();
      return opened.status();
    }
    f.fd = std::move(opened->fd);
    f.direct = opened->direct;
  }
  if (Status s = settle_alignment(impl); !s.ok()) {
    cleanup();
    return s;
  }
  for (auto& f : impl.files) {
    if (Status s = aio::allocate_file(f.fd.get(), f.data_path, f.bytes, options.fault_hook); !s.ok()) {
      cleanup();
      return s;
    }
  }
  impl.table.assign(impl.ntiles, {});
  Status s = impl.create_table();
  // The manifests go last: a store is recognised only once everything it describes exists.
  for (std::size_t k = 0; s.ok() && k < impl.files.size(); ++k) {
    s = replace_file(impl.folders[k], impl.manifest_name(), manifest_json(impl, k).dump(2) + "\n");
  }
  if (s.ok()) s = impl.setup_runtime();
  if (!s.ok()) {
    cleanup();
    (void)impl.folders[0].remove(impl.table_name());
    for (const Folder& folder : impl.folders) (void)folder.remove(impl.manifest_name());
    return s;
  }
  return SwapStore(std::move(made).value());
}

Result<SpaceNeed> SwapStore::footprint(const SwapOptions& options, const std::string& name, std::size_t n,
                                       std::size_t tile) {
  Result<std::unique_ptr<Impl>> made = make_impl(options, name, n, tile);
  if (!made.ok()) return made.status();
  Impl& impl = **made;
  // The sizes create() and setup_runtime() give them, at the alignment asked for (settle_alignment).
  impl.tile_bytes = impl.tile * 4;
  impl.slot_bytes = (impl.slot_payload() + impl.alignment - 1) / impl.alignment * impl.alignment;
  SpaceNeed need;
  const std::size_t buffer = AlignedBuffer::io_size(impl.slot_bytes, std::max<std::size_t>(impl.alignment, 4096));
  need.add_ram("swap store buffers", static_cast<std::uint64_t>(std::max(options.buffer_count, 0)) * buffer);
  for (std::size_t k = 0; k < impl.files.size(); ++k) {
    const SwapStore::Impl::PathFile& f = impl.files[k];
    std::uint64_t bytes = 2ull * f.tiles_here * impl.slot_bytes;
    std::vector<std::string> replaces = {f.data_name};
    if (k == 0) {
      bytes += 2 * impl.table_region_bytes();
      replaces.push_back(impl.table_name());
    }
    need.add_disk(f.dir, bytes, std::move(replaces));
  }
  return need;
}

Result<SwapStore> SwapStore::open(const SwapOptions& options, const std::string& name, std::size_t n, std::size_t tile) {
  Result<std::unique_ptr<Impl>> made = make_impl(options, name, n, tile);
  if (!made.ok()) return made.status();
  Impl& impl = **made;
  if (Status s = own(impl); !s.ok()) return s;
  UnusedLocks unused{impl};
  const std::size_t P = impl.files.size();
  for (std::size_t k = 0; k < P; ++k) {
    const std::string path = impl.manifest_path(k);
    Result<std::string> text = impl.folders[k].read(impl.manifest_name());
    if (!text.ok()) {
      return Status(StatusCode::invalid_argument, "no swap store named " + name + " in " + impl.files[k].dir + " (" +
                                                      path + " is missing): create it, or fix nvme_path", ENOENT);
    }
    nlohmann::json m = nlohmann::json::parse(text.value(), nullptr, false);
    if (m.is_discarded() || !m.is_object() || !m.contains("format") || m.at("format") != "zoe-swap") {
      return Status(StatusCode::corrupt, "manifest " + path + " is not a zoe swap manifest (not JSON, or no format field)");
    }
    auto differs = [&](const std::string& what, const std::string& stored, const std::string& asked) {
      return Status(StatusCode::invalid_argument, "swap store " + path + " was written with " + what + " = " + stored +
                                                      ", this run asks for " + asked +
                                                      ": use the same settings, or remove the store to start afresh");
    };
    const std::optional<std::uint64_t> version = manifest_count(m, "version");
    if (version != std::uint64_t{kSwapFormatVersion}) {
      return differs("format version", shown(version), std::to_string(kSwapFormatVersion) + " (this build's)");
    }
    if (const auto stored = manifest_count(m, "n"); stored != n) return differs("n", shown(stored), std::to_string(n));
    if (const auto stored = manifest_count(m, "tile"); stored != tile) {
      return differs("tile", shown(stored), std::to_string(tile));
    }
    // Stores written before the field existed hold f32 moments.
    const std::string stored_state = m.contains("state_dtype") && m.at("state_dtype").is_string()
                                         ? m.at("state_dtype").get<std::string>() : "f32";
    if (const std::string asked(dtype_name(options.state_dtype)); stored_state != asked) {
      return differs("state_dtype", stored_state, asked);
    }
    // Stores written before the field existed hold Adam's two moments.
    const std::optional<std::uint64_t> stored_arrays = m.contains("state_arrays") ? manifest_count(m, "state_arrays")
                                                                                   : std::optional<std::uint64_t>(2);
    if (stored_arrays != std::uint64_t{options.state_arrays}) {
      return differs("state_arrays", shown(stored_arrays), std::to_string(options.state_arrays));
    }
    const std::optional<std::vector<std::string>> stored_paths = manifest_strings(m, "paths");
    std::vector<std::string> asked_paths;
    for (const auto& f : impl.files) asked_paths.push_back(canonical(f.dir));
    if (stored_paths != asked_paths || manifest_count(m, "path_index") != k) {
      return differs("paths", stored_paths ? nlohmann::json(*stored_paths).dump() : "(missing or not a list of strings)",
                     nlohmann::json(asked_paths).dump());
    }
  }
  for (std::size_t k = 0; k < P; ++k) {
    auto& f = impl.files[k];
    Result<aio::OpenedFile> opened = aio::open_swap_file(impl.folders[k], f.data_name, false, options.fault_hook);
    if (!opened.ok()) return opened.status();
    f.fd = std::move(opened->fd);
    f.direct = opened->direct;
  }
  if (Status s = settle_alignment(impl); !s.ok()) return s;
  if (Status s = impl.check_file_sizes(); !s.ok()) return s;
  if (Status s = impl.load_table(); !s.ok()) return s;
  if (Status s = impl.setup_runtime(); !s.ok()) return s;
  impl.reopened = true;
  // The owner record names this run now (zoe probe reports it). Best effort: the layout it rewrites is the
  // one just checked, and the store's lock already says it is in use.
  for (std::size_t k = 0; k < P; ++k) {
    (void)replace_file(impl.folders[k], impl.manifest_name(), manifest_json(impl, k).dump(2) + "\n");
  }
  return SwapStore(std::move(made).value());
}

Result<SwapStore> SwapStore::open_or_create(const SwapOptions& options, const std::string& name, std::size_t n,
                                            std::size_t tile) {
  if (!options.paths.empty() && ::access((options.paths[0] + "/" + name + ".zoe-swap.json").c_str(), F_OK) == 0) {
    return open(options, name, n, tile);
  }
  return create(options, name, n, tile);
}

Status SwapStore::remove(const SwapOptions& options, const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos) return invalid_argument("store name '" + name + "' is invalid");
  // Removing follows no link and opens nothing for writing, so a folder others can write is no danger here
  // (and its stores can still be cleaned up).
  std::vector<Folder> folders;
  for (const std::string& dir : options.paths) {
    if (Status s = aio::check_swap_dir(dir); !s.ok()) return s;
    Result<Folder> folder = Folder::open(dir);
    if (!folder.ok()) return folder.status();
    folders.push_back(std::move(folder).value());
  }
  // Never a store another SwapStore holds: its owner would go on with deleted files.
  Result<std::vector<aio::FileHandle>> owned = aio::take_ownership(folders, name + ".zoe-swap", "swap store " + name);
  if (!owned.ok()) return owned.status();
  for (const Folder& folder : folders) {
    // Manifest first: a store half removed is then no longer recognised as a store. The lock file last,
    // while it is held: an opener waiting for it sees it removed and starts again.
    for (const char* suffix : {".zoe-swap.json", ".zoe-swap.table", ".zoe-swap"}) {
      if (Status s = folder.remove(name + suffix); !s.ok()) return s;
    }
    aio::remove_stale_temps(folder, name);
    (void)folder.remove(aio::owner_lock_name(name + ".zoe-swap"));
  }
  return Status::success();
}

SwapStore::SwapStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SwapStore::SwapStore(SwapStore&&) noexcept = default;
SwapStore& SwapStore::operator=(SwapStore&&) noexcept = default;
SwapStore::~SwapStore() = default;

std::size_t SwapStore::n() const { return impl_->n; }
std::size_t SwapStore::tile() const { return impl_->tile; }
std::size_t SwapStore::tiles() const { return impl_->ntiles; }
std::size_t SwapStore::alignment() const { return impl_->alignment; }
const std::string& SwapStore::name() const { return impl_->name; }
const std::vector<std::string>& SwapStore::paths() const { return impl_->paths; }
std::vector<std::string> SwapStore::files() const {
  std::vector<std::string> out;
  for (const auto& f : impl_->files) out.push_back(f.data_path);
  return out;
}
bool SwapStore::direct_io() const {
  for (const auto& f : impl_->files) {
    if (!f.direct) return false;
  }
  return true;
}
std::int64_t SwapStore::tile_step(std::size_t t) const { return t < impl_->ntiles ? impl_->table[t].step : -1; }
const SwapStats& SwapStore::last_stats() const { return impl_->stats; }
std::size_t SwapStore::buffer_bytes() const {
  std::size_t total = 0;
  for (const auto& b : impl_->buffers) total += b.size();
  return total;
}

std::vector<TileRun> SwapStore::tile_runs() const {
  std::vector<TileRun> runs;
  const Impl& im = *impl_;
  std::size_t first = 0;
  for (std::size_t t = 1; t <= im.ntiles; ++t) {
    if (t == im.ntiles || im.table[t].step != im.table[first].step) {
      TileRun r;
      r.first_tile = first;
      r.tiles = t - first;
      r.offset = im.tile_begin(first);
      r.n = std::min(im.n, im.tile_begin(t)) - r.offset;
      r.step = im.table[first].step;
      runs.push_back(r);
      first = t;
    }
  }
  return runs;
}

std::string SwapStore::describe_state() const { return impl_->describe(); }

}  // namespace zoe
