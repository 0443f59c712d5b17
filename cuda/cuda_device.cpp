// CudaDevice: the CUDA runtime behind zoe::Device. Ownership: the device owns its streams, events, scratch,
// result slots and every buffer it handed out and the caller did not free; the destructor waits for its
// streams and releases them all.
#include "cuda/cuda_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <new>
#include <utility>

#include <hwloc.h>
#include <hwloc/cudart.h>

#include "cuda/cuda_kernels.h"
#include "cuda/device.h"

namespace zoe::cuda {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kSlotsPerChunk = 64;
// Below this many tracked events record() does not look for completed ones to recycle.
constexpr std::size_t kSweepMin = 1024;

bool valid_stream(Stream stream) {
  const int i = static_cast<int>(stream);
  return i >= 0 && i < kStreams;
}

std::size_t stream_index(Stream stream) { return static_cast<std::size_t>(stream); }

std::string_view stream_name(Stream stream) {
  switch (stream) {
    case Stream::compute: return "compute stream";
    case Stream::d2h: return "d2h stream";
    case Stream::h2d: return "h2d stream";
  }
  return "invalid stream";
}

StatusCode code_of(cudaError_t err) {
  switch (err) {
    case cudaErrorMemoryAllocation: return StatusCode::out_of_memory;
    case cudaErrorInvalidValue: return StatusCode::invalid_argument;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver: return StatusCode::unsupported;
    default: return StatusCode::internal;
  }
}

std::string describe(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

Status out_of_host_memory(std::string_view what) {
  return Status(StatusCode::out_of_memory, "out of host memory while " + std::string(what));
}

}  // namespace

// Page-locked memory that grad_stats copies its 16-byte result into; the host moves the result to the
// caller's *out and returns the slot once an event after the copy has completed (deliver_stats).
struct StatsSlot {
  StatsResult result;
};

class StatsSlotPool {
 public:
  StatsSlotPool() = default;
  StatsSlotPool(const StatsSlotPool&) = delete;
  StatsSlotPool& operator=(const StatsSlotPool&) = delete;
  // Only after every stream that may still copy into a slot has been synchronized.
  ~StatsSlotPool() {
    for (void* chunk : chunks_) cudaFreeHost(chunk);
  }

  // The device must be current on the calling thread: a new chunk is allocated in its context.
  Result<StatsSlot*> take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        StatsSlot* slot = free_.back();
        free_.pop_back();
        return slot;
      }
    }
    void* chunk = nullptr;
    const cudaError_t err = cudaHostAlloc(&chunk, kSlotsPerChunk * sizeof(StatsSlot), cudaHostAllocPortable);
    if (err != cudaSuccess) {
      return Status(code_of(err), "cudaHostAlloc of grad_stats result slots failed: " + describe(err));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      chunks_.reserve(chunks_.size() + 1);
      free_.reserve(slots_ + kSlotsPerChunk);
    } catch (const std::bad_alloc&) {
      cudaFreeHost(chunk);
      return out_of_host_memory("adding grad_stats result slots");
    }
    chunks_.push_back(chunk);
    slots_ += kSlotsPerChunk;
    auto* slots = static_cast<StatsSlot*>(chunk);
    for (std::size_t i = 1; i < kSlotsPerChunk; ++i) free_.push_back(slots + i);
    return slots;
  }

  // Never allocates (capacity covers every slot).
  void give(StatsSlot* slot) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(slot);
  }

 private:
  std::mutex mutex_;
  std::vector<void*> chunks_;
  std::vector<StatsSlot*> free_;
  std::size_t slots_ = 0;
};

CudaDevice::CudaDevice(int ordinal, std::string name)
    : ordinal_(ordinal), name_(std::move(name)), sweep_at_(kSweepMin) {}

