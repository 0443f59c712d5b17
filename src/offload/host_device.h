// What the host stand-in device offers inside zoe beyond the Device interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "zoe/device.h"

namespace zoe {

class WorkQueue;

// A stream zoe does not own, on the host: what torch's current stream is to zoe on a GPU. Its work runs in
// order on its own thread; handle() is what Device::use_compute_stream takes on a host stand-in.
class HostStream {
 public:
  HostStream();
  ~HostStream();  // runs what is queued first
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;
  void enqueue(std::function<void()> work);
  void drain();  // returns once everything enqueued before has run
  std::uintptr_t handle() const;

 private:
  std::unique_ptr<WorkQueue> queue_;
};

struct HostDeviceOptions {
  bool cpu = false;  // make_cpu_device's: device memory is the process's own
  // Chaos: with a seed other than 0, every piece of work the device runs (copies, kernels, events, waits, on
  // its own streams and on a foreign compute stream) first sleeps a random time up to chaos_max_s, so that
  // tests see the orders a GPU may run concurrent streams in.
  std::uint64_t chaos_seed = 0;
  double chaos_max_s = 5e-4;
};
std::unique_ptr<Device> make_host_device(const HostDeviceOptions& options);

// Runs `work` on `stream` of a host stand-in device, in order with the stream's other work (in-process
// collectives run this way); invalid_argument for any other device.
Status enqueue_on_host_device(Device& device, Stream stream, std::function<void()> work);

// The statistics a host stand-in's grad_stats() computes, on the calling thread: the same kernel wherever
// the gradients are in host memory, so that every schedule reaches the same decision bit for bit.
GradStats host_grad_stats(const void* grad, DType dtype, std::size_t n);
// Only the count of NaN/Inf values (sum_sq stays 0), in one read of the gradients: all that the refusal of
// non-finite gradients needs when nothing asks for the norm.
GradStats host_non_finite(const void* grad, DType dtype, std::size_t n);

}  // namespace zoe
