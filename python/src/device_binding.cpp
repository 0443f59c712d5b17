// zoe._zoe's devices: Device (where weights and gradients live, as the engine sees it), the host stand-in
// with its HostStream, the CPU and CUDA devices; and the process's large host allocations.
#include <malloc.h>

#include "python/src/binding.h"
#include "zoe/host_device.h"

namespace zoe::python {
namespace {

// The handle of the stream object `stream` for the device `d`: a torch.cuda.Stream of the device's GPU on
// CUDA, a HostStream on the host stand-in and the CPU. Never an integer: an address from Python that is no
// stream would be dereferenced at the next enqueue.
std::uintptr_t stream_handle(const PyDevice& d, nb::handle stream) {
  const std::string type = nb::type_name(stream.type()).c_str();
  if (d.array_device_type == nb::device::cuda::value) {
    int index = -1;
    std::uintptr_t handle = 0;
    if (!nb::hasattr(stream, "cuda_stream") || !nb::hasattr(stream, "device") ||
        !nb::try_cast(stream.attr("device").attr("index"), index) || !nb::try_cast(stream.attr("cuda_stream"), handle)) {
      check(invalid_argument("use_compute_stream: need a torch.cuda.Stream, not " + type));
    }
    if (index != d.array_device_id) {
      check(invalid_argument("use_compute_stream: the stream is on cuda:" + std::to_string(index) +
                             ", the device is " + d.device->name()));
    }
    return handle;
  }
  HostStream* host = nullptr;
  if (!nb::try_cast(stream, host) || host == nullptr) {
    check(invalid_argument("use_compute_stream: need a zoe._zoe.HostStream on " + d.device->name() + ", not " + type));
  }
  return host->handle();
}

}  // namespace

void bind_device(nb::module_& m) {
  nb::class_<PyDevice>(m, "Device", "Where the model's weights and gradients live, as zoe's engine sees it.")
      .def_prop_ro("name", [](const PyDevice& d) { return d.device->name(); })
      .def_prop_ro("host_memory", [](const PyDevice& d) { return d.device->host_memory(); },
                   "True when the device's memory is host memory (the CPU): gradients never leave it.")
      .def("synchronize", &PyDevice::synchronize, "Waits for every copy the engine has enqueued.")
      .def("use_compute_stream",
           [](PyDevice& d, nb::object stream) {
             std::optional<std::uintptr_t> handle;
             if (!stream.is_none()) handle = stream_handle(d, stream);
             check(d.device->use_compute_stream(handle));
             d.compute_stream = std::move(stream);
           },
           nb::arg("stream").none(),
           "Enqueue zoe's compute-stream work on a stream it does not own, held until replaced: on CUDA a "
           "torch.cuda.Stream of the device's GPU (torch.cuda.current_stream()), on the host stand-in a "
           "HostStream; None returns to zoe's own.")
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
          return std::make_unique<PyDevice>(make_host_device(options));
        },
        nb::arg("chaos_seed") = 0, nb::arg("chaos_max_s") = 5e-4,
        "The host stand-in: any host address is device memory; copies run on stream threads. chaos_seed other "
        "than 0: every piece of its work first sleeps a random time up to chaos_max_s (the orders a GPU's "
        "concurrent streams may take).");
  nb::class_<HostStream>(m, "HostStream",
                         "A stream of host work zoe does not own, which a host stand-in's compute stream can follow "
                         "(Device.use_compute_stream(stream)): stands for torch's current CUDA stream.")
      .def(nb::init<>())
      .def("drain", &HostStream::drain, nb::call_guard<nb::gil_scoped_release>(),
           "Returns once everything enqueued on it has run.");
  m.def("cpu_device", [] { return std::make_unique<PyDevice>(make_cpu_device()); },
        "The CPU as the device: the engine reads gradients and writes weights in place (fp32 weights are the "
        "master), except with schedule 'delayed', which needs its own copy.");
  m.def("map_large_allocations",
        [](std::size_t bytes) {
#ifdef __GLIBC__
          // A fixed threshold also ends glibc's raising it to the largest block freed so far, after which
          // blocks of up to 32 MiB come from the heap and stay with the process once freed.
          return bytes <= (std::size_t(1) << 30) && mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) == 1;
#else
          (void)bytes;
          return false;
#endif
        },
        nb::arg("bytes"),
        "glibc: every allocation of `bytes` or more is mapped on its own and unmapped when freed, so that "
        "memory freed goes back to the system. False where the C library has no such setting.");
  m.def("cuda_device",
        [](int ordinal) {
          return std::make_unique<PyDevice>(take(make_cuda_device(ordinal)), nb::device::cuda::value, ordinal);
        },
        nb::arg("ordinal") = 0, "The CUDA GPU `ordinal`; raises UnsupportedError without CUDA.");
}

}  // namespace zoe::python