Result<std::unique_ptr<CudaDevice>> CudaDevice::create(int ordinal) {
  Result<DeviceQuery> query = query_devices();
  if (!query.ok()) return query.status();
  if (query->count == 0) return Status(StatusCode::unsupported, "no CUDA device: " + query->reason);
  if (ordinal < 0 || ordinal >= query->count) {
    return invalid_argument("cuda:" + std::to_string(ordinal) + " does not exist: this machine has " +
                            std::to_string(query->count) + " GPU(s), numbered from 0");
  }
  cudaDeviceProp prop{};
  const cudaError_t err = cudaGetDeviceProperties(&prop, ordinal);
  if (err != cudaSuccess) {
    return Status(code_of(err), "cudaGetDeviceProperties(" + std::to_string(ordinal) + ") failed: " + describe(err));
  }
  std::unique_ptr<CudaDevice> device(new (std::nothrow) CudaDevice(ordinal, prop.name));
  if (!device) return out_of_host_memory("creating the CUDA device");
  if (Status st = device->init(); !st.ok()) return st;
  return Result<std::unique_ptr<CudaDevice>>(std::move(device));
}

Status CudaDevice::init() {
  if (Status st = make_current(); !st.ok()) return st;
  for (int i = 0; i < kStreams; ++i) {
    const auto stream = static_cast<Stream>(i);
    Status st = check(cudaStreamCreateWithFlags(&streams_[stream_index(stream)], cudaStreamNonBlocking),
                      "cudaStreamCreateWithFlags", stream_name(stream));
    if (!st.ok()) return st;
  }
  void* scratch = nullptr;
  if (Status st = check(cudaMalloc(&scratch, kStreams * sizeof(StatsScratch)), "cudaMalloc", "grad_stats scratch");
      !st.ok()) {
    return st;
  }
  scratch_ = static_cast<StatsScratch*>(scratch);
  stats_slots_.reset(new (std::nothrow) StatsSlotPool());
  if (!stats_slots_) return out_of_host_memory("creating the grad_stats result slots");
  // One chunk now, so that the first grad_stats calls do not pay for cudaHostAlloc.
  Result<StatsSlot*> slot = stats_slots_->take();
  if (!slot.ok()) return slot.status();
  stats_slots_->give(*slot);
  // Placement is an optimisation: without a topology or the GPU's locality, buffers are placed by first touch.
  if (hwloc_topology_init(&topology_) == 0 && hwloc_topology_load(topology_) == 0) {
    local_cpus_ = hwloc_bitmap_alloc();
    if (local_cpus_ != nullptr && hwloc_cudart_get_device_cpuset(topology_, ordinal_, local_cpus_) != 0) {
      hwloc_bitmap_zero(local_cpus_);
    }
  }
  return {};
}

// Errors are ignored here: nothing can report them, and at process exit the runtime may already be unloading.
CudaDevice::~CudaDevice() {
  (void)make_current();
  // Pending host functions point into stats_slots_; pending copies and kernels into the memory freed below.
  for (cudaStream_t stream : streams_) {
    if (stream != nullptr) cudaStreamSynchronize(stream);
  }
  for (const auto& entry : live_events_) cudaEventDestroy(entry.second.event);
  for (cudaEvent_t event : free_events_) cudaEventDestroy(event);
  for (void* ptr : device_allocations_) cudaFree(ptr);
  for (const auto& [ptr, length] : host_allocations_) {
    cudaHostUnregister(ptr);
    munmap(ptr, length);
  }
  if (scratch_ != nullptr) cudaFree(scratch_);
  stats_slots_.reset();
  for (cudaStream_t stream : streams_) {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  if (local_cpus_ != nullptr) hwloc_bitmap_free(local_cpus_);
  if (topology_ != nullptr) hwloc_topology_destroy(topology_);
}

std::string CudaDevice::name() const { return "cuda:" + std::to_string(ordinal_) + " (" + name_ + ")"; }

cudaStream_t CudaDevice::cuda_stream(Stream stream) const {
  return valid_stream(stream) ? stream_for(stream) : nullptr;
}

Status CudaDevice::make_current() const {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == ordinal_) return {};
  return check(cudaSetDevice(ordinal_), "cudaSetDevice", "making the device current");
}

Status CudaDevice::check(cudaError_t err, std::string_view call, std::string_view context) const {
  if (err == cudaSuccess) return {};
  return Status(code_of(err), "cuda:" + std::to_string(ordinal_) + ": " + std::string(call) + " (" +
                                  std::string(context) + ") failed: " + describe(err));
}

