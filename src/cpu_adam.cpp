#include "src/cpu_engine.h"
#include "zoe/optimizers.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace zoe::cpu_engine {

std::string tensor_name(std::size_t index, std::size_t count) {
  return count == 1 ? std::string("tensor") : "tensor " + std::to_string(index);
}

Status bad_value(const char* name, double value, const char* want) {
  return invalid_argument(std::string(name) + " = " + std::to_string(value) + " is invalid: " + want);
}

Status require_non_negative(const char* name, float value) {
  if (!(value >= 0.0f) || !std::isfinite(value)) return bad_value(name, value, "need a finite value >= 0");
  return Status::success();
}

Status require_beta(const char* name, float value) {
  if (!(value >= 0.0f && value < 1.0f)) {
    return bad_value(name, value, (std::string("need 0 <= ") + name + " < 1").c_str());
  }
  return Status::success();
}

Status check_step_options(const StepOptions& o) {
  if (o.step < 1) return invalid_argument("step = " + std::to_string(o.step) + " is invalid: steps count from 1");
  if (!std::isfinite(o.grad_scale)) return bad_value("grad_scale", o.grad_scale, "need a finite value");
  return Status::success();
}

Status add_arrays(std::vector<ByteRange>& ranges, const std::string& name, std::size_t tensor,
                  std::initializer_list<ArrayRef> arrays, const std::string& why) {
  for (const ArrayRef& a : arrays) {
    if (a.ptr == nullptr) {
      if (a.optional) continue;
      return invalid_argument(name + ": " + a.what + " is null " + why);
    }
    if (a.bytes == 0) continue;  // an empty array shares no memory with anything
    const auto begin = reinterpret_cast<std::uintptr_t>(a.ptr);
    ranges.push_back({begin, begin + a.bytes, tensor, a.what, a.output});
  }
  return Status::success();
}

