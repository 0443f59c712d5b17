// A run's optimizer checkpoints, one per rank, read and joined (zoe/checkpoint.h): each file's manifest says
// which pieces of which parameters its state arrays hold (the partition's record, or every parameter whole at
// world 1), and joining copies each piece to its place.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "src/offload/checkpoint.h"
#include "src/offload/optimizer_manifest.h"
#include "zoe/checkpoint.h"

namespace zoe {
namespace {

// One rank's file: its manifest, and its state arrays' pieces of the trainer's parameters.
struct RankFile {
  std::string path;
  OptimizerManifest manifest;
  std::vector<CheckpointPiece> pieces;  // in the order of the state arrays
  std::size_t elements = 0;
  // The trainer's parameters: the optimizer's own at world 1.
  const std::vector<ManifestParam>& params() const {
    return manifest.world == 1 ? manifest.params : manifest.user_params;
  }
};

Result<RankFile> describe(const std::string& path, const CheckpointReader& reader) {
  Result<OptimizerManifest> m = OptimizerManifest::parse(reader.manifest(), path);
  if (!m.ok()) return m.status();
  RankFile f;
  f.path = path;
  f.manifest = std::move(m).value();
  const OptimizerManifest& mf = f.manifest;
  if (mf.world == 1) {
    for (std::size_t i = 0; i < mf.params.size(); ++i) f.pieces.push_back({i, 0, mf.params[i].n});
  } else if (!mf.pieces_recorded) {
    return Status(StatusCode::corrupt, "checkpoint " + path + ": rank " + std::to_string(mf.rank) + " of " +
                                           std::to_string(mf.world) +
                                           ", written before zoe recorded how partitions join; it cannot be joined");
  } else {
    f.pieces = mf.pieces;
  }
  // Each count is at most 2^60 (OptimizerManifest::parse), their sum is checked: n + 2^62 elements wrapped
  // the byte count of the arrays to that of n, which their checksums then vouched for.
  for (const CheckpointPiece& k : f.pieces) {
    if (__builtin_add_overflow(f.elements, k.n, &f.elements) || f.elements > kMaxCheckpointElements) {
      return Status(StatusCode::corrupt, "checkpoint " + path + ": its state arrays would hold more than 2^60 elements");
    }
  }
  return f;
}

}  // namespace

struct PartitionedCheckpoint::Impl {
  static Result<std::unique_ptr<Impl>> open(const std::vector<std::string>& paths) {
    if (paths.empty()) return invalid_argument("no checkpoint given");
    auto c = std::make_unique<Impl>();
    for (const std::string& p : paths) {
      Result<CheckpointReader> r = CheckpointReader::open(p);
      if (!r.ok()) return r.status();
      Result<RankFile> f = describe(p, r.value());
      if (!f.ok()) return f.status();
      c->readers_.push_back(std::move(r).value());
      c->files_.push_back(std::move(f).value());
    }
    if (Status s = c->check_one_run(); !s.ok()) return s;
    if (Status s = c->check_coverage(); !s.ok()) return s;
    if (Status s = c->name_params(); !s.ok()) return s;
    return c;
  }

  // Checks every file's blobs against their checksums, reading them without keeping them.
  Status verify(std::span<const char* const> blobs) const {
    for (std::size_t f = 0; f < files_.size(); ++f) {
      for (const char* blob : blobs) {
        const Status s = readers_[f].read_streamed(blob, files_[f].elements * 4, CheckpointWriter::kStreamSlice,
                                                   [](std::size_t, const void*, std::size_t) { return Status::success(); });
        if (!s.ok()) return s;
      }
    }
    return Status::success();
  }

  // One blob ("master" or a state array's) of every rank joined: each parameter's elements, whole.
  Result<std::vector<std::vector<float>>> join(const char* blob) const {
    std::vector<std::vector<float>> data(params_.size());
    std::vector<std::size_t> filled(params_.size(), 0);
    for (std::size_t i = 0; i < params_.size(); ++i) data[i].resize(params_[i].n);
    for (std::size_t f = 0; f < files_.size(); ++f) {
      std::vector<float> all(files_[f].elements);
      if (Status s = readers_[f].read(blob, all.data(), all.size() * 4); !s.ok()) return s;
      std::size_t at = 0;
      for (const CheckpointPiece& p : files_[f].pieces) {
        std::memcpy(data[p.param].data() + p.begin, all.data() + at, p.n * 4);
        filled[p.param] += p.n;
        at += p.n;
      }
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (filled[i] != params_[i].n) {
        return Status(StatusCode::corrupt, "parameter " + params_[i].name + ": the checkpoints hold " +
                                               std::to_string(filled[i]) + " of its " + std::to_string(params_[i].n) +
                                               " elements");
      }
    }
    return data;
  }

