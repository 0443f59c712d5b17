// CPU Adam/AdamW over fp32 master weights and fp32 moments, with fp32/fp16/bf16 gradients and an optional
// fp16/bf16 copy of the updated weights written in the same pass. Numerics follow torch.optim.Adam/AdamW
// (bias correction, eps added after the square root, decoupled weight decay: Loshchilov & Hutter,
// arXiv 1711.05101), with torch's amsgrad. The same engine steps Lion and Adagrad (LionHyper, AdagradHyper),
// which keep one state array per parameter (OneStateTensor).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zoe/dtype.h"
#include "zoe/status.h"

namespace zoe {

struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw = true;            // decoupled weight decay (AdamW); false: L2 added to the gradient (Adam)
  bool bias_correction = true;
  // torch's maximize: ascend, stepping with the negated gradient (negated before Adam's L2 term is added;
  // AdamW's decoupled decay is unchanged). The kernels take it as a negated gradient scale: exact.
  bool maximize = false;
  // torch's amsgrad (Reddi, Kale & Kumar 2018): a third state array, max_exp_avg_sq = max(max_exp_avg_sq,
  // exp_avg_sq) after exp_avg_sq's update, is the denominator's second moment. State dtype f32 or bf16.
  bool amsgrad = false;
};

// Where a step reads the state when that is not where it writes it: the overlap schedule's speculative step
// reads the current state set and writes the other one (ping-pong), so the current set stays as it was and a
// discarded speculation has nothing to copy back. Each array has the layout of the one it stands for —
// param, exp_avg, exp_avg_sq and, for state dtype i8, the block scales — is only read, and must not overlap
// any output. param null: the step reads the tensor's own arrays (in place).
struct AdamSource {
  const float* param = nullptr;
  const void* exp_avg = nullptr;
  const void* exp_avg_sq = nullptr;
  const float* exp_avg_scale = nullptr;
  const float* exp_avg_sq_scale = nullptr;
  const void* max_exp_avg_sq = nullptr;  // with amsgrad
};

// One tensor's state. Gradients may be any DType; `out`, when not null, receives the updated weights in
// `out_dtype` (f16 or bf16). Outputs (param, exp_avg, exp_avg_sq, out) must not overlap each other or grad.
// The moments are stored in `state_dtype`: f32, or bf16 — half the bytes; each step computes in fp32 from
// the widened moments and stores them rounded to nearest even (the master weights stay fp32) — or i8:
// one byte each, in blocks of kMomentBlock elements from the tensor's first, with an fp32 scale per block
// in exp_avg_scale / exp_avg_sq_scale (m: linear codes of max |m|; v: an 8-bit float of v / max v with a
// 3-bit mantissa over nine decades; simd/kernels.h has the exact scheme). A block is decoded, stepped in
// fp32 and encoded again with new scales. Results stay bit-identical for any thread count and tile size.
struct AdamTensor {
  float* param = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType state_dtype = DType::f32;
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  void* out = nullptr;
  DType out_dtype = DType::bf16;
  std::size_t n = 0;
  float* exp_avg_scale = nullptr;  // state dtype i8: one per kMomentBlock elements (moment_blocks(n))
  float* exp_avg_sq_scale = nullptr;
  AdamSource from{};  // the state read, where it is not param, exp_avg, exp_avg_sq (and their scales)
  // amsgrad only (read and written; ignored without it): the running maximum of exp_avg_sq, in state_dtype,
  // exp_avg_sq's layout; the caller zeroes it before the first step, as torch does.
  void* max_exp_avg_sq = nullptr;
};

// Lion (Chen et al. 2023, arXiv 2302.06675): u = sign(beta1 * m + (1 - beta1) * g);
// p = p * (1 - lr * weight_decay) - lr * u; m = beta2 * m + (1 - beta2) * g, with g the scaled gradient and
// sign(0) = 0 as torch.sign. The weight decay is decoupled, applied as AdamW applies it. One state array per
// parameter, the moment m (torch's exp_avg, zero before the first step). The update does not use the step
// count; StepOptions::step is still checked (>= 1) as for every rule, since the state keeps it all the same.
struct LionHyper {
  float lr = 1e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.0f;
  bool maximize = false;  // ascend: the gradient negated, as AdamHyper's
};

