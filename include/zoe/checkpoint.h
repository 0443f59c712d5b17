// Reading a run's optimizer checkpoints (OffloadOptimizer::save, one file per rank) as one: every rank's
// partition joined into whole parameters, by name. What `zoe export` writes as safetensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "zoe/offload.h"
#include "zoe/status.h"

namespace zoe {

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
  // What file `file` (in the order open() was given them) holds: its state arrays' pieces of params(), in
  // their order.
  const std::vector<CheckpointPiece>& pieces(std::size_t file) const;
  // Checks every file's blobs ("master", "exp_avg", "exp_avg_sq") against their checksums, reading them
  // without keeping them.
  Status verify(std::span<const char* const> blobs) const;
  // One blob of every rank joined: each parameter's fp32 elements, whole, in params()' order.
  Result<std::vector<std::vector<float>>> join(const char* blob) const;

  struct Impl;

 private:
  explicit PartitionedCheckpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoe
