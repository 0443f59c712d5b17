// Reading zoe's checkpoints: one file (CheckpointReader), and a run's optimizer checkpoints (OffloadOptimizer::save, one file per rank) as one: every rank's
// partition joined into whole parameters, by name. What `zoe export` writes as safetensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "zoe/offload.h"
#include "zoe/optimizers.h"
#include "zoe/status.h"

namespace zoe {

// One checkpoint file (OffloadOptimizer::save writes them: a header, blobs, an index and the manifest)
// opened, its header, trailer and index checked; each blob's CRC-32C is checked when it is read. Move-only;
// holds the file open. A moved-from reader may only be assigned to or destroyed.
class CheckpointReader {
 public:
  static Result<CheckpointReader> open(const std::string& path);
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();

  const std::string& path() const;
  const std::string& manifest() const;
  std::uint32_t major_version() const;
  std::uint32_t minor_version() const;
  bool has(const std::string& name) const;
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

  struct Impl;

 private:
  explicit CheckpointReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A parameter of the checkpoint: its name ("param.<i>" where the run recorded none), its shape (one
// dimension of n where none was recorded) and its element count.
struct CheckpointParam {
  std::string name;
  std::vector<std::int64_t> shape;
  std::size_t n = 0;
};

// Elements [begin, begin + n) of parameter `param` of params().
struct CheckpointPiece {
  std::size_t param = 0, begin = 0, n = 0;
  bool operator==(const CheckpointPiece&) const = default;
};

// Every rank's checkpoint file of one run, opened (each file's header, index and manifest checked) and checked
// to be that: the same world, each rank once, the same parameters at the same step, no two named alike.
class PartitionedCheckpoint {
 public:
  static Result<PartitionedCheckpoint> open(const std::vector<std::string>& paths);
  PartitionedCheckpoint(PartitionedCheckpoint&&) noexcept;
  PartitionedCheckpoint& operator=(PartitionedCheckpoint&&) noexcept;
  ~PartitionedCheckpoint();

  const std::vector<CheckpointParam>& params() const;
  std::int64_t step() const;
  std::size_t files() const;
  LossScaleState loss_scale() const;  // the run's fp16 loss scaler (every rank holds the same)
  // The optimizer whose state the files hold (every rank's the same), and its state arrays: the blobs beside
  // "master", by the optimizer table's names (zoe/optimizers.h; amsgrad's max_exp_avg_sq included).
  Rule rule() const;
  std::vector<std::string> state_names() const;
  // What file `file` (in the order open() was given them) holds: its state arrays' pieces of params(), in
  // their order.
  const std::vector<CheckpointPiece>& pieces(std::size_t file) const;
  // Checks every file's blobs ("master" and the rule's states) against their checksums, reading them
  // without keeping them.
  Status verify(std::span<const char* const> blobs) const;
  // One blob of every rank joined: each parameter's fp32 elements, whole, in params()' order.
  Result<std::vector<std::vector<float>>> join(const char* blob) const;

  struct Impl;

 private:
  explicit PartitionedCheckpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One file `zoe export` writes: the joined fp32 array `blob` ("master" or a state's name) of every
// parameter, by name, as the safetensors file `name`.
struct ExportFile {
  const char* blob;
  std::string name;
};

// `zoe export`: each of `files` in the folder `dir` (made when missing, then opened once: every file is
// written through that one descriptor, wherever the path leads meanwhile). Each file is written beside
// itself and renamed over it, or not at all; what killed exports of this host and PID namespace left there
// is removed first. `written(path, k)` is called as files[k] lands; the first failure stops the export.
Status export_safetensors(const PartitionedCheckpoint& checkpoint, std::span<const ExportFile> files,
                          const std::string& dir, const std::function<void(const std::string&, std::size_t)>& written);

}  // namespace zoe
