// The device the optimizer exchanges gradients and weights with. Two implementations: CUDA (cuda/), and a
// host stand-in (src/offload/host_device.cpp) that behaves like a device — its own memory, asynchronous
// in-order streams, events, a settable compute time — so that every schedule runs on machines without a GPU.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "zoe/dtype.h"
#include "zoe/status.h"

namespace zoe {

// Work on one stream runs in the order it was enqueued; different streams run concurrently.
enum class Stream : int { compute = 0, d2h = 1, h2d = 2 };
constexpr int kStreams = 3;

// Recorded on a stream: complete once everything enqueued on that stream before it has run. Each event is
// consumed by exactly one wait() or synchronize(); after that its id is unknown to the device.
using EventId = std::uint64_t;

struct GradStats {
  double sum_sq = 0;            // sum of squares of the gradient values as stored (before any unscale)
  std::uint64_t non_finite = 0; // NaN/Inf values
};

// Every time the host stops for the device (synchronize), counted by whose thread stopped: the trainer's
// (any thread that is not zoe's own) or zoe's worker (a thread that called mark_worker_thread()).
struct HostWaits {
  std::uint64_t trainer_calls = 0, worker_calls = 0;
  double trainer_s = 0, worker_s = 0;
};

// Marks the calling thread as one of zoe's own (the background step, a loader): its host waits are the
// worker's, which the trainer does not see.
void mark_worker_thread() noexcept;
bool on_worker_thread() noexcept;

// Implementations are thread-safe: a trainer thread and the optimizer's worker call them concurrently.
class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  // True when device memory is this process's own host memory (the CPU as the device): the optimizer then
  // reads gradients and writes weights in place instead of copying them through staging.
  virtual bool host_memory() const { return false; }

  // Device memory and host memory the device copies from/to asynchronously (page-locked on CUDA).
  virtual Result<void*> allocate(std::size_t bytes) = 0;
  virtual void free(void* device_ptr) = 0;
  virtual Result<void*> allocate_host(std::size_t bytes) = 0;
  virtual void free_host(void* host_ptr) = 0;

  // Asynchronous, in order on `stream`. Buffers must stay valid until an event recorded after them completes.
  virtual Status copy_to_host(void* host, const void* device, std::size_t bytes, Stream stream) = 0;
  virtual Status copy_to_device(void* device, const void* host, std::size_t bytes, Stream stream) = 0;
  virtual Status copy_on_device(void* dst, const void* src, std::size_t bytes, Stream stream) = 0;
  // Sets `bytes` of device memory to zero (gradient buffers between micro-batches).
  virtual Status fill_zero(void* device, std::size_t bytes, Stream stream) = 0;
  // Fills *out (host memory) with the sum of squares and NaN/Inf count of n gradients in device memory.
  virtual Status grad_stats(const void* device, DType dtype, std::size_t n, GradStats* out, Stream stream) = 0;
  // Keeps `stream` busy for `seconds`: the forward/backward of benchmarks and tests.
  virtual Status simulate_compute(double seconds, Stream stream) = 0;

  virtual Result<EventId> record(Stream stream) = 0;
  virtual Status wait(Stream stream, EventId event) = 0;  // later work on `stream` starts after `event`
  virtual Status synchronize(EventId event) = 0;           // the host waits for `event`
  virtual Status synchronize() = 0;                        // the host waits for every stream

  // Stream::compute as a stream zoe does not own: on CUDA a cudaStream_t (torch's current stream, whose
  // handle may be 0, the legacy default stream), so that zoe's events on Stream::compute order its copies
  // against the caller's kernels with no host wait. Later calls enqueue there; nullopt returns to the
  // device's own. The caller keeps the stream alive while zoe may enqueue on it.
  virtual Status use_compute_stream(std::optional<std::uintptr_t> handle) {
    (void)handle;
    return Status(StatusCode::unsupported, name() + " has no foreign streams");
  }

  // Every host wait since the device was made (synchronize, both forms).
  HostWaits host_waits() const noexcept;

 protected:
  // Held by an implementation's synchronize() for as long as the host waits; nested waits count once.
  class HostWaitScope {
   public:
    explicit HostWaitScope(const Device& device) noexcept;
    ~HostWaitScope();
    HostWaitScope(const HostWaitScope&) = delete;
    HostWaitScope& operator=(const HostWaitScope&) = delete;

   private:
    const Device* device_;  // null when nested in another wait of this thread
    std::chrono::steady_clock::time_point start_;
  };

 private:
  mutable std::atomic<std::uint64_t> wait_calls_[2] = {0, 0};       // [trainer, worker]
  mutable std::atomic<std::uint64_t> wait_ns_[2] = {0, 0};
};

// The host stand-in: `device` memory is ordinary host memory that the optimizer must only touch through
// this interface; each stream is a thread.
std::unique_ptr<Device> make_host_device();
// The CPU itself as the device, for models whose weights live in host memory (a CPU-only PyTorch model):
// the host stand-in's streams and events, with host_memory() true.
std::unique_ptr<Device> make_cpu_device();

// The GPU `ordinal` through CUDA; unsupported when zoe was built without CUDA or no GPU is usable.
Result<std::unique_ptr<Device>> make_cuda_device(int ordinal);

}  // namespace zoe
