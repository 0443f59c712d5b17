// zoe._zoe: the C++ core for Python. Three objects: CpuAdam (the kernel over numpy arrays or CPU tensors),
// Device (host stand-in or CUDA) and Engine (OffloadOptimizer). The PyTorch adapter (zoe/torch.py) is
// built on these; nothing here knows torch.
//
// Every long call releases the GIL: a step over 100M parameters takes tens of milliseconds in which data
// loaders and other Python threads must run. A failed Status becomes a Python exception whose type follows
// the status code (zoe.ZoeError and its subclasses, see zoe/__init__.py), carrying the engine's message;
// any other C++ exception becomes one of those classes too (the translator in NB_MODULE).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "src/offload/checkpoint.h"
#include "src/offload/config.h"
#include "src/offload/host_device.h"
#include "zoe/adam.h"
#include "zoe/device.h"
#include "zoe/dtype.h"
#include "zoe/offload.h"
#include "zoe/param_tier.h"
#include "zoe/partition.h"
#include "zoe/status.h"

namespace nb = nanobind;

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

// Carries a failed Status out of a binding; the translator registered in the module picks the Python type.
struct StatusError : std::runtime_error {
  StatusError(StatusCode c, const std::string& what) : std::runtime_error(what), code(c) {}
  StatusCode code;
};

void check(const Status& s) {
  if (!s.ok()) throw StatusError(s.code(), s.to_string());
}

template <typename T>
T take(Result<T>&& r) {
  if (!r.ok()) check(r.status());
  return std::move(r).value();
}

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

// A checkpoint file opened (header, trailer and index read and checked) without the GIL.
CheckpointReader open_checkpoint(const std::string& path) {
  Result<CheckpointReader> r = Status(StatusCode::internal, "not read");
  {
    nb::gil_scoped_release release;
    r = CheckpointReader::open(path);
  }
  return take(std::move(r));
}

using CpuArray = nb::ndarray<nb::device::cpu, nb::c_contig>;
using F32Array = nb::ndarray<float, nb::device::cpu, nb::c_contig>;

DType dtype_of(const CpuArray& a, const char* what) {
  const nb::dlpack::dtype d = a.dtype();
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
                     bool bias_correction) {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adamw = adamw;
  h.bias_correction = bias_correction;
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
  return d;
}

// ---- CpuAdam over arrays -------------------------------------------------------------------------------

struct PyCpuAdam {
  CpuAdam adam;

  // Lists of equal length; `outs` may be empty (no 16-bit copy) or hold one array (or None) per tensor.
  void step(std::vector<F32Array> params, std::vector<F32Array> exp_avgs, std::vector<F32Array> exp_avg_sqs,
            std::vector<CpuArray> grads, std::vector<std::optional<CpuArray>> outs, std::int64_t step, float lr,
            float beta1, float beta2, float eps, float weight_decay, bool adamw, bool bias_correction,
            float grad_scale, bool check_finite) {
    const std::size_t count = params.size();
    if (exp_avgs.size() != count || exp_avg_sqs.size() != count || grads.size() != count ||
        (!outs.empty() && outs.size() != count)) {
      throw std::invalid_argument("CpuAdam.step: params, exp_avgs, exp_avg_sqs, grads (and outs) need equal lengths");
    }
    std::vector<AdamTensor> tensors(count);
    for (std::size_t i = 0; i < count; ++i) {
      const std::string where = "tensor " + std::to_string(i);
      AdamTensor& t = tensors[i];
      t.n = params[i].size();
      if (exp_avgs[i].size() != t.n || exp_avg_sqs[i].size() != t.n || grads[i].size() != t.n) {
        throw std::invalid_argument(where + ": param, exp_avg, exp_avg_sq and grad must have the same size");
      }
      t.param = params[i].data();
      t.exp_avg = exp_avgs[i].data();
      t.exp_avg_sq = exp_avg_sqs[i].data();
      t.grad = grads[i].data();
      t.grad_dtype = dtype_of(grads[i], (where + " grad").c_str());
      if (!outs.empty() && outs[i]) {
        CpuArray& out = *outs[i];
        if (out.size() != t.n) throw std::invalid_argument(where + ": out must have the same size as param");
        t.out = out.data();
        t.out_dtype = dtype_of(out, (where + " out").c_str());
        if (t.out_dtype == DType::f32) throw std::invalid_argument(where + ": out must be float16 or bfloat16");
      }
    }
    StepOptions o;
    o.step = step;
    o.grad_scale = grad_scale;
    o.check_finite = check_finite;
    const AdamHyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction);
    Status s;
    {
      nb::gil_scoped_release release;
      s = adam.step(h, o, tensors);
    }
    check(s);
  }
};

// ---- Device and Engine ---------------------------------------------------------------------------------

struct PyDevice {
  std::unique_ptr<Device> device;
  void synchronize() {
    Status s;
    {
      nb::gil_scoped_release release;
      s = device->synchronize();
    }
    check(s);
  }
};

// One parameter as (n, dtype name, device weights address, device gradients address, group, name, shape);
// the name and shape are recorded in checkpoints (zoe export).
using ParamTuple = std::tuple<std::size_t, std::string, std::uintptr_t, std::uintptr_t, int, std::string,
                              std::vector<std::int64_t>>;

