// zoe._zoe's Engine: an OffloadOptimizer over parameters given as arrays (torch tensors, numpy arrays) on a
// Device, with collectives implemented in Python and parameters whose weights live in a ParamTier; its calls
// release the GIL.
#include <algorithm>
#include <span>
#include <tuple>

#include "python/src/binding.h"
#include "zoe/partition.h"

namespace zoe::python {
namespace {

// One parameter as (n, dtype name, weights, gradients, group, name, shape): weights and gradients are
// arrays in the device's memory (weights None where a parameter tier holds them); the name and shape are
// recorded in checkpoints (zoe export).
using ParamTuple = std::tuple<std::size_t, std::string, nb::object, nb::object, int, std::string,
                              std::vector<std::int64_t>>;

std::string array_device_name(int type, int id) {
  if (type == nb::device::cpu::value) return "the host";
  if (type == nb::device::cuda::value) return "cuda:" + std::to_string(id);
  if (type == nb::device::cuda_host::value) return "pinned host memory";
  return "DLPack device " + std::to_string(type) + ":" + std::to_string(id);
}

// `obj` as the memory the engine reads or writes for `what`, n elements of `dtype`: an array in the device's
// memory, contiguous, of that dtype and size. Anything else — an address, a DTensor, a view with strides, a
// tensor on another device, a short or a float64 one — is refused naming `what`, so that no address the
// engine keeps can point outside what it came from. The array is returned: it holds the memory's owner.
AnyArray param_array(nb::handle obj, const PyDevice& device, std::size_t n, DType dtype, const std::string& what) {
  AnyArray a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) {
    throw std::invalid_argument(what + ": need a tensor or array, not " + nb::type_name(obj.type()).c_str());
  }
  memory_of(a, what);
  if (a.device_type() != device.array_device_type ||
      (device.array_device_type != nb::device::cpu::value && a.device_id() != device.array_device_id)) {
    throw std::invalid_argument(what + ": the array is on " + array_device_name(a.device_type(), a.device_id()) +
                                ", the engine's device is " + device.device->name());
  }
  if (const DType d = dtype_of(a.dtype(), what.c_str()); d != dtype) {
    throw std::invalid_argument(what + ": the array is " + std::string(dtype_name(d)) + ", the parameter is " +
                                std::string(dtype_name(dtype)));
  }
  if (a.size() != n) {
    throw std::invalid_argument(what + ": the array has " + std::to_string(a.size()) + " elements, the parameter " +
                                std::to_string(n));
  }
  std::int64_t expected = 1;  // row-major strides, in elements; a dimension of one may have any
  for (std::size_t k = a.ndim(); k-- > 0;) {
    if (a.shape(k) != 1 && a.stride(k) != expected) throw std::invalid_argument(what + ": the array is not contiguous");
    expected *= a.shape(k);
  }
  return a;
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
  std::vector<std::pair<std::size_t, DType>> param_shapes;  // (n, dtype) per parameter: set_grad_sources checks
  // The arrays whose memory the optimizer reads and writes: held, so that it stays while the engine may use it.
  std::vector<AnyArray> arrays;
  std::vector<AnyArray> grad_sources;  // per parameter, the one set_grad_sources() gave last

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
    return memory_of(*a, what);
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
    // Each group's rule and fields by the optimizer table; Adam's defaults unless it names another rule.
    gs.push_back(ParamGroup{hyper_from_dict(g, "group " + std::to_string(gs.size()), OptimizerHyper{})});
  }
  const OffloadOptions o = to_options(options);
  auto engine = std::make_unique<PyEngine>();
  std::vector<char> is_tiered(params.size(), 0);
  for (const auto& t : tiered) {
    if (std::get<0>(t) >= params.size()) {
      throw std::invalid_argument("tiered parameter " + std::to_string(std::get<0>(t)) + " does not exist");
    }
    is_tiered[std::get<0>(t)] = 1;
  }
  std::vector<ParamSpec> ps;
  ps.reserve(params.size());
  for (const auto& [n, dtype, weights, grads, group, name, shape] : params) {
    ParamSpec p;
    p.n = n;
    p.dtype = parse_dtype_or_throw(dtype);
    const std::string what = "parameter " + std::to_string(ps.size()) + (name.empty() ? "" : " '" + name + "'");
    if (!is_tiered[ps.size()] || !weights.is_none()) {
      engine->arrays.push_back(param_array(weights, device, n, p.dtype, what + " weights"));
      p.device_weights = engine->arrays.back().data();
    }
    if (!grads.is_none() || !o.spill_grads) {  // None: spilled, each gradient given with its report (spill_grad)
      engine->arrays.push_back(param_array(grads, device, n, p.dtype, what + " gradients"));
      p.device_grads = engine->arrays.back().data();
    }
    p.group = group;
    p.name = name;
    p.shape = shape;
    engine->param_shapes.emplace_back(n, p.dtype);
    ps.push_back(p);
  }
  engine->grad_sources.resize(ps.size());
  for (const auto& [param, tier_obj, block, entry] : tiered) {
    ps[param].tier = &nb::cast<PyParamTier&>(tier_obj).get();
    ps[param].tier_block = block;
    ps[param].tier_entry = entry;
    if (std::find_if(engine->tiers.begin(), engine->tiers.end(), [&](const nb::object& t) { return t.is(tier_obj); }) ==
        engine->tiers.end()) {
      engine->tiers.push_back(tier_obj);
      ++nb::cast<PyParamTier&>(tier_obj).engines;
    }
  }
  engine->device_owner = device_obj;
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

// The calls of a training step: creation, gradients in, the step, clipping.
void bind_engine_steps(nb::class_<PyEngine>& engine) {
  engine.def("__init__",
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
             "params: (n, dtype, weights, grads, group, name, shape), weights and grads arrays (torch tensors, "
             "numpy arrays) in the device's memory, contiguous, of n elements of dtype; the engine holds them. "
             "tiered: (parameter, ParamTier, block, entry) for each parameter whose weights live in a parameter "
             "tier (its weights are then None).")
      .def("grad_ready",
           [](PyEngine& e, std::size_t i) { e.call([i](OffloadOptimizer& o) { return o.grad_ready(i); }); })
      .def("spill_grad",
           [](PyEngine& e, std::size_t i, const nb::object& grad) {
             if (i >= e.param_shapes.size()) {
               throw std::invalid_argument("spill_grad: parameter " + std::to_string(i) + " does not exist (" +
                                           std::to_string(e.param_shapes.size()) + " parameters)");
             }
             const PyDevice& device = nb::cast<const PyDevice&>(e.device_owner);
             const auto [n, dtype] = e.param_shapes[i];
             const AnyArray a = param_array(grad, device, n, dtype, "spill_grad: parameter " + std::to_string(i) + " gradient");
             e.call([&](OffloadOptimizer& o) { return o.spill_grad(i, a.data()); });
           },
           nb::arg("param"), nb::arg("grad"),
           "spill_grads: the parameter's gradient (an array on the engine's device of its size and dtype) goes to "
           "the spill file now and counts as reported; it is not held after this call.")
      .def("step", [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.step(); }); })
      .def("wait", [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.wait(); }); })
      .def("grads_changed", [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.grads_changed(); }); },
           "The trainer changed gradients after backward: step() takes them all again.")
      .def("discard_speculative_steps",
           [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.discard_speculative_steps(); }); },
           "Undoes the overlap schedule's steps taken during this backward; step() takes them again.")
      .def("abandon_iteration",
           [](PyEngine& e) { e.call([](OffloadOptimizer& o) { return o.abandon_iteration(); }); },
           "Drops this iteration's reports and puts back what was stepped or sent during it: state and device "
           "weights as before it, for the iteration to run again.")
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
           nb::arg("max_norm"), "Clipping from the next step on (0: none).");
}

