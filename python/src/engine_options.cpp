// zoe._zoe's EngineOptions (binding.h): OffloadOptions field by field as option_fields() lists them, each
// value checked and converted on its way in and out of Python.
#include <span>
#include <variant>

#include "python/src/binding.h"

namespace zoe::python {

void check_option(const Status& s) {
  if (!s.ok()) check(Status(s.code(), "EngineOptions." + s.message()));
}

OffloadOptions to_options(const EngineOptions& e) {
  OffloadOptions o;
  const std::span<const OptionField> fields = option_fields();
  for (std::size_t i = 0; i < fields.size(); ++i) check_option(fields[i].set(o, e.values[i]));
  return o;
}

nb::object option_to_python(const OptionValue& v) {
  return std::visit([](const auto& x) { return nb::cast(x); }, v);
}

// A Python value as the kind of `like` (the field's), or zoe's error naming the field.
OptionValue option_from_python(const OptionValue& like, nb::handle v, const std::string& name) {
  auto refuse = [&](const char* need) {
    nb::object shown = nb::steal(PyObject_ASCII(v.ptr()));
    if (!shown.is_valid()) throw nb::python_error();
    check(invalid_argument(name + " = " + nb::borrow<nb::str>(shown).c_str() + " is invalid: need " + need));
  };
  switch (like.index()) {
    case 0:
      if (!PyBool_Check(v.ptr())) refuse("True or False");
      return v.ptr() == Py_True;
    case 1: return int_arg<std::int64_t>(v, name.c_str());
    case 2: {
      const double x = PyFloat_AsDouble(v.ptr());
      if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        refuse("a number");
      }
      return x;
    }
    case 3:
      if (!PyUnicode_Check(v.ptr())) refuse("a str");
      return utf8_arg(nb::borrow<nb::str>(v), name.c_str());
    default: {
      if (PyUnicode_Check(v.ptr()) || !PySequence_Check(v.ptr())) refuse("a list of str");
      std::vector<std::string> out;
      for (nb::handle item : v) {
        if (!PyUnicode_Check(item.ptr())) refuse("a list of str");
        out.push_back(utf8_arg(nb::borrow<nb::str>(item), name.c_str()));
      }
      return out;
    }
  }
}

void bind_engine_options(nb::module_& m) {
  nb::class_<EngineOptions> options(m, "EngineOptions",
                                    "zoe's OffloadOptions, field by field (EngineOptions.names() lists them).");
  options.def(nb::init<>());
  options.def_static("names", [] {
    std::vector<std::string> names;
    for (const OptionField& f : option_fields()) names.emplace_back(f.name);
    return names;
  });
  const std::span<const OptionField> fields = option_fields();
  for (std::size_t i = 0; i < fields.size(); ++i) {
    // The names are string literals: null-terminated, and they live as long as the module.
    options.def_prop_rw(
        fields[i].name.data(), [i](const EngineOptions& o) { return option_to_python(o.values[i]); },
        [i](EngineOptions& o, nb::handle v) {
          const OptionField& f = option_fields()[i];
          OptionValue value = option_from_python(o.values[i], v, "EngineOptions." + std::string(f.name));
          if (std::holds_alternative<std::int64_t>(value)) {
            OffloadOptions scratch;
            check_option(f.set(scratch, value));
          }
          o.values[i] = std::move(value);
        });
  }
}

}  // namespace zoe::python
