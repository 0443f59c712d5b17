// Lion and Adagrad on CpuAdam's threads: the rules that keep one state array per parameter (OneStateTensor;
// Lion's also in 8 bits).
// The checks, tiling and contract are Adam's (cpu_adam.cpp); the kernels are simd/lion_body.inl and
// simd/adagrad_body.inl.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "src/cpu_engine.h"
#include "zoe/optimizers.h"

namespace zoe {
namespace {

using namespace cpu_engine;

// Ranges as torch's constructors check them, and finite: the optimizer table's (zoe/optimizers.h).
Status check_hyper(const LionHyper& h) { return validate_hyper(OptimizerHyper(h)); }
Status check_hyper(const AdagradHyper& h) { return validate_hyper(OptimizerHyper(h)); }

// Null pointers, invalid dtypes, and overlaps between an output (p, state, its scales, out) and anything else.
// `state_rule` says which state dtypes the call takes: i8 where `int8` (Lion's step), else f32 and bf16.
Status check_tensors(std::span<const OneStateTensor> tensors, bool int8, const char* state_rule) {
  std::vector<ByteRange> ranges;
  ranges.reserve(tensors.size() * 6);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const OneStateTensor& t = tensors[i];
    const std::string name = tensor_name(i, tensors.size());
    if (Status s = check_dtypes(name, t.grad_dtype, t.out, t.out_dtype, t.state_dtype, int8, state_rule); !s.ok()) {
      return s;
    }
    if (t.n == 0) continue;
    const bool q8 = t.state_dtype == DType::i8;
    const std::size_t state = dtype_size(t.state_dtype) * t.n, scales = q8 ? 4 * moment_blocks(t.n) : 0;
    if (Status s = add_arrays(ranges, name, i,
                              {{t.param, 4 * t.n, "param", true},
                               {t.state, state, "state", true},
                               {q8 ? t.state_scale : nullptr, scales, "state_scale", true, !q8},
                               {t.grad, dtype_size(t.grad_dtype) * t.n, "grad", false},
                               {t.out, dtype_size(t.out_dtype) * t.n, "out", true, true}},
                              q8 ? "with state dtype i8" : "with n = " + std::to_string(t.n));
        !s.ok()) {
      return s;
    }
    if (t.from.param == nullptr) continue;
    if (Status s = add_arrays(ranges, name, i,
                              {{t.from.param, 4 * t.n, "from.param", false},
                               {t.from.state, state, "from.state", false},
                               {q8 ? t.from.state_scale : nullptr, scales, "from.state_scale", false, !q8}},
                              "while from.param is set");
        !s.ok()) {
      return s;
    }
  }
  return check_overlaps(ranges, tensors.size());
}

constexpr const char* kLionStates = "Lion's state is stored as f32, bf16 or i8";
constexpr const char* kAdagradStates = "Adagrad's state (sum) is stored as f32 or bf16";

simd::LionConstants constants(const LionHyper& h, const StepOptions& o) {
  simd::LionConstants c{};
  c.beta1 = h.beta1;
  c.one_minus_beta1 = 1.0f - h.beta1;
  c.beta2 = h.beta2;
  c.one_minus_beta2 = 1.0f - h.beta2;
  c.neg_lr = -h.lr;
  c.decay = static_cast<float>(1.0 - static_cast<double>(h.lr) * h.weight_decay);
  // maximize: -g, as for Adam; negation is exact, so -(g * s) is (-g) * s.
  c.grad_scale = h.maximize ? -o.grad_scale : o.grad_scale;
  return c;
}

simd::AdagradConstants constants(const AdagradHyper& h, const StepOptions& o) {
  // torch computes clr in Python floats (double) and rounds it once, to the tensor's float, in addcdiv_.
  const double clr = static_cast<double>(h.lr) / (1.0 + static_cast<double>(o.step - 1) * h.lr_decay);
  simd::AdagradConstants c{};
  c.neg_clr = static_cast<float>(-clr);
  c.eps = h.eps;
  c.l2 = h.weight_decay;
  c.grad_scale = h.maximize ? -o.grad_scale : o.grad_scale;  // negated before the L2 term, as torch does
  return c;
}

// Elements [offset, offset + count) of one tensor, read from `from` where it is set (OneStateSource).
template <typename Fn, typename Constants>
void run_one_state(Fn fn, const Constants& c, const OneStateTensor& t, std::size_t offset, std::size_t count) {
  const std::size_t ssize = dtype_size(t.state_dtype);
  const bool own = t.from.param == nullptr;
  const simd::StepArrays<1> a{(own ? t.param : t.from.param) + offset,
                              {at(own ? t.state : t.from.state, offset, ssize)},
                              t.param + offset,
                              {at(t.state, offset, ssize)},
                              at(t.grad, offset, dtype_size(t.grad_dtype)),
                              at(t.out, offset, dtype_size(t.out_dtype))};
  fn(c, a, count);
}

// Lion's 8-bit moment: the blocks that start in [offset, offset + count), each whole, as run_adam_q8 steps
// Adam's (cpu_adam.cpp): every block starts in exactly one tile's range, so each is stepped once.
void run_lion_q8(simd::LionQ8Fn fn, const simd::LionConstants& c, const OneStateTensor& t, std::size_t offset,
                 std::size_t count) {
  const std::size_t first = moment_blocks(offset) * kMomentBlock;
  if (first >= offset + count) return;
  const std::size_t end = std::min(t.n, moment_blocks(offset + count) * kMomentBlock), block = first / kMomentBlock;
  const bool own = t.from.param == nullptr;
  const simd::StateIn in{(own ? t.param : t.from.param) + first,
                         at(own ? t.state : t.from.state, first, 1),
                         nullptr,
                         (own ? t.state_scale : t.from.state_scale) + block,
                         nullptr};
  fn(c, in, t.param + first, static_cast<std::int8_t*>(t.state) + first, t.state_scale + block,
     at(t.grad, first, dtype_size(t.grad_dtype)), at(t.out, first, dtype_size(t.out_dtype)), end - first);
}

// What the engine runs on each tile: the rule's kernel (or its ceiling) for the tensor's dtypes.
template <typename Fn, typename Constants>
auto tile_piece(const simd::RuleKernels<Fn>& kernels, bool streams, const Constants& c) {
  return [&kernels, streams, c](const OneStateTensor& t, std::size_t offset, std::size_t count) {
    const int g = int(t.grad_dtype), o = out_index(t.out, t.out_dtype), s = state_index(t.state_dtype);
    run_one_state(streams ? kernels.streams[g][o][s] : kernels.step[g][o][s], c, t, offset, count);
  };
}

}  // namespace