Status CudaDevice::check_stream(Stream stream, std::string_view call) const {
  if (valid_stream(stream)) return {};
  return invalid_argument(std::string(call) + ": stream " + std::to_string(static_cast<int>(stream)) +
                          " is not one of compute (0), d2h (1), h2d (2)");
}

Result<void*> CudaDevice::allocate(std::size_t bytes) {
  if (bytes == 0) return static_cast<void*>(nullptr);
  if (Status st = make_current(); !st.ok()) return st;
  void* ptr = nullptr;
  if (Status st = check(cudaMalloc(&ptr, bytes), "cudaMalloc", std::to_string(bytes) + " bytes"); !st.ok()) {
    return st;
  }
  std::lock_guard<std::mutex> lock(alloc_mutex_);
  try {
    device_allocations_.insert(ptr);
  } catch (const std::bad_alloc&) {
    cudaFree(ptr);
    return out_of_host_memory("tracking a device allocation");
  }
  return ptr;
}

void CudaDevice::free(void* device_ptr) {
  if (device_ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(alloc_mutex_);
    if (device_allocations_.erase(device_ptr) == 0) return;
  }
  (void)make_current();
  cudaFree(device_ptr);
}

Result<void*> CudaDevice::allocate_host(std::size_t bytes) {
  if (bytes == 0) return static_cast<void*>(nullptr);
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  if (bytes > SIZE_MAX - 2 * kHugePage) {
    return invalid_argument("allocate_host: " + std::to_string(bytes) + " bytes is more than any machine has");
  }
  if (Status st = make_current(); !st.ok()) return st;
  const std::size_t length = (bytes + page - 1) / page * page;
  const bool huge = length >= kHugePage;
  // From 2 MiB up, map one huge page more and trim to a 2 MiB-aligned start: transparent huge pages back
  // only aligned 2 MiB ranges. The length itself stays page-rounded, never rounded to a power of two.
  const std::size_t mapped = huge ? length + kHugePage : length;
  void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return Status(StatusCode::out_of_memory, "allocate_host: mmap of " + std::to_string(mapped) + " bytes failed",
                  errno);
  }
  auto* base = static_cast<char*>(raw);
  if (huge) {
    const std::size_t lead = (kHugePage - reinterpret_cast<std::uintptr_t>(raw) % kHugePage) % kHugePage;
    if (lead > 0) munmap(base, lead);
    const std::size_t trail = mapped - lead - length;
    if (trail > 0) munmap(base + lead + length, trail);
    base += lead;
    // Advice only: with THP off the buffer is as correct, on 4 KiB pages.
    madvise(base, length, MADV_HUGEPAGE);
  }
  // Before the pages exist: on the GPU's NUMA node (advice too; a single-node machine has nothing to choose).
  if (local_cpus_ != nullptr && !hwloc_bitmap_iszero(local_cpus_) && !hwloc_bitmap_isfull(local_cpus_)) {
    (void)hwloc_set_area_membind(topology_, base, length, local_cpus_, HWLOC_MEMBIND_BIND, 0);
  }
  // Registering faults every page in (after the advice, so as huge pages where the kernel gives them) and pins it.
  Status st = check(cudaHostRegister(base, length, cudaHostRegisterPortable), "cudaHostRegister",
                    std::to_string(length) + " bytes");
  if (!st.ok()) {
    munmap(base, length);
    return st;
  }
  std::lock_guard<std::mutex> lock(alloc_mutex_);
  try {
    host_allocations_.emplace(base, length);
  } catch (const std::bad_alloc&) {
    cudaHostUnregister(base);
    munmap(base, length);
    return out_of_host_memory("tracking a host allocation");
  }
  return static_cast<void*>(base);
}

void CudaDevice::free_host(void* host_ptr) {
  if (host_ptr == nullptr) return;
  std::size_t length = 0;
  {
    std::lock_guard<std::mutex> lock(alloc_mutex_);
    const auto it = host_allocations_.find(host_ptr);
    if (it == host_allocations_.end()) return;
    length = it->second;
    host_allocations_.erase(it);
  }
  (void)make_current();
  cudaHostUnregister(host_ptr);
  munmap(host_ptr, length);
}

