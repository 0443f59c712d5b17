// The host stand-in device beyond the Device interface: its options (the CPU itself, chaos for tests), a
// stream zoe does not own on the host (what torch's current stream is on a GPU), and work run in order on
// one of its streams. The Python package builds its host devices here; tests and benchmarks use them as a
// GPU that is always there.
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

}  // namespace zoe