// Adagrad as torch.optim.Adagrad (Duchi, Hazan & Singer 2011): g = g + weight_decay * p (when weight_decay is
// not 0); clr = lr / (1 + (step - 1) * lr_decay); sum = sum + g * g; p = p - clr * g / (sqrt(sum) + eps). One
// state array per parameter, sum, which the caller fills before the first step with torch's
// initial_accumulator_value (0 by default).
struct AdagradHyper {
  float lr = 1e-2f;
  float lr_decay = 0.0f;
  float weight_decay = 0.0f;
  float eps = 1e-10f;
  bool maximize = false;  // ascend: the gradient negated before the weight decay is added, as torch does
};

// AdamSource for a rule with one state array: where the step reads, when that is not where it writes.
// param null: the step reads the tensor's own arrays (in place).
struct OneStateSource {
  const float* param = nullptr;
  const void* state = nullptr;
  const float* state_scale = nullptr;  // state dtype i8: state's block scales
};

// One tensor of a rule with one state array per parameter: Lion's exp_avg, Adagrad's sum. One type for
// both, since the engine treats them alike (the hyper-parameters say which rule runs); the rest is as
// AdamTensor: the state in state_dtype f32 or bf16 (stepped in fp32, stored rounded to nearest even) or, for
// Lion, i8 (AdamTensor's exp_avg code: linear, one fp32 scale per kMomentBlock elements in state_scale; each
// block decoded, stepped in fp32, encoded again), the gradient in any DType, the optional f16/bf16 copy of
// the weights, outputs that overlap nothing.
struct OneStateTensor {
  float* param = nullptr;
  void* state = nullptr;
  DType state_dtype = DType::f32;
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  void* out = nullptr;
  DType out_dtype = DType::bf16;
  std::size_t n = 0;
  OneStateSource from{};  // the state read, where it is not param and state
  float* state_scale = nullptr;  // state dtype i8: one per kMomentBlock elements (moment_blocks(n))
};
using LionTensor = OneStateTensor;
using AdagradTensor = OneStateTensor;

// Elements per block of 8-bit moments (one fp32 scale per block and moment).
constexpr std::size_t kMomentBlock = 2048;
inline std::size_t moment_blocks(std::size_t n) { return (n + kMomentBlock - 1) / kMomentBlock; }

// The one-state view of an AdamTensor's param, exp_avg (with its scales), grad and out, and of its source:
// how the tiers, which lay out every rule's first state array where Adam's exp_avg is, hand it to a rule
// with one.
inline OneStateTensor one_state_of(const AdamTensor& t) {
  OneStateTensor o;
  o.param = t.param;
  o.state = t.exp_avg;
  o.state_dtype = t.state_dtype;
  o.grad = t.grad;
  o.grad_dtype = t.grad_dtype;
  o.out = t.out;
  o.out_dtype = t.out_dtype;
  o.n = t.n;
  o.state_scale = t.exp_avg_scale;
  o.from = OneStateSource{t.from.param, t.from.exp_avg, t.from.exp_avg_scale};
  return o;
}

// fp32 moments of n elements to 8-bit codes and block scales (whole blocks from the first element), and
// back: what the kernels store and read, for taking state in and out. v null: m alone (Lion's one moment;
// vq and v_scale are then not touched).
void encode_moments(const float* m, const float* v, std::size_t n, std::int8_t* mq, std::uint8_t* vq, float* m_scale,
                    float* v_scale);
void decode_moments(const std::int8_t* mq, const std::uint8_t* vq, const float* m_scale, const float* v_scale,
                    std::size_t n, float* m, float* v);

struct StepOptions {
  std::int64_t step = 1;     // 1-based, as torch's state["step"] after its increment
  float grad_scale = 1.0f;   // applied to each gradient on load: 1/loss_scale times the clip coefficient
  bool check_finite = false; // true: refuse the step if any gradient is NaN/Inf, changing nothing
};

// One fp32 accumulator and the micro-batch gradient added into it (gradient accumulation on the host).
// `grad` is written only with AccumulateOptions::zero_source. acc must not overlap any grad or other acc.
struct AccumulateTensor {
  float* acc = nullptr;
  void* grad = nullptr;
  DType grad_dtype = DType::f32;
  std::size_t n = 0;
};

struct AccumulateOptions {
  bool first = false;        // the first micro-batch: acc = grad; acc's old contents are never read
  bool zero_source = false;  // also set grad to +0 (in its dtype) in the same pass, ready for the next one
};