// Checkpoints, hyper-parameters, the loss scale and the counters.
void bind_engine_settings(nb::class_<PyEngine>& engine) {
  engine.def("save",
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
           [](PyEngine& e, std::size_t group, const nb::kwargs& fields) {
             OptimizerHyper& target = e.get().group_hyper(group);
             const OptimizerHyper h = hyper_from_dict(fields, "group " + std::to_string(group), target);
             check(validate_hyper(h));
             // The state arrays were made for the rule and amsgrad at creation.
             if (h.rule != target.rule || h.amsgrad != target.amsgrad) {
               throw std::invalid_argument("set_hyper: group " + std::to_string(group) +
                                           ": the optimizer and amsgrad are fixed when the engine is made");
             }
             target = h;
           },
           "Sets fields of param group `group` by the optimizer table's names (lr=..., beta1=..., ...).")
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
      .def_prop_ro("reads_grads_in_place", [](PyEngine& e) { return e.get().reads_grads_in_place(); })
      .def_prop_ro("param_count", [](PyEngine& e) { return e.param_shapes.size(); })
      .def("stats", [](PyEngine& e) { return stats_dict(e.get().stats()); });
}

// The optimizer state arrays of each parameter, copied out and in.
void bind_engine_state_arrays(nb::class_<PyEngine>& engine) {
  engine.def("read_state",
             [](PyEngine& e, std::size_t i, std::optional<F32Array> master, std::optional<F32Array> exp_avg,
                std::optional<F32Array> exp_avg_sq, std::optional<F32Array> max_exp_avg_sq) {
               float* ptrs[4] = {e.state_array(i, master, "master"), e.state_array(i, exp_avg, "exp_avg"),
                                 e.state_array(i, exp_avg_sq, "exp_avg_sq"),
                                 e.state_array(i, max_exp_avg_sq, "max_exp_avg_sq")};
               e.call([&](OffloadOptimizer& o) { return o.read_state(i, ptrs[0], ptrs[1], ptrs[2], ptrs[3]); });
             },
             // noconvert: a converted copy of a strided or float64 array would be filled and dropped.
             nb::arg("param"), nb::arg("master").none().noconvert(), nb::arg("exp_avg").none().noconvert(),
             nb::arg("exp_avg_sq").none().noconvert(), nb::arg("max_exp_avg_sq").none().noconvert() = nb::none(),
             "Copies a parameter's fp32 master weights and state arrays (the optimizer's: Lion's and Adagrad's one "
             "as exp_avg, amsgrad's max_exp_avg_sq) into the given arrays, of a whole step (it waits first).")
      .def("write_state",
           [](PyEngine& e, std::size_t i, std::optional<F32Array> master, std::optional<F32Array> exp_avg,
              std::optional<F32Array> exp_avg_sq, std::optional<F32Array> max_exp_avg_sq) {
             const float* ptrs[4] = {e.state_array(i, master, "master"), e.state_array(i, exp_avg, "exp_avg"),
                                     e.state_array(i, exp_avg_sq, "exp_avg_sq"),
                                     e.state_array(i, max_exp_avg_sq, "max_exp_avg_sq")};
             e.call([&](OffloadOptimizer& o) { return o.write_state(i, ptrs[0], ptrs[1], ptrs[2], ptrs[3]); });
           },
           nb::arg("param"), nb::arg("master").none(), nb::arg("exp_avg").none(), nb::arg("exp_avg_sq").none(),
           nb::arg("max_exp_avg_sq").none() = nb::none(),
           "Replaces a parameter's fp32 master weights and moments (None: kept); the device weights follow.");
}