Status CudaDevice::copy_to_host(void* host, const void* device, std::size_t bytes, Stream stream) {
  if (Status st = check_stream(stream, "copy_to_host"); !st.ok()) return st;
  if (bytes == 0) return {};
  if (host == nullptr || device == nullptr) {
    return invalid_argument("copy_to_host: null pointer for " + std::to_string(bytes) + " bytes");
  }
  if (Status st = make_current(); !st.ok()) return st;
  return check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_for(stream)),
               "cudaMemcpyAsync", "copy_to_host on the " + std::string(stream_name(stream)));
}

Status CudaDevice::copy_to_device(void* device, const void* host, std::size_t bytes, Stream stream) {
  if (Status st = check_stream(stream, "copy_to_device"); !st.ok()) return st;
  if (bytes == 0) return {};
  if (host == nullptr || device == nullptr) {
    return invalid_argument("copy_to_device: null pointer for " + std::to_string(bytes) + " bytes");
  }
  if (Status st = make_current(); !st.ok()) return st;
  return check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_for(stream)),
               "cudaMemcpyAsync", "copy_to_device on the " + std::string(stream_name(stream)));
}

Status CudaDevice::copy_on_device(void* dst, const void* src, std::size_t bytes, Stream stream) {
  if (Status st = check_stream(stream, "copy_on_device"); !st.ok()) return st;
  if (bytes == 0) return {};
  if (dst == nullptr || src == nullptr) {
    return invalid_argument("copy_on_device: null pointer for " + std::to_string(bytes) + " bytes");
  }
  if (Status st = make_current(); !st.ok()) return st;
  return check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_for(stream)),
               "cudaMemcpyAsync", "copy_on_device on the " + std::string(stream_name(stream)));
}

Status CudaDevice::fill_zero(void* device, std::size_t bytes, Stream stream) {
  if (Status st = check_stream(stream, "fill_zero"); !st.ok()) return st;
  if (bytes == 0) return {};
  if (device == nullptr) return invalid_argument("fill_zero: null pointer for " + std::to_string(bytes) + " bytes");
  if (Status st = make_current(); !st.ok()) return st;
  return check(cudaMemsetAsync(device, 0, bytes, stream_for(stream)), "cudaMemsetAsync",
               "fill_zero on the " + std::string(stream_name(stream)));
}

Status CudaDevice::grad_stats(const void* device, DType dtype, std::size_t n, GradStats* out, Stream stream) {
  if (Status st = check_stream(stream, "grad_stats"); !st.ok()) return st;
  if (!dtype_valid(dtype)) return invalid_argument("grad_stats: invalid dtype " + std::to_string(int(dtype)));
  if (out == nullptr) return invalid_argument("grad_stats: out is null");
  if (n > 0 && device == nullptr) return invalid_argument("grad_stats: null gradients for n > 0");
  if (reinterpret_cast<std::uintptr_t>(device) % dtype_size(dtype) != 0) {
    return invalid_argument("grad_stats: " + std::string(dtype_name(dtype)) +
                            " gradients at an address not aligned to their element size");
  }
  if (Status st = make_current(); !st.ok()) return st;
  Result<StatsSlot*> taken = stats_slots_->take();
  if (!taken.ok()) return taken.status();
  StatsSlot* slot = *taken;
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    try {
      pending_stats_.reserve(pending_stats_.size() + 1);
    } catch (const std::bad_alloc&) {
      stats_slots_->give(slot);
      return out_of_host_memory("queueing a grad_stats result");
    }
  }

  const std::size_t i = stream_index(stream);
  const std::string context = "grad_stats on the " + std::string(stream_name(stream));
  StatsScratch* scratch = scratch_ + i;
  std::lock_guard<std::mutex> lock(stats_mutex_[i]);
  if (Status st = check(launch_grad_stats(device, dtype, n, scratch, stream_for(stream)), "kernel launch", context);
      !st.ok()) {
    stats_slots_->give(slot);
    return st;
  }
  // On failure the slot is not returned: the copy may still write it. It is freed with the pool.
  if (Status st = check(cudaMemcpyAsync(&slot->result, &scratch->result, sizeof(StatsResult),
                                        cudaMemcpyDeviceToHost, stream_for(stream)),
                        "cudaMemcpyAsync", context);
      !st.ok()) {
    return st;
  }
  std::lock_guard<std::mutex> pending(pending_mutex_);
  pending_stats_.push_back(PendingStats{i, ++stats_calls_[i], slot, out});  // capacity reserved above
  return {};
}

