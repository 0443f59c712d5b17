#include "src/arena.h"

#include <hwloc.h>
#include <sched.h>

#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <atomic>
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace zoe {
namespace {

thread_local bool keeps_core = false;  // keep_core_binding_on_this_thread()

Result<int> threads_from_env(int requested) {
  const char* env = std::getenv("ZOE_THREADS");
  if (env == nullptr || *env == '\0') return requested;
  const std::string_view text(env);
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 1) {
    return invalid_argument("ZOE_THREADS=" + std::string(text) + " is not a positive integer");
  }
  return std::min(requested, value);
}

struct HwlocTopology {
  hwloc_topology_t topology = nullptr;
  HwlocTopology() {
    if (hwloc_topology_init(&topology) != 0) {
      topology = nullptr;
      return;
    }
    if (hwloc_topology_load(topology) != 0) {
      hwloc_topology_destroy(topology);
      topology = nullptr;
    }
  }
  ~HwlocTopology() {
    if (topology != nullptr) hwloc_topology_destroy(topology);
  }
  HwlocTopology(const HwlocTopology&) = delete;
  HwlocTopology& operator=(const HwlocTopology&) = delete;
};

// Binds each thread entering the arena to one core of the process's allowed set, by arena slot, so a
// thread keeps its core (and its NUMA node's memory) across steps. A trainer's thread that calls in gets its
// original binding back when it leaves the arena; a thread marked to keep its core keeps it.
class PinningObserver final : public tbb::task_scheduler_observer {
 public:
  PinningObserver(tbb::task_arena& arena, hwloc_topology_t topology)
      : tbb::task_scheduler_observer(arena), topology_(topology) {
    hwloc_bitmap_t allowed = hwloc_bitmap_alloc();
    if (hwloc_get_cpubind(topology_, allowed, HWLOC_CPUBIND_PROCESS) != 0) {
      hwloc_bitmap_copy(allowed, hwloc_topology_get_allowed_cpuset(topology_));
    }
    cores_ = hwloc_bitmap_dup(allowed);
    hwloc_bitmap_free(allowed);
    observe(true);
  }
  ~PinningObserver() override {
    observe(false);
    hwloc_bitmap_free(cores_);
  }

  void on_scheduler_entry(bool is_worker) override {
    const int slot = tbb::this_task_arena::current_thread_index();
    const int count = hwloc_bitmap_weight(cores_);
    if (slot < 0 || count <= 0) return;
    int index = -1;
    for (int i = 0; i <= slot % count; ++i) index = hwloc_bitmap_next(cores_, index);
    // A thread that keeps its binding (keep_core_binding_on_this_thread: the overlap schedule's worker,
    // which enters once per piece) is bound once: binding and undoing would cost two sched_setaffinity
    // calls and a migration per entry.
    const bool own = !is_worker && keeps_core;
    if (own && kept_core_ == index) return;
    if (!is_worker && !own) {
      hwloc_bitmap_t saved = hwloc_bitmap_alloc();
      if (hwloc_get_cpubind(topology_, saved, HWLOC_CPUBIND_THREAD) != 0) {
        hwloc_bitmap_free(saved);
        saved = nullptr;  // unknown: left as the arena binds it
      }
      saved_.push_back(saved);
    }
    hwloc_bitmap_t one = hwloc_bitmap_alloc();
    hwloc_bitmap_only(one, static_cast<unsigned>(index));
    // Best effort: a refusal only costs locality.
    const bool bound = hwloc_set_cpubind(topology_, one, HWLOC_CPUBIND_THREAD) == 0;
    hwloc_bitmap_free(one);
    if (own) kept_core_ = bound ? index : -1;
  }
  void on_scheduler_exit(bool is_worker) override {
    if (is_worker || keeps_core || saved_.empty()) return;
    hwloc_bitmap_t saved = saved_.back();
    saved_.pop_back();
    if (saved == nullptr) return;
    hwloc_set_cpubind(topology_, saved, HWLOC_CPUBIND_THREAD);
    hwloc_bitmap_free(saved);
  }

 private:
  hwloc_topology_t topology_;
  hwloc_bitmap_t cores_ = nullptr;
  // A trainer's thread: its binding before each arena it is inside, innermost last. A stack, because a thread
  // in one engine's arena may step another engine and so enter a second arena before it leaves the first.
  static thread_local std::vector<hwloc_bitmap_t> saved_;
  static thread_local int kept_core_;  // a thread that keeps its core: that core (-1: none yet)
};

thread_local std::vector<hwloc_bitmap_t> PinningObserver::saved_;
thread_local int PinningObserver::kept_core_ = -1;

}  // namespace

void keep_core_binding_on_this_thread() noexcept { keeps_core = true; }

int available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

struct PinnedArena::Impl {
  int threads = 1;
  tbb::task_arena arena;
  std::unique_ptr<HwlocTopology> topology;
  std::unique_ptr<PinningObserver> observer;

  explicit Impl(int n) : threads(n), arena(n, 1) {}
  ~Impl() { observer.reset(); }  // stop observing before the arena goes
};

Result<PinnedArena> PinnedArena::create(int threads, bool pin) {
  // More threads than CPUs would only time-slice a memory-bound loop.
  int count = threads > 0 ? std::min(threads, available_cpus()) : available_cpus();
  Result<int> capped = threads_from_env(count);
  if (!capped.ok()) return capped.status();
  count = capped.value();
  auto impl = std::make_unique<Impl>(count);
  impl->arena.initialize();
  if (pin) {
    impl->topology = std::make_unique<HwlocTopology>();
    if (impl->topology->topology != nullptr) {
      impl->observer = std::make_unique<PinningObserver>(impl->arena, impl->topology->topology);
    }
  }
  return PinnedArena(std::move(impl));
}

PinnedArena::PinnedArena(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PinnedArena::PinnedArena(PinnedArena&&) noexcept = default;
PinnedArena& PinnedArena::operator=(PinnedArena&&) noexcept = default;
PinnedArena::~PinnedArena() = default;

int PinnedArena::threads() const { return impl_->threads; }

void PinnedArena::run(void (*fn)(void*), void* ctx) {
  impl_->arena.execute([fn, ctx] { fn(ctx); });
}

}  // namespace zoe
