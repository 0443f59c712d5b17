// zoe::Device on an NVIDIA GPU through the CUDA runtime: three non-blocking streams, pooled events,
// page-locked host buffers, and the grad_stats and simulate_compute kernels.
//
// Thread-safe: the engine's pipeline stages call it from several threads at once. Every call first makes
// the GPU `ordinal` the calling thread's current device (as torch.cuda.set_device would) and leaves it so:
// restoring a previous device that was never used would create a CUDA context on it.
//
// Events: ids grow from 1 and are never reused. An id that was recorded and is no longer tracked has
// completed (it was synchronized, or found complete and recycled), so wait() on it is a no-op and
// synchronize() on it returns at once; an id never handed out is invalid_argument.
//
// grad_stats: the statistics are copied into a page-locked slot on the stream itself (no host callback
// holds the stream); *out is filled from it when the host learns that an event recorded on the same stream
// after the call has completed — synchronize(event) returned, or synchronize() — and must stay valid until
// then.
#pragma once

#include "cuda/private.h"

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "zoe/device.h"

struct hwloc_topology;  // hwloc's, so that this header does not need hwloc.h
struct hwloc_bitmap_s;

namespace zoe::cuda {

struct StatsScratch;
struct StatsSlot;
class StatsSlotPool;

class CudaDevice final : public Device {
 public:
  // unsupported when no GPU or no driver is usable; invalid_argument for an ordinal that does not exist.
  static Result<std::unique_ptr<CudaDevice>> create(int ordinal);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  std::string name() const override;  // "cuda:0 (NVIDIA H100 80GB HBM3)"

  // 0 bytes gives nullptr; free(nullptr) and free_host(nullptr) do nothing, as do pointers these did not
  // return. Host buffers are page-locked and exactly `bytes` rounded up to the page (2 MiB-aligned, with
  // transparent huge pages requested, from 2 MiB up).
  Result<void*> allocate(std::size_t bytes) override;
  void free(void* device_ptr) override;
  Result<void*> allocate_host(std::size_t bytes) override;
  void free_host(void* host_ptr) override;

  Status copy_to_host(void* host, const void* device, std::size_t bytes, Stream stream) override;
  Status copy_to_device(void* device, const void* host, std::size_t bytes, Stream stream) override;
  Status copy_on_device(void* dst, const void* src, std::size_t bytes, Stream stream) override;
  Status fill_zero(void* device, std::size_t bytes, Stream stream) override;
  // `device` must be aligned to the element size of `dtype`. The result's bits depend only on the values, n
  // and the address modulo 16, not on the GPU or the run.
  Status grad_stats(const void* device, DType dtype, std::size_t n, GradStats* out, Stream stream) override;
  Status simulate_compute(double seconds, Stream stream) override;

  Result<EventId> record(Stream stream) override;
  Status wait(Stream stream, EventId event) override;
  Status synchronize(EventId event) override;
  Status synchronize() override;  // this device's three streams, not the whole GPU
  // A cudaStream_t (0: the legacy default stream) as Stream::compute; nullopt: the device's own again.
  Status use_compute_stream(std::optional<std::uintptr_t> handle) override;

  int ordinal() const { return ordinal_; }
  // The CUDA stream behind `stream` (nullptr for a value outside Stream), for collectives that enqueue on
  // this device's streams. Owned by the device, except a foreign compute stream (use_compute_stream).
  cudaStream_t cuda_stream(Stream stream) const;
  // Makes this GPU the calling thread's current device.
  Status make_current() const;

 private:
  struct LiveEvent {
    cudaEvent_t event;
    int synchronizing;  // threads inside cudaEventSynchronize on it: it is recycled only once this is 0
    bool released;      // synchronized once: complete, and recycled when `synchronizing` reaches 0
    std::size_t stream;    // where it was recorded, and how many grad_stats calls that stream had seen then
    std::uint64_t stats_seen;
  };
  // A grad_stats result on its way to the caller's GradStats.
  struct PendingStats {
    std::size_t stream;
    std::uint64_t seq;  // the stream's grad_stats calls before and with this one
    StatsSlot* slot;
    GradStats* out;
  };
  // Fills *out of every grad_stats call on `stream` numbered up to `seq`: an event after them has completed.
  void deliver_stats(std::size_t stream, std::uint64_t seq);

  CudaDevice(int ordinal, std::string name);
  Status init();
  Status check(cudaError_t err, std::string_view call, std::string_view context) const;
  Status check_stream(Stream stream, std::string_view call) const;
  Status sweep_completed_events();  // event_mutex_ held
  void recycle_event(cudaEvent_t event) noexcept;  // event_mutex_ held

  cudaStream_t stream_for(Stream stream) const;  // `stream` valid

  int ordinal_;
  std::string name_;
  std::array<cudaStream_t, kStreams> streams_{};
  mutable std::mutex compute_mutex_;
  std::optional<cudaStream_t> foreign_compute_;  // Stream::compute when set (use_compute_stream)
  StatsScratch* scratch_ = nullptr;  // kStreams consecutive scratches in device memory, one per stream
  // Held while grad_stats enqueues its kernels and copy, so that two threads' calls on one stream cannot
  // interleave on that stream's scratch.
  // Also held by record(), so that an event and the grad_stats calls around it are numbered in stream order.
  std::array<std::mutex, kStreams> stats_mutex_;
  std::array<std::uint64_t, kStreams> stats_calls_{};  // grad_stats calls per stream, under stats_mutex_
  std::unique_ptr<StatsSlotPool> stats_slots_;
  std::mutex pending_mutex_;
  std::vector<PendingStats> pending_stats_;

  std::mutex event_mutex_;
  std::unordered_map<EventId, LiveEvent> live_events_;
  std::vector<cudaEvent_t> free_events_;
  EventId next_event_ = 1;
  std::size_t sweep_at_;  // live_events_ size at which record() next recycles completed events

  // The CPUs nearest the GPU (hwloc): page-locked host buffers are bound to their NUMA node, so DMA and the
  // CPU step both stay local. Empty when hwloc cannot tell, and then the first touch places the pages.
  hwloc_topology* topology_ = nullptr;
  hwloc_bitmap_s* local_cpus_ = nullptr;

  std::mutex alloc_mutex_;
  std::unordered_set<void*> device_allocations_;
  std::unordered_map<void*, std::size_t> host_allocations_;  // address -> mapped (page-rounded) length
};

}  // namespace zoe::cuda
