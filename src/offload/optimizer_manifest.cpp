// The optimizer checkpoint's manifest as JSON. Reading takes nothing on trust: a member of the wrong type, a
// number out of range or a list of the wrong length is refused with what and where, for the optimizer's load
// and for every reader of a run's checkpoints alike.
#include "src/offload/optimizer_manifest.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>


namespace zoe {
namespace {

using Json = nlohmann::json;

// A member of `j` by reference, or null when `j` is not an object or lacks it. Not json::value(), which
// returns a copy, made recursively: a deeply nested member of a damaged manifest overflowed the stack.
const Json& member(const Json& j, const char* key) {
  static const Json kNone;
  if (!j.is_object()) return kNone;
  const auto it = j.find(key);
  return it == j.end() ? kNone : *it;
}

// `v` into `out` if it has the right type and is in range; false otherwise. The writer stores integers as
// JSON integers; a float, or a value out of range, would be converted with undefined behaviour, so it is
// refused.
template <typename T>
bool get(const Json& v, T& out) {
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

template <typename T>
bool get(const Json& j, const char* key, T& out) {
  return get(member(j, key), out);
}

Status corrupt(const std::string& path, const std::string& what) {
  return Status(StatusCode::corrupt, "checkpoint " + path + ": " + what);
}

Json param_json(const ManifestParam& p) {
  Json j = {{"n", p.n}, {"dtype", p.dtype}, {"group", p.group}};
  if (!p.name.empty()) j["name"] = p.name;
  if (!p.shape.empty()) j["shape"] = p.shape;
  return j;
}

bool read_param(const Json& j, ManifestParam& p) {
  if (!get(j, "n", p.n) || !get(j, "dtype", p.dtype) || !get(j, "group", p.group)) return false;
  if (j.contains("name") && !get(j, "name", p.name)) return false;
  if (j.contains("shape")) {
    const Json& shape = member(j, "shape");
    if (!shape.is_array()) return false;
    for (const Json& d : shape) {
      std::int64_t e = 0;
      if (!get(d, e) || e < 0) return false;
      p.shape.push_back(e);
    }
  }
  return true;
}

Status read_params(const Json& list, const char* what, const std::string& path, std::vector<ManifestParam>& out) {
  if (!list.is_array()) return corrupt(path, std::string("its manifest lacks the ") + what + " list");
  for (std::size_t i = 0; i < list.size(); ++i) {
    ManifestParam p;
    if (!read_param(list[i], p)) return corrupt(path, std::string(what) + " " + std::to_string(i) + " is malformed");
    const std::string where = std::string(what) + " " + std::to_string(i) + (p.name.empty() ? "" : " ('" + p.name + "')");
    if (p.n > kMaxCheckpointElements) {
      return corrupt(path, where + " has " + std::to_string(p.n) + " elements, more than a checkpoint holds (2^60)");
    }
    if (std::string why = shape_mismatch(p.shape, p.n); !why.empty()) return corrupt(path, where + ": " + why);
    out.push_back(std::move(p));
  }
  return Status::success();
}

// Each group's fields of the manifest's rule, by the optimizer table: every number is required; a flag may be
// absent (the rule's default; Adam's maximize was written only when true).
Status read_groups(const Json& list, const std::string& path, Rule rule, std::vector<OptimizerHyper>& out) {
  if (!list.is_array()) return corrupt(path, "its manifest lacks the params or groups list");
  const OptimizerHyper defaults = hyper_defaults(rule);
  for (std::size_t g = 0; g < list.size(); ++g) {
    OptimizerHyper h = defaults;
    const Json& w = list[g];
    bool ok = w.is_object();
    for (const HyperField& f : optimizer_rule(rule).fields) {
      const std::string key(f.name);
      if (f.number != nullptr) {
        ok = ok && get(w, key.c_str(), h.*f.number);
      } else if (ok && w.contains(key)) {
        ok = get(w, key.c_str(), h.*f.flag);
      }
    }
    if (!ok) return corrupt(path, "param group " + std::to_string(g) + " is malformed");
    if (Status s = validate_hyper(h); !s.ok()) return corrupt(path, "param group " + std::to_string(g) + ": " + s.message());
    out.push_back(h);
  }
  return Status::success();
}

// The step count, the loss scaler's state and each parameter's step count.
Status read_counters(const Json& j, const std::string& path, OptimizerManifest& m) {
  const Json& scale = member(j, "loss_scale");
  LossScaleState& ls = m.loss_scale;
  if (!get(j, "step", m.step) || m.step < 0 || !get(scale, "scale", ls.scale) || !(ls.scale > 0) ||
      !get(scale, "clean_steps", ls.clean_steps) || ls.clean_steps < 0 ||
      !get(scale, "hysteresis_left", ls.hysteresis_left) || ls.hysteresis_left < 1) {
    return corrupt(path, "step or loss-scale state is malformed");
  }
  if (!j.contains("param_steps")) return Status::success();
  const Json& ps = member(j, "param_steps");
  bool ok = ps.is_array() && ps.size() == m.params.size();
  for (std::size_t i = 0; ok && i < ps.size(); ++i) {
    std::int64_t t = 0;
    ok = get(ps[i], t) && t >= 0 && t <= m.step;
    m.param_steps.push_back(t);
  }
  if (!ok) return corrupt(path, "param_steps is malformed");
  return Status::success();
}

// Partitioned: the trainer's parameters and the pieces of them this rank's arrays hold, each inside its
// parameter.
Status read_pieces(const Json& part, const std::string& path, OptimizerManifest& m) {
  if (!part.contains("pieces")) return Status::success();
  if (Status s = read_params(member(part, "params"), "partitioned parameter", path, m.user_params); !s.ok()) return s;
  const Json& list = member(part, "pieces");
  if (!list.is_array()) return corrupt(path, "its partition's pieces are malformed");
  for (const Json& k : list) {
    CheckpointPiece p;
    if (!get(k, "param", p.param) || !get(k, "begin", p.begin) || !get(k, "n", p.n) || p.param >= m.user_params.size() ||
        p.begin > m.user_params[p.param].n || p.n > m.user_params[p.param].n - p.begin) {
      return corrupt(path, "a piece lies outside its parameter");
    }
    m.pieces.push_back(p);
  }
  m.pieces_recorded = true;
  return Status::success();
}

}  // namespace

std::string shape_mismatch(const std::vector<std::int64_t>& shape, std::uint64_t n) {
  if (shape.empty()) return "";
  std::string text = "[";
  std::uint64_t product = 1;
  bool overflow = false;
  for (std::int64_t d : shape) {
    text += (text.size() > 1 ? ", " : "") + std::to_string(d);
    if (d < 0) return "its shape has a negative dimension " + std::to_string(d);
    overflow = overflow || __builtin_mul_overflow(product, static_cast<std::uint64_t>(d), &product);
  }
  text += "]";
  if (overflow) return "its shape " + text + " holds more than 2^64 elements, and it has " + std::to_string(n);
  if (product != n) {
    return "its shape " + text + " holds " + std::to_string(product) + " elements, and it has " + std::to_string(n);
  }
  return "";
}

ManifestParam manifest_param(const ParamSpec& p, bool record_name) {
  return {p.n, std::string(dtype_name(p.dtype)), p.group, record_name ? p.name : std::string(), p.shape};
}

std::string OptimizerManifest::dump() const {
  Json j;
  j["format"] = kFormat;
  j["version"] = 1;  // Adam's; a rule of version 2 sets it below
  j["step"] = step;
  if (!param_steps.empty()) j["param_steps"] = param_steps;
  j["loss_scale"] = {{"scale", loss_scale.scale},
                     {"clean_steps", loss_scale.clean_steps},
                     {"hysteresis_left", loss_scale.hysteresis_left}};
  j["partition"] = {{"rank", rank}, {"world", world}};
  j["groups"] = Json::array();
  // Another rule's state, or amsgrad's third array, would be taken for Adam's two by a version-1 reader.
  const bool amsgrad = std::any_of(groups.begin(), groups.end(), [](const OptimizerHyper& h) { return h.amsgrad; });
  if (rule != Rule::adam || amsgrad) j["version"] = kVersion;
  if (rule != Rule::adam) j["optimizer"] = std::string(optimizer_rule(rule).name);
  // The rule's fields; a flag whose default is false only when true (Adam's manifests stay as they were).
  const OptimizerHyper defaults = hyper_defaults(rule);
  for (const OptimizerHyper& h : groups) {
    Json w = Json::object();
    for (const HyperField& f : optimizer_rule(rule).fields) {
      const std::string key(f.name);
      if (f.number != nullptr) {
        w[key] = h.*f.number;
      } else if (h.*f.flag || defaults.*f.flag) {
        w[key] = h.*f.flag;
      }
    }
    j["groups"].push_back(std::move(w));
  }
  j["params"] = Json::array();
  for (const ManifestParam& p : params) j["params"].push_back(param_json(p));
  if (pieces_recorded) {
    Json& part = j["partition"];
    part["params"] = Json::array();
    for (const ManifestParam& p : user_params) part["params"].push_back(param_json(p));
    part["pieces"] = Json::array();
    for (const CheckpointPiece& k : pieces) part["pieces"].push_back({{"param", k.param}, {"begin", k.begin}, {"n", k.n}});
  }
  if (!tier.empty()) j["tier"] = tier;
  if (!state_dtype.empty()) j["state_dtype"] = state_dtype;
  return j.dump();
}

Result<OptimizerManifest> OptimizerManifest::parse(const std::string& text, const std::string& path) {
  const Json j = Json::parse(text, nullptr, false);
  std::string format;
  int version = 0;
  if (j.is_discarded() || !get(j, "format", format) || format != kFormat) {
    return corrupt(path, "its manifest is not a zoe optimizer manifest");
  }
  if (!get(j, "version", version) || version > kVersion) {
    return Status(StatusCode::unsupported, "checkpoint " + path + " has manifest version " + std::to_string(version) +
                                               "; this build reads up to " + std::to_string(kVersion));
  }
  OptimizerManifest m;
  const Json& part = member(j, "partition");
  if (!get(part, "rank", m.rank) || !get(part, "world", m.world) || m.world < 1 || m.rank < 0 || m.rank >= m.world) {
    return corrupt(path, "its partition (rank and world) is malformed");
  }
  if (!member(j, "params").is_array() || !member(j, "groups").is_array()) {
    return corrupt(path, "its manifest lacks the params or groups list");
  }
  if (Status s = read_params(member(j, "params"), "parameter", path, m.params); !s.ok()) return s;
  if (j.contains("optimizer")) {
    std::string name;
    const OptimizerRule* r = get(j, "optimizer", name) ? find_optimizer_rule(name) : nullptr;
    if (r == nullptr || r->name != name) return corrupt(path, "its optimizer is not one zoe has");
    m.rule = r->rule;
  }
  if (Status s = read_groups(member(j, "groups"), path, m.rule, m.groups); !s.ok()) return s;
  if (Status s = read_counters(j, path, m); !s.ok()) return s;
  if (Status s = read_pieces(part, path, m); !s.ok()) return s;
  if (j.contains("tier") && !get(j, "tier", m.tier)) return corrupt(path, "its tier is malformed");
  if (j.contains("state_dtype") && !get(j, "state_dtype", m.state_dtype)) return corrupt(path, "its state_dtype is malformed");
  return m;
}

}  // namespace zoe