  // Every parameter's elements held once over the ranks' pieces, before join() allocates a parameter's
  // size: a partitioned file may name a parameter far larger than the pieces its arrays hold.
  Status check_coverage() const {
    const std::vector<ManifestParam>& params = files_[0].params();
    std::vector<std::uint64_t> held(params.size(), 0);
    for (const RankFile& f : files_) {
      for (const CheckpointPiece& p : f.pieces) {
        if (__builtin_add_overflow(held[p.param], p.n, &held[p.param])) held[p.param] = UINT64_MAX;  // never n
      }
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (held[i] != params[i].n) {
        return Status(StatusCode::corrupt, "parameter " + (params[i].name.empty() ? std::to_string(i) : params[i].name) +
                                               ": the checkpoints hold " + std::to_string(held[i]) + " of its " +
                                               std::to_string(params[i].n) + " elements");
      }
    }
    return Status::success();
  }

  // One run's ranks, each once, over the same parameters at the same step.
  Status check_one_run() const {
    const int world = files_[0].manifest.world;
    std::map<int, std::string> by_rank;
    for (const RankFile& f : files_) {
      if (f.manifest.world != world) {
        return invalid_argument(f.path + " is a checkpoint of " + std::to_string(f.manifest.world) + " ranks, " + files_[0].path +
                                " of " + std::to_string(world) + ": give one run's checkpoints");
      }
      const int rank = f.manifest.rank;
      if (!by_rank.emplace(rank, f.path).second) {
        return invalid_argument(f.path + " and " + by_rank[rank] + " are both rank " + std::to_string(rank));
      }
      if (!same_params(f.params(), files_[0].params()) || f.manifest.step != files_[0].manifest.step ||
          f.manifest.rule != files_[0].manifest.rule) {
        return invalid_argument(f.path + " and " + files_[0].path + " are not of one run (their parameters, steps or optimizers differ)");
      }
    }
    for (int r = 0; r < world; ++r) {
      if (!by_rank.count(r)) {
        return invalid_argument("rank " + std::to_string(r) + " of " + std::to_string(world) +
                                " is missing: give every rank's checkpoint");
      }
    }
    return Status::success();
  }

  // The trainer's parameters as every rank records them (dtype and group aside: a partition's pieces of one
  // parameter are all of its dtype and group).
  static bool same_params(const std::vector<ManifestParam>& a, const std::vector<ManifestParam>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const ManifestParam& x, const ManifestParam& y) {
      return x.n == y.n && x.name == y.name && x.shape == y.shape;
    });
  }

  Status name_params() {
    const std::vector<ManifestParam>& params = files_[0].params();
    std::map<std::string, std::size_t> seen;
    for (std::size_t i = 0; i < params.size(); ++i) {
      CheckpointParam e{params[i].name.empty() ? "param." + std::to_string(i) : params[i].name, params[i].shape,
                      params[i].n};
      if (e.shape.empty()) e.shape = {static_cast<std::int64_t>(params[i].n)};
      if (!seen.emplace(e.name, i).second) {
        return invalid_argument("parameters " + std::to_string(seen[e.name]) + " and " + std::to_string(i) +
                                " are both named '" + e.name + "'");
      }
      params_.push_back(std::move(e));
    }
    return Status::success();
  }

  std::vector<CheckpointReader> readers_;
  std::vector<RankFile> files_;
  std::vector<CheckpointParam> params_;
};


Result<PartitionedCheckpoint> PartitionedCheckpoint::open(const std::vector<std::string>& paths) {
  Result<std::unique_ptr<Impl>> impl = Impl::open(paths);
  if (!impl.ok()) return impl.status();
  return PartitionedCheckpoint(std::move(impl).value());
}

PartitionedCheckpoint::PartitionedCheckpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PartitionedCheckpoint::PartitionedCheckpoint(PartitionedCheckpoint&&) noexcept = default;
PartitionedCheckpoint& PartitionedCheckpoint::operator=(PartitionedCheckpoint&&) noexcept = default;
PartitionedCheckpoint::~PartitionedCheckpoint() = default;

const std::vector<CheckpointParam>& PartitionedCheckpoint::params() const { return impl_->params_; }
std::int64_t PartitionedCheckpoint::step() const { return impl_->files_[0].manifest.step; }
LossScaleState PartitionedCheckpoint::loss_scale() const { return impl_->files_[0].manifest.loss_scale; }
const std::vector<CheckpointPiece>& PartitionedCheckpoint::pieces(std::size_t file) const {
  return impl_->files_.at(file).pieces;
}
std::size_t PartitionedCheckpoint::files() const { return impl_->files_.size(); }
Rule PartitionedCheckpoint::rule() const { return impl_->files_[0].manifest.rule; }
std::vector<std::string> PartitionedCheckpoint::state_names() const {
  const OptimizerManifest& m = impl_->files_[0].manifest;
  return zoe::state_names(m.groups.empty() ? hyper_defaults(m.rule) : m.groups[0]);
}
Status PartitionedCheckpoint::verify(std::span<const char* const> blobs) const { return impl_->verify(blobs); }
Result<std::vector<std::vector<float>>> PartitionedCheckpoint::join(const char* blob) const {
  return impl_->join(blob);
}

}  // namespace zoe