struct EngineOptions {
  std::string tier = "ram";
  std::vector<std::string> nvme_paths;
  int buffer_count = 4;
  std::size_t block_size = 1 << 20;
  int queue_depth = 8;
  std::string nvme_durability = "step";
  bool nvme_keep_resident = true;
  std::string state_dtype = "fp32";
  std::string schedule = "sync";
  int delayed_warmup_steps = 10;
  int gradient_accumulation_steps = 1;
  bool partition_flat_buffers = false;
  bool partition_grads_averaged = false;
  float max_grad_norm = 0;
  bool refuse_non_finite = true;
  bool loss_scale = false;
  bool dynamic_loss_scale = true;
  float static_loss_scale = 1;
  float initial_scale = 65536;
  float growth_factor = 2;
  float backoff_factor = 0.5f;
  int growth_interval = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  float min_scale = 1;
  std::size_t tile = 1 << 20;
  std::string isa = "auto";
  int threads = 0;
};

OffloadOptions to_options(const EngineOptions& e) {
  OffloadOptions o;
  Result<Tier> tier = parse_tier(e.tier);
  if (!tier.ok()) throw std::invalid_argument(tier.status().message());
  o.tier = tier.value();
  o.nvme.paths = e.nvme_paths;
  o.nvme.buffer_count = e.buffer_count;
  o.nvme.block_size = e.block_size;
  o.nvme.queue_depth = e.queue_depth;
  Result<Durability> durability = parse_durability(e.nvme_durability);
  if (!durability.ok()) throw std::invalid_argument(durability.status().message());
  o.nvme.durability = durability.value();
  o.nvme.keep_resident = e.nvme_keep_resident;
  Result<DType> state = parse_state_dtype(e.state_dtype);
  if (!state.ok()) throw std::invalid_argument(state.status().message());
  o.state_dtype = state.value();
  Result<Schedule> schedule = parse_schedule(e.schedule);
  if (!schedule.ok()) throw std::invalid_argument(schedule.status().message());
  o.schedule = schedule.value();
  o.delayed_warmup_steps = e.delayed_warmup_steps;
  o.gradient_accumulation_steps = e.gradient_accumulation_steps;
  o.partition.flat_buffers = e.partition_flat_buffers;
  o.partition.grads_averaged = e.partition_grads_averaged;
  o.max_grad_norm = e.max_grad_norm;
  o.refuse_non_finite = e.refuse_non_finite;
  if (e.loss_scale) {
    // A scale of inf passes the engine's "> 0" and then overflows every gradient: every step is skipped.
    for (auto [value, name] : {std::pair{e.initial_scale, "initial_scale"},
                               std::pair{e.static_loss_scale, "static_loss_scale"}, std::pair{e.min_scale, "min_scale"}}) {
      if (!(std::isfinite(value) && value > 0)) {
        check(invalid_argument("EngineOptions." + std::string(name) + " = " + std::to_string(value) +
                               " is invalid: need a finite number > 0"));
      }
    }
  }
  LossScaleOptions& ls = o.loss_scale;
  ls.enabled = e.loss_scale;
  ls.dynamic = e.dynamic_loss_scale;
  ls.static_scale = e.static_loss_scale;
  ls.initial_scale = e.initial_scale;
  ls.growth_factor = e.growth_factor;
  ls.backoff_factor = e.backoff_factor;
  ls.growth_interval = e.growth_interval;
  ls.hysteresis = e.hysteresis;
  ls.consecutive_hysteresis = e.consecutive_hysteresis;
  ls.min_scale = e.min_scale;
  o.tile = e.tile;
  o.cpu.isa = e.isa;
  o.cpu.threads = e.threads;
  return o;
}

// Collectives implemented in Python (zoe/_data_parallel.py, over torch.distributed): an object with rank(),
// world(), reduce_scatter(send, recv, count, dtype) and all_gather(send, recv, count, dtype) on addresses of
// the device's memory, and all_reduce_host(values) -> values. Python enqueues on torch's streams, not on
// zoe's: what zoe enqueued is finished before each call, and the call finishes its own work before it
// returns.
class PyCollectives final : public Collectives {
 public:
  PyCollectives(nb::object impl, Device& device)
      : impl_(std::move(impl)), device_(device), rank_(nb::cast<int>(impl_.attr("rank")())),
        world_(nb::cast<int>(impl_.attr("world")())) {}
  ~PyCollectives() override {
    nb::gil_scoped_acquire gil;  // the last reference to a Python object goes with the GIL held
    impl_.reset();
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Status reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, Stream) override {
    return call("reduce_scatter", send, recv, count, dtype);
  }
  Status all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream) override {
    return call("all_gather", send, recv, count, dtype);
  }
  Status all_reduce_host(double* values, std::size_t count) override {
    nb::gil_scoped_acquire gil;
    try {
      nb::list in;
      for (std::size_t i = 0; i < count; ++i) in.append(values[i]);
      nb::object out = impl_.attr("all_reduce_host")(in);
      for (std::size_t i = 0; i < count; ++i) values[i] = nb::cast<double>(out[i]);
    } catch (const std::exception& e) {
      return Status(StatusCode::internal, std::string("all_reduce_host over torch.distributed failed: ") + e.what());
    }
    return Status::success();
  }

 private:
  Status call(const char* name, const void* send, void* recv, std::size_t count, DType dtype) {
    if (Status s = device_.synchronize(); !s.ok()) return s;
    nb::gil_scoped_acquire gil;
    try {
      impl_.attr(name)(reinterpret_cast<std::uintptr_t>(send), reinterpret_cast<std::uintptr_t>(recv), count,
                       std::string(dtype_name(dtype)));
    } catch (const std::exception& e) {
      return Status(StatusCode::internal, std::string(name) + " over torch.distributed failed: " + e.what());
    }
    return Status::success();
  }

  nb::object impl_;
  Device& device_;
  int rank_, world_;
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

