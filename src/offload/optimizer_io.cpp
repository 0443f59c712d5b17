// OffloadOptimizer save/load: the whole optimizer state in one checkpoint file (checkpoint.h: atomic,
// checksummed), described by a manifest that load compares with this optimizer before touching anything.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>

#include "base/aligned_buffer.h"
#include "src/offload/checkpoint.h"
#include "src/offload/optimizer_impl.h"

namespace zoe {
namespace {

constexpr const char* kFormat = "zoe-offload-optimizer";
constexpr int kManifestVersion = 1;

nlohmann::json param_json(const ParamSpec& p, bool record_name) {
  nlohmann::json j = {{"n", p.n}, {"dtype", std::string(dtype_name(p.dtype))}, {"group", p.group}};
  if (record_name && !p.name.empty()) j["name"] = p.name;
  if (!p.shape.empty()) j["shape"] = p.shape;
  return j;
}

nlohmann::json hyper_json(const AdamHyper& h) {
  return {{"lr", h.lr}, {"beta1", h.beta1}, {"beta2", h.beta2}, {"eps", h.eps}, {"weight_decay", h.weight_decay},
          {"adamw", h.adamw}, {"bias_correction", h.bias_correction}};
}

// A member of `j` by reference, or null when `j` is not an object or lacks it. Not json::value(), which
// returns a copy, made recursively: a deeply nested member of a damaged manifest overflowed the stack.
const nlohmann::json& member(const nlohmann::json& j, const char* key) {
  static const nlohmann::json kNone;
  if (!j.is_object()) return kNone;
  const auto it = j.find(key);
  return it == j.end() ? kNone : *it;
}

// Reads `key` of object `j` into `out` if present with the right type and in range; false otherwise. The
// writer stores integers as JSON integers; a float, or a value out of range, would be converted with
// undefined behaviour, so it is refused.
template <typename T>
bool get(const nlohmann::json& j, const char* key, T& out) {
  const nlohmann::json& v = member(j, key);
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return false;
    out = v.get<bool>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return false;
    out = v.get<std::string>();
  } else if constexpr (std::is_integral_v<T>) {
    using Limits = std::numeric_limits<T>;
    if (v.is_number_unsigned()) {
      const auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(Limits::max())) return false;
      out = static_cast<T>(u);
    } else if (v.is_number_integer()) {
      const auto i = v.get<std::int64_t>();
      if (i < static_cast<std::int64_t>(Limits::min()) ||
          (i > 0 && static_cast<std::uint64_t>(i) > static_cast<std::uint64_t>(Limits::max()))) {
        return false;
      }
      out = static_cast<T>(i);
    } else {
      return false;
    }
  } else {
    if (!v.is_number()) return false;
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::fabs(d) > static_cast<double>(std::numeric_limits<T>::max())) return false;
    out = static_cast<T>(d);
  }
  return true;
}

}  // namespace

Status OffloadOptimizer::save(const std::string& path, bool record_names) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (Status s = wait(); !s.ok()) return s;
  // Tier nvme with durability checkpoint: the swap files become durable here, and only here.
  if (Status s = m.tier->flush(); !s.ok()) return s;
  nlohmann::json manifest;
  manifest["format"] = kFormat;
  manifest["version"] = kManifestVersion;
  manifest["step"] = m.step_count.load();
  // Parameters that missed steps (no gradient) have their own count: recorded only then.
  if (std::any_of(m.param_steps.begin(), m.param_steps.end(), [&](std::int64_t t) { return t != m.step_count.load(); })) {
    manifest["param_steps"] = m.param_steps;
  }
  const LossScaler::State ls = m.scaler.state();
  manifest["loss_scale"] = {{"scale", ls.scale}, {"clean_steps", ls.clean_steps}, {"hysteresis_left", ls.hysteresis_left}};
  manifest["partition"] = {{"rank", m.partition ? m.partition->comm->rank() : 0},
                           {"world", m.partition ? m.partition->comm->world() : 1}};
  for (const ParamGroup& g : m.groups) manifest["groups"].push_back(hyper_json(g.hyper));
  for (const ParamSpec& p : m.params) manifest["params"].push_back(param_json(p, record_names));
  if (m.partition) {
    // The trainer's parameters and where each of ours lies in them: every rank's checkpoint together
    // holds each parameter whole (zoe export joins them).
    nlohmann::json& part = manifest["partition"];
    for (const ParamSpec& p : m.partition->user) part["params"].push_back(param_json(p, record_names));
    for (const Piece& k : m.partition->origin) part["pieces"].push_back({{"param", k.param}, {"begin", k.begin}, {"n", k.n}});
  }
  manifest["tier"] = std::string(tier_name(m.options.tier));
  // The moments are stored as fp32 whatever the run kept them in (bf16 widens exactly; i8 is decoded, and
  // its codes and scales are stored beside them for the run itself to resume exactly): recorded so that a
  // reader knows how they were kept.
  manifest["state_dtype"] = state_dtype_name(m.options.state_dtype);
  Result<CheckpointWriter> writer = CheckpointWriter::create(path);
  if (!writer.ok()) return writer.status();
  const std::size_t total = m.offsets.back();
  const char* names[3] = {"master", "exp_avg", "exp_avg_sq"};
  // An array the tier does not hold contiguously in RAM (tier nvme; in place, the master) streams out a
  // slice at a time.
  AlignedBuffer slice;
  for (int k = 0; k < 3; ++k) {
    const float* contiguous = m.tier->flat(k);
    if (contiguous == nullptr && slice.data() == nullptr) {
      Result<AlignedBuffer> b = AlignedBuffer::allocate(CheckpointWriter::kStreamSlice);
      if (!b.ok()) return b.status();
      slice = std::move(b).value();
    }
    const Status s = writer->add_streamed(names[k], total * 4, [&](std::size_t offset, std::size_t n, const void** out) {
      if (contiguous != nullptr) {
        *out = reinterpret_cast<const unsigned char*>(contiguous) + offset;
        return Status::success();
      }
      *out = slice.data();
      float* arrays[3] = {nullptr, nullptr, nullptr};
      arrays[k] = slice.as<float>();
      return m.tier->read(offset / 4, n / 4, arrays[0], arrays[1], arrays[2]);
    });
    if (!s.ok()) return s;
  }
  if (Status s = m.tier->save_q8(writer.value()); !s.ok()) return s;
  // In place, the 16-bit weights are the device's own.
  std::vector<unsigned char> weights16;
  if (m.in_place) {
    weights16.resize(m.weight_offsets.back());
    for (std::size_t i = 0; i < m.params.size(); ++i) {
      const std::size_t bytes = m.weight_offsets[i + 1] - m.weight_offsets[i];
      if (bytes > 0) std::memcpy(weights16.data() + m.weight_offsets[i], m.weights_of(i), bytes);
    }
  }
  const void* w16 = m.in_place ? static_cast<const void*>(weights16.data()) : m.weight_staging;
  if (Status s = writer->add("weights16", w16, m.weight_offsets.back()); !s.ok()) return s;
  return writer->commit(manifest.dump());
}

