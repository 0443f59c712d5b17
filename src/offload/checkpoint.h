// The checkpoint container: named binary blobs plus the caller's manifest (JSON text) in one file, written
// atomically (a temporary file renamed over the target after fsync) and checked on read (CRC-32C of every
// blob and of the index). The format is described at the top of checkpoint.cpp.
#pragma once

#include "src/private.h"

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
#include "zoe/checkpoint.h"
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

}  // namespace zoe