struct PyEngine {
  // Declared first so that it is destroyed last: the optimizer's destructor still talks to the device.
  nb::object device_owner;
  std::vector<nb::object> tiers;  // parameter tiers the optimizer writes into: they outlive it
  PyEngine() = default;
  PyEngine(PyEngine&&) = default;
  ~PyEngine() {
    opt.reset();  // before the tiers it writes into may be closed
    for (nb::object& t : tiers) --nb::cast<PyParamTier&>(t).engines;
  }
  std::unique_ptr<PyCollectives> collectives;  // outlives the optimizer, which holds its address
  std::optional<OffloadOptimizer> opt;
  std::size_t param_count = 0;

  OffloadOptimizer& get() { return *opt; }

  // A state array of parameter i, checked against its size (null when not given).
  float* state_array(std::size_t i, std::optional<F32Array>& a, const char* what) {
    if (!a) return nullptr;
    const std::vector<std::size_t> sizes = opt->state_sizes();
    if (i >= sizes.size()) {
      throw std::invalid_argument("parameter " + std::to_string(i) + " does not exist (" + std::to_string(sizes.size()) +
                                  " parameters)");
    }
    if (a->size() != sizes[i]) {
      throw std::invalid_argument(std::string(what) + " has " + std::to_string(a->size()) + " elements, parameter " +
                                  std::to_string(i) + " has " + std::to_string(sizes[i]));
    }
    return a->data();
  }

  // Runs a call on the optimizer with the GIL released and raises on failure.
  template <typename F>
  void call(F&& f) {
    Status s;
    {
      nb::gil_scoped_release release;
      s = f(*opt);
    }
    check(s);
  }
};

std::unique_ptr<PyEngine> make_engine(nb::object device_obj, std::vector<nb::dict> groups,
                                      std::vector<ParamTuple> params, const EngineOptions& options,
                                      nb::object collectives, const std::vector<std::tuple<std::size_t, nb::object, std::size_t, std::size_t>>& tiered) {
  PyDevice& device = nb::cast<PyDevice&>(device_obj);
  std::vector<ParamGroup> gs;
  for (nb::dict& g : groups) {
    auto get = [&g, &gs](const char* key, auto fallback) {
      using T = decltype(fallback);
      if (!g.contains(key)) return fallback;
      T v{};
      if (!nb::try_cast<T>(g[key], v)) {
        nb::object shown = nb::steal(PyObject_ASCII(nb::object(g[key]).ptr()));
        if (!shown.is_valid()) throw nb::python_error();
        check(invalid_argument("group " + std::to_string(gs.size()) + ": " + key + " = " +
                               nb::borrow<nb::str>(shown).c_str() + " is invalid: need " +
                               (std::is_same_v<T, bool> ? "True or False" : "a number")));
      }
      return v;
    };
    const AdamHyper defaults;
    gs.push_back(ParamGroup{make_hyper(get("lr", defaults.lr), get("beta1", defaults.beta1),
                                       get("beta2", defaults.beta2), get("eps", defaults.eps),
                                       get("weight_decay", defaults.weight_decay), get("adamw", defaults.adamw),
                                       get("bias_correction", defaults.bias_correction))});
  }
  std::vector<ParamSpec> ps;
  ps.reserve(params.size());
  for (const auto& [n, dtype, weights, grads, group, name, shape] : params) {
    ParamSpec p;
    p.n = n;
    p.dtype = parse_dtype_or_throw(dtype);
    p.device_weights = reinterpret_cast<void*>(weights);
    p.device_grads = reinterpret_cast<const void*>(grads);
    p.group = group;
    p.name = name;
    p.shape = shape;
    ps.push_back(p);
  }
  auto engine = std::make_unique<PyEngine>();
  for (const auto& [param, tier_obj, block, entry] : tiered) {
    if (param >= ps.size()) throw std::invalid_argument("tiered parameter " + std::to_string(param) + " does not exist");
    ps[param].tier = &nb::cast<PyParamTier&>(tier_obj).get();
    ps[param].tier_block = block;
    ps[param].tier_entry = entry;
    if (std::find_if(engine->tiers.begin(), engine->tiers.end(), [&](const nb::object& t) { return t.is(tier_obj); }) ==
        engine->tiers.end()) {
      engine->tiers.push_back(tier_obj);
      ++nb::cast<PyParamTier&>(tier_obj).engines;
    }
  }
  const OffloadOptions o = to_options(options);
  engine->device_owner = device_obj;
  engine->param_count = ps.size();
  if (!collectives.is_none()) engine->collectives = std::make_unique<PyCollectives>(collectives, *device.device);
  Result<OffloadOptimizer> made = Status(StatusCode::internal, "not created");
  {
    nb::gil_scoped_release release;
    made = OffloadOptimizer::create(*device.device, std::move(gs), std::move(ps), o, engine->collectives.get());
  }
  engine->opt.emplace(take(std::move(made)));
  return engine;
}

// Tier nvme's counters, where the engine this module is built against has them (they arrived with the tier).
template <typename Stats>
void add_nvme_stats(nb::dict& d, const Stats& s) {
  if constexpr (requires { s.nvme_read_s; }) {
    d["nvme_read_bytes"] = s.nvme_read_bytes;
    d["nvme_write_bytes"] = s.nvme_write_bytes;
    d["nvme_read_s"] = s.nvme_read_s;
    d["nvme_write_s"] = s.nvme_write_s;
  }
}

nb::dict stats_dict(const StepStats& s) {
  nb::dict d;
  d["steps"] = s.steps;
  d["skipped"] = s.skipped;
  d["redone"] = s.redone;
  d["last_grad_norm"] = s.last_grad_norm;
  d["adam_s"] = s.adam_s;
  d["step_call_s"] = s.step_call_s;
  d["d2h_bytes"] = s.d2h_bytes;
  d["h2d_bytes"] = s.h2d_bytes;
  add_nvme_stats(d, s);
  return d;
}