namespace {

Status refuse(const std::string& path, const std::string& why) {
  return Status(StatusCode::invalid_argument, "checkpoint " + path + " does not fit this optimizer: " + why);
}

// The manifest's format and version, which say whether the rest can be read at all.
Status check_format(const nlohmann::json& manifest, const std::string& path) {
  std::string format;
  int version = 0;
  if (manifest.is_discarded() || !get(manifest, "format", format) || format != kFormat) {
    return Status(StatusCode::corrupt, "checkpoint " + path + ": its manifest is not a zoe optimizer manifest");
  }
  if (!get(manifest, "version", version) || version > kManifestVersion) {
    return Status(StatusCode::unsupported, "checkpoint " + path + " has manifest version " + std::to_string(version) +
                                               "; this build reads up to " + std::to_string(kManifestVersion));
  }
  return Status::success();
}

// The partition, the parameters and the number of groups, compared with this optimizer's.
Status check_layout(const Impl& m, const nlohmann::json& manifest, const std::string& path) {
  int rank = -1, world = -1;
  const nlohmann::json& partition = member(manifest, "partition");
  const int my_rank = m.partition ? m.partition->comm->rank() : 0;
  const int my_world = m.partition ? m.partition->comm->world() : 1;
  if (!get(partition, "rank", rank) || !get(partition, "world", world) || rank != my_rank || world != my_world) {
    return refuse(path, "it was written by rank " + std::to_string(rank) + " of " + std::to_string(world) +
                            "; this optimizer is rank " + std::to_string(my_rank) + " of " + std::to_string(my_world));
  }
  const nlohmann::json& params = member(manifest, "params");
  const nlohmann::json& groups = member(manifest, "groups");
  if (!params.is_array() || !groups.is_array()) {
    return Status(StatusCode::corrupt, "checkpoint " + path + ": its manifest lacks the params or groups list");
  }
  if (params.size() != m.params.size()) {
    return refuse(path, "it holds " + std::to_string(params.size()) + " parameters, this optimizer " +
                            std::to_string(m.params.size()));
  }
  if (groups.size() != m.groups.size()) {
    return refuse(path, "it holds " + std::to_string(groups.size()) + " param groups, this optimizer " +
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
      return refuse(path, "parameter " + std::to_string(i) + " is n=" + std::to_string(n) + " " + dtype + " in group " +
                              std::to_string(group) + " there, n=" + std::to_string(p.n) + " " +
                              std::string(dtype_name(p.dtype)) + " in group " + std::to_string(p.group) + " here");
    }
  }
  return Status::success();
}

// Each group's hyper-parameters, into `groups` (as many as the manifest's, checked by check_layout).
Status read_groups(const nlohmann::json& manifest, const std::string& path, std::vector<ParamGroup>& groups) {
  const nlohmann::json& written = member(manifest, "groups");
  for (std::size_t g = 0; g < written.size(); ++g) {
    AdamHyper& h = groups[g].hyper;
    if (!get(written[g], "lr", h.lr) || !get(written[g], "beta1", h.beta1) || !get(written[g], "beta2", h.beta2) ||
        !get(written[g], "eps", h.eps) || !get(written[g], "weight_decay", h.weight_decay) ||
        !get(written[g], "adamw", h.adamw) || !get(written[g], "bias_correction", h.bias_correction)) {
      return Status(StatusCode::corrupt, "checkpoint " + path + ": param group " + std::to_string(g) + " is malformed");
    }
    if (Status s = CpuAdam::validate(h); !s.ok()) {
      return Status(StatusCode::corrupt, "checkpoint " + path + ": param group " + std::to_string(g) + ": " + s.message());
    }
  }
  return Status::success();
}

// The step count, the loss scaler's state and each parameter's step count.
Status read_counters(const nlohmann::json& manifest, const std::string& path, std::int64_t& step,
                     LossScaler::State& ls, std::vector<std::int64_t>& param_steps) {
  const nlohmann::json& scale = member(manifest, "loss_scale");
  if (!get(manifest, "step", step) || step < 0 || !get(scale, "scale", ls.scale) || !(ls.scale > 0) ||
      !get(scale, "clean_steps", ls.clean_steps) || ls.clean_steps < 0 ||
      !get(scale, "hysteresis_left", ls.hysteresis_left) || ls.hysteresis_left < 1) {
    return Status(StatusCode::corrupt, "checkpoint " + path + ": step or loss-scale state is malformed");
  }
  std::fill(param_steps.begin(), param_steps.end(), step);
  if (manifest.contains("param_steps")) {
    const nlohmann::json& ps = manifest["param_steps"];
    bool ok = ps.is_array() && ps.size() == param_steps.size();
    for (std::size_t i = 0; ok && i < param_steps.size(); ++i) {
      ok = ps[i].is_number_integer() && ps[i].get<std::int64_t>() >= 0 && ps[i].get<std::int64_t>() <= step;
      if (ok) param_steps[i] = ps[i].get<std::int64_t>();
    }
    if (!ok) return Status(StatusCode::corrupt, "checkpoint " + path + ": param_steps is malformed");
  }
  return Status::success();
}

// The loaded 16-bit weights (and, in place, the f32 masters the tier loaded) where the step reads them.
void place_weights(Impl& m, const AlignedBuffer& weights) {
  if (m.in_place) {
    // The device's weights are the ones to set: f32 masters and 16-bit copies alike.
    for (std::size_t i = 0; i < m.params.size(); ++i) {
      const ParamSpec& p = m.params[i];
      if (p.dtype == DType::f32) {
        std::memcpy(p.device_weights, m.tier->master(i), p.n * 4);
      } else if (p.n > 0) {
        std::memcpy(p.device_weights, weights.as<unsigned char>() + m.weight_offsets[i], p.n * 2);
      }
    }
  } else if (m.weight_offsets.back() > 0) {
    std::memcpy(m.weight_staging, weights.data(), m.weight_offsets.back());
  }
}

}  // namespace

