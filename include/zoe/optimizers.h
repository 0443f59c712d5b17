// The optimizers zoe steps, as data (docs/architecture.md, "Optimizers as data"). One entry per update rule
// says its names (zoe's, torch's class, DeepSpeed's optimizer.type), its hyper-parameter fields (name,
// default, valid range, DeepSpeed key) and its state arrays (torch's state keys, in the order the tiers,
// swap slots and checkpoints keep them). The offload engine, the checkpoint manifest, the config reader,
// the bindings and `zoe plan` read this table rather than naming any rule's fields themselves; the kernels
// that run each rule are CpuAdam's (zoe/adam.h).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zoe/adam.h"
#include "zoe/status.h"

namespace zoe {

// Adam covers AdamW (OptimizerHyper::adamw), as torch.optim.Adam's algorithm covers both.
enum class Rule : std::uint8_t { adam, lion, adagrad };

// One param group's hyper-parameters for whichever rule it runs: the union of every rule's fields. A rule
// reads the fields its table entry lists; the others are ignored (and keep their defaults in a group made
// by hyper_defaults()). The default-constructed value is AdamW's defaults, as AdamHyper's.
struct OptimizerHyper {
  Rule rule = Rule::adam;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float lr_decay = 0.0f;                   // Adagrad
  float initial_accumulator_value = 0.0f;  // Adagrad: the state's value before the first step
  bool adamw = true;                       // Adam: decoupled weight decay
  bool bias_correction = true;             // Adam
  bool maximize = false;
  bool amsgrad = false;  // Adam: a third state array (max_exp_avg_sq)

  OptimizerHyper() = default;
  // A kernel's hyper-parameters as a group's (the rule they belong to, its fields, the others' defaults):
  // ParamGroup{AdamHyper{...}} or ParamGroup{LionHyper{...}} picks the rule.
  OptimizerHyper(const AdamHyper& h);  // NOLINT(google-explicit-constructor)
  OptimizerHyper(const LionHyper& h);  // NOLINT(google-explicit-constructor)
  OptimizerHyper(const AdagradHyper& h, float initial_sum = 0.0f);  // NOLINT: initial_accumulator_value

  // The kernels' hyper-parameters of this rule (the caller checks `rule` first).
  AdamHyper adam() const;
  LionHyper lion() const;
  AdagradHyper adagrad() const;
  bool operator==(const OptimizerHyper&) const = default;
};

// What a float field may hold: a finite value >= 0, or a beta in [0, 1).
enum class HyperRange : std::uint8_t { non_negative, beta };

// A hyper-parameter field: a float (with its range) or a flag of OptimizerHyper.
struct HyperField {
  std::string_view name;  // torch's param-group key; torch's `betas` pair is beta1 and beta2
  float OptimizerHyper::*number = nullptr;
  bool OptimizerHyper::*flag = nullptr;
  HyperRange range = HyperRange::non_negative;
  std::string_view deepspeed;  // its key in a DeepSpeed config's optimizer.params ("betas": the pair); empty: none
  int pair_index = -1;         // 0 or 1 within the DeepSpeed pair `betas`; -1: a value of its own
};

struct OptimizerRule {
  Rule rule;
  std::string_view name;         // zoe's name: adam, lion, adagrad (zoe plan/bench --optimizer, manifests)
  std::string_view torch_class;  // the torch optimizer it matches (torch.optim.AdamW, or the paper's rule)
  std::span<const std::string_view> deepspeed_types;  // optimizer.type values, compared case-insensitively
  std::span<const HyperField> fields;
  // The state arrays beside the fp32 master, by torch's state keys, in the engine's order (array 1, 2).
  std::span<const std::string_view> states;
  bool int8_state;  // the kernels keep this rule's state as 8-bit codes (state dtype i8)
  // Bit k set: state array k + 1 holds values >= 0 only (Adam's exp_avg_sq and amsgrad's max_exp_avg_sq,
  // Adagrad's sum); state written from outside (write_state) is refused otherwise.
  unsigned non_negative_states;
};

std::span<const OptimizerRule> optimizer_rules();
const OptimizerRule& optimizer_rule(Rule rule);
// By zoe's name or a DeepSpeed optimizer.type, case-insensitively ("AdamW" and "Adam" are adam); null if none.
const OptimizerRule* find_optimizer_rule(std::string_view name);
// The rule's defaults (AdamW's for adam; torch.optim.Adagrad's; Lion's paper's).
OptimizerHyper hyper_defaults(Rule rule);
// State arrays per element beside the master: the rule's, plus amsgrad's maximum for Adam.
std::size_t state_arrays(const OptimizerHyper& hyper);
// Their names, by torch's state keys, in the engine's order: the rule's, then "max_exp_avg_sq" (amsgrad).
std::vector<std::string> state_names(const OptimizerHyper& hyper);
// Every field the rule reads within its range (the kernels' checks of their hyper-parameters call this):
// invalid_argument naming the field otherwise.
Status validate_hyper(const OptimizerHyper& hyper);
// One step of the hyper-parameters' rule on `engine`: Adam's over `adam`, Lion's or Adagrad's over
// `one_state`; the span the rule does not read must be empty (invalid_argument otherwise).
Status step_rule(CpuAdam& engine, const OptimizerHyper& hyper, const StepOptions& options,
                 std::span<const AdamTensor> adam, std::span<const OneStateTensor> one_state);

}  // namespace zoe
