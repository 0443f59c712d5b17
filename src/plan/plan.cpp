// zoe plan's arithmetic (plan.h): the ZeRO memory formulas per placement, the fit check, the placement
// order, the step estimate and the DeepSpeed-style config.
#include "src/plan/plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <new>
#include <utility>
#include <nlohmann/json.hpp>

namespace zoe::plan {
namespace {

using Json = nlohmann::ordered_json;

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

// A number with an optional decimal point and one suffix from `suffixes` (multipliers in `scales`).
Result<std::uint64_t> parse_scaled(std::string_view text, std::string_view what, std::string_view suffixes,
                                   std::initializer_list<double> scales, std::string_view example) {
  std::string t(text);
  double scale = 1;
  if (!t.empty() && std::isalpha(static_cast<unsigned char>(t.back()))) {
    const std::size_t k = suffixes.find(static_cast<char>(std::toupper(static_cast<unsigned char>(t.back()))));
    if (k == std::string_view::npos) {
      return invalid_argument(std::string(what) + ": unknown suffix '" + t.back() + "' in '" + t + "' (use " +
                              std::string(example) + ")");
    }
    scale = scales.begin()[k];
    t.pop_back();
  }
  // Digits and one decimal point only: strtod alone would also take "0x10" (hex), "1e3" and "inf".
  const bool plain = !t.empty() && t.find_first_not_of("0123456789.") == std::string::npos &&
                     std::count(t.begin(), t.end(), '.') <= 1 && t != ".";
  char* end = nullptr;
  const double v = plain ? std::strtod(t.c_str(), &end) : -1;
  if (v < 0 || end == nullptr || *end != '\0' || !std::isfinite(v) || v * scale >= 1.8e19) {
    return invalid_argument(std::string(what) + ": '" + std::string(text) + "' is not a size (use " +
                            std::string(example) + ")");
  }
  return static_cast<std::uint64_t>(std::llround(v * scale));
}

// A model config is read into std::map objects, not ordered_json's vector of pairs: growing that vector
// copies each earlier value (its pairs hold a const key, so they cannot be moved), and copying a deeply
// nested value recurses once per level (60000 levels overflowed the stack under AddressSanitizer).
using ConfigJson = nlohmann::json;

std::string shown(const ConfigJson& v) { return v.dump(-1, ' ', false, ConfigJson::error_handler_t::replace); }

// The first of `names` that `cfg` has, as a positive integer; 0 when none is there.
Result<std::uint64_t> field(const ConfigJson& cfg, std::initializer_list<const char*> names, std::string_view source) {
  for (const char* n : names) {
    const auto it = cfg.find(n);
    if (it == cfg.end() || it->is_null()) continue;
    // The parser stores every integer written without a sign as unsigned: anything else is not a count.
    if (!it->is_number_unsigned() || it->get<std::uint64_t>() == 0) {
      return invalid_argument(std::string(source) + ": '" + n + "' must be a positive integer, not " + shown(*it));
    }
    return it->get<std::uint64_t>();
  }
  return std::uint64_t{0};
}

// An optional string or boolean key (null is absent); another type is an error naming the key, where
// nlohmann's value() would throw.
Result<std::string> text_field(const ConfigJson& cfg, const char* name, std::string_view source) {
  const auto it = cfg.find(name);
  if (it == cfg.end() || it->is_null()) return std::string();
  if (!it->is_string()) {
    return invalid_argument(std::string(source) + ": '" + name + "' must be a string, not " + shown(*it));
  }
  return it->get<std::string>();
}

Result<bool> bool_field(const ConfigJson& cfg, const char* name, bool fallback, std::string_view source) {
  const auto it = cfg.find(name);
  if (it == cfg.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    return invalid_argument(std::string(source) + ": '" + name + "' must be true or false, not " + shown(*it));
  }
  return it->get<bool>();
}

std::string billions(std::uint64_t n) {
  char b[32];
  if (n >= 1'000'000'000) {
    std::snprintf(b, sizeof b, "%.2fB", n / 1e9);
  } else {
    std::snprintf(b, sizeof b, "%.2fM", n / 1e6);
  }
  return b;
}

}  // namespace

std::string format_bytes(std::uint64_t bytes) {
  char b[32];
  if (bytes >= (1ull << 40)) {
    std::snprintf(b, sizeof b, "%.2f TiB", bytes / double(1ull << 40));
  } else if (bytes >= (1ull << 30)) {
    std::snprintf(b, sizeof b, "%.1f GiB", bytes / double(1ull << 30));
  } else {
    std::snprintf(b, sizeof b, "%.1f MiB", bytes / double(1ull << 20));
  }
  return b;
}

std::string_view offload_name(Offload o) {
  switch (o) {
    case Offload::none: return "none";
    case Offload::cpu: return "cpu";
    case Offload::nvme: return "nvme";
  }
  return "?";
}

Result<Offload> parse_offload(std::string_view text, std::string_view option) {
  for (Offload o : {Offload::none, Offload::cpu, Offload::nvme}) {
    if (offload_name(o) == text) return o;
  }
  return invalid_argument(std::string(option) + ": '" + std::string(text) + "' is not one of none, cpu, nvme");
}

Result<DType> parse_state_dtype(std::string_view text) {
  if (Result<DType> d = zoe::parse_state_dtype(text); d.ok()) return d;
  return invalid_argument("--state-dtype: '" + std::string(text) + "' is not one of fp32, bf16, int8");
}

Result<std::uint64_t> parse_param_count(std::string_view text) {
  return parse_scaled(text, "--params", "KMBGT", {1e3, 1e6, 1e9, 1e9, 1e12}, "e.g. 350M, 7.5B, 1T");
}

Result<std::uint64_t> parse_bytes(std::string_view text, std::string_view option) {
  const double k = 1024;
  return parse_scaled(text, option, "KMGT", {k, k * k, k * k * k, k * k * k * k}, "e.g. 80G, 1.5T");
}

Model model_from_params(std::uint64_t params) {
  Model m;
  m.params = params;
  // Ψ = 12 L h² and L = h / 128: h = (128 Ψ / 12)^(1/3).
  const double h = std::cbrt(128.0 * static_cast<double>(params) / 12.0);
  m.hidden = std::max<std::uint64_t>(128, static_cast<std::uint64_t>(std::llround(h / 128)) * 128);
  m.layers = std::max<std::uint64_t>(1, m.hidden / 128);
  m.heads = std::max<std::uint64_t>(1, m.hidden / 128);
  m.largest_tensor = std::min<std::uint64_t>(params, 4 * m.hidden * m.hidden);
  m.shape_assumed = true;
  m.description = billions(params) + " parameters (given; shape assumed GPT-like: " + std::to_string(m.layers) +
                  " layers, hidden " + std::to_string(m.hidden) + ")";
  return m;
}

namespace {

// A model config nests two or three levels; text nested deeper is refused before anything recurses over it
// (dump() recurses once per level).
constexpr int kMaxDepth = 64;

// A model config's sizes as read (0 where absent) and what its architecture changes in the count.
struct ModelShape {
  std::uint64_t layers = 0, hidden = 0, vocab = 0, heads = 0, kv_heads = 0, head_dim = 0, inter = 0, positions = 0,
                experts = 0;
  std::string type;
  bool gated = false, bias = false, tied = true;
};

Status parse_model_json(std::string_view json_text, std::string_view source, ConfigJson& cfg) {
  bool too_deep = false;
  const auto depth_check = [&too_deep](int depth, ConfigJson::parse_event_t, ConfigJson&) {
    too_deep = too_deep || depth > kMaxDepth;
    return true;
  };
  try {
    cfg = ConfigJson::parse(json_text, depth_check, true);
  } catch (const ConfigJson::out_of_range& e) {
    // A number beyond double's range (1e400) is valid JSON text that nlohmann cannot hold: say so, not "no
    // object". Its message names the number ("number overflow parsing '1e400'").
    const std::string what = e.what();
    const std::size_t at = what.find("] ");
    return invalid_argument(std::string(source) + ": a number is out of range (" +
                            (at == std::string::npos ? what : what.substr(at + 2)) + ")");
  } catch (const ConfigJson::parse_error&) {
    return invalid_argument(std::string(source) + ": not a JSON object");
  }
  if (!cfg.is_object()) return invalid_argument(std::string(source) + ": not a JSON object");
  if (too_deep) {
    return invalid_argument(std::string(source) + ": nests arrays or objects more than " + std::to_string(kMaxDepth) +
                            " levels deep: not a model config");
  }
  return Status::success();
}

Status read_sizes(const ConfigJson& cfg, std::string_view source, ModelShape& shape) {
  Result<std::uint64_t> layers = field(cfg, {"num_hidden_layers", "n_layer", "num_layers"}, source);
  Result<std::uint64_t> hidden = field(cfg, {"hidden_size", "n_embd", "d_model"}, source);
  Result<std::uint64_t> vocab = field(cfg, {"vocab_size"}, source);
  Result<std::uint64_t> heads = field(cfg, {"num_attention_heads", "n_head"}, source);
  Result<std::uint64_t> kv_heads = field(cfg, {"num_key_value_heads"}, source);
  Result<std::uint64_t> head_dim = field(cfg, {"head_dim"}, source);
  Result<std::uint64_t> inter = field(cfg, {"intermediate_size", "n_inner", "ffn_dim"}, source);
  Result<std::uint64_t> positions = field(cfg, {"n_positions"}, source);
  Result<std::uint64_t> experts = field(cfg, {"num_local_experts"}, source);
  for (const auto* r : {&layers, &hidden, &vocab, &heads, &kv_heads, &head_dim, &inter, &positions, &experts}) {
    if (!r->ok()) return r->status();
  }
  std::string missing;
  for (auto [value, name] : {std::pair{*layers, "num_hidden_layers (or n_layer)"},
                             std::pair{*hidden, "hidden_size (or n_embd, d_model)"}, std::pair{*vocab, "vocab_size"},
                             std::pair{*heads, "num_attention_heads (or n_head)"}}) {
    if (value == 0) missing += (missing.empty() ? "" : ", ") + std::string(name);
  }
  if (!missing.empty()) return invalid_argument(std::string(source) + ": missing " + missing);
  shape.layers = *layers;
  shape.hidden = *hidden;
  shape.vocab = *vocab;
  shape.heads = *heads;
  shape.kv_heads = *kv_heads;
  shape.head_dim = *head_dim;
  shape.inter = *inter;
  shape.positions = *positions;
  shape.experts = *experts;
  return Status::success();
}

Status read_architecture(const ConfigJson& cfg, std::string_view source, ModelShape& shape) {
  Result<std::string> model_type = text_field(cfg, "model_type", source);
  Result<std::string> hidden_act = text_field(cfg, "hidden_act", source);
  Result<std::string> activation = text_field(cfg, "activation_function", source);
  Result<bool> attention_bias = bool_field(cfg, "attention_bias", false, source);
  Result<bool> tie = bool_field(cfg, "tie_word_embeddings", true, source);
  for (const Status* s : {&model_type.status(), &hidden_act.status(), &activation.status(), &attention_bias.status(),
                          &tie.status()}) {
    if (!s->ok()) return *s;
  }
  const std::string& type = *model_type;
  const std::string& act = hidden_act->empty() ? *activation : *hidden_act;
  shape.type = type;
  shape.gated = act == "silu" || act == "swiglu" || act == "swish" ||
                type == "llama" || type == "mistral" || type == "mixtral" || type.rfind("qwen", 0) == 0 ||
                type.rfind("gemma", 0) == 0;
  shape.bias = cfg.contains("attention_bias") && !cfg.at("attention_bias").is_null()
                   ? *attention_bias
                   : (type == "gpt2" || type == "gpt_neo" || type == "gpt_neox" || type == "opt" ||
                      type == "bert" || type == "phi");
  shape.tied = *tie;
  return Status::success();
}

Result<Model> count_model(const ModelShape& shape, std::string_view source) {
  const std::string& type = shape.type;
  const bool gated = shape.gated, bias = shape.bias, tied = shape.tied;
  const std::uint64_t h = shape.hidden, L = shape.layers, V = shape.vocab, H = shape.heads;
  const std::uint64_t kv = shape.kv_heads ? shape.kv_heads : H, hd = shape.head_dim ? shape.head_dim : h / H;
  const std::uint64_t I = shape.inter ? shape.inter : 4 * h, E = shape.experts ? shape.experts : 1;
  // The count in double first: each product below is at most the total, so a total within kMaxParams
  // keeps the integer arithmetic exact, and a config whose sizes overflow it is refused, not wrapped.
  const auto count = [&](auto one) {
    using T = decltype(one);
    const T th = T(h), tH = T(H), tkv = T(kv), thd = T(hd), tI = T(I), tE = T(E);
    const T norm = bias ? 2 * th : th;  // LayerNorm has a bias, RMSNorm none
    T attn = th * tH * thd + 2 * th * tkv * thd + tH * thd * th;
    if (bias) attn += tH * thd + 2 * tkv * thd + th;
    T mlp = (gated ? 3 : 2) * th * tI;
    if (bias) mlp += (gated ? 2 : 1) * tI + th;
    mlp = mlp * tE + (E > 1 ? th * tE : 0);
    return T(L) * (attn + mlp + 2 * norm) + T(V) * th * (tied ? 1 : 2) + T(shape.positions) * th + norm;
  };
  if (const double total = count(1.0); !(total <= static_cast<double>(kMaxParams))) {
    char figure[32];
    std::snprintf(figure, sizeof figure, "%.3g", total);
    return invalid_argument(std::string(source) + ": its sizes give " + figure +
                            " parameters, more than zoe plan counts (100T)");
  }
  Model m;
  m.layers = L;
  m.hidden = h;
  m.heads = H;
  m.params = count(std::uint64_t{1});
  m.largest_tensor = std::max({V * h, h * I, h * H * hd});
  m.description = std::string(source) + (type.empty() ? "" : " (" + type + ")") + ": " + std::to_string(L) +
                  " layers, hidden " + std::to_string(h) + ", intermediate " + std::to_string(I) +
                  (gated ? " (gated)" : "") + ", vocab " + std::to_string(V) + ", " + std::to_string(H) + " heads (" +
                  std::to_string(kv) + " kv)" + (E > 1 ? ", " + std::to_string(E) + " experts" : "") +
                  (tied ? ", tied embeddings" : ", untied embeddings") + " -> " + billions(m.params) + " parameters";
  return m;
}

Result<Model> read_model(std::string_view json_text, std::string_view source) {
  ConfigJson cfg;
  ModelShape shape;
  if (Status s = parse_model_json(json_text, source, cfg); !s.ok()) return s;
  if (Status s = read_sizes(cfg, source, shape); !s.ok()) return s;
  if (Status s = read_architecture(cfg, source, shape); !s.ok()) return s;
  return count_model(shape, source);
}

}  // namespace

Result<Model> model_from_config(std::string_view json_text, std::string_view source) {
  // The CLI's boundary with the JSON library: whatever it throws becomes an error naming the file.
  try {
    return read_model(json_text, source);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::out_of_memory, "out of memory reading model config " + std::string(source));
  } catch (const std::exception& e) {
    return Status(StatusCode::internal, "reading model config " + std::string(source) + ": " + e.what());
  }
}

