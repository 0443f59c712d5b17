// zoe._zoe's shared pieces, for the bindings split by interface over python/src/ (zoe_module.cpp holds
// NB_MODULE, which calls each bind_* function below): how a failed Status leaves a binding (check, take), the
// argument conversions that name what they refuse (utf8_arg, int_arg), the numpy array types and helpers, and
// the objects more than one binding holds (PyDevice, PyParamTier, EngineOptions).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zoe/adam.h"
#include "zoe/optimizers.h"
#include "zoe/device.h"
#include "zoe/dtype.h"
#include "zoe/offload.h"
#include "zoe/param_tier.h"
#include "zoe/status.h"

namespace nb = nanobind;

namespace zoe::python {

// Carries a failed Status out of a binding; the translator registered in the module picks the Python type.
struct StatusError : std::runtime_error {
  StatusError(StatusCode c, const std::string& what) : std::runtime_error(what), code(c) {}
  StatusCode code;
};

inline void check(const Status& s) {
  if (!s.ok()) throw StatusError(s.code(), s.to_string());
}

template <typename T>
T take(Result<T>&& r) {
  if (!r.ok()) check(r.status());
  return std::move(r).value();
}

// A str argument as UTF-8. nanobind's own conversion fails on a lone surrogate (U+D800..U+DFFF, which
// UTF-8 cannot encode) with an overload TypeError that names neither the argument nor the character.
std::string utf8_arg(const nb::str& value, const char* name);

// An integer argument as the C++ type `T` holds it, from any Python int (or __index__ object, as numpy's
// integers). nanobind refuses -1 for a size_t, or 2**40 for an int, with an overload TypeError that names
// neither the argument nor the value.
template <typename T>
T int_arg(nb::handle value, const char* name) {
  constexpr long long lo = std::is_signed_v<T> ? static_cast<long long>(std::numeric_limits<T>::min()) : 0;
  constexpr long long hi = sizeof(T) < sizeof(long long) ? static_cast<long long>(std::numeric_limits<T>::max())
                                                         : std::numeric_limits<long long>::max();
  long long v = 0;
  int overflow = 1;
  if (PyIndex_Check(value.ptr()) && !PyBool_Check(value.ptr())) {
    nb::object index = nb::steal(PyNumber_Index(value.ptr()));
    if (!index.is_valid()) throw nb::python_error();
    v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  }
  if (overflow != 0 || v < lo || v > hi) {
    // ascii(), not repr(): the value's text goes into a UTF-8 message whatever it holds.
    nb::object shown = nb::steal(PyObject_ASCII(value.ptr()));
    if (!shown.is_valid()) throw nb::python_error();
    check(invalid_argument(std::string(name) + " = " + nb::borrow<nb::str>(shown).c_str() +
                           " is invalid: need an integer from " + std::to_string(lo) + " to " + std::to_string(hi)));
  }
  return static_cast<T>(v);
}

using CpuArray = nb::ndarray<nb::device::cpu, nb::c_contig>;
using F32Array = nb::ndarray<float, nb::device::cpu, nb::c_contig>;
// Any framework's array on any device (a torch tensor on the GPU too), as it is: the weights and gradients
// whose addresses the engine keeps, checked against the engine's device and the parameter (engine_binding.cpp).
using AnyArray = nb::ndarray<>;

DType dtype_of(nb::dlpack::dtype d, const char* what);
inline DType dtype_of(const CpuArray& a, const char* what) { return dtype_of(a.dtype(), what); }
// The address of an array's elements. A tensor subclass without storage of its own (a DTensor, an offloaded
// FSDP2 shard) exports a null address through DLPack: refused here, where reading it would crash.
template <class Array>
auto memory_of(const Array& a, const std::string& what) {
  if (a.data() == nullptr && a.size() != 0) {
    throw std::invalid_argument(what + ": the tensor has no memory of its own (a tensor subclass such as a "
                                "DTensor: pass its local tensor, or a plain copy)");
  }
  return a.data();
}
DType parse_dtype_or_throw(const std::string& name);
AdamHyper make_hyper(float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw,
                     bool bias_correction, bool maximize = false);
// A param group's hyper-parameters by the optimizer table's field names (zoe/optimizers.h), with "optimizer"
// naming the rule: read from a dict over `base` (its rule when the dict names none; the named rule's defaults
// when it names another), and written back as one. A key the rule does not have is refused, naming `where`.
OptimizerHyper hyper_from_dict(const nb::dict& d, const std::string& where, const OptimizerHyper& base);
nb::dict hyper_dict(const OptimizerHyper& h);
// The optimizer table as Python values: per rule its names, fields with their defaults, and state arrays.
nb::list optimizer_table();

struct PyDevice {
  explicit PyDevice(std::unique_ptr<Device> d, int type = nb::device::cpu::value, int id = 0)
      : device(std::move(d)), array_device_type(type), array_device_id(id) {}
  // The stream use_compute_stream() follows (a torch.cuda.Stream, a HostStream), held while the device may
  // enqueue on it; declared first, so that it goes after the device.
  nb::object compute_stream;
  std::unique_ptr<Device> device;
  // Where arrays of this device's memory are, as DLPack names it: the host for the CPU and the host
  // stand-in, the GPU `array_device_id` for CUDA.
  int array_device_type;
  int array_device_id;
  void synchronize() {
    Status s;
    {
      nb::gil_scoped_release release;
      s = device->synchronize();
    }
    check(s);
  }
};

// A parameter tier on a Device (zoe/param_tier.h), addresses as integers for the PyTorch hooks.
struct PyParamTier {
  nb::object device_owner;  // first: destroyed last, after the tier that uses the device
  std::optional<ParamTier> tier;
  int engines = 0;  // optimizers writing into it: it may not be closed under them

  ParamTier& get() {
    if (!tier) throw std::invalid_argument("the parameter tier was closed");
    return *tier;
  }
  template <typename F>
  auto call(F&& f) {
    ParamTier& t = get();
    nb::gil_scoped_release release;  // a fetch may wait for an NVMe read
    return f(t);
  }
};

// EngineOptions: OffloadOptions as option_fields() names and carries them, one value per field. An integer
// is checked against its field as it is set (as nanobind would refuse it, but naming it); every other value
// when an Engine is made from them (to_options), whichever way the options were filled in.
struct EngineOptions {
  std::vector<OptionValue> values;  // in option_fields() order
  EngineOptions() {
    const OffloadOptions defaults;
    for (const OptionField& f : option_fields()) values.push_back(f.get(defaults));
  }
};

void check_option(const Status& s);
OffloadOptions to_options(const EngineOptions& e);
nb::object option_to_python(const OptionValue& v);
OptionValue option_from_python(const OptionValue& like, nb::handle v, const std::string& name);

// One per interface, in the order NB_MODULE calls them.
void bind_cpu_adam(nb::module_& m);
void bind_device(nb::module_& m);
void bind_engine_options(nb::module_& m);
void bind_engine(nb::module_& m);
void bind_checkpoint_config(nb::module_& m);
void bind_param_tier(nb::module_& m);

}  // namespace zoe::python
