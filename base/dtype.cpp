#include "zoe/dtype.h"

#include "base/convert.h"

namespace zoe {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i8: return "i8";
  }
  return "invalid";
}

std::optional<DType> parse_dtype(std::string_view s) {
  if (s == "f32" || s == "fp32" || s == "float32" || s == "float") return DType::f32;
  if (s == "f16" || s == "fp16" || s == "float16" || s == "half") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  return std::nullopt;
}

bool dtype_valid(DType dtype) { return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16; }

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::i8: return 1;
  }
  return 0;
}

std::uint16_t float_to_f16(float x) { return f32_to_f16(x); }
float f16_to_float(std::uint16_t h) { return f16_to_f32(h); }
std::uint16_t float_to_bf16(float x) { return f32_to_bf16(x); }
float bf16_to_float(std::uint16_t b) { return bf16_to_f32(b); }

}  // namespace zoe