std::string placement_name(const Placement& p) {
  return "stage " + std::to_string(p.stage) + ", optimizer " + std::string(offload_name(p.optimizer)) + ", params " +
         std::string(offload_name(p.param));
}

std::string zoe_gap(const Placement& p) {
  // Every stage and parameter home runs: stage 3 with FSDP2 (fully_shard) partitioning the 16-bit weights, zoe
  // stepping each rank's shards, and offload_parameters on that model keeping them in each rank's tier.
  return p.optimizer == Offload::none ? "the optimizer state stays on the GPU, where zoe is not needed" : "";
}

std::uint64_t moment_bytes(std::uint64_t elements, DType d) {
  switch (d) {
    case DType::bf16: return 4 * elements;
    case DType::i8: return 2 * elements + 2 * 4 * ceil_div(elements, kInt8Block);
    default: return 8 * elements;
  }
}

Usage usage(const Model& m, const Cluster& c, const Placement& p, const Training& t) {
  const std::uint64_t psi = m.params, part = ceil_div(psi, c.ranks()), n = c.gpus_per_node;
  // The modules fetched to the GPU at once: the one computing and `prefetch` ahead (16-bit weights), and
  // the gradient of the one in backward before it leaves.
  const std::uint64_t window = (t.prefetch + 1) * m.largest_tensor * 2 + m.largest_tensor * 2;
  const bool fetched = p.stage == 3 || p.param != Offload::none;
  Usage u;
  Bytes rank_host, rank_nvme;
  Bytes& gpu = u.per_gpu;
  if (p.param == Offload::none) {
    gpu.weights16 = p.stage == 3 ? 2 * part : 2 * psi;
    gpu.grads16 = p.stage >= 2 ? 2 * part : 2 * psi;
  } else {
    (p.param == Offload::cpu ? rank_host : rank_nvme).weights16 = 2 * part;
    // The gradient shards reach the host as FSDP2 reduce-scatters them (CPUOffloadPolicy), and stay there
    // until zoe's step reads them: host RAM whichever home the weights have.
    rank_host.grads16 = 2 * part;
  }
  if (fetched) gpu.buffers = window;
  Bytes& state = p.optimizer == Offload::none ? gpu : p.optimizer == Offload::cpu ? rank_host : rank_nvme;
  state.master32 = 4 * part;
  state.moments = moment_bytes(part, t.state);
  if (p.optimizer != Offload::none) {
    // Pinned staging of the rank's gradient and weight partitions, unless they live on the host already.
    if (p.param == Offload::none) rank_host.buffers += 2 * part + 2 * part;
    if (t.grad_accumulation > 1) rank_host.buffers += 4 * part;  // the fp32 sums of the micro-batches
    if (p.optimizer == Offload::nvme) rank_host.buffers += t.buffer_count * (4 * t.tile + moment_bytes(t.tile, t.state));
  }
  if (p.param == Offload::nvme) rank_host.buffers += window;  // the pinned pool between NVMe and the GPU
  if (t.micro_batch > 0 && t.seq_len > 0) {
    // Korthikanti et al., 2022 ("Reducing Activation Recomputation in Large Transformer Models"): a layer's
    // 16-bit activations are s b h (34 + 5 a s / h) bytes; with full checkpointing only each layer's input
    // (2 s b h) is kept, plus one layer's activations while it is recomputed.
    const double s = static_cast<double>(t.seq_len), b = static_cast<double>(t.micro_batch);
    const double h = static_cast<double>(m.hidden), a = static_cast<double>(m.heads);
    const double layer = s * b * h * (34 + 5 * a * s / h);
    const double all = t.activation_checkpointing ? static_cast<double>(m.layers) * 2 * s * b * h + layer
                                                  : static_cast<double>(m.layers) * layer;
    // s and b come from the command line and a from a config: saturated, so that the conversion is defined.
    gpu.activations = all < static_cast<double>(kMaxEstimateBytes) ? static_cast<std::uint64_t>(all) : kMaxEstimateBytes;
  }
  auto scale = [](const Bytes& x, std::uint64_t k, std::uint64_t divide) {
    return Bytes{ceil_div(x.weights16 * k, divide), ceil_div(x.grads16 * k, divide), ceil_div(x.master32 * k, divide),
                 ceil_div(x.moments * k, divide),   ceil_div(x.buffers * k, divide), ceil_div(x.activations * k, divide)};
  };
  u.per_host = scale(rank_host, n, 1);
  u.per_nvme_path = scale(rank_nvme, n, std::max<std::uint64_t>(1, c.nvme_paths.size()));
  return u;
}