// The DeepSpeed JSON config as plain Python values (engine options by the names Engine takes, the Adam
// hyper-parameters, and the notes on keys zoe ignored or read differently).
nb::dict config_dict(const LoadedConfig& c) {
  const OffloadOptions& o = c.options;
  nb::dict opts;
  opts["tier"] = std::string(tier_name(o.tier));
  opts["nvme_paths"] = o.nvme.paths;
  opts["buffer_count"] = o.nvme.buffer_count;
  opts["block_size"] = o.nvme.block_size;
  opts["queue_depth"] = o.nvme.queue_depth;
  opts["nvme_durability"] = std::string(durability_name(o.nvme.durability));
  opts["nvme_keep_resident"] = o.nvme.keep_resident;
  opts["state_dtype"] = std::string(state_dtype_name(o.state_dtype));
  opts["schedule"] = std::string(schedule_name(o.schedule));
  opts["delayed_warmup_steps"] = o.delayed_warmup_steps;
  opts["gradient_accumulation_steps"] = o.gradient_accumulation_steps;
  opts["max_grad_norm"] = o.max_grad_norm;
  opts["refuse_non_finite"] = o.refuse_non_finite;
  opts["loss_scale"] = o.loss_scale.enabled;
  opts["dynamic_loss_scale"] = o.loss_scale.dynamic;
  opts["static_loss_scale"] = o.loss_scale.static_scale;
  opts["initial_scale"] = o.loss_scale.initial_scale;
  opts["growth_factor"] = o.loss_scale.growth_factor;
  opts["backoff_factor"] = o.loss_scale.backoff_factor;
  opts["growth_interval"] = o.loss_scale.growth_interval;
  opts["hysteresis"] = o.loss_scale.hysteresis;
  opts["consecutive_hysteresis"] = o.loss_scale.consecutive_hysteresis;
  opts["min_scale"] = o.loss_scale.min_scale;
  opts["tile"] = o.tile;
  nb::dict d;
  d["options"] = opts;
  d["hyper"] = hyper_dict(c.hyper);
  d["notes"] = c.notes;
  if (c.offload_param) {
    nb::dict op;
    op["device"] = std::string(param_home_name(c.param_tier.home));
    op["nvme_path"] = c.param_tier.nvme_paths;
    op["prefetch"] = c.param_tier.prefetch;
    op["budget_bytes"] = c.param_tier.budget_bytes;
    d["offload_param"] = op;
  } else {
    d["offload_param"] = nb::none();
  }
  return d;
}

void bind_cpu_adam(nb::module_& m) {
  nb::class_<PyCpuAdam>(m, "CpuAdam", "Multi-tensor CPU Adam/AdamW on fp32 master weights and moments.")
      .def("__init__",
           [](PyCpuAdam* self, const nb::str& isa, nb::handle threads, nb::handle tile) {
             CpuAdamOptions o;
             o.isa = utf8_arg(isa, "CpuAdam: isa");
             o.threads = int_arg<int>(threads, "CpuAdam: threads");
             o.tile = int_arg<std::size_t>(tile, "CpuAdam: tile");
             new (self) PyCpuAdam{take(CpuAdam::create(o))};
           },
           nb::arg("isa") = "auto", nb::arg("threads") = 0, nb::arg("tile") = std::size_t{1} << 16)
      .def("step", &PyCpuAdam::step, nb::arg("params"), nb::arg("exp_avgs"), nb::arg("exp_avg_sqs"),
           nb::arg("grads"), nb::arg("outs") = std::vector<std::optional<CpuArray>>{}, nb::kw_only(),
           nb::arg("step"), nb::arg("lr") = 1e-3f, nb::arg("beta1") = 0.9f, nb::arg("beta2") = 0.999f,
           nb::arg("eps") = 1e-8f, nb::arg("weight_decay") = 0.0f, nb::arg("adamw") = true,
           nb::arg("bias_correction") = true, nb::arg("grad_scale") = 1.0f, nb::arg("check_finite") = false,
           "Steps every tensor in place; `outs` (optional, one per tensor) receive the weights as fp16/bf16.")
      .def_prop_ro("isa", [](const PyCpuAdam& a) { return std::string(isa_name(a.adam.isa())); })
      .def_prop_ro("kernel", [](const PyCpuAdam& a) { return std::string(a.adam.kernel()); })
      .def_prop_ro("threads", [](const PyCpuAdam& a) { return a.adam.threads(); })
      .def_prop_ro("tile", [](const PyCpuAdam& a) { return a.adam.tile(); });
}

