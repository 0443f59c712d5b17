// zoe._zoe's shared conversions (binding.h): str arguments as UTF-8, array dtypes, dtype names, and Adam's
// hyper-parameters to and from Python.
#include "python/src/binding.h"

#include <cstdio>

namespace zoe::python {

// A str argument as UTF-8. nanobind's own conversion fails on a lone surrogate (U+D800..U+DFFF, which
// UTF-8 cannot encode) with an overload TypeError that names neither the argument nor the character.
std::string utf8_arg(const nb::str& value, const char* name) {
  Py_ssize_t size = 0;
  if (const char* p = PyUnicode_AsUTF8AndSize(value.ptr(), &size)) {
    return std::string(p, static_cast<std::size_t>(size));
  }
  PyErr_Clear();
  const Py_ssize_t n = PyUnicode_GetLength(value.ptr());
  Py_ssize_t at = 0;
  Py_UCS4 c = 0;
  for (; at < n; ++at) {
    c = PyUnicode_ReadChar(value.ptr(), at);
    if (c >= 0xD800 && c <= 0xDFFF) break;
  }
  char code[16] = "?";
  if (at < n) std::snprintf(code, sizeof code, "U+%04X", static_cast<unsigned>(c));
  check(invalid_argument(std::string(name) + ": the str holds a lone surrogate (" + code + " at index " +
                         std::to_string(at) + "), which UTF-8 cannot encode"));
  return {};
}

DType dtype_of(nb::dlpack::dtype d, const char* what) {
  if (d == nb::dtype<float>()) return DType::f32;
  if (d.bits == 16 && d.lanes == 1 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) return DType::f16;
  if (d.bits == 16 && d.lanes == 1 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat)) return DType::bf16;
  throw std::invalid_argument(std::string(what) + ": dtype must be float32, float16 or bfloat16");
}

DType parse_dtype_or_throw(const std::string& name) {
  std::optional<DType> d = parse_dtype(name);
  if (!d) throw std::invalid_argument("unknown dtype '" + name + "': use f32, f16 or bf16");
  return *d;
}

AdamHyper make_hyper(float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw,
                     bool bias_correction, bool maximize) {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adamw = adamw;
  h.bias_correction = bias_correction;
  h.maximize = maximize;
  return h;
}

nb::dict hyper_dict(const AdamHyper& h) {
  nb::dict d;
  d["lr"] = h.lr;
  d["beta1"] = h.beta1;
  d["beta2"] = h.beta2;
  d["eps"] = h.eps;
  d["weight_decay"] = h.weight_decay;
  d["adamw"] = h.adamw;
  d["bias_correction"] = h.bias_correction;
  d["maximize"] = h.maximize;
  return d;
}

}  // namespace zoe::python
