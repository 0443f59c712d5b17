// A run's optimizer checkpoints, one per rank, read and joined (zoe/checkpoint.h): each file's manifest says
// which pieces of which parameters its state arrays hold (the partition's record, or every parameter whole at
// world 1), and joining copies each piece to its place.
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "src/offload/checkpoint.h"
#include "zoe/checkpoint.h"

namespace zoe {
namespace {

using Json = nlohmann::json;


struct UserParam {
  std::size_t n = 0;
  std::string name;
  std::vector<std::int64_t> shape;
  bool operator==(const UserParam&) const = default;
};

struct Piece {
  std::size_t param, begin, n;
};

struct RankFile {
  std::string path;
  int rank = 0, world = 1;
  std::int64_t step = 0;
  std::vector<UserParam> params;
  std::vector<Piece> pieces;  // in the order of the state arrays
  std::size_t elements = 0;
};

Status malformed(const std::string& path, const std::string& what) {
  return Status(StatusCode::corrupt, "checkpoint " + path + ": " + what);
}

std::vector<UserParam> read_params(const Json& list) {
  std::vector<UserParam> out;
  for (const Json& p : list) {
    UserParam u;
    u.n = p.at("n").get<std::size_t>();
    if (p.contains("name")) u.name = p.at("name").get<std::string>();
    if (p.contains("shape")) u.shape = p.at("shape").get<std::vector<std::int64_t>>();
    out.push_back(u);
  }
  return out;
}

Result<RankFile> describe(const std::string& path, const CheckpointReader& reader) {
  const Json m = Json::parse(reader.manifest(), nullptr, false);
  if (m.is_discarded() || m.value("format", "") != "zoe-offload-optimizer") {
    return malformed(path, "not a zoe optimizer checkpoint (its manifest is not one)");
  }
  RankFile f;
  f.path = path;
  try {
    f.step = m.at("step").get<std::int64_t>();
    const Json& part = m.at("partition");
    f.rank = part.at("rank").get<int>();
    f.world = part.at("world").get<int>();
    if (f.world == 1) {
      f.params = read_params(m.at("params"));
      for (std::size_t i = 0; i < f.params.size(); ++i) f.pieces.push_back({i, 0, f.params[i].n});
    } else {
      if (!part.contains("pieces")) {
        return malformed(path, "rank " + std::to_string(f.rank) + " of " + std::to_string(f.world) +
                                   ", written before zoe recorded how partitions join; it cannot be exported");
      }
      f.params = read_params(part.at("params"));
      for (const Json& k : part.at("pieces")) {
        f.pieces.push_back({k.at("param").get<std::size_t>(), k.at("begin").get<std::size_t>(), k.at("n").get<std::size_t>()});
      }
    }
  } catch (const Json::exception& e) {
    return malformed(path, std::string("its manifest is malformed (") + e.what() + ")");
  }
  for (const Piece& k : f.pieces) {
    if (k.param >= f.params.size() || k.begin > f.params[k.param].n || k.n > f.params[k.param].n - k.begin) {
      return malformed(path, "a piece lies outside its parameter");
    }
    f.elements += k.n;
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

  // One blob ("master", "exp_avg", "exp_avg_sq") of every rank joined: each parameter's elements, whole.
  Result<std::vector<std::vector<float>>> join(const char* blob) const {
    std::vector<std::vector<float>> data(params_.size());
    std::vector<std::size_t> filled(params_.size(), 0);
    for (std::size_t i = 0; i < params_.size(); ++i) data[i].resize(params_[i].n);
    for (std::size_t f = 0; f < files_.size(); ++f) {
      std::vector<float> all(files_[f].elements);
      if (Status s = readers_[f].read(blob, all.data(), all.size() * 4); !s.ok()) return s;
      std::size_t at = 0;
      for (const Piece& p : files_[f].pieces) {
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

  // One run's ranks, each once, over the same parameters at the same step.
  Status check_one_run() const {
    const int world = files_[0].world;
    std::map<int, std::string> by_rank;
    for (const RankFile& f : files_) {
      if (f.world != world) {
        return invalid_argument(f.path + " is a checkpoint of " + std::to_string(f.world) + " ranks, " + files_[0].path +
                                " of " + std::to_string(world) + ": give one run's checkpoints");
      }
      if (!by_rank.emplace(f.rank, f.path).second) {
        return invalid_argument(f.path + " and " + by_rank[f.rank] + " are both rank " + std::to_string(f.rank));
      }
      if (f.params != files_[0].params || f.step != files_[0].step) {
        return invalid_argument(f.path + " and " + files_[0].path + " are not of one run (their parameters or steps differ)");
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

  Status name_params() {
    const std::vector<UserParam>& params = files_[0].params;
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
std::int64_t PartitionedCheckpoint::step() const { return impl_->files_[0].step; }
std::size_t PartitionedCheckpoint::files() const { return impl_->files_.size(); }
Status PartitionedCheckpoint::verify(std::span<const char* const> blobs) const { return impl_->verify(blobs); }
Result<std::vector<std::vector<float>>> PartitionedCheckpoint::join(const char* blob) const {
  return impl_->join(blob);
}

}  // namespace zoe
