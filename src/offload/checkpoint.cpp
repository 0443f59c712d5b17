// Checkpoint file format, version 1.0. All integers little-endian.
//
//   header   64 bytes: "ZOECKPT\0", u32 major, u32 minor, zeros. The first 16 bytes keep this layout in every
//            version, so that any reader can say which version a file has before refusing it.
//   blobs    back to back, each starting at a multiple of 64 bytes (zero padding between them).
//   index    at a multiple of 8: u32 count, count x {u32 name_len, name, u64 offset, u64 size, u32 crc32c},
//            u64 manifest_len, manifest (the caller's JSON text, stored as given).
//   trailer  the last 40 bytes: u64 index_offset, u64 index_size, u32 index_crc32c, u32 major, u32 minor,
//            u32 crc32c of the 28 bytes before it, "ZOEINDX\0".
//
// The trailer is written last, so a file cut short anywhere lacks it; the index checksum covers names,
// offsets and sizes, and each blob carries its own checksum so one damaged blob does not hide the others.
#include "src/offload/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "base/crc32c.h"
#include "base/process_identity.h"
#include "base/unique_fd.h"

namespace zoe {
namespace {

constexpr char kMagic[8] = {'Z', 'O', 'E', 'C', 'K', 'P', 'T', '\0'};
constexpr char kTrailerMagic[8] = {'Z', 'O', 'E', 'I', 'N', 'D', 'X', '\0'};
constexpr std::uint64_t kHeaderBytes = 64;
constexpr std::uint64_t kTrailerBytes = 40;
constexpr std::uint64_t kBlobAlignment = 64;  // a cache line: blobs can be read into place by aligned loads
constexpr std::size_t kMaxName = 4096;
constexpr std::size_t kMaxIo = std::size_t(1) << 30;  // Linux transfers at most ~2 GiB per call
// A header version beyond these bounds is taken for damage, not for a newer format (CheckpointReader::load).
constexpr std::uint32_t kPlausibleMajorsAhead = 64;
constexpr std::uint32_t kPlausibleMinor = 1 << 16;

void put_u32(std::string& s, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put_u64(std::string& s, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
std::uint64_t get_le(const char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08X", v);
  return buf;
}

Status io_error(std::string message, int err) { return {StatusCode::io_error, std::move(message), err}; }
Status corrupt(const std::string& path, const std::string& what) {
  return {StatusCode::corrupt, "checkpoint " + path + ": " + what};
}

// Reads exactly `bytes` at `offset`; the file ending first is corruption (it was shorter than its index said).
Status pread_all(int fd, void* dst, std::size_t bytes, std::uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t r = ::pread(fd, p, std::min(bytes, kMaxIo), static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_error("reading checkpoint " + path + " at offset " + std::to_string(offset) + " failed", errno);
    }
    if (r == 0) return corrupt(path, "unexpected end of file at offset " + std::to_string(offset) + " (truncated?)");
    p += r;
    bytes -= static_cast<std::size_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
  return Status::success();
}

// Temporary names: <path>.tmp-<host>-<scope>-<pid>-<random>, the random part AtomicFile's. The scope
// (base/process_identity.h) says where the pid can be checked; the host is for people. Parsed from the
// right, so a host or checkpoint name may hold '-'.
std::string temp_tag() {
  const ProcessIdentity self = this_process();
  return file_name_host(self.host) + "-" + (self.scope.empty() ? "noscope" : self.scope) + "-" + std::to_string(self.pid);
}

std::optional<ProcessIdentity> parse_temp_name(const std::string& name) {
  auto all = [](std::string_view s, bool hex) {
    for (char c : s) {
      if (!((c >= '0' && c <= '9') || (hex && c >= 'a' && c <= 'f'))) return false;
    }
    return !s.empty();
  };
  std::string_view rest = name;
  std::string_view field[3];  // random, pid, scope
  for (std::string_view& f : field) {
    const std::size_t dash = rest.rfind('-');
    if (dash == std::string_view::npos) return std::nullopt;
    f = rest.substr(dash + 1);
    rest = rest.substr(0, dash);
  }
  const std::size_t tmp = rest.rfind(".tmp-");
  if (tmp == std::string_view::npos || !all(field[0], true) || !all(field[1], false) || field[1].size() > 10 ||
      field[2].size() != 16 || !all(field[2], true)) {
    return std::nullopt;
  }
  return ProcessIdentity{std::string(rest.substr(tmp + 5)), std::string(field[2]), std::stoll(std::string(field[1]))};
}

// A file is removed only when its name says this scope wrote it and that writer is gone, and only while no
// one holds its lock (every writer holds one on its temporary file). The second look at the pid, once the
// lock is held, covers a pid reused by a writer that made the same name since the first look: a file exists
// only after its writer does. Opened and removed through the folder's descriptor, no link followed.
void remove_if_abandoned(const Folder& folder, const std::string& name, const ProcessIdentity& writer) {
  Result<UniqueFd> fd = folder.open_file(name, O_RDONLY);
  if (!fd.ok() || ::flock(fd->get(), LOCK_EX | LOCK_NB) != 0 || liveness(writer) != Liveness::gone) return;
  struct stat held {}, named {};
  char magic[sizeof kMagic] = {};
  const ssize_t got = ::pread(fd->get(), magic, sizeof magic, 0);
  const bool ours = got == 0 || (got == static_cast<ssize_t>(sizeof magic) && std::memcmp(magic, kMagic, sizeof magic) == 0);
  if (ours && ::fstat(fd->get(), &held) == 0 && ::fstatat(folder.fd(), name.c_str(), &named, AT_SYMLINK_NOFOLLOW) == 0 &&
      held.st_ino == named.st_ino && held.st_dev == named.st_dev) {
    (void)folder.remove(name);
  }
}

// What killed writers (kill -9, OOM) left in the folder, for every checkpoint name there: a rank that is not
// run again leaves nothing either. Writers of other scopes (hosts, containers, boots) are never judged.
// Best effort: a failure here never fails a save.
void remove_abandoned_temps(const std::string& dir) {
  Result<Folder> folder = Folder::open(dir);
  if (!folder.ok()) return;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::optional<ProcessIdentity> writer = parse_temp_name(name);
    if (writer && liveness(*writer) == Liveness::gone) remove_if_abandoned(*folder, name, *writer);
  }
}

}  // namespace

// ---- writer ----

CheckpointWriter::CheckpointWriter(AtomicFile file) : file_(std::make_unique<AtomicFile>(std::move(file))) {}

Result<CheckpointWriter> CheckpointWriter::create(const std::string& path) {
  if (path.empty() || path.back() == '/') {
    return invalid_argument("checkpoint path '" + path + "' is invalid: need a file name");
  }
  remove_abandoned_temps(parent_dir(path));
  // A temporary of our own (AtomicFile: exclusive, unguessable, never reopened by name); the writer's
  // identity in its name lets a later save clean up after a crash.
  Result<AtomicFile> file = AtomicFile::create(path, AtomicFile::Options{0666, temp_tag()});
  if (!file.ok()) {
    return io_error("cannot create a temporary beside checkpoint " + path + " (" + file.status().message() +
                        "): check that directory " + parent_dir(path) + " exists and is writable",
                    file.status().sys_errno());
  }
  // Held until commit or discard: while it is, no cleaner removes the file, whatever its pid says.
  // A filesystem without locks (some FUSE mounts) still has the pid check.
  (void)::flock(file->fd(), LOCK_EX | LOCK_NB);
  CheckpointWriter w(std::move(file).value());
  std::string header(kMagic, sizeof kMagic);
  put_u32(header, kCheckpointMajor);
  put_u32(header, kCheckpointMinor);
  header.resize(kHeaderBytes, '\0');
  if (Status s = w.write_all(header.data(), header.size()); !s.ok()) return s;
  return w;
}

Status CheckpointWriter::fail(Status s) {
  failed_ = true;
  return s;
}

Status CheckpointWriter::write_all(const void* data, std::size_t bytes) {
  if (Status s = file_->write(data, bytes); !s.ok()) {
    return fail(Status(s.code(), s.message() + " (checkpoint " + path() + ")", s.sys_errno()));
  }
  return Status::success();
}

Status CheckpointWriter::pad_to(std::uint64_t alignment) {
  static constexpr std::array<char, kBlobAlignment> kZeros{};
  const std::uint64_t pad = (alignment - file_->offset() % alignment) % alignment;
  return write_all(kZeros.data(), static_cast<std::size_t>(pad));
}

Status CheckpointWriter::add(std::string name, const void* data, std::size_t bytes) {
  if (data == nullptr && bytes != 0) {
    return invalid_argument("checkpoint " + path() + ": blob '" + name + "' has null data and " +
                            std::to_string(bytes) + " bytes");
  }
  const auto* p = static_cast<const char*>(data);
  return add_streamed(std::move(name), bytes, [p](std::size_t offset, std::size_t, const void** slice) {
    *slice = p + offset;
    return Status::success();
  });
}

Status CheckpointWriter::add_streamed(std::string name, std::size_t bytes, const Producer& produce) {
  if (committed_) return invalid_argument("checkpoint " + path() + " is already committed: cannot add '" + name + "'");
  if (failed_ || !file_) {
    return invalid_argument("checkpoint " + path() + ": an earlier step failed; start again with a new writer");
  }
  if (name.empty() || name.size() > kMaxName) {
    return invalid_argument("checkpoint " + path() + ": blob names must have 1 to " + std::to_string(kMaxName) +
                            " bytes (got " + std::to_string(name.size()) + ")");
  }
  if (names_.count(name) != 0) {
    return invalid_argument("checkpoint " + path() + ": blob '" + name + "' was already added");
  }
  if (Status s = pad_to(kBlobAlignment); !s.ok()) return s;
  Entry e{name, file_->offset(), bytes, 0};
  // In slices, so each is checksummed while it is still in cache and then written.
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t n = std::min(kStreamSlice, bytes - done);
    const void* slice = nullptr;
    if (Status s = produce(done, n, &slice); !s.ok()) return fail(s);
    e.crc = crc32c(slice, n, e.crc);
    if (Status s = write_all(slice, n); !s.ok()) return s;
    done += n;
  }
  names_.insert(name);
  entries_.push_back(std::move(e));
  return Status::success();
}

Status CheckpointWriter::commit(const std::string& manifest_json) {
  if (committed_) return invalid_argument("checkpoint " + path() + " is already committed");
  if (failed_ || !file_) {
    return invalid_argument("checkpoint " + path() + ": an earlier step failed; start again with a new writer");
  }
  if (Status s = pad_to(8); !s.ok()) return s;
  const std::uint64_t index_offset = file_->offset();
  std::string index;
  put_u32(index, static_cast<std::uint32_t>(entries_.size()));
  for (const Entry& e : entries_) {
    put_u32(index, static_cast<std::uint32_t>(e.name.size()));
    index += e.name;
    put_u64(index, e.offset);
    put_u64(index, e.size);
    put_u32(index, e.crc);
  }
  put_u64(index, manifest_json.size());
  index += manifest_json;
  std::string trailer;
  put_u64(trailer, index_offset);
  put_u64(trailer, index.size());
  put_u32(trailer, crc32c(index.data(), index.size()));
  put_u32(trailer, kCheckpointMajor);
  put_u32(trailer, kCheckpointMinor);
  put_u32(trailer, crc32c(trailer.data(), trailer.size()));
  trailer.append(kTrailerMagic, sizeof kTrailerMagic);
  if (Status s = write_all(index.data(), index.size()); !s.ok()) return s;
  if (Status s = write_all(trailer.data(), trailer.size()); !s.ok()) return s;

  Status s = file_->commit();
  // In place once renamed, even if syncing the folder then failed (the error says so).
  committed_ = file_->committed();
  return s.ok() || committed_ ? s : fail(std::move(s));
}

// ---- reader ----

// The open file and what its index says.
struct CheckpointReader::Impl {
  struct Blob {
    std::uint64_t offset, size;
    std::uint32_t crc;
  };
  Status load(const std::string& path);
  Status parse_index(const std::string& index, std::uint64_t data_end);

