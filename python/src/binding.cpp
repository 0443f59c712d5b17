// zoe._zoe's shared conversions (binding.h): str arguments as UTF-8, array dtypes, dtype names, and Adam's
// hyper-parameters to and from Python.
#include "python/src/binding.h"

#include <algorithm>
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

OptimizerHyper hyper_from_dict(const nb::dict& d, const std::string& where, const OptimizerHyper& base) {
  OptimizerHyper h = base;
  if (d.contains("optimizer")) {
    std::string name;
    const OptimizerRule* r = nb::try_cast<std::string>(d["optimizer"], name) ? find_optimizer_rule(name) : nullptr;
    if (r == nullptr) {
      throw std::invalid_argument(where + ": optimizer must name one of zoe's rules (adam, lion, adagrad)");
    }
    if (r->rule != base.rule) h = hyper_defaults(r->rule);
  }
  const OptimizerRule& rule = optimizer_rule(h.rule);
  for (auto [key_obj, value] : d) {
    std::string key;
    if (!nb::try_cast<std::string>(key_obj, key)) throw std::invalid_argument(where + ": keys must be strings");
    if (key == "optimizer") continue;
    const auto f = std::find_if(rule.fields.begin(), rule.fields.end(), [&](const HyperField& x) { return x.name == key; });
    if (f == rule.fields.end()) {
      throw std::invalid_argument(where + ": " + key + " is not a hyper-parameter of " + std::string(rule.name));
    }
    const bool ok = f->number != nullptr ? nb::try_cast<float>(value, h.*f->number) &&
                                               !nb::isinstance<nb::bool_>(value)
                                         : nb::isinstance<nb::bool_>(value) && nb::try_cast<bool>(value, h.*f->flag);
    if (!ok) {
      nb::object shown = nb::steal(PyObject_ASCII(value.ptr()));
      if (!shown.is_valid()) throw nb::python_error();
      throw std::invalid_argument(where + ": " + key + " = " + nb::borrow<nb::str>(shown).c_str() +
                                  " is invalid: need " + (f->number != nullptr ? "a number" : "True or False"));
    }
  }
  return h;
}

nb::dict hyper_dict(const OptimizerHyper& h) {
  nb::dict d;
  const OptimizerRule& rule = optimizer_rule(h.rule);
  d["optimizer"] = std::string(rule.name);
  for (const HyperField& f : rule.fields) {
    const std::string key(f.name);
    if (f.number != nullptr) {
      d[key.c_str()] = h.*f.number;
    } else {
      d[key.c_str()] = h.*f.flag;
    }
  }
  return d;
}

nb::list optimizer_table() {
  nb::list out;
  for (const OptimizerRule& r : optimizer_rules()) {
    nb::dict e;
    e["name"] = std::string(r.name);
    e["torch_class"] = std::string(r.torch_class);
    nb::list types, states;
    for (std::string_view t : r.deepspeed_types) types.append(std::string(t));
    for (std::string_view s : r.states) states.append(std::string(s));
    e["deepspeed_types"] = types;
    e["states"] = states;
    e["defaults"] = hyper_dict(hyper_defaults(r.rule));
    e["int8_state"] = r.int8_state;
    out.append(e);
  }
  return out;
}

}  // namespace zoe::python