// Ranges sorted by start, each compared with the furthest-reaching range before it.
Status check_overlaps(std::vector<ByteRange>& ranges, std::size_t count) {
  std::sort(ranges.begin(), ranges.end(), [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  // Among the ranges seen so far, the one reaching furthest, and the furthest-reaching output.
  const ByteRange* reach = nullptr;
  const ByteRange* reach_output = nullptr;
  for (const ByteRange& r : ranges) {
    const ByteRange* other = r.output ? reach : reach_output;
    if (other != nullptr && other->end > r.begin) {
      return invalid_argument(tensor_name(other->tensor, count) + " " + other->what + " overlaps " +
                              tensor_name(r.tensor, count) + " " + r.what +
                              ": outputs must not share memory with any other array");
    }
    if (reach == nullptr || r.end > reach->end) reach = &r;
    if (r.output && (reach_output == nullptr || r.end > reach_output->end)) reach_output = &r;
  }
  return Status::success();
}

Status check_dtypes(const std::string& name, DType grad, const void* out, DType out_dtype, DType state,
                    bool allow_i8, const char* state_rule) {
  if (!dtype_valid(grad)) {
    return invalid_argument(name + ": grad dtype " + std::to_string(int(grad)) + " is not f32, f16 or bf16");
  }
  if (out != nullptr && out_dtype != DType::f16 && out_dtype != DType::bf16) {
    return invalid_argument(name + ": out dtype " + std::string(dtype_name(out_dtype)) +
                            " is invalid: the weight copy is f16 or bf16 (or no copy: out = nullptr)");
  }
  if (state != DType::f32 && state != DType::bf16 && !(allow_i8 && state == DType::i8)) {
    return invalid_argument(name + ": state dtype " + std::string(dtype_name(state)) + " is invalid: " + state_rule);
  }
  return Status::success();
}

}  // namespace zoe::cpu_engine

namespace zoe {
namespace {

using simd::AdamFn;
using simd::KernelTable;
using namespace cpu_engine;

Status check_hyper(const AdamHyper& h, const StepOptions& o) {
  if (Status s = check_step_options(o); !s.ok()) return s;
  return validate_hyper(OptimizerHyper(h));  // the ranges of the optimizer table's fields
}

// Which tensors carry max_exp_avg_sq: every one (a step with amsgrad), none (without), or those that set it
// (the streams ceiling, which counts the array where it is given).
enum class MaxSq { none, every, where_set };

// One tensor's arrays: null pointers, the dtypes, and their byte ranges for the overlap check.
Status check_tensor(const AdamTensor& t, std::size_t i, std::size_t count, MaxSq max_sq,
                    std::vector<ByteRange>& ranges) {
  const std::string name = tensor_name(i, count);
  if (Status s = check_dtypes(name, t.grad_dtype, t.out, t.out_dtype, t.state_dtype, true,
                              "the moments are stored as f32, bf16 or i8");
      !s.ok()) {
    return s;
  }
  const bool with_max = max_sq == MaxSq::every || (max_sq == MaxSq::where_set && t.max_exp_avg_sq != nullptr);
  if (with_max && t.state_dtype == DType::i8) {
    return invalid_argument(name + ": amsgrad with state dtype i8 is not supported; use f32 or bf16 moments");
  }
  if (t.n == 0) return Status::success();
  const std::size_t state = dtype_size(t.state_dtype) * t.n;
  const std::size_t scales = t.state_dtype == DType::i8 ? 4 * moment_blocks(t.n) : 0;
  const bool q8 = t.state_dtype == DType::i8;
  const std::string with_n = "with n = " + std::to_string(t.n);
  if (q8) {
    if (Status s = add_arrays(ranges, name, i, {{t.exp_avg_scale, scales, "exp_avg_scale", true},
                                                {t.exp_avg_sq_scale, scales, "exp_avg_sq_scale", true}},
                              "with state dtype i8");
        !s.ok()) {
      return s;
    }
  }
  if (Status s = add_arrays(ranges, name, i,
                            {{t.param, 4 * t.n, "param", true},
                             {t.exp_avg, state, "exp_avg", true},
                             {t.exp_avg_sq, state, "exp_avg_sq", true},
                             // Ignored without amsgrad, as adam.h says: not checked either.
                             {with_max ? t.max_exp_avg_sq : nullptr, state, "max_exp_avg_sq", true, !with_max},
                             {t.grad, dtype_size(t.grad_dtype) * t.n, "grad", false},
                             {t.out, dtype_size(t.out_dtype) * t.n, "out", true, true}},
                            with_max ? with_n + " and amsgrad" : with_n);
      !s.ok()) {
    return s;
  }
  if (t.from.param == nullptr) return Status::success();
  return add_arrays(ranges, name, i,
                    {{t.from.param, 4 * t.n, "from.param", false},
                     {t.from.exp_avg, state, "from.exp_avg", false},
                     {t.from.exp_avg_sq, state, "from.exp_avg_sq", false},
                     {q8 ? t.from.exp_avg_scale : nullptr, scales, "from.exp_avg_scale", false, !q8},
                     {q8 ? t.from.exp_avg_sq_scale : nullptr, scales, "from.exp_avg_sq_scale", false, !q8},
                     {with_max ? t.from.max_exp_avg_sq : nullptr, state, "from.max_exp_avg_sq", false, !with_max}},
                    "while from.param is set");
}

// Null pointers, invalid dtypes, and overlaps between an output (p, m, v, v_max, out) and anything else.
Status check_tensors(std::span<const AdamTensor> tensors, MaxSq max_sq) {
  std::vector<ByteRange> ranges;
  ranges.reserve(tensors.size() * 6);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (Status s = check_tensor(tensors[i], i, tensors.size(), max_sq, ranges); !s.ok()) return s;
  }
  return check_overlaps(ranges, tensors.size());
}

// Null pointers with elements, invalid dtypes, and overlaps: acc is always written, grad with zero_source.
Status check_accumulate_tensors(std::span<const AccumulateTensor> tensors, const AccumulateOptions& options) {
  std::vector<ByteRange> ranges;
  ranges.reserve(tensors.size() * 2);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const AccumulateTensor& t = tensors[i];
    const std::string name = tensor_name(i, tensors.size());
    if (!dtype_valid(t.grad_dtype)) {
      return invalid_argument(name + ": grad dtype " + std::to_string(int(t.grad_dtype)) + " is not f32, f16 or bf16");
    }
    if (t.n == 0) continue;
    if (t.acc == nullptr) return invalid_argument(name + ": acc is null with n = " + std::to_string(t.n));
    if (t.grad == nullptr) return invalid_argument(name + ": grad is null with n = " + std::to_string(t.n));
    const auto acc = reinterpret_cast<std::uintptr_t>(t.acc);
    const auto grad = reinterpret_cast<std::uintptr_t>(t.grad);
    ranges.push_back({acc, acc + 4 * t.n, i, "acc", true});
    ranges.push_back({grad, grad + dtype_size(t.grad_dtype) * t.n, i, "grad", options.zero_source});
  }
  return check_overlaps(ranges, tensors.size());
}

int accumulate_mode(const AccumulateOptions& options) {
  return (options.first ? simd::kAccumulateFirst : 0) | (options.zero_source ? simd::kAccumulateZeroSource : 0);
}

// The state the step reads from element `offset` (block `block` of the scales): the tensor's own arrays, or
// `from` (AdamSource).
simd::StateIn state_in(const AdamTensor& t, std::size_t offset, std::size_t block) {
  const std::size_t ssize = dtype_size(t.state_dtype);
  const bool own = t.from.param == nullptr;
  const float* ms = own ? t.exp_avg_scale : t.from.exp_avg_scale;
  const float* vs = own ? t.exp_avg_sq_scale : t.from.exp_avg_sq_scale;
  return simd::StateIn{(own ? t.param : t.from.param) + offset,
                       static_cast<const unsigned char*>(own ? t.exp_avg : t.from.exp_avg) + offset * ssize,
                       static_cast<const unsigned char*>(own ? t.exp_avg_sq : t.from.exp_avg_sq) + offset * ssize,
                       ms == nullptr ? nullptr : ms + block, vs == nullptr ? nullptr : vs + block};
}

void run_adam(AdamFn fn, const simd::AdamConstants& c, const AdamTensor& t, std::size_t offset, std::size_t count) {
  const std::size_t gsize = dtype_size(t.grad_dtype);
  const std::size_t osize = t.out == nullptr ? 0 : dtype_size(t.out_dtype);
  const std::size_t ssize = dtype_size(t.state_dtype);
  fn(c, state_in(t, offset, 0), t.param + offset, static_cast<unsigned char*>(t.exp_avg) + offset * ssize,
     static_cast<unsigned char*>(t.exp_avg_sq) + offset * ssize,
     static_cast<const unsigned char*>(t.grad) + offset * gsize,
     t.out == nullptr ? nullptr : static_cast<unsigned char*>(t.out) + offset * osize, count);
}

// 8-bit moments: the blocks that start in [offset, offset + count), each whole. Every block starts in
// exactly one tile's range, so each is stepped once, by one thread, whatever the tiling.
void run_adam_q8(simd::AdamQ8Fn fn, const simd::AdamConstants& c, const AdamTensor& t, std::size_t offset,
                 std::size_t count) {
  const std::size_t first = moment_blocks(offset) * kMomentBlock;
  if (first >= offset + count) return;
  const std::size_t end = std::min(t.n, moment_blocks(offset + count) * kMomentBlock);
  const std::size_t gsize = dtype_size(t.grad_dtype);
  const std::size_t osize = t.out == nullptr ? 0 : dtype_size(t.out_dtype);
  fn(c, state_in(t, first, first / kMomentBlock), t.param + first, static_cast<std::int8_t*>(t.exp_avg) + first,
     static_cast<std::uint8_t*>(t.exp_avg_sq) + first, t.exp_avg_scale + first / kMomentBlock, t.exp_avg_sq_scale + first / kMomentBlock,
     static_cast<const unsigned char*>(t.grad) + first * gsize,
     t.out == nullptr ? nullptr : static_cast<unsigned char*>(t.out) + first * osize, end - first);
}

simd::AdamConstants constants(const AdamHyper& h, const StepOptions& o) {
  const double t = static_cast<double>(o.step);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(static_cast<double>(h.beta1), t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(static_cast<double>(h.beta2), t) : 1.0;
  simd::AdamConstants c{};
  c.beta1 = h.beta1;
  c.one_minus_beta1 = 1.0f - h.beta1;
  c.beta2 = h.beta2;
  c.one_minus_beta2 = 1.0f - h.beta2;
  c.neg_step_size = static_cast<float>(-static_cast<double>(h.lr) / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = h.eps;
  c.decay = h.adamw ? static_cast<float>(1.0 - static_cast<double>(h.lr) * h.weight_decay) : 1.0f;
  c.l2 = h.adamw ? 0.0f : h.weight_decay;
  // maximize: -g, as torch negates the gradient before anything else. The kernels multiply each gradient by
  // grad_scale before adding the L2 term, and negation is exact, so -(g * s) is torch's (-g) * s.
  c.grad_scale = h.maximize ? -o.grad_scale : o.grad_scale;
  return c;
}

int out_index(const AdamTensor& t) { return cpu_engine::out_index(t.out, t.out_dtype); }
int state_index(const AdamTensor& t) { return cpu_engine::state_index(t.state_dtype); }

// AMSGrad: Adam's arrays and max_exp_avg_sq, read from `from` where it is set (AdamSource).
void run_amsgrad(simd::AmsgradFn fn, const simd::AdamConstants& c, const AdamTensor& t, std::size_t offset,
                 std::size_t count) {
  const std::size_t ssize = dtype_size(t.state_dtype);
  const simd::StateIn in = state_in(t, offset, 0);
  const void* max_in = t.from.param == nullptr ? t.max_exp_avg_sq : t.from.max_exp_avg_sq;
  const simd::StepArrays<3> a{in.p,
                              {in.m, in.v, at(max_in, offset, ssize)},
                              t.param + offset,
                              {at(t.exp_avg, offset, ssize), at(t.exp_avg_sq, offset, ssize),
                               at(t.max_exp_avg_sq, offset, ssize)},
                              at(t.grad, offset, dtype_size(t.grad_dtype)),
                              at(t.out, offset, dtype_size(t.out_dtype))};
  fn(c, a, count);
}

}  // namespace

Status CpuAdam::Impl::accumulate(std::span<const AccumulateTensor> tensors, const AccumulateOptions& options,
                                const simd::AccumulateFn (&kernels)[simd::kElems]) {
  if (Status s = check_accumulate_tensors(tensors, options); !s.ok()) return s;
  const int mode = accumulate_mode(options);
  for_each_tile(tensors, [&](const AccumulateTensor& t, std::size_t offset, std::size_t count) {
    kernels[int(t.grad_dtype)](t.acc + offset, static_cast<unsigned char*>(t.grad) + offset * dtype_size(t.grad_dtype),
                               count, mode);
  });
  return Status::success();
}

Result<CpuAdam> CpuAdam::create(const CpuAdamOptions& options) {
  Result<Isa> isa = simd::choose_isa(options.isa);
  if (!isa.ok()) return isa.status();
  if (options.tile == 0) return invalid_argument("tile = 0 is invalid: tiles hold at least one element");
  Result<PinnedArena> arena = PinnedArena::create(options.threads, options.pin_threads);
  if (!arena.ok()) return arena.status();
  auto impl = std::unique_ptr<Impl>(
      new Impl{isa.value(), &simd::kernel_table(isa.value()), options.tile, std::move(arena).value()});
  return CpuAdam(std::move(impl));
}

CpuAdam::CpuAdam(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuAdam::CpuAdam(CpuAdam&&) noexcept = default;
CpuAdam& CpuAdam::operator=(CpuAdam&&) noexcept = default;
CpuAdam::~CpuAdam() = default;

Status CpuAdam::validate(const AdamHyper& hyper) { return check_hyper(hyper, StepOptions{}); }

Isa CpuAdam::isa() const { return impl_->isa; }
std::string_view CpuAdam::kernel() const { return impl_->table->name; }
int CpuAdam::threads() const { return impl_->arena.threads(); }
std::size_t CpuAdam::tile() const { return impl_->tile; }

Status CpuAdam::step(const AdamHyper& hyper, const StepOptions& options, std::span<const AdamTensor> tensors) {
  if (Status s = check_hyper(hyper, options); !s.ok()) return s;
  if (Status s = check_tensors(tensors, hyper.amsgrad ? MaxSq::every : MaxSq::none); !s.ok()) return s;
  if (options.check_finite) {
    if (Status s = impl_->check_finite<AdamTensor>(tensors); !s.ok()) return s;
  }
  const KernelTable& table = *impl_->table;
  const simd::AdamConstants c = constants(hyper, options);
  impl_->for_each_tile(tensors, [&](const AdamTensor& t, std::size_t offset, std::size_t count) {
    if (t.state_dtype == DType::i8) {
      run_adam_q8(table.adam_q8[int(t.grad_dtype)][out_index(t)], c, t, offset, count);
    } else if (hyper.amsgrad) {
      run_amsgrad(table.amsgrad.step[int(t.grad_dtype)][out_index(t)][state_index(t)], c, t, offset, count);
    } else {
      run_adam(table.adam[int(t.grad_dtype)][out_index(t)][state_index(t)], c, t, offset, count);
    }
  });
  return Status::success();
}

void CpuAdam::parallel_for(std::size_t n, const std::function<void(std::size_t)>& body) {
  if (n == 0) return;
  impl_->arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, 1), [&](const tbb::blocked_range<std::size_t>& r) {
      for (std::size_t i = r.begin(); i != r.end(); ++i) body(i);
    }, tbb::simple_partitioner());
  });
}