void CudaDevice::deliver_stats(std::size_t stream, std::uint64_t seq) {
  std::lock_guard<std::mutex> lock(pending_mutex_);
  auto kept = pending_stats_.begin();
  for (PendingStats& p : pending_stats_) {
    if (p.stream == stream && p.seq <= seq) {
      p.out->sum_sq = p.slot->result.sum_sq;
      p.out->non_finite = p.slot->result.non_finite;
      stats_slots_->give(p.slot);
    } else {
      *kept++ = p;
    }
  }
  pending_stats_.erase(kept, pending_stats_.end());
}

Status CudaDevice::simulate_compute(double seconds, Stream stream) {
  if (Status st = check_stream(stream, "simulate_compute"); !st.ok()) return st;
  // 1.8e10 s keeps the nanoseconds inside 64 bits; any real benchmark asks for far less.
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 1.8e10) {
    return invalid_argument("simulate_compute: seconds must be in [0, 1.8e10], got " + std::to_string(seconds));
  }
  const auto ns = static_cast<std::uint64_t>(std::ceil(seconds * 1e9));
  if (ns == 0) return {};
  if (Status st = make_current(); !st.ok()) return st;
  return check(launch_spin(ns, stream_for(stream)), "spin kernel launch",
               "simulate_compute on the " + std::string(stream_name(stream)));
}

void CudaDevice::recycle_event(cudaEvent_t event) noexcept {
  try {
    free_events_.push_back(event);
  } catch (const std::bad_alloc&) {
    cudaEventDestroy(event);
  }
}

Status CudaDevice::sweep_completed_events() {
  for (auto it = live_events_.begin(); it != live_events_.end();) {
    if (it->second.synchronizing > 0) {
      ++it;
      continue;
    }
    const cudaError_t err = cudaEventQuery(it->second.event);
    if (err == cudaErrorNotReady) {
      ++it;
      continue;
    }
    if (err != cudaSuccess) return check(err, "cudaEventQuery", "recycling completed events");
    deliver_stats(it->second.stream, it->second.stats_seen);
    recycle_event(it->second.event);
    it = live_events_.erase(it);
  }
  // Doubling keeps the sweeps' cost linear in the number of records when many events are pending.
  sweep_at_ = std::max(kSweepMin, 2 * live_events_.size());
  return {};
}

Result<EventId> CudaDevice::record(Stream stream) {
  if (Status st = check_stream(stream, "record"); !st.ok()) return st;
  if (Status st = make_current(); !st.ok()) return st;
  std::lock_guard<std::mutex> lock(event_mutex_);
  if (live_events_.size() >= sweep_at_) {
    if (Status st = sweep_completed_events(); !st.ok()) return st;
  }
  cudaEvent_t event = nullptr;
  if (free_events_.empty()) {
    Status st = check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags", "record");
    if (!st.ok()) return st;
  } else {
    event = free_events_.back();
    free_events_.pop_back();
  }
  const std::size_t i = stream_index(stream);
  std::uint64_t stats_seen;
  {
    std::lock_guard<std::mutex> order(stats_mutex_[i]);
    if (Status st = check(cudaEventRecord(event, stream_for(stream)), "cudaEventRecord", stream_name(stream));
        !st.ok()) {
      recycle_event(event);
      return st;
    }
    stats_seen = stats_calls_[i];
  }
  try {
    live_events_.emplace(next_event_, LiveEvent{event, 0, false, i, stats_seen});
  } catch (const std::bad_alloc&) {
    cudaEventDestroy(event);  // released once the recorded work completes
    return out_of_host_memory("tracking an event");
  }
  return next_event_++;
}

