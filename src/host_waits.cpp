// Device::host_waits: every synchronize() of a device is the host stopping for it. The trainer thread's
// waits are what make a GPU idle; a worker's overlap the device's work and cost only latency.
#include "base/thread_role.h"
#include "zoe/device.h"

namespace zoe {
namespace {

thread_local int t_wait_depth = 0;  // a synchronize() inside another (synchronize() of every stream) counts once

}  // namespace

HostWaits Device::host_waits() const noexcept {
  HostWaits w;
  w.trainer_calls = wait_calls_[0].load(std::memory_order_relaxed);
  w.worker_calls = wait_calls_[1].load(std::memory_order_relaxed);
  w.trainer_s = static_cast<double>(wait_ns_[0].load(std::memory_order_relaxed)) * 1e-9;
  w.worker_s = static_cast<double>(wait_ns_[1].load(std::memory_order_relaxed)) * 1e-9;
  return w;
}

Device::HostWaitScope::HostWaitScope(const Device& device) noexcept
    : device_(t_wait_depth++ == 0 ? &device : nullptr), start_(std::chrono::steady_clock::now()) {}

Device::HostWaitScope::~HostWaitScope() {
  --t_wait_depth;
  if (device_ == nullptr) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
  const int kind = on_worker_thread() ? 1 : 0;
  device_->wait_calls_[kind].fetch_add(1, std::memory_order_relaxed);
  device_->wait_ns_[kind].fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
}

}  // namespace zoe
