// What the engine's translation units share (cpu_adam.cpp: Adam, AMSGrad and accumulation; cpu_rules.cpp:
// Lion and Adagrad): CpuAdam's state, its tiling over threads, and the argument checks' helpers.
#pragma once

#include "src/private.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <type_traits>
#include <string>
#include <vector>

#include "simd/dispatch.h"
#include "src/arena.h"
#include "zoe/adam.h"

namespace zoe::cpu_engine {

std::string tensor_name(std::size_t index, std::size_t count);

// An array's bytes, for the overlap check: outputs may share memory with nothing else.
struct ByteRange {
  std::uintptr_t begin, end;
  std::size_t tensor;
  const char* what;
  bool output;
};

// One array of a tensor as the checks see it: null is an error unless `optional`.
struct ArrayRef {
  const void* ptr;
  std::size_t bytes;
  const char* what;
  bool output;
  bool optional = false;
};

// Appends the arrays' ranges; the first null one that is not optional is an error "<name>: <what> is null
// <why>" (why: "with n = 5", "while from.param is set").
Status add_arrays(std::vector<ByteRange>& ranges, const std::string& name, std::size_t tensor,
                  std::initializer_list<ArrayRef> arrays, const std::string& why);

// Overlaps between an output and any other array, across all `count` tensors.
Status check_overlaps(std::vector<ByteRange>& ranges, std::size_t count);

// "<name> = <value> is invalid: <want>"
Status bad_value(const char* name, double value, const char* want);
// A finite value >= 0 (lr, eps, weight_decay, lr_decay), else bad_value's error.
Status require_non_negative(const char* name, float value);
// 0 <= beta < 1.
Status require_beta(const char* name, float value);
// What every rule asks of StepOptions: step >= 1, a finite grad_scale.
Status check_step_options(const StepOptions& o);

// The grad dtype, the copy-out dtype and the state dtype (f32 or bf16, and i8 where `allow_i8`).
Status check_dtypes(const std::string& name, DType grad, const void* out, DType out_dtype, DType state,
                    bool allow_i8, const char* state_rule);

inline int out_index(const void* out, DType out_dtype) {
  if (out == nullptr) return simd::kOutNone;
  return out_dtype == DType::f16 ? simd::kOutF16 : simd::kOutBF16;
}
inline int state_index(DType state) { return state == DType::bf16 ? simd::kStateBF16 : simd::kStateF32; }

// Element `offset` of an array of `elem` bytes per element (null stays null).
template <typename T>
T* at(T* base, std::size_t offset, std::size_t elem) {
  if (base == nullptr) return nullptr;
  using Byte = std::conditional_t<std::is_const_v<T>, const unsigned char, unsigned char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + offset * elem);
}

}  // namespace zoe::cpu_engine

namespace zoe {

struct CpuAdam::Impl {
  Isa isa;
  const simd::KernelTable* table;
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
                    const simd::AccumulateFn (&kernels)[simd::kElems]);

  // Counts NaN/Inf gradients over all tensors (any type with n, grad and grad_dtype) in parallel; returns
  // an error naming the first one found.
  template <typename Tensor>
  Status check_finite(std::span<const Tensor> tensors) {
    std::atomic<std::size_t> bad_tensor{tensors.size()};
    std::atomic<std::size_t> bad_count{0};
    std::vector<std::size_t> first(tensors.size(), 0);
    arena.execute([&] {
      tbb::parallel_for(std::size_t(0), tensors.size(), [&](std::size_t i) {
        const Tensor& t = tensors[i];
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
                      cpu_engine::tensor_name(i, tensors.size()) + " at element " + std::to_string(first[i]) +
                      "; nothing was changed");
  }
};

}  // namespace zoe
