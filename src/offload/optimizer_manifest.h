// The manifest of an optimizer checkpoint (OffloadOptimizer::save): the JSON beside the state arrays that says
// what they are. Written and read here only — by the optimizer's save and load and by PartitionedCheckpoint
// (zoe/checkpoint.h), which `zoe export` and Python's consolidate_state_dicts use.
#pragma once

#include "src/private.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zoe/adam.h"
#include "zoe/checkpoint.h"
#include "zoe/offload.h"
#include "zoe/optimizers.h"
#include "zoe/status.h"

namespace zoe {

struct ManifestParam {
  std::size_t n = 0;
  std::string dtype;  // dtype_name()
  int group = 0;
  std::string name;                 // empty: not recorded
  std::vector<std::int64_t> shape;  // empty: not recorded
  bool operator==(const ManifestParam&) const = default;
};

ManifestParam manifest_param(const ParamSpec& p, bool record_name);

// At most this many elements per parameter, and in a rank's state arrays together: their fp32 bytes, times
// the three arrays, stay inside 64 bits, and a count past it (n + 2^62 in a crafted file) is refused before
// any size is computed from it.
constexpr std::uint64_t kMaxCheckpointElements = std::uint64_t{1} << 60;

// Why a recorded shape does not describe n elements, or "" when it does (or none is recorded). The product
// is taken without overflow: [2^40, 2^40] over n elements is a mismatch, not a wrapped 0. Checked when a
// parameter is described (OffloadOptimizer::create) and when a checkpoint is read, so that no export writes
// a safetensors header its readers refuse.
std::string shape_mismatch(const std::vector<std::int64_t>& shape, std::uint64_t n);

struct OptimizerManifest {
  static constexpr const char* kFormat = "zoe-offload-optimizer";
  // Version 2: state of a rule other than Adam ("optimizer") or with amsgrad's max_exp_avg_sq, which a
  // version-1 reader would take for Adam's two moments. Adam's manifests without amsgrad stay version 1.
  static constexpr int kVersion = 2;

  std::int64_t step = 0;
  std::vector<std::int64_t> param_steps;  // each parameter's step count; empty: all at `step`
  LossScaleState loss_scale;
  int rank = 0, world = 1;
  Rule rule = Rule::adam;  // "optimizer": the rule every group runs; absent: adam
  std::vector<OptimizerHyper> groups;
  std::vector<ManifestParam> params;  // the optimizer's own: this rank's pieces when partitioned
  // Partitioned: the trainer's parameters and where each of `params` lies in them (every rank's checkpoint
  // together holds each one whole). Checkpoints written before zoe recorded this have neither.
  bool pieces_recorded = false;
  std::vector<ManifestParam> user_params;
  std::vector<CheckpointPiece> pieces;
  std::string tier, state_dtype;  // how the run kept its state (the arrays are fp32 whatever it was)

  std::string dump() const;
  // Every field checked for its type and range (a damaged manifest is refused, never half-read): corrupt,
  // or unsupported for a version newer than this build's.
  static Result<OptimizerManifest> parse(const std::string& text, const std::string& path);
};

}  // namespace zoe
