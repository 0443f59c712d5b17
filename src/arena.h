// The one persistent TBB arena of a CpuAdam (and later of the tile pipeline), its threads bound to cores
// with hwloc. The arena owns its observer and topology; callers run work inside it with execute().
#pragma once

#include "src/private.h"

#include <memory>
#include <type_traits>

#include "zoe/status.h"

namespace zoe {

class PinnedArena {
 public:
  // threads <= 0: every CPU this process may run on; more than that is capped to it. ZOE_THREADS, when set, caps the count; a value that
  // is not a positive integer is an error.
  static Result<PinnedArena> create(int threads, bool pin);
  PinnedArena(PinnedArena&&) noexcept;
  PinnedArena& operator=(PinnedArena&&) noexcept;
  ~PinnedArena();

  int threads() const;

  // Runs f() inside the arena (where tbb::parallel_for uses its threads) and returns when it is done.
  template <typename F>
  void execute(F&& f) {
    run([](void* ctx) { (*static_cast<std::remove_reference_t<F>*>(ctx))(); }, &f);
  }

 private:
  struct Impl;
  explicit PinnedArena(std::unique_ptr<Impl> impl);
  void run(void (*fn)(void*), void* ctx);
  std::unique_ptr<Impl> impl_;
};

// The number of CPUs this process may run on (its affinity mask).
int available_cpus();

// The calling thread, one of zoe's own that enters an arena again and again (the overlap schedule's worker,
// once per piece), keeps the core an arena binds it to instead of having its binding restored each time it
// leaves: two sched_setaffinity calls and a migration per entry saved. Every other thread that calls in (a
// trainer's, a stream's) gets its own binding back.
void keep_core_binding_on_this_thread() noexcept;

}  // namespace zoe