Status CpuAdam::streams_pass(std::span<const AdamTensor> tensors) {
  if (Status s = check_tensors(tensors, MaxSq::where_set); !s.ok()) return s;
  const KernelTable& table = *impl_->table;
  impl_->for_each_tile(tensors, [&](const AdamTensor& t, std::size_t offset, std::size_t count) {
    if (t.state_dtype == DType::i8) {
      run_adam_q8(table.streams_q8[int(t.grad_dtype)][out_index(t)], simd::AdamConstants{}, t, offset, count);
    } else if (t.max_exp_avg_sq != nullptr) {
      run_amsgrad(table.amsgrad.streams[int(t.grad_dtype)][out_index(t)][state_index(t)], simd::AdamConstants{}, t,
                  offset, count);
    } else {
      run_adam(table.streams[int(t.grad_dtype)][out_index(t)][state_index(t)], simd::AdamConstants{}, t, offset, count);
    }
  });
  return Status::success();
}

Status CpuAdam::accumulate(std::span<const AccumulateTensor> tensors, const AccumulateOptions& options) {
  return impl_->accumulate(tensors, options, impl_->table->accumulate);
}

Status CpuAdam::accumulate_streams_pass(std::span<const AccumulateTensor> tensors, const AccumulateOptions& options) {
  return impl_->accumulate(tensors, options, impl_->table->accumulate_streams);
}

void encode_moments(const float* m, const float* v, std::size_t n, std::int8_t* mq, std::uint8_t* vq, float* m_scale,
                    float* v_scale) {
  static_assert(kMomentBlock == simd::kQuantBlock);
  simd::scalar::table().encode_q8(m, v, n, mq, vq, m_scale, v_scale);
}

void decode_moments(const std::int8_t* mq, const std::uint8_t* vq, const float* m_scale, const float* v_scale,
                    std::size_t n, float* m, float* v) {
  simd::scalar::table().decode_q8(mq, vq, m_scale, v_scale, n, m, v);
}

}  // namespace zoe
