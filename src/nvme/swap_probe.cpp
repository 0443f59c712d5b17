// zoe/swap_probe.h: a swap path's filesystem, O_DIRECT, block size, space and bandwidth, and the stores in it.
#include "zoe/swap_probe.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "aio/files.h"
#include "aio/io_engine.h"
#include "src/nvme/swap_inventory.h"
#include "zoe/aligned_buffer.h"

namespace zoe {
namespace {

// The inventory's stores as the public struct has them.
std::vector<SwapStoreFound> found_stores(const std::string& path) {
  std::vector<SwapStoreFound> out;
  for (const aio::FoundStore& s : aio::find_swap_stores(path)) {
    const SwapStoreState state = s.state == aio::StoreState::in_use      ? SwapStoreState::in_use
                                 : s.state == aio::StoreState::abandoned ? SwapStoreState::abandoned
                                                                         : SwapStoreState::unknown;
    out.push_back({s.name, s.files, s.bytes, state, s.who, aio::remove_command(s)});
  }
  return out;
}

// Writes then reads `bytes` through the libaio engine (1 MiB requests, queue depth 8), fdatasync included
// in the write time so that a write cache does not flatter it.
Status measure(const std::string& file, int fd, std::size_t bytes, double& write_gbps, double& read_gbps) {
  aio::EngineOptions eo;
  eo.queue_depth = 8;
  eo.request_bytes = 1 << 20;
  eo.alignment = 4096;
  Result<std::unique_ptr<aio::IoEngine>> engine = aio::IoEngine::create(eo);
  if (!engine.ok()) return engine.status();
  const int f = (*engine)->add_file(fd, file);
  constexpr std::size_t kChunk = 16 << 20;
  Result<AlignedBuffer> buf = AlignedBuffer::allocate_for_io(2 * kChunk, 4096);  // as the swap store's buffers
  if (!buf.ok()) return buf.status();
  for (std::size_t i = 0; i < 2 * kChunk / 4; ++i) buf->as<std::uint32_t>()[i] = static_cast<std::uint32_t>(i * 2654435761u);
  for (int pass = 0; pass < 2; ++pass) {
    const IoOp op = pass == 0 ? IoOp::write : IoOp::read;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<aio::IoEngine::Ticket> tickets;
    for (std::size_t off = 0; off < bytes; off += kChunk) {
      Result<aio::IoEngine::Ticket> t = (*engine)->submit(op, f, off, buf->as<char>() + (tickets.size() % 2) * kChunk,
                                                          std::min(kChunk, bytes - off));
      if (!t.ok()) return t.status();
      tickets.push_back(t.value());
    }
    if (Status s = (*engine)->wait_all(); !s.ok()) return s;
    if (pass == 0) {
      if (Status s = aio::sync_file(fd, file, {}); !s.ok()) return s;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    (pass == 0 ? write_gbps : read_gbps) = static_cast<double>(bytes) / secs / 1e9;
  }
  return Status::success();
}

SwapPathProbe probe_one(const std::string& path, std::size_t bytes) {
  SwapPathProbe p;
  p.path = path;
  Result<aio::FsInfo> info = aio::fs_info(path);
  if (info.ok()) {
    p.fs_type = info->type;
    p.free_bytes = info->free_bytes;
  }
  Result<Folder> folder = aio::open_swap_dir(path, "swap path");
  if (!folder.ok()) {
    p.verdict = "unusable: " + folder.status().message();
    return p;
  }
  p.stores = found_stores(path);
  // A name nobody can guess, created exclusively and never reopened: the measurement's writes go nowhere else.
  const std::string name = ".zoe-probe-" + random_hex();
  const std::string file = folder->path_of(name);
  Result<aio::OpenedFile> opened = aio::open_swap_file(*folder, name, true, {});
  if (!opened.ok()) {
    p.verdict = "unusable: " + opened.status().message();
    return p;
  }
  p.direct = opened->direct;
  p.dio_alignment = aio::dio_alignment(opened->fd.get()).first;
  p.logical_block = aio::device_logical_block(path);
  if (p.logical_block == 0) p.logical_block = p.dio_alignment;
  Status s = aio::allocate_file(opened->fd.get(), file, bytes, {});
  if (s.ok()) s = measure(file, opened->fd.get(), bytes, p.write_gbps, p.read_gbps);
  opened->fd.reset();
  (void)folder->remove(name);
  if (!s.ok()) {
    p.verdict = "unusable: " + s.message();
    return p;
  }
  p.usable = true;
  if (!p.direct) {
    p.verdict = "usable with a warning: no O_DIRECT on " + p.fs_type +
                ", so swap I/O is buffered through the page cache (slower, uses RAM)";
  } else if (p.fs_type == "tmpfs" || p.fs_type == "ramfs") {
    p.verdict = "usable with a warning: " + p.fs_type + " lives in RAM, so swapping there saves no memory";
  } else if (p.fs_type == "nfs" || p.fs_type == "cifs" || p.fs_type == "fuse" || p.fs_type == "9p") {
    p.verdict = "usable with a warning: " + p.fs_type + " is a network or user-space filesystem; prefer local NVMe";
  } else {
    p.verdict = "ok";
  }
  return p;
}

// Stores nobody is known to use are worth a warning: each holds its state twice over, often many GiB.
void warn_about_stores(SwapPathProbe& p) {
  std::uint64_t abandoned = 0, unknown = 0;
  int n_abandoned = 0, n_unknown = 0;
  for (const SwapStoreFound& s : p.stores) {
    if (s.state == SwapStoreState::abandoned) abandoned += s.bytes, ++n_abandoned;
    if (s.state == SwapStoreState::unknown) unknown += s.bytes, ++n_unknown;
  }
  std::string warning;
  if (n_abandoned > 0) {
    warning = std::to_string(n_abandoned) + " swap store(s) of runs that are not running hold " +
              aio::format_bytes(abandoned) + " here; each is listed with the rm command that removes it";
  }
  if (n_unknown > 0) {
    warning += (warning.empty() ? "" : "; ") + std::to_string(n_unknown) + " swap store(s) of " +
               aio::format_bytes(unknown) + " whose runs cannot be checked from here: remove them once no run uses them";
  }
  if (warning.empty()) return;
  if (p.verdict == "ok") p.verdict = "usable with a warning: " + warning;
  else p.verdict += "; " + warning;
}

}  // namespace

SwapPathProbe probe_swap_path(const std::string& path, std::size_t bytes) {
  // Whole MiB, which every O_DIRECT alignment divides; at least one.
  constexpr std::size_t kMiB = std::size_t(1) << 20;
  bytes = std::max(kMiB, (std::min(bytes, SIZE_MAX - kMiB) + kMiB - 1) / kMiB * kMiB);
  SwapPathProbe p = probe_one(path, bytes);
  warn_about_stores(p);
  return p;
}

std::string format_bytes(std::uint64_t bytes) { return aio::format_bytes(bytes); }

}  // namespace zoe
