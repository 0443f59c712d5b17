#if defined(__x86_64__)
#include <emmintrin.h>  // SSE2 streaming stores (copy_streaming)
#endif
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "simd/dispatch.h"
#include "src/arena.h"
#include "zoe/adam.h"

namespace zoe {
namespace {

using simd::AdamFn;
using simd::KernelTable;

std::string tensor_name(std::size_t index, std::size_t count) {
  return count == 1 ? std::string("tensor") : "tensor " + std::to_string(index);
}

struct ByteRange {
  std::uintptr_t begin, end;
  std::size_t tensor;
  const char* what;
  bool output;
};

Status check_hyper(const AdamHyper& h, const StepOptions& o) {
  auto bad = [](const char* name, double value, const char* want) {
    return invalid_argument(std::string(name) + " = " + std::to_string(value) + " is invalid: " + want);
  };
  if (o.step < 1) return invalid_argument("step = " + std::to_string(o.step) + " is invalid: steps count from 1");
  if (!(h.lr >= 0.0f) || !std::isfinite(h.lr)) return bad("lr", h.lr, "need a finite value >= 0");
  if (!(h.eps >= 0.0f) || !std::isfinite(h.eps)) return bad("eps", h.eps, "need a finite value >= 0");
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f)) return bad("beta1", h.beta1, "need 0 <= beta1 < 1");
  if (!(h.beta2 >= 0.0f && h.beta2 < 1.0f)) return bad("beta2", h.beta2, "need 0 <= beta2 < 1");
  if (!(h.weight_decay >= 0.0f) || !std::isfinite(h.weight_decay)) {
    return bad("weight_decay", h.weight_decay, "need a finite value >= 0");
  }
  if (!std::isfinite(o.grad_scale)) return bad("grad_scale", o.grad_scale, "need a finite value");
  return Status::success();
}

// Overlaps between an output and any other array, across all `count` tensors: ranges sorted by start, each
// compared with the furthest-reaching range before it.
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

