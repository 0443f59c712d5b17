// The host stand-in for a GPU: "device" memory is host memory owned here, each stream is a thread that
// runs its work in order, events are flags set when a stream reaches them. It lets every schedule run
// (and be timed) on machines without a GPU; its copies cost CPU time that a GPU's copy engines would not.
#include <algorithm>
#include <random>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>

#include "base/work_queue.h"
#include "simd/dispatch.h"
#include "src/offload/host_device.h"
#include "zoe/aligned_buffer.h"
#include "zoe/device.h"

namespace zoe {
namespace {

const simd::KernelTable& stats_table() {
  static const simd::KernelTable& table = simd::kernel_table(supported_isas().front());
  return table;
}

int simd_elem(DType dtype) { return dtype == DType::f32 ? simd::kF32 : dtype == DType::f16 ? simd::kF16 : simd::kBF16; }

struct EventState {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;

  void set() {
    std::lock_guard lock(mutex);
    done = true;
    done_cv.notify_all();
  }
  bool is_done() {
    std::lock_guard lock(mutex);
    return done;
  }
  void wait() {
    std::unique_lock lock(mutex);
    done_cv.wait(lock, [this] { return done; });
  }
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(const HostDeviceOptions& o)
      : cpu_(o.cpu), chaos_on_(o.chaos_seed != 0 && o.chaos_max_s > 0), chaos_max_s_(o.chaos_max_s), chaos_(o.chaos_seed) {}
  ~HostDevice() override {
    streams_.clear();  // drains and joins every stream before memory goes
  }

  std::string name() const override { return cpu_ ? "cpu" : "host stand-in"; }
  bool host_memory() const override { return cpu_; }

  Result<void*> allocate(std::size_t bytes) override { return allocate_bytes(bytes); }
  void free(void* p) override { free_bytes(p); }
  Result<void*> allocate_host(std::size_t bytes) override { return allocate_bytes(bytes); }
  void free_host(void* p) override { free_bytes(p); }

  Status copy_to_host(void* host, const void* device, std::size_t bytes, Stream stream) override {
    return enqueue(stream, [=] { std::memcpy(host, device, bytes); });
  }
  Status copy_to_device(void* device, const void* host, std::size_t bytes, Stream stream) override {
    return enqueue(stream, [=] { std::memcpy(device, host, bytes); });
  }
  Status copy_on_device(void* dst, const void* src, std::size_t bytes, Stream stream) override {
    return enqueue(stream, [=] { std::memmove(dst, src, bytes); });
  }

  Status fill_zero(void* device, std::size_t bytes, Stream stream) override {
    return enqueue(stream, [=] { std::memset(device, 0, bytes); });
  }

  Status grad_stats(const void* device, DType dtype, std::size_t n, GradStats* out, Stream stream) override {
    if (!dtype_valid(dtype)) return invalid_argument("grad_stats: invalid dtype");
    return enqueue(stream, [=] { *out = host_grad_stats(device, dtype, n); });
  }

  Status simulate_compute(double seconds, Stream stream) override {
    if (!(seconds >= 0)) return invalid_argument("simulate_compute: seconds must be >= 0");
    // Sleeping, not spinning: a GPU computing leaves the host's cores to the optimizer.
    return enqueue(stream, [seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); });
  }

  Result<EventId> record(Stream stream) override {
    auto event = std::make_shared<EventState>();
    EventId id;
    {
      std::lock_guard lock(mutex_);
      id = ++last_event_;
      events_[id] = event;
    }
    if (Status s = enqueue(stream, [event] { event->set(); }); !s.ok()) return s;
    return id;
  }

  Status wait(Stream stream, EventId id) override {
    std::shared_ptr<EventState> event = take(id);
    if (!event) return invalid_argument("wait: unknown event " + std::to_string(id));
    return enqueue(stream, [event] { event->wait(); });
  }

  Status synchronize(EventId id) override {
    std::shared_ptr<EventState> event = take(id);
    if (!event) return invalid_argument("synchronize: unknown event " + std::to_string(id));
    if (!event->is_done()) {  // counted only where the host actually stops
      HostWaitScope counted(*this);
      event->wait();
    }
    return Status::success();
  }

  Status synchronize() override {
    std::shared_ptr<EventState> reached[kStreams];
    bool busy = false;
    for (int s = 0; s < kStreams; ++s) {
      Result<EventId> e = record(static_cast<Stream>(s));
      if (!e.ok()) return e.status();
      reached[s] = take(e.value());
      busy = busy || !reached[s]->is_done();
    }
    std::optional<HostWaitScope> counted;  // one wait, and only where some stream is still busy
    if (busy) counted.emplace(*this);
    for (const auto& event : reached) event->wait();
    return Status::success();
  }