Status CudaDevice::wait(Stream stream, EventId event) {
  if (Status st = check_stream(stream, "wait"); !st.ok()) return st;
  if (Status st = make_current(); !st.ok()) return st;
  std::lock_guard<std::mutex> lock(event_mutex_);
  if (event == 0 || event >= next_event_) {
    return invalid_argument("wait: event " + std::to_string(event) + " was never recorded on " + name());
  }
  const auto it = live_events_.find(event);
  if (it == live_events_.end() || it->second.released) return {};  // complete: nothing to wait for
  // Under the lock: a recycled cudaEvent_t is recorded again for a later id, and the wait must capture this one.
  return check(cudaStreamWaitEvent(stream_for(stream), it->second.event, 0), "cudaStreamWaitEvent",
               stream_name(stream));
}

Status CudaDevice::synchronize(EventId event) {
  cudaEvent_t handle = nullptr;
  std::size_t stream = 0;
  std::uint64_t stats_seen = 0;
  {
    std::lock_guard<std::mutex> lock(event_mutex_);
    if (event == 0 || event >= next_event_) {
      return invalid_argument("synchronize: event " + std::to_string(event) + " was never recorded on " + name());
    }
    const auto it = live_events_.find(event);
    if (it == live_events_.end() || it->second.released) return {};
    ++it->second.synchronizing;
    handle = it->second.event;
    stream = it->second.stream;
    stats_seen = it->second.stats_seen;
  }
  // Outside the lock, so that other threads record and wait meanwhile; `synchronizing` keeps the event
  // from being recycled under us.
  // Counted only where the host actually stops: an event already complete costs nothing.
  cudaError_t err = cudaEventQuery(handle);
  if (err == cudaErrorNotReady) {
    HostWaitScope counted(*this);
    err = cudaEventSynchronize(handle);
  }
  {
    std::lock_guard<std::mutex> lock(event_mutex_);
    const auto it = live_events_.find(event);
    LiveEvent& live = it->second;
    --live.synchronizing;
    if (err == cudaSuccess) live.released = true;
    if (live.released && live.synchronizing == 0) {
      recycle_event(live.event);
      live_events_.erase(it);
    }
  }
  if (err == cudaSuccess) deliver_stats(stream, stats_seen);
  return check(err, "cudaEventSynchronize", "event " + std::to_string(event));
}

Status CudaDevice::synchronize() {
  if (Status st = make_current(); !st.ok()) return st;
  std::array<std::uint64_t, kStreams> stats_seen{};
  for (std::size_t i = 0; i < kStreams; ++i) {
    std::lock_guard<std::mutex> lock(stats_mutex_[i]);
    stats_seen[i] = stats_calls_[i];
  }
  std::optional<HostWaitScope> counted;  // only where some stream is still busy
  for (int i = 0; i < kStreams; ++i) {
    const auto stream = static_cast<Stream>(i);
    cudaStream_t handle = stream_for(stream);
    cudaError_t err = cudaStreamQuery(handle);
    if (err == cudaErrorNotReady) {
      if (!counted) counted.emplace(*this);
      err = cudaStreamSynchronize(handle);
    }
    if (Status st = check(err, "cudaStreamSynchronize", stream_name(stream)); !st.ok()) return st;
  }
  for (std::size_t i = 0; i < kStreams; ++i) deliver_stats(i, stats_seen[i]);
  return {};
}

cudaStream_t CudaDevice::stream_for(Stream stream) const {
  if (stream == Stream::compute) {
    std::lock_guard<std::mutex> lock(compute_mutex_);
    if (foreign_compute_) return *foreign_compute_;
  }
  return streams_[stream_index(stream)];
}

Status CudaDevice::use_compute_stream(std::optional<std::uintptr_t> handle) {
  std::lock_guard<std::mutex> lock(compute_mutex_);
  if (handle) {
    foreign_compute_ = reinterpret_cast<cudaStream_t>(*handle);
  } else {
    foreign_compute_.reset();
  }
  return {};
}

}  // namespace zoe::cuda

namespace zoe {

Result<std::unique_ptr<Device>> make_cuda_device(int ordinal) {
  Result<std::unique_ptr<cuda::CudaDevice>> device = cuda::CudaDevice::create(ordinal);
  if (!device.ok()) return device.status();
  return std::unique_ptr<Device>(std::move(device).value());
}

}  // namespace zoe
