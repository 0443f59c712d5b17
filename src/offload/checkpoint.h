// The checkpoint container: named binary blobs plus the caller's manifest (JSON text) in one file, written
// atomically (a temporary file renamed over the target after fsync) and checked on read (CRC-32C of every
// blob and of the index). The format is described at the top of checkpoint.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "base/files.h"
#include "base/unique_fd.h"
#include "zoe/status.h"

namespace zoe {

// Checkpoint format version. A reader accepts any file with its major version or older; a minor version
// only adds what older readers may ignore.
constexpr std::uint32_t kCheckpointMajor = 1;
constexpr std::uint32_t kCheckpointMinor = 0;

// Streams blobs to `<path>.tmp-<host>-<scope>-<pid>-<n>` as they are added (nothing is held in memory but the
// index); commit() makes the file appear at `path` whole, or not at all. Destroying a writer without a
// successful commit removes the temporary file and leaves whatever was at `path` untouched. A writer killed
// outright cannot: create() removes, in the folder of `path`, the temporary files of writers that are gone —
// only those of this host's boot and PID namespace (the scope), whose pid no longer exists and whose lock
// no one holds; a writer elsewhere (shared storage, another container) is never judged from here.
class CheckpointWriter {
 public:
  static Result<CheckpointWriter> create(const std::string& path);
  CheckpointWriter(CheckpointWriter&& o) noexcept = default;
  CheckpointWriter& operator=(CheckpointWriter&& o) noexcept = default;
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter() = default;

  // `name` must be non-empty and not yet added; `data` may be null when `bytes` is 0. After any failure the
  // writer refuses further calls (the temporary file is incomplete).
  Status add(std::string name, const void* data, std::size_t bytes);
  // The same for a blob too large to hold in memory: produce(offset, n, &slice) points `slice` at the blob's
  // bytes [offset, offset + n), valid until the next call; slices are at most kStreamSlice bytes.
  using Producer = std::function<Status(std::size_t offset, std::size_t n, const void** slice)>;
  static constexpr std::size_t kStreamSlice = std::size_t(8) << 20;
  Status add_streamed(std::string name, std::size_t bytes, const Producer& produce);
  // Writes the index and `manifest_json` (stored as given: the container does not parse it), fsyncs the
  // file, renames it over `path` and fsyncs the directory so the rename survives a crash.
  Status commit(const std::string& manifest_json);

  const std::string& path() const { return file_->path(); }
  std::string temp_path() const { return file_->temp_path(); }

 private:
  struct Entry {
    std::string name;
    std::uint64_t offset, size;
    std::uint32_t crc;
  };
  explicit CheckpointWriter(AtomicFile file);
  Status write_all(const void* data, std::size_t bytes);
  Status pad_to(std::uint64_t alignment);
  Status fail(Status s);

  // The temporary beside the checkpoint's path, renamed over it by commit(); removed unless committed.
  std::unique_ptr<AtomicFile> file_;
  std::vector<Entry> entries_;
  std::unordered_set<std::string> names_;
  bool committed_ = false;
  bool failed_ = false;
};

// Opens a checkpoint and checks its header, trailer and index; each blob's CRC-32C is checked when it is
// read. Move-only; holds the file open.
class CheckpointReader {
 public:
  static Result<CheckpointReader> open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::string& manifest() const { return manifest_; }
  std::uint32_t major_version() const { return major_; }
  std::uint32_t minor_version() const { return minor_; }
  bool has(const std::string& name) const { return blobs_.count(name) != 0; }
  std::vector<std::string> names() const;  // sorted
  Result<std::size_t> size(const std::string& name) const;
  // Where the blob's bytes start in the file (blobs are stored whole, aligned): a reader holding the file
  // in memory can view an array in place.
  Result<std::uint64_t> offset(const std::string& name) const;
  // Reads the whole blob into `dst`, which must hold exactly `bytes` = the blob's size. On a CRC mismatch
  // the contents of `dst` are unspecified and the error names the blob, the file and both checksums.
  Status read(const std::string& name, void* dst, std::size_t bytes) const;
  // The same in slices of `slice_bytes` (read into `buffer`, or a buffer of its own when null), each handed
  // to consume(offset, slice, n) as it arrives. The checksum is known only after the last slice: a consumer
  // that must not act on damaged data verifies first (a pass whose consumer does nothing).
  using Consumer = std::function<Status(std::size_t offset, const void* slice, std::size_t n)>;
  Status read_streamed(const std::string& name, std::size_t bytes, std::size_t slice_bytes, const Consumer& consume,
                       void* buffer = nullptr) const;

 private:
  struct Blob {
    std::uint64_t offset, size;
    std::uint32_t crc;
  };
  CheckpointReader() = default;
  Status load(const std::string& path);
  Status parse_index(const std::string& index, std::uint64_t data_end);

  std::string path_;
  UniqueFd fd_;
  std::uint32_t major_ = 0, minor_ = 0;
  std::map<std::string, Blob> blobs_;
  std::string manifest_;
};

}  // namespace zoe
