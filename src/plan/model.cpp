// zoe plan's inputs (plan.h): the number parsers, and the model — a bare parameter count given an assumed
// GPT-like shape, or a Hugging Face-style config counted tensor by tensor.
#include "zoe/plan.h"

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
  // A layer's matrices as the shape assumes them (12 h² together): q, k, v, o and the two MLP ones.
  const std::uint64_t hh = m.hidden;
  m.layer_tensors = {{hh, hh}, {hh, hh}, {hh, hh}, {hh, hh}, {4 * hh, hh}, {hh, 4 * hh}};
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

// The tensors the count below adds up, as torch's Linear holds them ([out, in]: FSDP2 shards the first), in
// FSDP2's groups: one layer's (fully_shard per layer), and the root's.
void list_tensors(const ModelShape& shape, Model& m) {
  const bool gated = shape.gated, bias = shape.bias;
  const std::uint64_t h = shape.hidden, H = shape.heads;
  const std::uint64_t kv = shape.kv_heads ? shape.kv_heads : H, hd = shape.head_dim ? shape.head_dim : h / H;
  const std::uint64_t I = shape.inter ? shape.inter : 4 * h, E = shape.experts ? shape.experts : 1;
  std::vector<Tensor>& layer = m.layer_tensors;
  layer = {{H * hd, h}, {kv * hd, h}, {kv * hd, h}, {h, H * hd}};
  if (bias) layer.insert(layer.end(), {{H * hd, 1}, {kv * hd, 1}, {kv * hd, 1}, {h, 1}});
  // Each expert's MLP alike: one entry with E copies (a config may name very many experts).
  layer.insert(layer.end(), {{I, h, E}, {h, I, E}});
  if (gated) layer.push_back({I, h, E});
  if (bias) layer.insert(layer.end(), {{I, 1, E}, {h, 1, E}});
  if (bias && gated) layer.push_back({I, 1, E});
  if (E > 1) layer.push_back({E, h});  // the router
  for (int k = 0; k < (bias ? 4 : 2); ++k) layer.push_back({h, 1});  // two norms (LayerNorm's biases too)
  m.root_tensors = {{shape.vocab, h}};
  if (!shape.tied) m.root_tensors.push_back({shape.vocab, h});
  if (shape.positions > 0) m.root_tensors.push_back({shape.positions, h});
  for (int k = 0; k < (bias ? 2 : 1); ++k) m.root_tensors.push_back({h, 1});  // the final norm
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
  list_tensors(shape, m);
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

}  // namespace zoe::plan