// Instruction sets with an Adam kernel: x86-64's in priority order (best first), then AArch64's (sve before
// neon); scalar runs everywhere. A build has the kernels of its own architecture only.
enum class Isa { avx512, avx2, scalar, sve, neon };
std::string_view isa_name(Isa isa);
std::vector<Isa> supported_isas();  // what this CPU and OS can run, best first
// The CPU features the choice of kernels reads, as "name=value" pairs separated by spaces (`zoe info`).
std::string cpu_features_text();

struct CpuAdamOptions {
  std::string isa = "auto";    // auto | scalar | avx2 | avx512 | neon | sve; ZOE_ISA replaces auto, never an explicit name
  int threads = 0;             // 0: every CPU this process may run on; ZOE_THREADS caps it
  std::size_t tile = 1 << 16;  // elements per unit of parallel work
  bool pin_threads = true;     // bind worker threads to cores (hwloc)
};

// Steps any number of tensors of any size on a persistent, pinned TBB arena. Results are bit-identical for
// any thread count and tile size. Move-only; one instance may be shared by callers that do not step
// concurrently.
class CpuAdam {
 public:
  static Result<CpuAdam> create(const CpuAdamOptions& options = {});
  CpuAdam(CpuAdam&&) noexcept;
  CpuAdam& operator=(CpuAdam&&) noexcept;
  ~CpuAdam();

  Status step(const AdamHyper& hyper, const StepOptions& options, std::span<const AdamTensor> tensors);
  Status step(const AdamHyper& hyper, const StepOptions& options, const AdamTensor& tensor) {
    return step(hyper, options, std::span<const AdamTensor>(&tensor, 1));
  }

  // Lion and Adagrad, under the same contract as Adam's step (a refused call changes nothing; results
  // bit-identical for any thread count and tile).
  Status step(const LionHyper& hyper, const StepOptions& options, std::span<const OneStateTensor> tensors);
  Status step(const LionHyper& hyper, const StepOptions& options, const OneStateTensor& tensor) {
    return step(hyper, options, std::span<const OneStateTensor>(&tensor, 1));
  }
  Status step(const AdagradHyper& hyper, const StepOptions& options, std::span<const OneStateTensor> tensors);
  Status step(const AdagradHyper& hyper, const StepOptions& options, const OneStateTensor& tensor) {
    return step(hyper, options, std::span<const OneStateTensor>(&tensor, 1));
  }

  // The bandwidth ceiling of `step`: the same loads and stores per element over the same tensors, threads
  // and tiles, with trivial arithmetic. It overwrites the tensors' state; benchmarks compare against it.
  // Tensors with max_exp_avg_sq set count it as AMSGrad's step does (not with int8 moments).
  Status streams_pass(std::span<const AdamTensor> tensors);
  // The ceiling of Lion's and Adagrad's step (the same loads and stores: one state array).
  Status streams_pass(std::span<const OneStateTensor> tensors);

  // Gradient accumulation: acc[i] = acc[i] + float(grad[i]), one fp32 addition rounded once, exactly what
  // fp32 `acc += grad` gives (or acc[i] = float(grad[i]) for the first micro-batch), tiled over this
  // engine's threads like step(): bit-identical for any thread count and tile. NaN/Inf propagate as in
  // IEEE addition. A refused call changes nothing.
  Status accumulate(std::span<const AccumulateTensor> tensors, const AccumulateOptions& options = {});
  Status accumulate(const AccumulateTensor& tensor, const AccumulateOptions& options = {}) {
    return accumulate(std::span<const AccumulateTensor>(&tensor, 1), options);
  }
  // The bandwidth ceiling of `accumulate`: the same loads and stores per element, tiles and threads, with
  // the cheapest widening of the gradient (its values are wrong for f16). For benchmarks.
  Status accumulate_streams_pass(std::span<const AccumulateTensor> tensors, const AccumulateOptions& options = {});

  // Runs body(i) for every i in [0, n) on this engine's threads (one i per task) and returns when all are
  // done: passes over host memory that belong beside the step (the gradients' NaN/Inf check and norm).
  void parallel_for(std::size_t n, const std::function<void(std::size_t)>& body);

  // The checks step() applies to hyper-parameters, for callers that validate up front.
  static Status validate(const AdamHyper& hyper);
  static Status validate(const LionHyper& hyper);
  static Status validate(const AdagradHyper& hyper);

  Isa isa() const;
  // The name recorded in the kernel table this engine calls: proof of which ISA's code runs.
  std::string_view kernel() const;
  int threads() const;
  std::size_t tile() const;

 private:
  struct Impl;
  explicit CpuAdam(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoe
