// The swap store's tile table file (swap_impl.h: TileEntry): its two copies, each written whole with a
// sequence number and a CRC-32C, created with the store, rewritten after each call that wrote, and read
// back (the newer intact copy) when a store is opened.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "base/crc32c.h"
#include "base/files.h"
#include "base/warning.h"
#include "src/nvme/swap_impl.h"
#include "src/nvme/swap_inventory.h"

namespace zoe {
namespace {

constexpr char kTableMagic[8] = {'Z', 'O', 'E', 'S', 'W', 'P', 'T', 'B'};
constexpr std::size_t kTableHeader = 32;  // magic, u32 version, u32 reserved, u64 tiles, u64 sequence
constexpr std::size_t kTableEntry = 24;   // i64 step, u32 slot, u32 crc[3]

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

template <typename T>
T get(const std::string& in, std::size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  return v;
}

}  // namespace

// The table file holds two copies (regions) written alternately in place, each with a sequence number and
// a CRC: an update is one pwrite and one fdatasync of a file that never changes size (no rename, no folder
// sync, no journal commit), and a torn update leaves the other copy, one update older, intact.
std::size_t SwapStore::Impl::table_region_bytes() const {
  return (kTableHeader + ntiles * kTableEntry + 4 + 4095) / 4096 * 4096;
}

Status SwapStore::Impl::write_table(const std::vector<TileEntry>& entries, std::uint64_t seq) const {
  std::string out;
  out.reserve(table_region_bytes());
  out.append(kTableMagic, sizeof kTableMagic);
  put<std::uint32_t>(out, kSwapFormatVersion);
  put<std::uint32_t>(out, 0);
  put<std::uint64_t>(out, entries.size());
  put<std::uint64_t>(out, seq);
  for (const TileEntry& e : entries) {
    put<std::int64_t>(out, e.step);
    put<std::uint32_t>(out, e.slot);
    for (std::uint32_t c : e.crc) put<std::uint32_t>(out, c);
  }
  put<std::uint32_t>(out, crc32c(out.data(), out.size()));
  out.resize(table_region_bytes(), '\0');
  const std::string path = table_path();
  const auto at = static_cast<off_t>((seq % 2) * table_region_bytes());
  std::size_t done = 0;
  Status s;
  while (s.ok() && done < out.size()) {
    const ssize_t w = ::pwrite(table_fd.get(), out.data() + done, out.size() - done, at + static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) s = sys_error("cannot write tile table", path, w < 0 ? errno : EIO);
    else done += static_cast<std::size_t>(w);
  }
  if (s.ok()) s = aio::sync_file(table_fd.get(), path, options.fault_hook);
  return s;
}

Status SwapStore::Impl::persist_table() {
  const std::uint64_t seq = table_seq + 1;
  const Status s = write_table(table, seq);
  table_dirty = !s.ok();
  if (s.ok()) table_seq = seq;
  return s;
}

Status SwapStore::Impl::create_table() {
  const std::string path = table_path();
  (void)folders[0].remove(table_name());  // an unfinished creation's (a link there goes, not its target)
  Result<UniqueFd> made = folders[0].create(table_name(), O_RDWR, 0600);
  if (!made.ok()) return Status(made.status().code(), "tile table: " + made.status().message(), made.status().sys_errno());
  table_fd = std::move(made).value();
  aio::mark_in_use(table_fd.get());
  if (::ftruncate(table_fd.get(), static_cast<off_t>(2 * table_region_bytes())) != 0) {
    return sys_error("cannot size tile table", path, errno);
  }
  table_seq = 0;
  if (Status s = persist_table(); !s.ok()) return s;
  // The file's size and its name must be durable too (later updates sync only its data).
  if (::fsync(table_fd.get()) != 0) return sys_error("fsync of", path, errno);
  return folders[0].sync();
}

Status SwapStore::Impl::load_table() {
  const std::string path = table_path();
  Result<UniqueFd> opened = folders[0].open_file(table_name(), O_RDWR);
  if (!opened.ok()) {
    return Status(StatusCode::corrupt, "the store's tile table cannot be opened (" + opened.status().message() +
                                           "): without it no tile can be trusted; restore from a checkpoint",
                  opened.status().sys_errno());
  }
  table_fd = std::move(opened).value();
  aio::mark_in_use(table_fd.get());
  const std::size_t region = table_region_bytes();
  std::string why = "it is shorter than " + std::to_string(2 * region) + " bytes";
  bool found = false, damaged = false;
  std::string in(region, '\0');
  for (std::size_t r = 0; r < 2; ++r) {
    if (::pread(table_fd.get(), in.data(), region, static_cast<off_t>(r * region)) != static_cast<ssize_t>(region)) continue;
    const std::size_t body = kTableHeader + ntiles * kTableEntry;
    if (std::memcmp(in.data(), kTableMagic, sizeof kTableMagic) != 0 || get<std::uint64_t>(in, 16) != ntiles ||
        get<std::uint32_t>(in, 8) != kSwapFormatVersion) {
      why = "its header is not this store's (version " + std::to_string(get<std::uint32_t>(in, 8)) + ", " +
            std::to_string(get<std::uint64_t>(in, 16)) + " tiles; expected " + std::to_string(ntiles) + ")";
      continue;
    }
    if (crc32c(in.data(), body) != get<std::uint32_t>(in, body)) {
      why = "both copies fail their checksum";
      damaged = true;
      continue;
    }
    const std::uint64_t seq = get<std::uint64_t>(in, 24);
    if (found && seq <= table_seq) continue;
    std::vector<TileEntry> t(ntiles);
    for (std::size_t i = 0; i < ntiles; ++i) {
      const std::size_t at = kTableHeader + i * kTableEntry;
      t[i].step = get<std::int64_t>(in, at);
      t[i].slot = get<std::uint32_t>(in, at + 8) & 1u;
      for (std::size_t k = 0; k < 3; ++k) t[i].crc[k] = get<std::uint32_t>(in, at + 12 + 4 * k);
    }
    table = std::move(t);
    table_seq = seq;
    found = true;
  }
  if (!found) {
    return Status(StatusCode::corrupt, "tile table " + path + " is unusable: " + why +
                                           "; without it no tile can be trusted -- restore from a checkpoint");
  }
  if (damaged) {
    // The other copy is consistent (it names slots no later write touched) but may be one update older.
    warn("one copy of tile table " + path + " is damaged; using the other: " + describe());
  }
  return Status::success();
}

}  // namespace zoe