// The optimizer state of each parameter: its sizes, views and step counts.
void bind_engine_state(nb::class_<PyEngine>& engine) {
  engine.def_prop_ro("state_sizes", [](PyEngine& e) { return e.get().state_sizes(); },
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
           "Tier ram with fp32 state: a numpy view of parameter `param`'s state array `which` (1 exp_avg, or Lion's "
           "and Adagrad's one; 2 exp_avg_sq; 3 max_exp_avg_sq) in the engine's memory (it keeps the engine alive); "
           "None otherwise.")
      .def("set_grad_sources",
           [](PyEngine& e, const std::vector<std::size_t>& params, const std::vector<nb::object>& grads) {
             if (params.size() != grads.size()) throw nb::value_error("set_grad_sources: one gradient per parameter");
             const PyDevice& device = nb::cast<const PyDevice&>(e.device_owner);
             std::vector<AnyArray> arrays;
             for (std::size_t k = 0; k < params.size(); ++k) {
               if (params[k] >= e.param_shapes.size()) {
                 throw std::invalid_argument("set_grad_sources: parameter " + std::to_string(params[k]) +
                                             " does not exist (" + std::to_string(e.param_shapes.size()) + " parameters)");
               }
               const auto [n, dtype] = e.param_shapes[params[k]];
               arrays.push_back(param_array(grads[k], device, n, dtype,
                                            "set_grad_sources: parameter " + std::to_string(params[k]) + " gradient"));
             }
             Status s;
             std::size_t done = 0;  // those before a failure point at their new array: it is held from now on
             {
               nb::gil_scoped_release release;
               for (; done < params.size() && s.ok(); ++done) s = e.get().set_grad_source(params[done], arrays[done].data());
               if (!s.ok()) --done;
             }
             for (std::size_t k = 0; k < done; ++k) e.grad_sources[params[k]] = std::move(arrays[k]);
             check(s);
           },
           nb::arg("params"), nb::arg("grads"),
           "Where each parameter's gradient is from now on: an array on the engine's device of the parameter's "
           "size and dtype, held by the engine until replaced.")
      .def("param_step_count", [](PyEngine& e, std::size_t i) { return e.get().param_step_count(i); }, nb::arg("param"),
           "Steps applied to this parameter (torch's state[p]['step']).")
      .def("set_param_step_count",
           [](PyEngine& e, std::size_t i, std::int64_t steps) {
             e.call([i, steps](OffloadOptimizer& o) { return o.set_param_step_count(i, steps); });
           },
           nb::arg("param"), nb::arg("steps"));
}

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<PyEngine> engine(m, "Engine", "zoe's OffloadOptimizer over parameters given by address on a Device.");
  bind_engine_steps(engine);
  bind_engine_settings(engine);
  bind_engine_state_arrays(engine);
  bind_engine_state(engine);
}

}  // namespace zoe::python