  Status enqueue(Stream stream, std::function<void()> work) {
    const int s = static_cast<int>(stream);
    if (s < 0 || s >= kStreams) return invalid_argument("unknown stream " + std::to_string(s));
    if (chaos_on_) {
      const double delay = chaos_delay();
      work = [delay, inner = std::move(work)] {
        std::this_thread::sleep_for(std::chrono::duration<double>(delay));
        inner();
      };
    }
    WorkQueue* foreign = stream == Stream::compute ? foreign_compute_.load() : nullptr;
    (foreign != nullptr ? foreign : streams_[s].get())->enqueue(std::move(work));
    return Status::success();
  }

  // `handle` is a HostStream's (HostStream::handle()); the caller keeps it alive while zoe may enqueue there.
  Status use_compute_stream(std::optional<std::uintptr_t> handle) override {
    if (handle && *handle == 0) return invalid_argument("use_compute_stream: a host stream's handle is never 0");
    foreign_compute_ = handle ? reinterpret_cast<WorkQueue*>(*handle) : nullptr;
    return Status::success();
  }

 private:
  double chaos_delay() {
    std::lock_guard lock(chaos_mutex_);
    return std::uniform_real_distribution<double>(0, chaos_max_s_)(chaos_);
  }

  const bool cpu_;
  const bool chaos_on_;
  const double chaos_max_s_;
  std::mutex chaos_mutex_;
  std::mt19937_64 chaos_;
  std::atomic<WorkQueue*> foreign_compute_{nullptr};

  // As the CUDA device's pinned memory: huge pages from 2 MiB up (AlignedBuffer::allocate_for_io).
  Result<void*> allocate_bytes(std::size_t bytes) {
    Result<AlignedBuffer> b = AlignedBuffer::allocate_for_io(std::max<std::size_t>(bytes, 1));
    if (!b.ok()) return Status(StatusCode::out_of_memory, "host device: cannot allocate " + std::to_string(bytes) + " bytes");
    void* p = b->data();
    std::lock_guard lock(mutex_);
    allocations_.emplace(p, std::move(b).value());
    return p;
  }

  void free_bytes(void* p) {
    if (p == nullptr) return;
    std::lock_guard lock(mutex_);
    allocations_.erase(p);
  }

  // Events are consumed by their one wait or synchronize.
  std::shared_ptr<EventState> take(EventId id) {
    std::lock_guard lock(mutex_);
    const auto it = events_.find(id);
    if (it == events_.end()) return nullptr;
    std::shared_ptr<EventState> event = std::move(it->second);
    events_.erase(it);
    return event;
  }

  std::mutex mutex_;
  std::map<void*, AlignedBuffer> allocations_;
  std::map<EventId, std::shared_ptr<EventState>> events_;
  EventId last_event_ = 0;
  std::vector<std::unique_ptr<WorkQueue>> streams_ = [] {
    std::vector<std::unique_ptr<WorkQueue>> v;
    for (int i = 0; i < kStreams; ++i) v.push_back(std::make_unique<WorkQueue>());
    return v;
  }();
};

}  // namespace

std::unique_ptr<Device> make_host_device(const HostDeviceOptions& options) {
  return std::make_unique<HostDevice>(options);
}
std::unique_ptr<Device> make_host_device() { return make_host_device(HostDeviceOptions{}); }
std::unique_ptr<Device> make_cpu_device() {
  HostDeviceOptions o;
  o.cpu = true;
  return make_host_device(o);
}

HostStream::HostStream() : queue_(std::make_unique<WorkQueue>()) {}
HostStream::~HostStream() = default;
void HostStream::enqueue(std::function<void()> work) { queue_->enqueue(std::move(work)); }
void HostStream::drain() { queue_->drain(); }
std::uintptr_t HostStream::handle() const { return reinterpret_cast<std::uintptr_t>(queue_.get()); }

GradStats host_grad_stats(const void* grad, DType dtype, std::size_t n) {
  // The CPU's best kernel, as a GPU runs its own: blockwise float sums, exact re-sums where float is not enough.
  GradStats out;
  std::uint64_t non_finite = 0;
  out.sum_sq = stats_table().sum_squares[simd_elem(dtype)](grad, n, &non_finite);
  out.non_finite = non_finite;
  return out;
}

GradStats host_non_finite(const void* grad, DType dtype, std::size_t n) {
  GradStats out;
  std::size_t first = 0;
  out.non_finite = stats_table().count_non_finite[simd_elem(dtype)](grad, n, &first);
  return out;
}

Status enqueue_on_host_device(Device& device, Stream stream, std::function<void()> work) {
  auto* host = dynamic_cast<HostDevice*>(&device);
  if (host == nullptr) return invalid_argument("device " + device.name() + " is not a host stand-in");
  return host->enqueue(stream, std::move(work));
}

}  // namespace zoe
