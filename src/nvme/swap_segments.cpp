// What a swap store's step is given, checked before any tile moves: element ranges, the segments (sorted,
// inside the store, each rule's state arrays the store's), and the gradients' finiteness; and the copy of a
// stepped master out to the weights the device receives.
#include <cstring>
#include <string>

#include "src/nvme/swap_impl.h"

namespace zoe {

Status check_range(std::size_t offset, std::size_t count, std::size_t n, const char* what) {
  if (offset > n || count > n - offset) {
    return invalid_argument(std::string(what) + ": elements [" + std::to_string(offset) + ", " +
                            std::to_string(offset) + " + " + std::to_string(count) + ") are outside the store's [0, " +
                            std::to_string(n) + ")");
  }
  return Status::success();
}

bool all_finite(const void* grad, DType dtype, std::size_t n) {
  // An exponent field of all ones is Inf or NaN in each of the three formats.
  if (dtype == DType::f32) {
    const auto* g = static_cast<const std::uint32_t*>(grad);
    std::uint32_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad |= static_cast<std::uint32_t>((g[i] & 0x7F800000u) == 0x7F800000u);
    return bad == 0;
  }
  const std::uint16_t mask = dtype == DType::f16 ? 0x7C00u : 0x7F80u;
  const auto* g = static_cast<const std::uint16_t*>(grad);
  std::uint32_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad |= static_cast<std::uint32_t>((g[i] & mask) == mask);
  return bad == 0;
}

// i8 moments (`blocks`): a block's scales belong to one tensor, so every segment starts on a block boundary.
// Each segment's rule keeps the store's `state_arrays`.
Status check_segments(std::span<const SwapSegment> segments, std::size_t n, bool blocks, std::size_t state_arrays) {
  std::size_t end = 0;
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const SwapSegment& s = segments[i];
    const std::string name = "segment " + std::to_string(i);
    if (Status r = check_range(s.offset, s.n, n, name.c_str()); !r.ok()) return r;
    if (s.n == 0) continue;
    if (blocks && s.offset % kMomentBlock != 0) {
      return invalid_argument(name + " starts at " + std::to_string(s.offset) + ", not on a block of " +
                              std::to_string(kMomentBlock) + " elements: with i8 moments each segment starts a block "
                              "(pad the flattened range so every tensor does)");
    }
    if (i > 0 && s.offset < end) {
      return invalid_argument(name + " starts at " + std::to_string(s.offset) +
                              ", inside an earlier segment (ending at " + std::to_string(end) +
                              "): segments must be sorted by offset and not overlap");
    }
    end = s.offset + s.n;
    if (s.hyper == nullptr) return invalid_argument(name + ": hyper is null");
    if (Status h = validate_hyper(*s.hyper); !h.ok()) return invalid_argument(name + ": " + h.message());
    if (zoe::state_arrays(*s.hyper) != state_arrays) {
      return invalid_argument(name + ": " + std::string(optimizer_rule(s.hyper->rule).name) + " keeps " +
                              std::to_string(zoe::state_arrays(*s.hyper)) + " state arrays, the store " +
                              std::to_string(state_arrays));
    }
    if (s.grad == nullptr) return invalid_argument(name + ": grad is null with n = " + std::to_string(s.n));
    if (!dtype_valid(s.grad_dtype)) return invalid_argument(name + ": grad dtype is not f32, f16 or bf16");
    if (s.out != nullptr && !dtype_valid(s.out_dtype)) {
      return invalid_argument(name + ": out dtype must be f32, f16 or bf16 (or out = nullptr)");
    }
  }
  return Status::success();
}

void copy_out(const float* p, void* out, DType dtype, std::size_t count) {
  if (dtype == DType::f32) {
    std::memcpy(out, p, count * 4);
    return;
  }
  auto* o = static_cast<std::uint16_t*>(out);
  if (dtype == DType::f16) {
    for (std::size_t i = 0; i < count; ++i) o[i] = float_to_f16(p[i]);
  } else {
    for (std::size_t i = 0; i < count; ++i) o[i] = float_to_bf16(p[i]);
  }
}

Status check_finite_grads(std::span<const SwapSegment> segments) {
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const SwapSegment& s = segments[i];
    if (s.n > 0 && !all_finite(s.grad, s.grad_dtype, s.n)) {
      return Status(StatusCode::non_finite, "segment " + std::to_string(i) + " (elements [" + std::to_string(s.offset) +
                                                ", " + std::to_string(s.offset + s.n) +
                                                ")) has a NaN or Inf gradient; nothing was changed");
    }
  }
  return Status::success();
}

}  // namespace zoe