  std::string path_;
  UniqueFd fd_;
  std::uint32_t major_ = 0, minor_ = 0;
  std::map<std::string, Blob> blobs_;
  std::string manifest_;
};

CheckpointReader::CheckpointReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;
CheckpointReader::~CheckpointReader() = default;

const std::string& CheckpointReader::path() const { return impl_->path_; }
const std::string& CheckpointReader::manifest() const { return impl_->manifest_; }
std::uint32_t CheckpointReader::major_version() const { return impl_->major_; }
std::uint32_t CheckpointReader::minor_version() const { return impl_->minor_; }
bool CheckpointReader::has(const std::string& name) const { return impl_->blobs_.count(name) != 0; }

Result<CheckpointReader> CheckpointReader::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  if (Status s = impl->load(path); !s.ok()) return s;
  return CheckpointReader(std::move(impl));
}

Status CheckpointReader::Impl::load(const std::string& path) {
  path_ = path;
  // O_NONBLOCK: a FIFO given as a checkpoint is refused below, not waited on for a writer (it changes
  // nothing for the regular file read after the check).
  fd_.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd_.valid()) return io_error("cannot open checkpoint " + path, errno);
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) return io_error("cannot stat checkpoint " + path, errno);
  if (!S_ISREG(st.st_mode)) return io_error("checkpoint " + path + " is not a regular file", EISDIR);
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < 16) {
    return corrupt(path, std::to_string(file_size) + " bytes is too short for a zoe checkpoint (truncated, or not a checkpoint)");
  }
  char header[16];
  if (Status s = pread_all(fd_.get(), header, sizeof header, 0, path); !s.ok()) return s;
  if (std::memcmp(header, kMagic, sizeof kMagic) != 0) {
    return corrupt(path, "not a zoe checkpoint (its first bytes are not \"ZOECKPT\")");
  }
  major_ = static_cast<std::uint32_t>(get_le(header + 8, 4));
  minor_ = static_cast<std::uint32_t>(get_le(header + 12, 4));
  const std::string version = std::to_string(major_) + "." + std::to_string(minor_);
  if (major_ == 0) return corrupt(path, "format version " + version + " does not exist");
  // The header has no checksum of its own, so its version is believed only where something vouches for
  // it: the trailer (checksummed, and carrying the same version) when it is in this version's layout.
  char trailer[kTrailerBytes];
  bool trailer_ok = false;
  if (file_size >= kHeaderBytes + kTrailerBytes) {
    if (Status s = pread_all(fd_.get(), trailer, sizeof trailer, file_size - kTrailerBytes, path); !s.ok()) return s;
    trailer_ok = std::memcmp(trailer + 32, kTrailerMagic, sizeof kTrailerMagic) == 0 &&
                 crc32c(trailer, 28) == static_cast<std::uint32_t>(get_le(trailer + 28, 4));
  }
  const std::string trailer_version =
      trailer_ok ? std::to_string(get_le(trailer + 20, 4)) + "." + std::to_string(get_le(trailer + 24, 4)) : "";
  if (trailer_ok && trailer_version != version) {
    return corrupt(path, "the header gives format version " + version + " and the trailer " + trailer_version +
                             ": the header is damaged");
  }
  if (major_ > kCheckpointMajor) {
    // Without a trailer to vouch, a newer layout may have moved it; but formats grow one version at a
    // time, and a version far beyond this one (a flipped high byte) is damage, not the future.
    if (!trailer_ok && (major_ > kCheckpointMajor + kPlausibleMajorsAhead || minor_ > kPlausibleMinor)) {
      return corrupt(path, "the header gives format version " + version + ", which no zoe writes (this one writes " +
                               std::to_string(kCheckpointMajor) + "." + std::to_string(kCheckpointMinor) +
                               "): the header is damaged");
    }
    return Status(StatusCode::unsupported,
                  "checkpoint " + path + " has format version " + version + "; this build of zoe reads versions up to " +
                      std::to_string(kCheckpointMajor) + ".x: read it with a newer zoe");
  }
  if (file_size < kHeaderBytes + kTrailerBytes) {
    return corrupt(path, std::to_string(file_size) + " bytes is too short to hold a trailer (truncated)");
  }
  if (std::memcmp(trailer + 32, kTrailerMagic, sizeof kTrailerMagic) != 0) {
    return corrupt(path, "no trailer at the end of the file: it was truncated or not completely written");
  }
  const auto trailer_crc = static_cast<std::uint32_t>(get_le(trailer + 28, 4));
  if (!trailer_ok) {
    return corrupt(path, "trailer checksum mismatch (stored " + hex32(trailer_crc) + ", computed " +
                             hex32(crc32c(trailer, 28)) + ")");
  }
  const std::uint64_t index_offset = get_le(trailer, 8);
  const std::uint64_t index_size = get_le(trailer + 8, 8);
  const auto index_crc = static_cast<std::uint32_t>(get_le(trailer + 16, 4));
  if (index_offset < kHeaderBytes || index_size > file_size ||
      index_offset != file_size - kTrailerBytes - index_size) {
    return corrupt(path, "the trailer places the index at offset " + std::to_string(index_offset) + " with " +
                             std::to_string(index_size) + " bytes, which does not fit a file of " +
                             std::to_string(file_size) + " bytes (truncated or extended?)");
  }
  std::string index(static_cast<std::size_t>(index_size), '\0');
  if (Status s = pread_all(fd_.get(), index.data(), index.size(), index_offset, path); !s.ok()) return s;
  const std::uint32_t computed = crc32c(index.data(), index.size());
  if (computed != index_crc) {
    return corrupt(path, "index checksum mismatch (stored " + hex32(index_crc) + ", computed " + hex32(computed) +
                             "): the blob table or manifest is damaged");
  }
  return parse_index(index, index_offset);
}

