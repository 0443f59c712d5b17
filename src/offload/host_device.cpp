// The host stand-in for a GPU: "device" memory is host memory owned here, each stream is a thread that
// runs its work in order, events are flags set when a stream reaches them. It lets every schedule run
// (and be timed) on machines without a GPU; its copies cost CPU time that a GPU's copy engines would not.
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "simd/convert.h"
#include "src/offload/work_queue.h"
#include "zoe/device.h"

namespace zoe {
namespace {

struct EventState {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;

  void set() {
    std::lock_guard lock(mutex);
    done = true;
    done_cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex);
    done_cv.wait(lock, [this] { return done; });
  }
};

template <typename T>
GradStats stats_of(const T* g, std::size_t n, float (*to_float)(T)) {
  GradStats s;
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = to_float(g[i]);
    if (!(x - x == 0.0f)) {  // NaN or Inf
      ++s.non_finite;
      continue;
    }
    sum += static_cast<double>(x) * x;
  }
  s.sum_sq = sum;
  return s;
}

class HostDevice final : public Device {
 public:
  ~HostDevice() override {
    streams_.clear();  // drains and joins every stream before memory goes
    for (void* p : allocations_) std::free(p);
  }

  std::string name() const override { return "host stand-in"; }

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

  Status grad_stats(const void* device, DType dtype, std::size_t n, GradStats* out, Stream stream) override {
    if (!dtype_valid(dtype)) return invalid_argument("grad_stats: invalid dtype");
    return enqueue(stream, [=] {
      switch (dtype) {
        case DType::f32:
          *out = stats_of<float>(static_cast<const float*>(device), n, [](float x) { return x; });
          break;
        case DType::f16:
          *out = stats_of<std::uint16_t>(static_cast<const std::uint16_t*>(device), n, simd::f16_to_f32);
          break;
        case DType::bf16:
          *out = stats_of<std::uint16_t>(static_cast<const std::uint16_t*>(device), n, simd::bf16_to_f32);
          break;
      }
    });
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
    event->wait();
    return Status::success();
  }

  Status synchronize() override {
    for (int s = 0; s < kStreams; ++s) {
      Result<EventId> e = record(static_cast<Stream>(s));
      if (!e.ok()) return e.status();
      if (Status st = synchronize(e.value()); !st.ok()) return st;
    }
    return Status::success();
  }

 private:
  Status enqueue(Stream stream, std::function<void()> work) {
    const int s = static_cast<int>(stream);
    if (s < 0 || s >= kStreams) return invalid_argument("unknown stream " + std::to_string(s));
    streams_[s]->enqueue(std::move(work));
    return Status::success();
  }

  Result<void*> allocate_bytes(std::size_t bytes) {
    void* p = std::aligned_alloc(4096, (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096);
    if (p == nullptr) return Status(StatusCode::out_of_memory, "host device: cannot allocate " + std::to_string(bytes) + " bytes");
    std::lock_guard lock(mutex_);
    allocations_.insert(p);
    return p;
  }

  void free_bytes(void* p) {
    if (p == nullptr) return;
    std::lock_guard lock(mutex_);
    if (allocations_.erase(p) != 0) std::free(p);
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
  std::set<void*> allocations_;
  std::map<EventId, std::shared_ptr<EventState>> events_;
  EventId last_event_ = 0;
  std::vector<std::unique_ptr<WorkQueue>> streams_ = [] {
    std::vector<std::unique_ptr<WorkQueue>> v;
    for (int i = 0; i < kStreams; ++i) v.push_back(std::make_unique<WorkQueue>());
    return v;
  }();
};

}  // namespace

std::unique_ptr<Device> make_host_device() { return std::make_unique<HostDevice>(); }

}  // namespace zoe