void bind_param_tier(nb::module_& m) {
  nb::class_<PyParamTier>(m, "ParamTier",
                          "Blocks of 16-bit weights off the device (pinned RAM or NVMe), fetched into a bounded "
                          "device pool with prefetch (zoe/param_tier.h).")
      .def("__init__",
           [](PyParamTier* self, nb::object device_obj, std::vector<std::vector<std::size_t>> entry_bytes,
              std::vector<std::string> names, const std::string& home, std::vector<std::string> nvme_paths,
              std::size_t budget_bytes, int prefetch, bool host_consumer) {
             ParamTierOptions o;
             o.host_consumer = host_consumer;
             o.home = take(parse_param_home(home));
             o.nvme_paths = std::move(nvme_paths);
             o.budget_bytes = budget_bytes;
             o.prefetch = prefetch;
             std::vector<ParamBlockSpec> blocks;
             for (std::size_t b = 0; b < entry_bytes.size(); ++b) {
               blocks.push_back({b < names.size() ? names[b] : std::string(), std::move(entry_bytes[b])});
             }
             Device& device = *nb::cast<PyDevice&>(device_obj).device;
             Result<ParamTier> made = Status(StatusCode::internal, "not created");
             {
               nb::gil_scoped_release release;
               made = ParamTier::create(device, std::move(blocks), o);
             }
             new (self) PyParamTier{device_obj, take(std::move(made))};
           },
           nb::arg("device"), nb::arg("entry_bytes"), nb::arg("names"), nb::arg("home") = "cpu",
           nb::arg("nvme_paths") = std::vector<std::string>{}, nb::arg("budget_bytes") = 0, nb::arg("prefetch") = 2,
           nb::arg("host_consumer") = false)
      .def("write",
           [](PyParamTier& t, std::size_t block, std::size_t entry, std::uintptr_t address, std::size_t nbytes,
              std::size_t byte_offset) {
             check(t.call([&](ParamTier& p) { return p.write(block, entry, reinterpret_cast<const void*>(address), byte_offset, nbytes); }));
           },
           nb::arg("block"), nb::arg("entry"), nb::arg("address"), nb::arg("nbytes"), nb::arg("byte_offset") = 0,
           "Copies nbytes of host memory at `address` into the entry's home.")
      .def("read",
           [](PyParamTier& t, std::size_t block, std::size_t entry, std::uintptr_t address, std::size_t nbytes,
              std::size_t byte_offset) {
             check(t.call([&](ParamTier& p) { return p.read(block, entry, reinterpret_cast<void*>(address), byte_offset, nbytes); }));
           },
           nb::arg("block"), nb::arg("entry"), nb::arg("address"), nb::arg("nbytes"), nb::arg("byte_offset") = 0)
      .def("set_order", [](PyParamTier& t, std::vector<std::size_t> order) { check(t.get().set_order(std::move(order))); })
      .def("fetch",
           [](PyParamTier& t, std::size_t block, bool backward) {
             Result<void*> r = t.call([&](ParamTier& p) { return p.fetch(block, backward); });
             return reinterpret_cast<std::uintptr_t>(take(std::move(r)));
           },
           nb::arg("block"), nb::arg("backward") = false,
           "The block's device address, valid for work after this call until release(); prefetches ahead.")
      .def("release", [](PyParamTier& t, std::size_t block) { check(t.call([&](ParamTier& p) { return p.release(block); })); })
      .def("prefetch", [](PyParamTier& t, std::size_t block) { check(t.call([&](ParamTier& p) { return p.prefetch(block); })); })
      .def("synchronize", [](PyParamTier& t) { check(t.call([](ParamTier& p) { return p.synchronize(); })); })
      .def("entry_offset", [](PyParamTier& t, std::size_t b, std::size_t e) { return t.get().entry_offset(b, e); })
      .def("in_use", [](PyParamTier& t, std::size_t b) { return t.get().in_use(b); })
      .def("blocks", [](PyParamTier& t) { return t.get().blocks(); })
      .def("block_bytes", [](PyParamTier& t, std::size_t b) { return t.get().block_bytes(b); })
      .def("files", [](PyParamTier& t) { return t.get().files(); })
      .def("close", [](PyParamTier& t) {
        if (t.engines > 0) {
          throw std::invalid_argument("the parameter tier cannot be closed: " + std::to_string(t.engines) +
                                      " optimizer(s) still write into it (delete them first)");
        }
        nb::gil_scoped_release release;
        t.tier.reset();
      }, "Frees the pool and the home (an NVMe file is removed); every later call raises.")
      .def_prop_ro("users", [](PyParamTier& t) { return t.engines; }, "Optimizers writing into this tier.")
      .def("stats", [](PyParamTier& t) {
        const ParamTierStats s = t.get().stats();
        nb::dict d;
        d["budget_bytes"] = s.budget_bytes;
        d["pool_peak_bytes"] = s.pool_peak_bytes;
        d["fetches"] = s.fetches;
        d["hits"] = s.hits;
        d["loads"] = s.loads;
        d["evictions"] = s.evictions;
        d["loaded_bytes"] = s.loaded_bytes;
        d["fetch_wait_s"] = s.fetch_wait_s;
        d["read_bytes"] = s.read_bytes;
        d["write_bytes"] = s.write_bytes;
        d["read_busy_s"] = s.read_busy_s;
        d["write_busy_s"] = s.write_busy_s;
        return d;
      });
}