// The index passed its checksum, so a failure here means a writer bug or a crafted file; every length is
// still checked against what remains so that nothing reads out of bounds.
Status CheckpointReader::Impl::parse_index(const std::string& index, std::uint64_t data_end) {
  std::size_t at = 0;
  auto take = [&](std::size_t n) -> const char* {
    if (index.size() - at < n) return nullptr;
    const char* p = index.data() + at;
    at += n;
    return p;
  };
  const char* p = take(4);
  if (p == nullptr) return corrupt(path_, "index too short");
  const std::uint64_t count = get_le(p, 4);
  for (std::uint64_t i = 0; i < count; ++i) {
    const char* len = take(4);
    if (len == nullptr) return corrupt(path_, "index entry " + std::to_string(i) + " is cut short");
    const auto name_len = static_cast<std::size_t>(get_le(len, 4));
    const char* name = take(name_len);
    const char* fields = name == nullptr ? nullptr : take(20);
    if (fields == nullptr) return corrupt(path_, "index entry " + std::to_string(i) + " is cut short");
    Blob b{get_le(fields, 8), get_le(fields + 8, 8), static_cast<std::uint32_t>(get_le(fields + 16, 4))};
    std::string key(name, name_len);
    if (b.offset < kHeaderBytes || b.offset > data_end || b.size > data_end - b.offset) {
      return corrupt(path_, "blob '" + key + "' at offset " + std::to_string(b.offset) + " with " +
                                std::to_string(b.size) + " bytes lies outside the data area");
    }
    if (!blobs_.emplace(std::move(key), b).second) {
      return corrupt(path_, "blob name '" + std::string(name, name_len) + "' appears twice in the index");
    }
  }
  const char* mlen = take(8);
  if (mlen == nullptr) return corrupt(path_, "index has no manifest length");
  const std::uint64_t manifest_size = get_le(mlen, 8);
  if (manifest_size != index.size() - at) {
    return corrupt(path_, "manifest length " + std::to_string(manifest_size) + " does not match the " +
                              std::to_string(index.size() - at) + " bytes left in the index");
  }
  manifest_.assign(index, at, std::string::npos);
  return Status::success();
}

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> out;
  out.reserve(impl_->blobs_.size());
  for (const auto& [name, blob] : impl_->blobs_) out.push_back(name);
  return out;
}

