// zoe._zoe's devices: Device (where weights and gradients live, as the engine sees it), the host stand-in
// with its HostStream, the CPU and CUDA devices.
#include "python/src/binding.h"
#include "src/offload/host_device.h"

namespace zoe::python {

void bind_device(nb::module_& m) {
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
}

}  // namespace zoe::python
