// The options' names: each choice's values by name, and OffloadOptions field by field (option_fields(),
// zoe/offload.h), the one list front-ends loop over.
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zoe/offload.h"

namespace zoe {
namespace {

template <typename E>
using Names = std::initializer_list<std::pair<E, std::string_view>>;

// Each choice once: its values, their names, and what the names mean (for the error of an unknown one).
const Names<Tier> kTiers = {{Tier::ram, "ram"}, {Tier::nvme, "nvme"}};
const Names<Schedule> kSchedules = {{Schedule::sync, "sync"}, {Schedule::overlap, "overlap"},
                                    {Schedule::delayed, "delayed"}};
const Names<Durability> kDurabilities = {{Durability::step, "step"}, {Durability::checkpoint, "checkpoint"}};
const Names<DType> kStateDtypes = {{DType::f32, "fp32"}, {DType::bf16, "bf16"}, {DType::i8, "int8"}};

template <typename E>
std::string_view name_in(Names<E> names, E value) {
  for (const auto& [v, name] : names) {
    if (v == value) return name;
  }
  return "invalid";
}

template <typename E>
Result<E> parse_in(Names<E> names, std::string_view what, std::string_view name, std::string_view meaning) {
  for (const auto& [v, n] : names) {
    if (n == name) return v;
  }
  return invalid_argument(std::string(what) + " '" + std::string(name) + "' is unknown: use " + std::string(meaning));
}

}  // namespace

std::string_view tier_name(Tier tier) { return name_in(kTiers, tier); }
std::string_view schedule_name(Schedule schedule) { return name_in(kSchedules, schedule); }
std::string_view durability_name(Durability durability) { return name_in(kDurabilities, durability); }
std::string_view state_dtype_name(DType state) { return name_in(kStateDtypes, state); }

Result<Tier> parse_tier(std::string_view name) { return parse_in(kTiers, "tier", name, "ram or nvme"); }

Result<Schedule> parse_schedule(std::string_view name) {
  return parse_in(kSchedules, "schedule", name, "sync, overlap or delayed");
}

Result<Durability> parse_durability(std::string_view name) {
  return parse_in(kDurabilities, "durability", name,
                  "step (each step durable in the background) or checkpoint (durable at save() only)");
}

Result<DType> parse_state_dtype(std::string_view name) {
  return parse_in(kStateDtypes, "state_dtype", name, "fp32, bf16 or int8");
}

namespace {

// A field's value as the table carries it, by the field's C++ type.
OptionValue value_of(bool v) { return v; }
OptionValue value_of(int v) { return std::int64_t{v}; }
OptionValue value_of(std::size_t v) { return static_cast<std::int64_t>(v); }
OptionValue value_of(float v) { return double{v}; }
OptionValue value_of(const std::string& v) { return v; }
OptionValue value_of(const std::vector<std::string>& v) { return v; }
OptionValue value_of(Tier v) { return std::string(tier_name(v)); }
OptionValue value_of(Schedule v) { return std::string(schedule_name(v)); }
OptionValue value_of(Durability v) { return std::string(durability_name(v)); }
OptionValue value_of(DType v) { return std::string(state_dtype_name(v)); }

Status wrong_kind(std::string_view name) {
  return invalid_argument(std::string(name) + ": the value is of another kind than the option");
}

// The value into the field, or an error naming the field; the field is written only when the value fits.
template <typename T>
Status assign_integer(T& to, const OptionValue& v, std::string_view name) {
  const auto* x = std::get_if<std::int64_t>(&v);
  if (x == nullptr) return wrong_kind(name);
  constexpr std::int64_t lo = std::is_signed_v<T> ? std::numeric_limits<T>::min() : 0;
  constexpr std::int64_t hi = sizeof(T) < sizeof(std::int64_t)
                                  ? static_cast<std::int64_t>(std::numeric_limits<T>::max())
                                  : std::numeric_limits<std::int64_t>::max();
  if (*x < lo || *x > hi) {
    return invalid_argument(std::string(name) + " = " + std::to_string(*x) + " is invalid: need an integer from " +
                            std::to_string(lo) + " to " + std::to_string(hi));
  }
  to = static_cast<T>(*x);
  return Status::success();
}
Status assign(int& to, const OptionValue& v, std::string_view name) { return assign_integer(to, v, name); }
Status assign(std::size_t& to, const OptionValue& v, std::string_view name) { return assign_integer(to, v, name); }

template <typename T>
Status assign_same(T& to, const OptionValue& v, std::string_view name) {
  const auto* x = std::get_if<T>(&v);
  if (x == nullptr) return wrong_kind(name);
  to = *x;
  return Status::success();
}
Status assign(bool& to, const OptionValue& v, std::string_view name) { return assign_same(to, v, name); }
Status assign(std::string& to, const OptionValue& v, std::string_view name) { return assign_same(to, v, name); }
Status assign(std::vector<std::string>& to, const OptionValue& v, std::string_view name) {
  return assign_same(to, v, name);
}

Status assign(float& to, const OptionValue& v, std::string_view name) {
  const auto* x = std::get_if<double>(&v);
  if (x == nullptr) return wrong_kind(name);
  to = static_cast<float>(*x);
  return Status::success();
}

template <typename E>
Status assign_choice(E& to, const OptionValue& v, std::string_view name, Result<E> (*parse)(std::string_view)) {
  const auto* x = std::get_if<std::string>(&v);
  if (x == nullptr) return wrong_kind(name);
  Result<E> parsed = parse(*x);
  if (!parsed.ok()) return invalid_argument(std::string(name) + ": " + parsed.status().message());
  to = parsed.value();
  return Status::success();
}
Status assign(Tier& to, const OptionValue& v, std::string_view name) { return assign_choice(to, v, name, parse_tier); }
Status assign(Schedule& to, const OptionValue& v, std::string_view name) {
  return assign_choice(to, v, name, parse_schedule);
}
Status assign(Durability& to, const OptionValue& v, std::string_view name) {
  return assign_choice(to, v, name, parse_durability);
}
Status assign(DType& to, const OptionValue& v, std::string_view name) {
  return assign_choice(to, v, name, parse_state_dtype);
}

// A loss scale: finite and > 0 (an infinite one overflows every scaled gradient, so every step is skipped).
Status assign_scale(float& to, const OptionValue& v, std::string_view name) {
  const auto* x = std::get_if<double>(&v);
  if (x != nullptr && !(std::isfinite(static_cast<float>(*x)) && *x > 0)) {
    char shown[32];
    std::snprintf(shown, sizeof shown, "%g", *x);
    return invalid_argument(std::string(name) + " = " + shown + " is invalid: need a finite number > 0");
  }
  return assign(to, v, name);
}

// One row: the field's name and where it is in OffloadOptions (a captureless lambda returning it by
// reference, const or not as the options are); `Assign` writes it (by default the assign() of its type).
template <auto Field, auto Assign = nullptr>
OptionField field(std::string_view name) {
  return {name, [](const OffloadOptions& o) { return value_of(Field(o)); },
          [](OffloadOptions& o, const OptionValue& v, std::string_view n) {
            if constexpr (std::is_same_v<decltype(Assign), std::nullptr_t>) {
              return assign(Field(o), v, n);
            } else {
              return Assign(Field(o), v, n);
            }
          }};
}

#define ZOE_FIELD(path) [](auto& o) -> auto& { return o.path; }

const std::vector<OptionField> kFields = {
    field<ZOE_FIELD(tier)>("tier"),
    field<ZOE_FIELD(nvme.paths)>("nvme_paths"),
    field<ZOE_FIELD(nvme.buffer_count)>("buffer_count"),
    field<ZOE_FIELD(nvme.block_size)>("block_size"),
    field<ZOE_FIELD(nvme.queue_depth)>("queue_depth"),
    field<ZOE_FIELD(nvme.durability)>("nvme_durability"),
    field<ZOE_FIELD(nvme.keep_resident)>("nvme_keep_resident"),
    field<ZOE_FIELD(state_dtype)>("state_dtype"),
    field<ZOE_FIELD(schedule)>("schedule"),
    field<ZOE_FIELD(delayed_warmup_steps)>("delayed_warmup_steps"),
    field<ZOE_FIELD(gradient_accumulation_steps)>("gradient_accumulation_steps"),
    field<ZOE_FIELD(partition.flat_buffers)>("partition_flat_buffers"),
    field<ZOE_FIELD(partition.grads_averaged)>("partition_grads_averaged"),
    field<ZOE_FIELD(max_grad_norm)>("max_grad_norm"),
    field<ZOE_FIELD(refuse_non_finite)>("refuse_non_finite"),
    field<ZOE_FIELD(loss_scale.enabled)>("loss_scale"),
    field<ZOE_FIELD(loss_scale.dynamic)>("dynamic_loss_scale"),
    field<ZOE_FIELD(loss_scale.static_scale), assign_scale>("static_loss_scale"),
    field<ZOE_FIELD(loss_scale.initial_scale), assign_scale>("initial_scale"),
    field<ZOE_FIELD(loss_scale.growth_factor)>("growth_factor"),
    field<ZOE_FIELD(loss_scale.backoff_factor)>("backoff_factor"),
    field<ZOE_FIELD(loss_scale.growth_interval)>("growth_interval"),
    field<ZOE_FIELD(loss_scale.hysteresis)>("hysteresis"),
    field<ZOE_FIELD(loss_scale.consecutive_hysteresis)>("consecutive_hysteresis"),
    field<ZOE_FIELD(loss_scale.min_scale), assign_scale>("min_scale"),
    field<ZOE_FIELD(tile)>("tile"),
    field<ZOE_FIELD(step_window)>("step_window"),
    field<ZOE_FIELD(grads_stay_on_device)>("grads_stay_on_device"),
    field<ZOE_FIELD(spill_grads)>("spill_grads"),
    field<ZOE_FIELD(cpu.isa)>("isa"),
    field<ZOE_FIELD(cpu.threads)>("threads"),
};

#undef ZOE_FIELD

}  // namespace

std::span<const OptionField> option_fields() { return kFields; }

}  // namespace zoe
