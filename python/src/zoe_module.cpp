// zoe._zoe: the C++ core for Python. Three objects: CpuAdam (the kernel over numpy arrays or CPU tensors),
// Device (host stand-in or CUDA) and Engine (OffloadOptimizer). The PyTorch adapter (zoe/torch.py) is
// built on these; nothing here knows torch.
//
// Every long call releases the GIL: a step over 100M parameters takes tens of milliseconds in which data
// loaders and other Python threads must run. A failed Status becomes a Python exception whose type follows
// the status code (zoe.ZoeError and its subclasses, see zoe/__init__.py), carrying the engine's message;
// any other C++ exception becomes one of those classes too (the translator in NB_MODULE).
//
// The bindings are split by interface (binding.h declares one bind_* function per file); this file holds the
// module itself and the translation of exceptions into zoe's Python classes.
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "python/src/binding.h"
#include "zoe/adam.h"
#include "zoe/status.h"

namespace zoe::python {
namespace {

// Raises `type` with `message`, decoded leniently: a message holding bytes that are not UTF-8 (a path
// from the file system, an excerpt of a damaged file) still arrives as zoe's error, its bad bytes shown as
// \xNN, rather than as the UnicodeDecodeError a strict decode would raise in its place.
void set_error(PyObject* type, const char* message) {
  const auto size = static_cast<Py_ssize_t>(std::strlen(message));
  nb::object text = nb::steal(PyUnicode_DecodeUTF8(message, size, "backslashreplace"));
  if (!text.is_valid()) {
    PyErr_Clear();
    text = nb::str("(the error message could not be decoded)");
  }
  PyErr_SetObject(type, text.ptr());
}

}  // namespace
}  // namespace zoe::python

NB_MODULE(_zoe, m) {
  using namespace zoe;
  using namespace zoe::python;
  m.doc() = "zoe's C++ core: CPU Adam and the offload engine";
  // An optimizer still referenced from a torch parameter's hook at interpreter exit is never destroyed;
  // that is not a leak worth a page of warnings on every exit.
  nb::set_leak_warnings(false);
  // Python types by status code; zoe/__init__.py re-exports them.
  static nb::object base = nb::steal(PyErr_NewException("zoe._zoe.ZoeError", PyExc_RuntimeError, nullptr));
  static nb::object unsupported =
      nb::steal(PyErr_NewException("zoe._zoe.UnsupportedError", base.ptr(), nullptr));
  static nb::object invalid = nb::steal(PyErr_NewException(
      "zoe._zoe.InvalidArgumentError", nb::make_tuple(base, nb::handle(PyExc_ValueError)).ptr(), nullptr));
  static nb::object corrupt = nb::steal(PyErr_NewException("zoe._zoe.CorruptError", base.ptr(), nullptr));
  m.attr("MOMENT_BLOCK") = kMomentBlock;  // elements per fp32 scale of int8 moments
  m.attr("ZoeError") = base;
  m.attr("UnsupportedError") = unsupported;
  m.attr("InvalidArgumentError") = invalid;
  m.attr("CorruptError") = corrupt;
  static nb::object out_of_memory = nb::steal(PyErr_NewException(
      "zoe._zoe.OutOfMemoryError", nb::make_tuple(base, nb::handle(PyExc_MemoryError)).ptr(), nullptr));
  m.attr("OutOfMemoryError") = out_of_memory;
  // nanobind handles its own exceptions (python_error, nb::value_error and the like) before this
  // translator; everything else a binding lets out becomes one of zoe's classes, so that callers need catch
  // only those. What the bindings throw to refuse an argument (std::invalid_argument and its kin, and
  // std::out_of_range from a lookup by the caller's index) is an InvalidArgumentError; anything else from a
  // dependency is a ZoeError saying it is internal.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      PyObject* type = base.ptr();
      if (e.code == StatusCode::unsupported) type = unsupported.ptr();
      if (e.code == StatusCode::invalid_argument) type = invalid.ptr();
      if (e.code == StatusCode::corrupt) type = corrupt.ptr();
      if (e.code == StatusCode::out_of_memory) type = out_of_memory.ptr();
      set_error(type, e.what());
    } catch (const std::bad_alloc& e) {
      set_error(out_of_memory.ptr(), (std::string("out of memory: ") + e.what()).c_str());
    } catch (const std::logic_error& e) {
      // invalid_argument, domain_error, length_error, out_of_range: a caller's value refused.
      set_error(invalid.ptr(), (std::string("invalid argument: ") + e.what()).c_str());
    } catch (const std::exception& e) {
      set_error(base.ptr(), (std::string("internal error: ") + e.what()).c_str());
    } catch (...) {
      set_error(base.ptr(), "internal error: an exception that is not a std::exception");
    }
  });
  m.def("supported_isas", [] {
    std::vector<std::string> names;
    for (Isa i : supported_isas()) names.emplace_back(isa_name(i));
    return names;
  });
  bind_cpu_adam(m);
  bind_device(m);
  bind_engine_options(m);
  bind_engine(m);
  bind_checkpoint_config(m);
  bind_param_tier(m);
}