void bind_engine(nb::module_& m) {
  nb::class_<PyDevice>(m, "Device", "Where the model's weights and gradients live, as zoe's engine sees it.")
      .def_prop_ro("name", [](const PyDevice& d) { return d.device->name(); })
      .def_prop_ro("host_memory", [](const PyDevice& d) { return d.device->host_memory(); },
                   "True when the device's memory is host memory (the CPU): gradients never leave it.")
      .def("synchronize", &PyDevice::synchronize, "Waits for every copy the engine has enqueued.")
      .def("use_compute_stream",
           [](PyDevice& d, std::optional<std::uintptr_t> handle) { check(d.device->use_compute_stream(handle)); },
           nb::arg("handle").none(),
           "Enqueue zoe's compute-stream work on a stream it does not own: on CUDA the cudaStream_t of torch's "
           "current stream (torch.cuda.current_stream().cuda_stream); None returns to zoe's own.")
      .def("host_waits",
           [](const PyDevice& d) {
             const HostWaits w = d.device->host_waits();
             nb::dict out;
             out["trainer_calls"] = w.trainer_calls;
             out["trainer_s"] = w.trainer_s;
             out["worker_calls"] = w.worker_calls;
             out["worker_s"] = w.worker_s;
             return out;
           },
           "Every time the host waited for this device since it was made: calls and seconds on the trainer's "
           "threads and on zoe's own workers.");
  m.def("host_device",
        [](std::uint64_t chaos_seed, double chaos_max_s) {
          if (!(chaos_max_s >= 0 && chaos_max_s <= 1)) {
            check(invalid_argument("host_device: chaos_max_s must be in [0, 1] seconds"));
          }
          HostDeviceOptions options;
          options.chaos_seed = chaos_seed;
          options.chaos_max_s = chaos_max_s;
          return std::make_unique<PyDevice>(PyDevice{make_host_device(options)});
        },
        nb::arg("chaos_seed") = 0, nb::arg("chaos_max_s") = 5e-4,
        "The host stand-in: any host address is device memory; copies run on stream threads. chaos_seed other "
        "than 0: every piece of its work first sleeps a random time up to chaos_max_s (the orders a GPU's "
        "concurrent streams may take).");
  nb::class_<HostStream>(m, "HostStream",
                         "A stream of host work zoe does not own, which a host stand-in's compute stream can follow "
                         "(Device.use_compute_stream(stream.handle())): stands for torch's current CUDA stream.")
      .def(nb::init<>())
      .def("handle", &HostStream::handle)
      .def("drain", &HostStream::drain, nb::call_guard<nb::gil_scoped_release>(),
           "Returns once everything enqueued on it has run.");
  m.def("cpu_device", [] { return std::make_unique<PyDevice>(PyDevice{make_cpu_device()}); },
        "The CPU as the device: the engine reads gradients and writes weights in place (fp32 weights are the "
        "master), except with schedule 'delayed', which needs its own copy.");
  m.def("cuda_device", [](int ordinal) { return std::make_unique<PyDevice>(PyDevice{take(make_cuda_device(ordinal))}); },
        nb::arg("ordinal") = 0, "The CUDA GPU `ordinal`; raises UnsupportedError without CUDA.");

  // Integer and text fields are set through zoe's checks (int_arg, utf8_arg): a value the field cannot hold
  // is an error naming the field.
  auto get = [](auto EngineOptions::*field) { return [field](const EngineOptions& o) { return o.*field; }; };
  auto int_setter = [](auto EngineOptions::*field, const char* name) {
    return [field, name](EngineOptions& o, nb::handle v) {
      o.*field = int_arg<std::remove_reference_t<decltype(o.*field)>>(v, name);
    };
  };
  auto str_setter = [](std::string EngineOptions::*field, const char* name) {
    return [field, name](EngineOptions& o, const nb::str& v) { o.*field = utf8_arg(v, name); };
  };
  nb::class_<EngineOptions>(m, "EngineOptions")
      .def(nb::init<>())
      .def_prop_rw("tier", get(&EngineOptions::tier), str_setter(&EngineOptions::tier, "EngineOptions.tier"))
      .def_prop_rw("nvme_paths", get(&EngineOptions::nvme_paths),
                   [](EngineOptions& o, const std::vector<nb::str>& paths) {
                     std::vector<std::string> out;
                     for (const nb::str& p : paths) out.push_back(utf8_arg(p, "EngineOptions.nvme_paths"));
                     o.nvme_paths = std::move(out);
                   })
      .def_prop_rw("buffer_count", get(&EngineOptions::buffer_count), int_setter(&EngineOptions::buffer_count, "EngineOptions.buffer_count"))
      .def_prop_rw("block_size", get(&EngineOptions::block_size), int_setter(&EngineOptions::block_size, "EngineOptions.block_size"))
      .def_prop_rw("queue_depth", get(&EngineOptions::queue_depth), int_setter(&EngineOptions::queue_depth, "EngineOptions.queue_depth"))
      .def_prop_rw("nvme_durability", get(&EngineOptions::nvme_durability), str_setter(&EngineOptions::nvme_durability, "EngineOptions.nvme_durability"))
      .def_rw("nvme_keep_resident", &EngineOptions::nvme_keep_resident)
      .def_prop_rw("state_dtype", get(&EngineOptions::state_dtype), str_setter(&EngineOptions::state_dtype, "EngineOptions.state_dtype"))
      .def_prop_rw("schedule", get(&EngineOptions::schedule), str_setter(&EngineOptions::schedule, "EngineOptions.schedule"))
      .def_prop_rw("delayed_warmup_steps", get(&EngineOptions::delayed_warmup_steps), int_setter(&EngineOptions::delayed_warmup_steps, "EngineOptions.delayed_warmup_steps"))
      .def_prop_rw("gradient_accumulation_steps", get(&EngineOptions::gradient_accumulation_steps), int_setter(&EngineOptions::gradient_accumulation_steps, "EngineOptions.gradient_accumulation_steps"))
      .def_rw("partition_flat_buffers", &EngineOptions::partition_flat_buffers)
      .def_rw("partition_grads_averaged", &EngineOptions::partition_grads_averaged)
      .def_rw("max_grad_norm", &EngineOptions::max_grad_norm)
      .def_rw("refuse_non_finite", &EngineOptions::refuse_non_finite)
      .def_rw("loss_scale", &EngineOptions::loss_scale)
      .def_rw("dynamic_loss_scale", &EngineOptions::dynamic_loss_scale)
      .def_rw("static_loss_scale", &EngineOptions::static_loss_scale)
      .def_rw("initial_scale", &EngineOptions::initial_scale)
      .def_rw("growth_factor", &EngineOptions::growth_factor)
      .def_rw("backoff_factor", &EngineOptions::backoff_factor)
      .def_prop_rw("growth_interval", get(&EngineOptions::growth_interval), int_setter(&EngineOptions::growth_interval, "EngineOptions.growth_interval"))
      .def_prop_rw("hysteresis", get(&EngineOptions::hysteresis), int_setter(&EngineOptions::hysteresis, "EngineOptions.hysteresis"))
      .def_rw("consecutive_hysteresis", &EngineOptions::consecutive_hysteresis)
      .def_rw("min_scale", &EngineOptions::min_scale)
      .def_prop_rw("tile", get(&EngineOptions::tile), int_setter(&EngineOptions::tile, "EngineOptions.tile"))
      .def_prop_rw("isa", get(&EngineOptions::isa), str_setter(&EngineOptions::isa, "EngineOptions.isa"))
      .def_prop_rw("threads", get(&EngineOptions::threads), int_setter(&EngineOptions::threads, "EngineOptions.threads"));

  nb::class_<PyEngine>(m, "Engine", "zoe's OffloadOptimizer over parameters given by address on a Device.")
      .def("__init__",
           [](PyEngine* self, nb::object device, std::vector<nb::dict> groups, std::vector<ParamTuple> params,
              const EngineOptions& options, nb::object collectives,
              std::vector<std::tuple<std::size_t, nb::object, std::size_t, std::size_t>> tiered) {
             new (self) PyEngine(std::move(*make_engine(device, groups, params, options, collectives, tiered)));
           },
           nb::arg("device"), nb::arg("groups"), nb::arg("params"), nb::arg("options"),
           nb::arg("collectives").none() = nb::none(),
           nb::arg("tiered") = std::vector<std::tuple<std::size_t, nb::object, std::size_t, std::size_t>>{},
           "collectives: None, or an object of rank(), world(), reduce_scatter, all_gather and all_reduce_host "
           "(zoe/_data_parallel.py): with world > 1 the engine partitions the parameters over its ranks. "
           "tiered: (parameter, ParamTier, block, entry) for each parameter whose weights live in a parameter "
           "tier (its weights address is then ignored).")
      .def("grad_ready",
           [](PyEngine& e, std::size_t i) { e.call([i](OffloadOptimizer& o) { return o.grad_ready(i); }); })
      .def("step", [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.step(); }); })
      .def("wait", [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.wait(); }); })
      .def("grads_changed", [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.grads_changed(); }); },
           "The trainer changed gradients after backward: step() takes them all again.")
      .def("discard_speculative_steps",
           [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.discard_speculative_steps(); }); },
           "Undoes the overlap schedule's steps taken during this backward; step() takes them again.")
      .def("grad_norm",
           [](PyEngine& e) {
             double norm = 0;
             e.call([&norm](OffloadOptimizer& o) {
               Result<double> r = o.grad_norm();
               if (r.ok()) norm = r.value();
               return r.ok() ? Status::success() : r.status();
             });
             return norm;
           },
           "The global L2 norm of this iteration's gradients, unscaled, as step() will use it.")
      .def("set_max_grad_norm",
           [](PyEngine& e, float max_norm) { e.call([max_norm](OffloadOptimizer& o) { return o.set_max_grad_norm(max_norm); }); },
           nb::arg("max_norm"), "Clipping from the next step on (0: none).")
      .def("save",
           [](PyEngine& e, const nb::str& path_arg, bool record_names) {
             const std::string path = utf8_arg(path_arg, "path");
             e.call([&](OffloadOptimizer& o) { return o.save(path, record_names); });
           },
           nb::arg("path"), nb::arg("record_names") = true)
      .def("load",
           [](PyEngine& e, const nb::str& path_arg) {
             const std::string path = utf8_arg(path_arg, "path");
             e.call([&path](OffloadOptimizer& o) { return o.load(path); });
           },
           nb::arg("path"))
      .def("set_hyper",
           [](PyEngine& e, std::size_t group, float lr, float beta1, float beta2, float eps, float weight_decay,
              bool adamw) {
             AdamHyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, adamw, true);
             check(CpuAdam::validate(h));
             AdamHyper& target = e.get().group_hyper(group);
             target = h;
           },
           nb::arg("group"), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
           nb::arg("weight_decay"), nb::arg("adamw"))
      .def("hyper", [](PyEngine& e, std::size_t group) { return hyper_dict(e.get().group_hyper(group)); })
      .def_prop_ro("loss_scale", [](PyEngine& e) { return e.get().loss_scale(); })
      .def_prop_ro("loss_scale_state",
                   [](PyEngine& e) {
                     const LossScaleState ls = e.get().loss_scale_state();
                     return std::make_tuple(ls.scale, ls.clean_steps, ls.hysteresis_left);
                   },
                   "(scale, clean_steps, hysteresis_left) of the fp16 loss scaler.")
      .def("set_loss_scale_state",
           [](PyEngine& e, float scale, std::int64_t clean_steps, std::int32_t hysteresis_left) {
             e.call([&](OffloadOptimizer& o) { return o.set_loss_scale_state({scale, clean_steps, hysteresis_left}); });
           },
           nb::arg("scale"), nb::arg("clean_steps"), nb::arg("hysteresis_left"))
      .def_prop_ro("step_count", [](PyEngine& e) { return e.get().step_count(); })
      .def_prop_ro("last_step_skipped", [](PyEngine& e) { return e.get().last_step_skipped(); })
      .def_prop_ro("param_count", [](PyEngine& e) { return e.param_count; })
      .def("stats", [](PyEngine& e) { return stats_dict(e.get().stats()); })
      .def("read_state",
           [](PyEngine& e, std::size_t i, std::optional<F32Array> master, std::optional<F32Array> exp_avg,
              std::optional<F32Array> exp_avg_sq) {
             float* ptrs[3] = {e.state_array(i, master, "master"), e.state_array(i, exp_avg, "exp_avg"),
                               e.state_array(i, exp_avg_sq, "exp_avg_sq")};
             e.call([&](OffloadOptimizer& o) { return o.read_state(i, ptrs[0], ptrs[1], ptrs[2]); });
           },
           nb::arg("param"), nb::arg("master").none(), nb::arg("exp_avg").none(), nb::arg("exp_avg_sq").none(),
           "Copies a parameter's fp32 master weights and moments into the given arrays (call wait() first).")
      .def("write_state",
           [](PyEngine& e, std::size_t i, std::optional<F32Array> master, std::optional<F32Array> exp_avg,
              std::optional<F32Array> exp_avg_sq) {
             const float* ptrs[3] = {e.state_array(i, master, "master"), e.state_array(i, exp_avg, "exp_avg"),
                                     e.state_array(i, exp_avg_sq, "exp_avg_sq")};
             e.call([&](OffloadOptimizer& o) { return o.write_state(i, ptrs[0], ptrs[1], ptrs[2]); });
           },
           nb::arg("param"), nb::arg("master").none(), nb::arg("exp_avg").none(), nb::arg("exp_avg_sq").none(),
           "Replaces a parameter's fp32 master weights and moments (None: kept); the device weights follow.")
      .def_prop_ro("state_sizes", [](PyEngine& e) { return e.get().state_sizes(); },
                   "Elements of each parameter (partitioned: each piece) read_state/write_state take.")
      .def("set_step_count",
           [](PyEngine& e, std::int64_t steps) { e.call([steps](OffloadOptimizer& o) { return o.set_step_count(steps); }); },
           nb::arg("steps"))
      .def("set_grads_absent",
           [](PyEngine& e, const std::vector<std::size_t>& which) {
             e.call([&which](OffloadOptimizer& o) { return o.set_grads_absent(which); });
           },
           nb::arg("params"),
           "The parameters (engine numbering) whose gradient is None this iteration: the coming step leaves them "
           "as they are (state, weights, step count). Replaces the previous list.")
      .def("moments_view",
           [](nb::handle self, std::size_t i, int which) -> nb::object {
             PyEngine& e = nb::cast<PyEngine&>(self);
             float* at = e.get().moments_of(i, which);
             if (at == nullptr) return nb::none();
             const std::size_t n = e.get().state_sizes()[i];
             // The array keeps the engine alive: the view cannot outlive the memory it shows.
             return nb::cast(nb::ndarray<nb::numpy, float, nb::ndim<1>>(at, {n}, self));
           },
           nb::arg("param"), nb::arg("which"),
           "Tier ram with fp32 moments: a numpy view of parameter `param`'s exp_avg (1) or exp_avg_sq (2) in the "
           "engine's memory (it keeps the engine alive); None otherwise.")
      .def("set_grad_sources",
           [](PyEngine& e, const std::vector<std::size_t>& params, const std::vector<std::uintptr_t>& addresses) {
             if (params.size() != addresses.size()) throw nb::value_error("set_grad_sources: one address per parameter");
             e.call([&](OffloadOptimizer& o) {
               for (std::size_t k = 0; k < params.size(); ++k) {
                 if (Status s = o.set_grad_source(params[k], reinterpret_cast<const void*>(addresses[k])); !s.ok()) return s;
               }
               return Status::success();
             });
           },
           nb::arg("params"), nb::arg("addresses"),
           "Where each parameter's gradient is from now on (a tensor's data_ptr(); it must outlive its use).")
      .def("param_step_count", [](PyEngine& e, std::size_t i) { return e.get().param_step_count(i); }, nb::arg("param"),
           "Steps applied to this parameter (torch's state[p]['step']).")
      .def("set_param_step_count",
           [](PyEngine& e, std::size_t i, std::int64_t steps) {
             e.call([i, steps](OffloadOptimizer& o) { return o.set_param_step_count(i, steps); });
           },
           nb::arg("param"), nb::arg("steps"));

  m.def("read_checkpoint",
        [](const nb::str& path_arg) {
          const std::string path = utf8_arg(path_arg, "path");
          const CheckpointReader reader = open_checkpoint(path);
          nb::dict blobs;
          for (const std::string& name : reader.names()) {
            const std::size_t bytes = take(reader.size(name));
            auto* data = new std::uint8_t[std::max<std::size_t>(bytes, 1)];
            nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<std::uint8_t*>(p); });
            Status s;
            {
              nb::gil_scoped_release release;
              s = reader.read(name, data, bytes);
            }
            check(s);
            blobs[name.c_str()] = nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>(data, {bytes}, owner);
          }
          return nb::make_tuple(reader.manifest(), blobs);
        },
        nb::arg("path"),
        "A zoe checkpoint file, every blob's checksum verified: (manifest JSON text, {blob name: uint8 array}).");
  m.def("checkpoint_blobs",
        [](const nb::str& path_arg) {
          const std::string path = utf8_arg(path_arg, "path");
          const CheckpointReader reader = open_checkpoint(path);
          nb::dict blobs;
          for (const std::string& name : reader.names()) {
            blobs[name.c_str()] = nb::make_tuple(take(reader.offset(name)), take(reader.size(name)));
          }
          return blobs;
        },
        nb::arg("path"), "Where each blob of a zoe checkpoint file lies in it: {blob name: (offset, bytes)}; nothing is read.");
  m.def("parse_config",
        [](const nb::str& text, const nb::str& source) {
          return config_dict(take(parse_config(utf8_arg(text, "text"), utf8_arg(source, "source"))));
        },
        nb::arg("text"), nb::arg("source") = "<string>");
  m.def("load_config", [](const nb::str& path) { return config_dict(take(load_config_file(utf8_arg(path, "path")))); },
        nb::arg("path"));
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
  bind_engine(m);
  bind_param_tier(m);
}