std::uint64_t usable_gpu(const Cluster& c) { return c.gpu_mem / 100 * 95; }
std::uint64_t usable_host(const Cluster& c) { return c.host_ram / 10 * 9; }

Verdict check(const Usage& u, const Cluster& c) {
  Verdict v;
  if (u.per_gpu.total() > usable_gpu(c)) {
    v.why = "GPU: needs " + format_bytes(u.per_gpu.total()) + ", " + format_bytes(usable_gpu(c)) + " usable of " + format_bytes(c.gpu_mem);
    return v;
  }
  if (u.per_host.total() > usable_host(c)) {
    v.why = "host: needs " + format_bytes(u.per_host.total()) + ", " + format_bytes(usable_host(c)) + " usable of " + format_bytes(c.host_ram);
    return v;
  }
  if (u.per_nvme_path.total() > 0) {
    if (c.nvme_paths.empty()) {
      v.why = "NVMe: needs " + format_bytes(u.per_nvme_path.total()) + " and no --nvme path was given";
      return v;
    }
    for (std::size_t i = 0; i < c.nvme_paths.size(); ++i) {
      if (u.per_nvme_path.total() > c.nvme_capacity[i]) {
        v.why = "NVMe: " + c.nvme_paths[i] + " needs " + format_bytes(u.per_nvme_path.total()) + ", holds " +
                format_bytes(c.nvme_capacity[i]);
        return v;
      }
    }
  }
  v.fits = true;
  return v;
}