// Everything is read and checked into temporary buffers first: a refused or corrupt checkpoint leaves the
// optimizer as it was.
Status OffloadOptimizer::load(const std::string& path) {
  const std::lock_guard serial(impl_->calls);
  Impl& m = *impl_;
  if (Status s = wait(); !s.ok()) return s;
  Result<CheckpointReader> reader = CheckpointReader::open(path);
  if (!reader.ok()) return reader.status();
  const nlohmann::json manifest = nlohmann::json::parse(reader->manifest(), nullptr, false);
  if (Status s = check_format(manifest, path); !s.ok()) return s;
  if (Status s = check_layout(m, manifest, path); !s.ok()) return s;
  std::vector<ParamGroup> new_groups = m.groups;
  if (Status s = read_groups(manifest, path, new_groups); !s.ok()) return s;
  std::int64_t step = 0;
  LossScaler::State ls{};
  std::vector<std::int64_t> param_steps(m.params.size());
  if (Status s = read_counters(manifest, path, step, ls, param_steps); !s.ok()) return s;
  Result<AlignedBuffer> weights = AlignedBuffer::allocate(m.weight_offsets.back());
  if (!weights.ok()) return weights.status();
  if (Status s = reader->read("weights16", weights->data(), m.weight_offsets.back()); !s.ok()) return s;
  if (Status s = m.tier->load(reader.value(), path, step); !s.ok()) return s;
  place_weights(m, *weights);
  m.groups = std::move(new_groups);
  m.step_count = step;
  m.param_steps = std::move(param_steps);
  m.scaler.restore(ls);
  m.visible_scale = m.scaler.scale();
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    if (Status s = m.enqueue_h2d(i); !s.ok()) return s;
  }
  if (Status s = m.finish_h2d(); !s.ok()) return s;
  // Partitioned: this rank set its shard of the weights; every rank's are gathered into every parameter.
  return m.partition ? m.partition_gather_weights() : Status::success();
}

}  // namespace zoe
