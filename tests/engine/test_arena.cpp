// The engine's threads and the caller's core binding (src/arena.cpp): a thread that steps gets its own binding
// back, zoe's own ones included; one marked to keep its core (the overlap schedule's worker) stays on it.
#include <gtest/gtest.h>
#include <sched.h>

#include <thread>
#include <vector>

#include "src/arena.h"
#include "zoe/adam.h"

namespace zoe {
namespace {

cpu_set_t binding() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  return set;
}

// One small step on an engine of `threads` threads that pins them.
void step_once(CpuAdam& adam) {
  std::vector<float> p(1024, 1.0f), m(1024, 0.0f), v(1024, 0.0f), g(1024, 0.5f);
  AdamTensor t;
  t.param = p.data();
  t.exp_avg = m.data();
  t.exp_avg_sq = v.data();
  t.grad = g.data();
  t.n = p.size();
  ASSERT_TRUE(adam.step(AdamHyper{}, StepOptions{}, t).ok());
}

TEST(Arena, AnUnmarkedThreadGetsItsBindingBack) {
  const cpu_set_t allowed = binding();
  if (CPU_COUNT(&allowed) < 2) GTEST_SKIP() << "one CPU: every binding is the same";
  Result<CpuAdam> adam = CpuAdam::create(CpuAdamOptions{});
  ASSERT_TRUE(adam.ok()) << adam.status().to_string();
  std::thread trainer([&] {
    const cpu_set_t before = binding();
    step_once(*adam);
    step_once(*adam);
    const cpu_set_t after = binding();
    EXPECT_TRUE(CPU_EQUAL(&before, &after)) << "the step left the caller bound to " << CPU_COUNT(&after) << " CPU(s)";
  });
  trainer.join();
}

// A thread inside one engine's arena that steps another engine (two optimizers, one stepping from inside the
// other's parallel region) enters a second arena before it leaves the first: leaving both gives it back the
// binding it had before the first, not the one the first arena gave it.
TEST(Arena, NestedArenasGiveTheOuterBindingBack) {
  const cpu_set_t allowed = binding();
  if (CPU_COUNT(&allowed) < 2) GTEST_SKIP() << "one CPU: every binding is the same";
  Result<PinnedArena> outer = PinnedArena::create(0, true);
  Result<PinnedArena> inner = PinnedArena::create(0, true);
  ASSERT_TRUE(outer.ok() && inner.ok());
  std::thread trainer([&] {
    const cpu_set_t before = binding();
    cpu_set_t inside_outer;
    outer->execute([&] {
      inside_outer = binding();
      inner->execute([] {});
      const cpu_set_t back_in_outer = binding();
      EXPECT_TRUE(CPU_EQUAL(&inside_outer, &back_in_outer)) << "leaving the inner arena restores the outer's binding";
    });
    const cpu_set_t after = binding();
    EXPECT_TRUE(CPU_EQUAL(&before, &after)) << "the nested entries left the caller bound to " << CPU_COUNT(&after)
                                            << " CPU(s)";
  });
  trainer.join();
}

// Binding is best effort: where the system refuses it (a container's seccomp), nothing is bound.
bool binding_allowed() {
  cpu_set_t set = binding();
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

TEST(Arena, AMarkedThreadKeepsOneCore) {
  const cpu_set_t allowed = binding();
  if (CPU_COUNT(&allowed) < 2) GTEST_SKIP() << "one CPU: every binding is the same";
  if (!binding_allowed()) GTEST_SKIP() << "sched_setaffinity is refused here: the engine binds nothing";
  Result<CpuAdam> adam = CpuAdam::create(CpuAdamOptions{});
  ASSERT_TRUE(adam.ok()) << adam.status().to_string();
  std::thread worker([&] {
    keep_core_binding_on_this_thread();
    step_once(*adam);
    const cpu_set_t first = binding();
    EXPECT_EQ(CPU_COUNT(&first), 1) << "the marked thread is bound to one core while and after it steps";
    step_once(*adam);
    const cpu_set_t second = binding();
    EXPECT_TRUE(CPU_EQUAL(&first, &second)) << "and to the same one at its next step";
  });
  worker.join();
}

}  // namespace
}  // namespace zoe
