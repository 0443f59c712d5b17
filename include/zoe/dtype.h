// Element types of gradients and of the 16-bit weight copy sent back to the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace zoe {

enum class DType : std::uint8_t { f32 = 0, f16 = 1, bf16 = 2 };

std::string_view dtype_name(DType dtype);            // "f32", "f16", "bf16"; "invalid" for anything else
std::optional<DType> parse_dtype(std::string_view);  // accepts the names above and fp32/fp16/float32/...
std::size_t dtype_size(DType dtype);                 // 0 for an invalid value
bool dtype_valid(DType dtype);

// Scalar conversions with IEEE round-to-nearest-even, the same the kernels use.
std::uint16_t float_to_f16(float x);
float f16_to_float(std::uint16_t h);
std::uint16_t float_to_bf16(float x);
float bf16_to_float(std::uint16_t b);

}  // namespace zoe
