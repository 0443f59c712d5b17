// Private interface between the generic engine and the per-ISA kernels. Plain C types only: this header is
// included by translation units compiled with wide-ISA flags.
#pragma once

#include "simd/private.h"

#include <cstddef>
#include <cstdint>

namespace zoe::simd {

// Element types by index; the values equal zoe::DType's. Output index 0 means "no output".
enum Elem : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum OutElem : int { kOutNone = 0, kOutF16 = 1, kOutBF16 = 2 };
constexpr int kElems = 3;
// How the moments m and v are stored: fp32, or bf16 rounded to nearest even after each step (the update
// itself is computed in fp32 from the widened values).
enum StateElem : int { kStateF32 = 0, kStateBF16 = 1 };
constexpr int kStates = 2;

// 8-bit moments (state dtype int8; Adam's two, Lion's one): per block of kQuantBlock elements counted from the tensor's first (the
// last block may be shorter), the codes and one fp32 scale per moment:
//  - m, signed and linear: scale = max |m| of the block; code = round-to-nearest-even(m * (127 / scale)),
//    in [-127, 127]; m' = code * (scale / 127). Values under scale / 254 become 0, which only drops their
//    (tiny) part of the update.
//  - v, unsigned, an 8-bit float relative to the block's largest: scale = max v; x = v * (1 / scale) in
//    [0, 1]; the code is x's exponent (2^-31 .. 2^0, 5 bits) and mantissa rounded to 3 bits, code 0 for
//    x <= 2^-31: v' = decode(code) * scale, decode(0) = 2^-31. Relative error <= 2^-4 over nine decades,
//    and a small v (the denominator of its element's update) is never rounded to zero beside a large one,
//    as a linear code would round it.
// Adam runs in fp32 on a block's widened m' and v'; the block is then encoded again with its new scales.
// Every operation is an exact IEEE one (products, the rounding, bit moves, max), so all ISAs write the
// same codes from the same fp32 values. NaN/Inf moments are not represented.
enum : int { kStateInt8 = 2 };
constexpr std::size_t kQuantBlock = 2048;

// Per-step scalars, derived once per call from the hyper-parameters (see cpu_adam.cpp for the formulas).
struct AdamConstants {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float neg_step_size;   // -lr / (1 - beta1^t)
  float inv_bc2_sqrt;    // 1 / sqrt(1 - beta2^t)
  float eps;
  float decay;           // AdamW: 1 - lr * weight_decay; else 1
  float l2;              // Adam: weight_decay (added to the gradient); else 0
  float grad_scale;
};

// The state a step reads: fp32 master weights p, moments m and v of the table's state type and, for 8-bit
// moments, their block scales (null otherwise).
struct StateIn {
  const float* p;
  const void* m;
  const void* v;
  const float* m_scale;
  const float* v_scale;
};

// in: the state read; p: fp32 master weights, m, v: moments of the table's state type, written; g: gradients
// of the table's grad type; out: copy of the new p. Each of p, m, v is either in's array itself (a step in
// place: sync, delayed) or does not overlap it (a step into the other state set, which leaves the state it
// read as it was: the overlap schedule's speculation).
using AdamFn = void (*)(const AdamConstants& c, const StateIn& in, float* p, void* m, void* v, const void* g,
                        void* out, std::size_t n);
// The same with 8-bit moments (codes m, v and a scale per kQuantBlock elements of each; in.m_scale and
// in.v_scale are read, m_scale and v_scale written, under the same rule).
using AdamQ8Fn = void (*)(const AdamConstants& c, const StateIn& in, float* p, std::int8_t* m, std::uint8_t* v,
                          float* m_scale, float* v_scale, const void* g, void* out, std::size_t n);
// Whole blocks of fp32 moments to codes and scales, and back (n elements; the last block may be shorter).
using EncodeQ8Fn = void (*)(const float* m, const float* v, std::size_t n, std::int8_t* mq, std::uint8_t* vq,
                            float* m_scale, float* v_scale);
using DecodeQ8Fn = void (*)(const std::int8_t* mq, const std::uint8_t* vq, const float* m_scale, const float* v_scale,
                            std::size_t n, float* m, float* v);
// Counts the NaN/Inf gradients in g[0, n); *first receives the index of the first one (n when none).
using CountNonFiniteFn = std::size_t (*)(const void* g, std::size_t n, std::size_t* first);
// Sum of squares of the finite values of g (in double), and the count of NaN/Inf values: a gradient norm.
using SumSquaresFn = double (*)(const void* g, std::size_t n, std::uint64_t* non_finite);

// Gradient accumulation over micro-batches: bit flags, combined with |.
enum AccumulateMode : int {
  kAccumulateAdd = 0,         // acc[i] = acc[i] + float(g[i]): one IEEE addition, as fp32 `acc += g`
  kAccumulateFirst = 1,       // acc[i] = float(g[i]), acc not read: the first micro-batch needs no zeroed acc
  kAccumulateZeroSource = 2,  // and g[i] = +0 in g's dtype in the same pass: g is ready for the next micro-batch
};
constexpr int kAccumulateModeMask = kAccumulateFirst | kAccumulateZeroSource;
// acc: fp32 accumulator; g: gradients of the table's grad type, written only with kAccumulateZeroSource.
using AccumulateFn = void (*)(float* acc, void* g, std::size_t n, int mode);

// ---- The rules beside Adam: Lion, Adagrad, and Adam with AMSGrad (simd/rule_run.inl and each rule's body) ----

// Lion's per-step scalars (Chen et al. 2023, arXiv 2302.06675).
struct LionConstants {
  float beta1;            // the update's interpolation: u = sign(beta1 * m + (1 - beta1) * g)
  float one_minus_beta1;
  float beta2;            // the moment's: m = beta2 * m + (1 - beta2) * g
  float one_minus_beta2;
  float neg_lr;           // -lr
  float decay;            // 1 - lr * weight_decay
  float grad_scale;       // negated for maximize
};

// Adagrad's per-step scalars (torch.optim.Adagrad).
struct AdagradConstants {
  float neg_clr;          // -lr / (1 + (step - 1) * lr_decay)
  float eps;
  float l2;               // weight_decay, added to the gradient (a separate instantiation when not 0)
  float grad_scale;       // negated for maximize
};

// The arrays of one call of a rule that keeps `States` state arrays per parameter (Lion's exp_avg and
// Adagrad's sum: 1; AMSGrad's exp_avg, exp_avg_sq and max_exp_avg_sq: 3, in that order), each of the table's
// state type. StateIn's convention: read from p_in and state_in, written to p and state, which are either
// the same arrays (a step in place) or do not overlap them; g: gradients of the table's grad type; out: the
// copy of the new p (null without one).
template <int States>
struct StepArrays {
  const float* p_in;
  const void* state_in[States];
  float* p;
  void* state[States];
  const void* g;
  void* out;
};

using LionFn = void (*)(const LionConstants& c, const StepArrays<1>& a, std::size_t n);
using AdagradFn = void (*)(const AdagradConstants& c, const StepArrays<1>& a, std::size_t n);
using AmsgradFn = void (*)(const AdamConstants& c, const StepArrays<3>& a, std::size_t n);
// Lion with its moment in 8 bits (m's code above, a scale per kQuantBlock elements; in.v and in.v_scale are
// not read): each block decoded, stepped in fp32 as LionFn steps it, and encoded again with its new scale.
using LionQ8Fn = void (*)(const LionConstants& c, const StateIn& in, float* p, std::int8_t* m, float* m_scale,
                          const void* g, void* out, std::size_t n);

// One rule's kernels and their bandwidth ceiling (the same loads and stores, one addition each).
template <typename Fn>
struct RuleKernels {
  Fn step[kElems][kElems][kStates];     // [grad Elem][OutElem][StateElem]
  Fn streams[kElems][kElems][kStates];
};

struct KernelTable {
  const char* name;         // the ISA token: "scalar", "avx2", "avx512", "neon", "sve"
  std::size_t lanes;        // fp32 lanes per vector (sve: this CPU's vector length)
  bool native_bf16;         // bf16 rounding done by a hardware instruction
  AdamFn adam[kElems][kElems][kStates];     // [grad Elem][OutElem][StateElem]
  AdamFn streams[kElems][kElems][kStates];  // the bandwidth ceiling: same loads/stores, trivial arithmetic
  AdamQ8Fn adam_q8[kElems][kElems];         // [grad Elem][OutElem], 8-bit moments
  AdamQ8Fn streams_q8[kElems][kElems];      // its ceiling: the codes' loads and stores, widened and narrowed
  EncodeQ8Fn encode_q8;
  DecodeQ8Fn decode_q8;
  CountNonFiniteFn count_non_finite[kElems];
  SumSquaresFn sum_squares[kElems];
  AccumulateFn accumulate[kElems];          // [grad Elem]
  AccumulateFn accumulate_streams[kElems];  // its ceiling: the same loads and stores, g widened by a shift
  RuleKernels<AmsgradFn> amsgrad;           // Adam/AdamW with amsgrad (fp32 and bf16 moments)
  RuleKernels<LionFn> lion;
  LionQ8Fn lion_q8[kElems][kElems];         // [grad Elem][OutElem]
  RuleKernels<AdagradFn> adagrad;
};

namespace scalar { const KernelTable& table(); }
namespace avx2 { const KernelTable& table(); }
namespace avx512 { const KernelTable& table(); }
namespace avx512bf16 { const KernelTable& table(); }  // avx512 with AVX512_BF16 rounding instructions
// AArch64 builds only (and x86 builds only the three above): simd/meson.build compiles each host's own.
namespace neon { const KernelTable& table(); }
namespace sve { const KernelTable& table(); }  // vector-length agnostic; call only where the CPU runs SVE

}  // namespace zoe::simd
