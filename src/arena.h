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

}  // namespace zoe
