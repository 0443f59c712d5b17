// Element types of gradients and of the 16-bit weight copy sent back to the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace zoe {

// i8: the 8-bit codes of Adam's and Lion's moments (a state dtype only, zoe/adam.h), never a weight or gradient.
enum class DType : std::uint8_t { f32 = 0, f16 = 1, bf16 = 2, i8 = 3 };

std::string_view dtype_name(DType dtype);            // "f32", "f16", "bf16", "i8"; "invalid" for anything else
std::optional<DType> parse_dtype(std::string_view);  // f32, f16, bf16 and fp32/fp16/float32/...: weights and gradients
std::size_t dtype_size(DType dtype);                 // 0 for an invalid value
bool dtype_valid(DType dtype);                       // a weight or gradient dtype: f32, f16 or bf16

// Scalar conversions with IEEE round-to-nearest-even, the same the kernels use.
std::uint16_t float_to_f16(float x);
float f16_to_float(std::uint16_t h);
std::uint16_t float_to_bf16(float x);
float bf16_to_float(std::uint16_t b);

}  // namespace zoe