Status CpuAdam::validate(const LionHyper& hyper) { return check_hyper(hyper); }
Status CpuAdam::validate(const AdagradHyper& hyper) { return check_hyper(hyper); }

Status CpuAdam::step(const LionHyper& hyper, const StepOptions& options, std::span<const OneStateTensor> tensors) {
  for (const Status& s : {check_hyper(hyper), check_step_options(options), check_tensors(tensors, true, kLionStates)}) {
    if (!s.ok()) return s;
  }
  if (options.check_finite) {
    if (Status s = impl_->check_finite<OneStateTensor>(tensors); !s.ok()) return s;
  }
  const simd::LionConstants c = constants(hyper, options);
  const auto fp = tile_piece(impl_->table->lion, false, c);
  const simd::KernelTable& table = *impl_->table;
  impl_->for_each_tile(tensors, [&](const OneStateTensor& t, std::size_t offset, std::size_t count) {
    if (t.state_dtype == DType::i8) {  // Lion's 8-bit moment (check_tensors let i8 through for Lion only)
      run_lion_q8(table.lion_q8[int(t.grad_dtype)][out_index(t.out, t.out_dtype)], c, t, offset, count);
    } else {
      fp(t, offset, count);
    }
  });
  return Status::success();
}

Status CpuAdam::step(const AdagradHyper& hyper, const StepOptions& options, std::span<const OneStateTensor> tensors) {
  for (const Status& s :
       {check_hyper(hyper), check_step_options(options), check_tensors(tensors, false, kAdagradStates)}) {
    if (!s.ok()) return s;
  }
  if (options.check_finite) {
    if (Status s = impl_->check_finite<OneStateTensor>(tensors); !s.ok()) return s;
  }
  impl_->for_each_tile(tensors, tile_piece(impl_->table->adagrad, false, constants(hyper, options)));
  return Status::success();
}

// Lion's and Adagrad's loads and stores are the same; Lion's table row serves both.
Status CpuAdam::streams_pass(std::span<const OneStateTensor> tensors) {
  if (Status s = check_tensors(tensors, false, "the one-state ceiling runs on f32 or bf16 state"); !s.ok()) return s;
  impl_->for_each_tile(tensors, tile_piece(impl_->table->lion, true, simd::LionConstants{}));
  return Status::success();
}

}  // namespace zoe