// Null pointers, invalid dtypes, and overlaps between an output (p, m, v, out) and anything else.
Status check_tensors(std::span<const AdamTensor> tensors) {
  std::vector<ByteRange> ranges;
  ranges.reserve(tensors.size() * 5);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const AdamTensor& t = tensors[i];
    const std::string name = [&] { return tensor_name(i, tensors.size()); }();
    if (!dtype_valid(t.grad_dtype)) {
      return invalid_argument(name + ": grad dtype " + std::to_string(int(t.grad_dtype)) + " is not f32, f16 or bf16");
    }
    if (t.out != nullptr && t.out_dtype != DType::f16 && t.out_dtype != DType::bf16) {
      return invalid_argument(name + ": out dtype " + std::string(dtype_name(t.out_dtype)) +
                              " is invalid: the weight copy is f16 or bf16 (or no copy: out = nullptr)");
    }
    if (t.state_dtype != DType::f32 && t.state_dtype != DType::bf16 && t.state_dtype != DType::i8) {
      return invalid_argument(name + ": state dtype " + std::string(dtype_name(t.state_dtype)) +
                              " is invalid: the moments are stored as f32, bf16 or i8");
    }
    if (t.n == 0) continue;
    const std::size_t state = dtype_size(t.state_dtype);
    if (t.state_dtype == DType::i8) {
      const std::size_t scale_bytes = 4 * moment_blocks(t.n);
      for (const auto& [ptr, what] : {std::pair<const float*, const char*>{t.exp_avg_scale, "exp_avg_scale"},
                                      {t.exp_avg_sq_scale, "exp_avg_sq_scale"}}) {
        if (ptr == nullptr) return invalid_argument(name + ": " + what + " is null with state dtype i8");
        const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
        ranges.push_back({begin, begin + scale_bytes, i, what, true});
      }
    }
    const struct {
      const void* ptr;
      std::size_t bytes;
      const char* what;
      bool output;
    } arrays[] = {{t.param, 4, "param", true},
                  {t.exp_avg, state, "exp_avg", true},
                  {t.exp_avg_sq, state, "exp_avg_sq", true},
                  {t.grad, dtype_size(t.grad_dtype), "grad", false},
                  {t.out, dtype_size(t.out_dtype), "out", true}};
    for (const auto& a : arrays) {
      if (a.ptr == nullptr) {
        if (a.what == std::string_view("out")) continue;
        return invalid_argument(name + ": " + a.what + " is null with n = " + std::to_string(t.n));
      }
      const auto begin = reinterpret_cast<std::uintptr_t>(a.ptr);
      ranges.push_back({begin, begin + a.bytes * t.n, i, a.what, a.output});
    }
    if (t.undo.param == nullptr) continue;
    const std::size_t scale_bytes = t.state_dtype == DType::i8 ? 4 * moment_blocks(t.n) : 0;
    const struct {
      const void* ptr;
      std::size_t bytes;
      const char* what;
      bool needed;
    } undo[] = {{t.undo.param, 4 * t.n, "undo.param", true},
                {t.undo.exp_avg, state * t.n, "undo.exp_avg", true},
                {t.undo.exp_avg_sq, state * t.n, "undo.exp_avg_sq", true},
                {t.undo.out, dtype_size(t.out_dtype) * t.n, "undo.out", t.out != nullptr},
                {t.undo.exp_avg_scale, scale_bytes, "undo.exp_avg_scale", scale_bytes > 0},
                {t.undo.exp_avg_sq_scale, scale_bytes, "undo.exp_avg_sq_scale", scale_bytes > 0}};
    for (const auto& a : undo) {
      if (!a.needed) continue;
      if (a.ptr == nullptr) return invalid_argument(name + ": " + a.what + " is null while undo.param is set");
      const auto begin = reinterpret_cast<std::uintptr_t>(a.ptr);
      ranges.push_back({begin, begin + a.bytes, i, a.what, true});
    }
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

// A copy whose stores bypass the cache (SSE2 streaming stores, in every x86-64 CPU): the undo copy is read
// only if the step is taken back, and a cached store would first read its destination from memory — the
// copy would then cost as much memory traffic as the Adam step itself (measured: 2.0x the step's time with
// memcpy, on the 2-core development VM). On AArch64 a plain memcpy until an Arm machine measures whether
// non-temporal pairs (STNP) pay there.
#if defined(__x86_64__)
void copy_streaming(void* dst, const void* src, std::size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const std::size_t head = std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  std::size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
}

void store_fence() { _mm_sfence(); }
#else
void copy_streaming(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }

void store_fence() {}
#endif

// Elements [begin, end) of what a step changes, copied to the tensor's undo arrays (tensor.undo).
void save_undo(const AdamTensor& t, std::size_t begin, std::size_t end) {
  const std::size_t n = end - begin, ssize = dtype_size(t.state_dtype);
  copy_streaming(t.undo.param + begin, t.param + begin, n * 4);
  copy_streaming(static_cast<unsigned char*>(t.undo.exp_avg) + begin * ssize,
                 static_cast<const unsigned char*>(t.exp_avg) + begin * ssize, n * ssize);
  copy_streaming(static_cast<unsigned char*>(t.undo.exp_avg_sq) + begin * ssize,
                 static_cast<const unsigned char*>(t.exp_avg_sq) + begin * ssize, n * ssize);
  if (t.out != nullptr) {
    const std::size_t osize = dtype_size(t.out_dtype);
    copy_streaming(static_cast<unsigned char*>(t.undo.out) + begin * osize,
                   static_cast<const unsigned char*>(t.out) + begin * osize, n * osize);
  }
  if (t.state_dtype == DType::i8) {  // begin is a block's first element
    const std::size_t b = begin / kMomentBlock, blocks = moment_blocks(end) - b;
    std::memcpy(t.undo.exp_avg_scale + b, t.exp_avg_scale + b, blocks * 4);
    std::memcpy(t.undo.exp_avg_sq_scale + b, t.exp_avg_sq_scale + b, blocks * 4);
  }
  store_fence();  // streaming stores are weakly ordered: visible before the task ends
}

void run_adam(AdamFn fn, const simd::AdamConstants& c, const AdamTensor& t, std::size_t offset, std::size_t count) {
  if (t.undo.param != nullptr) save_undo(t, offset, offset + count);
  const std::size_t gsize = dtype_size(t.grad_dtype);
  const std::size_t osize = t.out == nullptr ? 0 : dtype_size(t.out_dtype);
  const std::size_t ssize = dtype_size(t.state_dtype);
  fn(c, t.param + offset, static_cast<unsigned char*>(t.exp_avg) + offset * ssize,
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
  if (t.undo.param != nullptr) save_undo(t, first, end);
  const std::size_t gsize = dtype_size(t.grad_dtype);
  const std::size_t osize = t.out == nullptr ? 0 : dtype_size(t.out_dtype);
  fn(c, t.param + first, static_cast<std::int8_t*>(t.exp_avg) + first, static_cast<std::uint8_t*>(t.exp_avg_sq) + first,
     t.exp_avg_scale + first / kMomentBlock, t.exp_avg_sq_scale + first / kMomentBlock,
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

int out_index(const AdamTensor& t) {
  if (t.out == nullptr) return simd::kOutNone;
  return t.out_dtype == DType::f16 ? simd::kOutF16 : simd::kOutBF16;
}

int state_index(const AdamTensor& t) { return t.state_dtype == DType::bf16 ? simd::kStateBF16 : simd::kStateF32; }

}  // namespace

struct CpuAdam::Impl {
  Isa isa;
  const KernelTable* table;
  std::size_t tile;
  PinnedArena arena;

  // Calls piece(tensor, offset, count) over every element of every tensor: the elements are numbered across
  // the tensors in order and cut into tiles of `tile` elements, so many small tensors share a tile and a
  // large one is split. Elements are independent, which makes the result independent of the cut.
  template <typename Tensor, typename Piece>
  void for_each_tile(std::span<const Tensor> tensors, Piece piece) {
    std::vector<std::size_t> starts(tensors.size() + 1, 0);
    for (std::size_t i = 0; i < tensors.size(); ++i) starts[i + 1] = starts[i] + tensors[i].n;
    const std::size_t total = starts.back();
    if (total == 0) return;
    // Written so that no sum can wrap: a tile of up to SIZE_MAX elements (an option) is one tile, not zero.
    const std::size_t tiles = total / tile + (total % tile != 0 ? 1 : 0);
    auto body = [&](const tbb::blocked_range<std::size_t>& r) {
      for (std::size_t k = r.begin(); k != r.end(); ++k) {
        std::size_t begin = k * tile;
        const std::size_t end = begin + std::min(tile, total - begin);
        std::size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
        while (begin < end) {
          const std::size_t count = std::min(end, starts[i + 1]) - begin;
          if (count != 0) piece(tensors[i], begin - starts[i], count);
          begin += count;
          ++i;
        }
      }
    };
    arena.execute([&] { tbb::parallel_for(tbb::blocked_range<std::size_t>(0, tiles, 1), body, tbb::simple_partitioner()); });
  }

  // `kernels` is the table's accumulate or accumulate_streams row.
  Status accumulate(std::span<const AccumulateTensor> tensors, const AccumulateOptions& options,
                    const simd::AccumulateFn (&kernels)[simd::kElems]) {
    if (Status s = check_accumulate_tensors(tensors, options); !s.ok()) return s;
    const int mode = accumulate_mode(options);
    for_each_tile(tensors, [&](const AccumulateTensor& t, std::size_t offset, std::size_t count) {
      kernels[int(t.grad_dtype)](t.acc + offset, static_cast<unsigned char*>(t.grad) + offset * dtype_size(t.grad_dtype),
                                 count, mode);
    });
    return Status::success();
  }

  // Counts NaN/Inf gradients over all tensors in parallel; returns an error naming the first one found.
  Status check_finite(std::span<const AdamTensor> tensors) {
    std::atomic<std::size_t> bad_tensor{tensors.size()};
    std::atomic<std::size_t> bad_count{0};
    std::vector<std::size_t> first(tensors.size(), 0);
    arena.execute([&] {
      tbb::parallel_for(std::size_t(0), tensors.size(), [&](std::size_t i) {
        const AdamTensor& t = tensors[i];
        if (t.n == 0) return;
        const std::size_t count = table->count_non_finite[int(t.grad_dtype)](t.grad, t.n, &first[i]);
        if (count == 0) return;
        bad_count += count;
        std::size_t seen = bad_tensor.load();
        while (i < seen && !bad_tensor.compare_exchange_weak(seen, i)) {
        }
      });
    });
    if (bad_count == 0) return Status::success();
    const std::size_t i = bad_tensor.load();
    return Status(StatusCode::non_finite,
                  std::to_string(bad_count.load()) + " NaN/Inf gradient value(s); the first in " +
                      tensor_name(i, tensors.size()) + " at element " + std::to_string(first[i]) +
                      "; nothing was changed");
  }
};

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
  if (Status s = check_tensors(tensors); !s.ok()) return s;
  if (options.check_finite) {
    if (Status s = impl_->check_finite(tensors); !s.ok()) return s;
  }
  const KernelTable& table = *impl_->table;
  const simd::AdamConstants c = constants(hyper, options);
  impl_->for_each_tile(tensors, [&](const AdamTensor& t, std::size_t offset, std::size_t count) {
    if (t.state_dtype == DType::i8) {
      run_adam_q8(table.adam_q8[int(t.grad_dtype)][out_index(t)], c, t, offset, count);
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
  if (Status s = check_tensors(tensors); !s.ok()) return s;
  const KernelTable& table = *impl_->table;
  impl_->for_each_tile(tensors, [&](const AdamTensor& t, std::size_t offset, std::size_t count) {
    if (t.state_dtype == DType::i8) {
      run_adam_q8(table.streams_q8[int(t.grad_dtype)][out_index(t)], simd::AdamConstants{}, t, offset, count);
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