std::vector<Placement> candidates() {
  std::vector<Placement> out;
  const std::pair<Offload, Offload> order[] = {{Offload::none, Offload::none}, {Offload::cpu, Offload::none},
                                               {Offload::cpu, Offload::cpu},   {Offload::nvme, Offload::none},
                                               {Offload::nvme, Offload::cpu},  {Offload::nvme, Offload::nvme}};
  for (auto [opt, param] : order) {
    for (int stage = param == Offload::none ? 1 : 3; stage <= 3; ++stage) out.push_back(Placement{stage, opt, param});
  }
  return out;
}

StepEstimate estimate_step(const Model& m, const Cluster& c, const Placement& p, const Training& t, const Rates& r) {
  StepEstimate e;
  const std::uint64_t part = ceil_div(m.params, c.ranks()), node = part * c.gpus_per_node;
  if (p.optimizer != Offload::none && r.adam_params_per_s > 0) e.cpu_adam_s = node / r.adam_params_per_s;
  if (p.optimizer == Offload::nvme) {
    const std::uint64_t state = 4 * node + moment_bytes(node, t.state);
    e.nvme_read_bytes = state;
    e.nvme_write_bytes = state;
  }
  if (p.param == Offload::nvme) {
    e.nvme_read_bytes += 2 * node;   // the 16-bit gradients backward wrote there
    e.nvme_write_bytes += 2 * node;  // the updated 16-bit weights
  }
  const double paths = static_cast<double>(std::max<std::size_t>(1, c.nvme_paths.size()));
  if (e.nvme_read_bytes > 0 && r.nvme_read_gbps > 0 && r.nvme_write_gbps > 0) {
    e.nvme_s = e.nvme_read_bytes / (r.nvme_read_gbps * 1e9 * paths) + e.nvme_write_bytes / (r.nvme_write_gbps * 1e9 * paths);
  }
  // Around the step each GPU sends its gradient partition down and takes its updated weights back; with
  // offloaded parameters both move during forward and backward instead.
  if (p.optimizer != Offload::none && p.param == Offload::none) e.pcie_bytes = 2 * part + 2 * part;
  if (r.pcie_gbps > 0) e.pcie_s = e.pcie_bytes / (r.pcie_gbps * 1e9);
  e.total_s = std::max(e.cpu_adam_s, e.nvme_s) + e.pcie_s;
  return e;
}

std::string deepspeed_config(const Placement& p, const Cluster& c, const Training& t) {
  Json cfg = Json::object();
  if (t.grad_accumulation > 1) cfg["gradient_accumulation_steps"] = t.grad_accumulation;
  cfg["bf16"] = {{"enabled", true}};
  Json zero = {{"stage", p.stage}};
  Json opt = {{"device", offload_name(p.optimizer)}};
  // One path as DeepSpeed writes it, several as the list zoe's reader also takes.
  const Json paths = c.nvme_paths.size() == 1 ? Json(c.nvme_paths[0]) : Json(c.nvme_paths);
  if (p.optimizer == Offload::nvme) opt["nvme_path"] = paths;
  if (p.optimizer != Offload::none) {
    opt["pin_memory"] = true;
    if (p.optimizer == Offload::nvme) opt["buffer_count"] = t.buffer_count;
  }
  zero["offload_optimizer"] = opt;
  if (p.param != Offload::none) {
    Json param = {{"device", offload_name(p.param)}, {"pin_memory", true}};
    if (p.param == Offload::nvme) param["nvme_path"] = paths;
    zero["offload_param"] = param;
  }
  cfg["zero_optimization"] = zero;
  return cfg.dump(2);
}

}  // namespace zoe::plan
