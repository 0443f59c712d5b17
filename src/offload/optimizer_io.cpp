// OffloadOptimizer save/load: the whole optimizer state in one checkpoint file (checkpoint.h: atomic,
// checksummed), described by a manifest that load compares with this optimizer before touching anything.
#include <nlohmann/json.hpp>

#include <cstring>
#include <string>

#include "src/offload/checkpoint.h"
#include "src/offload/optimizer_impl.h"

namespace zoe {
namespace {

constexpr const char* kFormat = "zoe-offload-optimizer";
constexpr int kManifestVersion = 1;

nlohmann::json hyper_json(const AdamHyper& h) {
  return {{"lr", h.lr}, {"beta1", h.beta1}, {"beta2", h.beta2}, {"eps", h.eps}, {"weight_decay", h.weight_decay},
          {"adamw", h.adamw}, {"bias_correction", h.bias_correction}};
}

// Reads `key` of object `j` into `out` if present with the right type; false otherwise.
template <typename T>
bool get(const nlohmann::json& j, const char* key, T& out) {
  const auto it = j.find(key);
  if (it == j.end()) return false;
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) return false;
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) return false;
  } else {
    if (!it->is_number()) return false;
  }
  out = it->get<T>();
  return true;
}

}  // namespace

Status OffloadOptimizer::save(const std::string& path) {
  Impl& m = *impl_;
  if (Status s = wait(); !s.ok()) return s;
  nlohmann::json manifest;
  manifest["format"] = kFormat;
  manifest["version"] = kManifestVersion;
  manifest["step"] = m.step_count.load();
  const LossScaler::State ls = m.scaler.state();
  manifest["loss_scale"] = {{"scale", ls.scale}, {"clean_steps", ls.clean_steps}, {"hysteresis_left", ls.hysteresis_left}};
  manifest["partition"] = {{"rank", 0}, {"world", 1}};
  for (const ParamGroup& g : m.groups) manifest["groups"].push_back(hyper_json(g.hyper));
  for (const ParamSpec& p : m.params) {
    manifest["params"].push_back({{"n", p.n}, {"dtype", std::string(dtype_name(p.dtype))}, {"group", p.group}});
  }
  Result<CheckpointWriter> writer = CheckpointWriter::create(path);
  if (!writer.ok()) return writer.status();
  const std::size_t total = m.offsets.back();
  const struct {
    const char* name;
    const void* data;
    std::size_t bytes;
  } blobs[] = {{"master", m.master.data(), total * 4},
               {"exp_avg", m.exp_avg.data(), total * 4},
               {"exp_avg_sq", m.exp_avg_sq.data(), total * 4},
               {"weights16", m.weight_staging, m.weight_offsets.back()}};
  for (const auto& b : blobs) {
    if (Status s = writer->add(b.name, b.data, b.bytes); !s.ok()) return s;
  }
  return writer->commit(manifest.dump());
}

