// The optimizer table (zoe/optimizers.h): each rule's names, fields and state arrays. A new rule is an
// entry here, its kernels (simd/<rule>_body.inl, CpuAdam::step) and its case in the two places that call
// them (tier ram, the swap store's step); docs/architecture.md, "Where to change what", lists the rest.
#include "zoe/optimizers.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "src/cpu_engine.h"

namespace zoe {
namespace {

using H = OptimizerHyper;
constexpr HyperRange kBeta = HyperRange::beta;
constexpr HyperRange kNonNegative = HyperRange::non_negative;

constexpr HyperField kAdamFields[] = {
    {"lr", &H::lr, nullptr, kNonNegative, "lr"},
    {"beta1", &H::beta1, nullptr, kBeta, "betas", 0},
    {"beta2", &H::beta2, nullptr, kBeta, "betas", 1},
    {"eps", &H::eps, nullptr, kNonNegative, "eps"},
    {"weight_decay", &H::weight_decay, nullptr, kNonNegative, "weight_decay"},
    {"adamw", nullptr, &H::adamw, kNonNegative, "adam_w_mode"},
    {"bias_correction", nullptr, &H::bias_correction, kNonNegative, "bias_correction"},
    {"maximize", nullptr, &H::maximize, kNonNegative, ""},
    {"amsgrad", nullptr, &H::amsgrad, kNonNegative, "amsgrad"},
};
constexpr HyperField kLionFields[] = {
    {"lr", &H::lr, nullptr, kNonNegative, "lr"},
    {"beta1", &H::beta1, nullptr, kBeta, "betas", 0},
    {"beta2", &H::beta2, nullptr, kBeta, "betas", 1},
    {"weight_decay", &H::weight_decay, nullptr, kNonNegative, "weight_decay"},
    {"maximize", nullptr, &H::maximize, kNonNegative, ""},
};
constexpr HyperField kAdagradFields[] = {
    {"lr", &H::lr, nullptr, kNonNegative, "lr"},
    {"lr_decay", &H::lr_decay, nullptr, kNonNegative, "lr_decay"},
    {"weight_decay", &H::weight_decay, nullptr, kNonNegative, "weight_decay"},
    {"initial_accumulator_value", &H::initial_accumulator_value, nullptr, kNonNegative, "initial_accumulator_value"},
    {"eps", &H::eps, nullptr, kNonNegative, "eps"},
    {"maximize", nullptr, &H::maximize, kNonNegative, ""},
};

constexpr std::string_view kAdamTypes[] = {"Adam", "AdamW"};
constexpr std::string_view kLionTypes[] = {"Lion"};
constexpr std::string_view kAdagradTypes[] = {"Adagrad"};
constexpr std::string_view kAdamStates[] = {"exp_avg", "exp_avg_sq"};
constexpr std::string_view kLionStates[] = {"exp_avg"};
constexpr std::string_view kAdagradStates[] = {"sum"};

constexpr OptimizerRule kRules[] = {
    {Rule::adam, "adam", "torch.optim.AdamW", kAdamTypes, kAdamFields, kAdamStates, true, 0b110},
    {Rule::lion, "lion", "Lion (Chen et al. 2023, arXiv 2302.06675)", kLionTypes, kLionFields, kLionStates, true, 0},
    {Rule::adagrad, "adagrad", "torch.optim.Adagrad", kAdagradTypes, kAdagradFields, kAdagradStates, false, 0b1},
};

bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

}  // namespace

OptimizerHyper::OptimizerHyper(const AdamHyper& h)
    : rule(Rule::adam), lr(h.lr), beta1(h.beta1), beta2(h.beta2), eps(h.eps), weight_decay(h.weight_decay),
      adamw(h.adamw), bias_correction(h.bias_correction), maximize(h.maximize), amsgrad(h.amsgrad) {}

OptimizerHyper::OptimizerHyper(const LionHyper& h)
    : rule(Rule::lion), lr(h.lr), beta1(h.beta1), beta2(h.beta2), weight_decay(h.weight_decay), maximize(h.maximize) {}

OptimizerHyper::OptimizerHyper(const AdagradHyper& h, float initial_sum)
    : rule(Rule::adagrad), lr(h.lr), eps(h.eps), weight_decay(h.weight_decay), lr_decay(h.lr_decay),
      initial_accumulator_value(initial_sum), maximize(h.maximize) {}

AdamHyper OptimizerHyper::adam() const {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adamw = adamw;
  h.bias_correction = bias_correction;
  h.maximize = maximize;
  h.amsgrad = amsgrad;
  return h;
}

LionHyper OptimizerHyper::lion() const { return LionHyper{lr, beta1, beta2, weight_decay, maximize}; }

AdagradHyper OptimizerHyper::adagrad() const { return AdagradHyper{lr, lr_decay, weight_decay, eps, maximize}; }

std::span<const OptimizerRule> optimizer_rules() { return kRules; }

const OptimizerRule& optimizer_rule(Rule rule) { return kRules[static_cast<int>(rule)]; }

const OptimizerRule* find_optimizer_rule(std::string_view name) {
  for (const OptimizerRule& r : kRules) {
    if (same_name(r.name, name)) return &r;
    for (std::string_view t : r.deepspeed_types) {
      if (same_name(t, name)) return &r;
    }
  }
  return nullptr;
}

OptimizerHyper hyper_defaults(Rule rule) {
  switch (rule) {
    case Rule::lion: return OptimizerHyper(LionHyper{});
    case Rule::adagrad: return OptimizerHyper(AdagradHyper{});
    case Rule::adam: break;
  }
  return OptimizerHyper(AdamHyper{});
}

std::size_t state_arrays(const OptimizerHyper& hyper) {
  return optimizer_rule(hyper.rule).states.size() + (hyper.rule == Rule::adam && hyper.amsgrad ? 1 : 0);
}

std::vector<std::string> state_names(const OptimizerHyper& hyper) {
  std::vector<std::string> names;
  for (std::string_view s : optimizer_rule(hyper.rule).states) names.emplace_back(s);
  if (hyper.rule == Rule::adam && hyper.amsgrad) names.emplace_back("max_exp_avg_sq");  // torch's key
  return names;
}

Status validate_hyper(const OptimizerHyper& hyper) {
  if (static_cast<int>(hyper.rule) >= static_cast<int>(std::size(kRules))) {
    return invalid_argument("rule " + std::to_string(int(hyper.rule)) + " is not an optimizer zoe has");
  }
  for (const HyperField& f : optimizer_rule(hyper.rule).fields) {
    if (f.number == nullptr) continue;
    const std::string name(f.name);
    const float value = hyper.*f.number;
    Status s = f.range == HyperRange::beta ? cpu_engine::require_beta(name.c_str(), value)
                                           : cpu_engine::require_non_negative(name.c_str(), value);
    if (!s.ok()) return s;
  }
  return Status::success();
}

Status step_rule(CpuAdam& engine, const OptimizerHyper& hyper, const StepOptions& options,
                 std::span<const AdamTensor> adam, std::span<const OneStateTensor> one_state) {
  const bool adam_rule = hyper.rule == Rule::adam;
  if ((adam_rule && !one_state.empty()) || (!adam_rule && !adam.empty())) {
    return invalid_argument(std::string(optimizer_rule(hyper.rule).name) + " was given tensors of another rule's state");
  }
  switch (hyper.rule) {
    case Rule::lion: return engine.step(hyper.lion(), options, one_state);
    case Rule::adagrad: return engine.step(hyper.adagrad(), options, one_state);
    case Rule::adam: break;
  }
  return engine.step(hyper.adam(), options, adam);
}

}  // namespace zoe