Result<std::size_t> CheckpointReader::size(const std::string& name) const {
  const auto it = impl_->blobs_.find(name);
  if (it == impl_->blobs_.end()) return invalid_argument("checkpoint " + impl_->path_ + " has no blob '" + name + "'");
  return static_cast<std::size_t>(it->second.size);
}

Result<std::uint64_t> CheckpointReader::offset(const std::string& name) const {
  const auto it = impl_->blobs_.find(name);
  if (it == impl_->blobs_.end()) return invalid_argument("checkpoint " + impl_->path_ + " has no blob '" + name + "'");
  return it->second.offset;
}

Status CheckpointReader::read(const std::string& name, void* dst, std::size_t bytes) const {
  if (bytes != 0 && dst == nullptr) return invalid_argument("checkpoint " + impl_->path_ + ": null destination for blob '" + name + "'");
  return read_streamed(name, bytes, bytes, [dst](std::size_t, const void* slice, std::size_t n) {
    // A whole-blob read is one slice, already in place.
    if (slice != dst) std::memcpy(dst, slice, n);
    return Status::success();
  }, dst);
}

Status CheckpointReader::read_streamed(const std::string& name, std::size_t bytes, std::size_t slice_bytes,
                                       const Consumer& consume, void* buffer) const {
  const auto it = impl_->blobs_.find(name);
  if (it == impl_->blobs_.end()) return invalid_argument("checkpoint " + impl_->path_ + " has no blob '" + name + "'");
  const Impl::Blob& b = it->second;
  if (bytes != b.size) {
    return Status(StatusCode::corrupt, "checkpoint " + path() + ": blob '" + name + "' holds " +
                                           std::to_string(b.size) + " bytes, the caller expects " +
                                           std::to_string(bytes) + " (a checkpoint of a different model?)");
  }
  if (bytes == 0) return Status::success();
  if (slice_bytes == 0) return invalid_argument("checkpoint " + impl_->path_ + ": slice size 0 for blob '" + name + "'");
  std::vector<char> own;
  if (buffer == nullptr) {
    own.resize(std::min(slice_bytes, bytes));
    buffer = own.data();
  }
  std::uint32_t computed = 0;
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t n = std::min(slice_bytes, bytes - done);
    if (Status s = pread_all(impl_->fd_.get(), buffer, n, b.offset + done, impl_->path_); !s.ok()) return s;
    computed = crc32c(buffer, n, computed);
    if (Status s = consume(done, buffer, n); !s.ok()) return s;
    done += n;
  }
  if (computed != b.crc) {
    return corrupt(impl_->path_, "blob '" + name + "' (" + std::to_string(bytes) + " bytes at offset " +
                              std::to_string(b.offset) + ") fails its checksum: stored CRC-32C " + hex32(b.crc) +
                              ", computed " + hex32(computed) + "; the data is damaged");
  }
  return Status::success();
}

}  // namespace zoe