// Everything is read and checked into temporary buffers first: a refused or corrupt checkpoint leaves the
// optimizer as it was.
Status OffloadOptimizer::load(const std::string& path) {
  Impl& m = *impl_;
  if (Status s = wait(); !s.ok()) return s;
  Result<CheckpointReader> reader = CheckpointReader::open(path);
  if (!reader.ok()) return reader.status();
  const nlohmann::json manifest = nlohmann::json::parse(reader->manifest(), nullptr, false);
  auto refuse = [&path](const std::string& why) {
    return Status(StatusCode::invalid_argument, "checkpoint " + path + " does not fit this optimizer: " + why);
  };
  std::string format;
  int version = 0;
  if (manifest.is_discarded() || !get(manifest, "format", format) || format != kFormat) {
    return Status(StatusCode::corrupt, "checkpoint " + path + ": its manifest is not a zoe optimizer manifest");
  }
  if (!get(manifest, "version", version) || version > kManifestVersion) {
    return Status(StatusCode::unsupported, "checkpoint " + path + " has manifest version " + std::to_string(version) +
                                               "; this build reads up to " + std::to_string(kManifestVersion));
  }
  const auto& params = manifest.value("params", nlohmann::json::array());
  const auto& groups = manifest.value("groups", nlohmann::json::array());
  if (params.size() != m.params.size()) {
    return refuse("it holds " + std::to_string(params.size()) + " parameters, this optimizer " +
                  std::to_string(m.params.size()));
  }
  if (groups.size() != m.groups.size()) {
    return refuse("it holds " + std::to_string(groups.size()) + " param groups, this optimizer " +
                  std::to_string(m.groups.size()));
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    std::size_t n = 0;
    std::string dtype;
    int group = -1;
    if (!get(params[i], "n", n) || !get(params[i], "dtype", dtype) || !get(params[i], "group", group)) {
      return Status(StatusCode::corrupt, "checkpoint " + path + ": parameter " + std::to_string(i) + " is malformed");
    }
    const ParamSpec& p = m.params[i];
    if (n != p.n || dtype != dtype_name(p.dtype) || group != p.group) {
      return refuse("parameter " + std::to_string(i) + " is n=" + std::to_string(n) + " " + dtype + " in group " +
                    std::to_string(group) + " there, n=" + std::to_string(p.n) + " " + std::string(dtype_name(p.dtype)) +
                    " in group " + std::to_string(p.group) + " here");
    }
  }
  int rank = -1, world = -1;
  const auto& partition = manifest.value("partition", nlohmann::json::object());
  if (!get(partition, "rank", rank) || !get(partition, "world", world) || rank != 0 || world != 1) {
    return refuse("it was written by rank " + std::to_string(rank) + " of " + std::to_string(world) +
                  "; this optimizer is rank 0 of 1");
  }
  std::vector<ParamGroup> new_groups = m.groups;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    AdamHyper& h = new_groups[g].hyper;
    if (!get(groups[g], "lr", h.lr) || !get(groups[g], "beta1", h.beta1) || !get(groups[g], "beta2", h.beta2) ||
        !get(groups[g], "eps", h.eps) || !get(groups[g], "weight_decay", h.weight_decay) ||
        !get(groups[g], "adamw", h.adamw) || !get(groups[g], "bias_correction", h.bias_correction)) {
      return Status(StatusCode::corrupt, "checkpoint " + path + ": param group " + std::to_string(g) + " is malformed");
    }
  }
  std::int64_t step = 0;
  LossScaler::State ls{};
  const auto& scale = manifest.value("loss_scale", nlohmann::json::object());
  if (!get(manifest, "step", step) || step < 0 || !get(scale, "scale", ls.scale) ||
      !get(scale, "clean_steps", ls.clean_steps) || !get(scale, "hysteresis_left", ls.hysteresis_left)) {
    return Status(StatusCode::corrupt, "checkpoint " + path + ": step or loss-scale state is malformed");
  }
  const std::size_t total = m.offsets.back();
  AlignedBuffer loaded[3];
  const char* names[3] = {"master", "exp_avg", "exp_avg_sq"};
  for (int k = 0; k < 3; ++k) {
    Result<AlignedBuffer> b = AlignedBuffer::allocate(total * 4);
    if (!b.ok()) return b.status();
    loaded[k] = std::move(b).value();
    if (Status s = reader->read(names[k], loaded[k].data(), total * 4); !s.ok()) return s;
  }
  Result<AlignedBuffer> weights = AlignedBuffer::allocate(m.weight_offsets.back());
  if (!weights.ok()) return weights.status();
  if (Status s = reader->read("weights16", weights->data(), m.weight_offsets.back()); !s.ok()) return s;

  m.master = std::move(loaded[0]);
  m.exp_avg = std::move(loaded[1]);
  m.exp_avg_sq = std::move(loaded[2]);
  if (m.weight_offsets.back() > 0) std::memcpy(m.weight_staging, weights->data(), m.weight_offsets.back());
  m.groups = std::move(new_groups);
  m.step_count = step;
  m.scaler.restore(ls);
  m.visible_scale = m.scaler.scale();
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    if (Status s = m.enqueue_h2d(i); !s.ok()) return s;
  }
  return m.finish_h2d();
}

}  // namespace zoe
