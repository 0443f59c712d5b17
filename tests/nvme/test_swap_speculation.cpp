// Speculative steps of the swap store (SwapStore::speculate): tiles stepped as a gate releases them, their new
// state written beside the valid copy. Committed, they equal a plain step bit for bit; discarded — after a
// gate that stopped, a failed write, or for no reason — the store is as it was and a plain step from there
// gives the uninterrupted result; a process killed in the middle reopens at the last committed step.
#include <gtest/gtest.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "tests/aio/aio_test_util.h"
#include "tests/nvme/swap_model.h"
#include "zoe/swap.h"

extern char** environ;

namespace zoe {
namespace {

using testing::FaultPlan;
using testing::SwapModel;
using testing::TempDir;

constexpr std::size_t kTile = 4096;
constexpr std::size_t kTiles = 8;
constexpr std::size_t kN = kTiles * kTile - 1000;

SwapOptions options_for(const std::string& dir, SwapDurability durability, bool resident, FaultPlan* faults = nullptr) {
  SwapOptions o;
  o.paths = {dir};
  o.buffer_count = resident ? static_cast<int>(kTiles) : 3;
  o.keep_resident = resident;
  o.durability = durability;
  o.queue_depth = 4;
  o.block_size = 16 << 10;
  o.cpu.threads = 2;
  if (faults != nullptr) o.fault_hook = faults->hook();
  return o;
}

// A gate that records the tiles' first elements in the order it is asked, and fails from the `fail_at`-th on.
struct Gate {
  std::vector<std::size_t> asked;
  int fail_at = -1;
  SwapStore::TileGate fn() {
    return [this](std::size_t begin, std::size_t) {
      if (fail_at >= 0 && static_cast<int>(asked.size()) >= fail_at) return Status(StatusCode::internal, "gate closed");
      asked.push_back(begin);
      return Status::success();
    };
  }
};

Status speculate(SwapStore& store, SwapModel& model, std::int64_t t, Gate& gate, const SwapStore::TileRank& rank = {}) {
  model.make_grads(t);
  std::vector<SwapSegment> segs = model.segments();
  StepOptions o;
  o.step = t;
  return store.speculate(segs, o, gate.fn(), rank);
}

// A store of the default segments at step 1, with the reference stepped alike.
Result<SwapStore> store_at_step_one(const SwapOptions& options, SwapModel& model) {
  Result<SwapStore> made = SwapStore::create(options, "r", kN, kTile);
  if (!made.ok()) return made;
  if (Status s = made->initialize(testing::fill_initial); !s.ok()) return s;
  if (Status s = testing::step(made.value(), model, 1); !s.ok()) return s;
  model.reference_step(1);
  return made;
}

struct Mode {
  SwapDurability durability;
  bool resident;
};

class SwapSpeculation : public ::testing::TestWithParam<Mode> {};

TEST_P(SwapSpeculation, CommittedEqualsAStepAndDiscardedChangesNothing) {
  TempDir dir;
  SwapModel model(kN, testing::default_specs(kN));
  Result<SwapStore> made = store_at_step_one(options_for(dir.path(), GetParam().durability, GetParam().resident), model);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  SwapStore& store = made.value();

  Gate first;
  ASSERT_TRUE(speculate(store, model, 2, first).ok());
  std::vector<std::size_t> descending;
  for (std::size_t t = kTiles; t-- > 0;) descending.push_back(t * kTile);
  EXPECT_EQ(first.asked, descending) << "the last tiles first, as backward reports them";
  EXPECT_TRUE(store.speculating());
  std::vector<float> p(kN);
  const Status refused = store.read(0, kN, p.data(), nullptr, nullptr);
  EXPECT_EQ(refused.code(), StatusCode::invalid_argument);
  EXPECT_NE(refused.message().find("speculative step is pending"), std::string::npos) << refused.to_string();
  EXPECT_FALSE(testing::step(store, model, 2).ok());
  ASSERT_TRUE(store.discard_speculation().ok());
  model.expect_matches(store, /*check_out=*/false);  // still step 1
  for (const TileRun& r : store.tile_runs()) EXPECT_EQ(r.step, 1);

  Gate second;
  ASSERT_TRUE(speculate(store, model, 2, second).ok());
  model.reference_step(2);
  ASSERT_TRUE(store.commit_speculation().ok());
  model.expect_matches(store);  // and the copy-outs the speculation wrote
  for (const TileRun& r : store.tile_runs()) EXPECT_EQ(r.step, 2);
  ASSERT_TRUE(testing::step(store, model, 3).ok());
  model.reference_step(3);
  model.expect_matches(store);
}

// A rank orders the tiles (the optimizer ranks each by when its gradients came last iteration): ascending,
// ties in descending order; the committed result is a step's whatever the order.
TEST_P(SwapSpeculation, TilesGoInTheOrderOfTheirRank) {
  TempDir dir;
  SwapModel model(kN, testing::default_specs(kN));
  Result<SwapStore> made = store_at_step_one(options_for(dir.path(), GetParam().durability, GetParam().resident), model);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  SwapStore& store = made.value();
  std::vector<std::pair<std::size_t, std::size_t>> ranked;  // (begin, end) as the rank was asked
  const SwapStore::TileRank rank = [&](std::size_t begin, std::size_t end) {
    ranked.emplace_back(begin, end);
    const std::size_t t = begin / kTile;
    return t < 3 ? std::size_t{0} : t;
  };
  Gate gate;
  ASSERT_TRUE(speculate(store, model, 2, gate, rank).ok());
  const std::vector<std::size_t> want = {2 * kTile, 1 * kTile, 0, 3 * kTile, 4 * kTile, 5 * kTile, 6 * kTile, 7 * kTile};
  EXPECT_EQ(gate.asked, want);
  ASSERT_EQ(ranked.size(), kTiles);
  for (const auto& [begin, end] : ranked) EXPECT_EQ(end, std::min(begin + kTile, kN)) << "tile at " << begin;
  model.reference_step(2);
  ASSERT_TRUE(store.commit_speculation().ok());
  model.expect_matches(store);
}

TEST_P(SwapSpeculation, AStoppedGateOrAFailedWriteIsDiscardedAndTheStepRedoneExactly) {
  for (bool write_fails : {false, true}) {
    // A resident store's speculation writes nothing: its commit writes as a resident step does
    // (test_swap_resident.cpp covers those writes failing).
    if (write_fails && GetParam().resident) continue;
    SCOPED_TRACE(write_fails ? "a failed write" : "the gate stops");
    TempDir dir;
    FaultPlan faults;
    SwapModel model(kN, testing::default_specs(kN));
    Result<SwapStore> made =
        store_at_step_one(options_for(dir.path(), GetParam().durability, GetParam().resident, &faults), model);
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    SwapStore& store = made.value();
    ASSERT_TRUE(store.flush().ok());  // step 1's writes settled: the fault lands in the speculation's
    Gate gate;
    if (write_fails) {
      faults.arm(IoOp::write, 1, EIO);
    } else {
      gate.fail_at = 3;
    }
    const Status s = speculate(store, model, 2, gate);
    faults.clear();
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("speculative step 2 stopped"), std::string::npos) << s.to_string();
    ASSERT_TRUE(store.speculating()) << "what it wrote waits for the discard";
    ASSERT_TRUE(store.discard_speculation().ok());
    model.expect_matches(store, false);
    ASSERT_TRUE(testing::step(store, model, 2).ok());
    model.reference_step(2);
    model.expect_matches(store);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, SwapSpeculation,
                         ::testing::Values(Mode{SwapDurability::each_call, false}, Mode{SwapDurability::next_call, false},
                                           Mode{SwapDurability::on_flush, false}, Mode{SwapDurability::next_call, true}),
                         [](const ::testing::TestParamInfo<Mode>& i) {
                           return testing::mode_name(i.param.durability) + (i.param.resident ? "_resident" : "");
                         });

// The child of the crash test (run by it in a fresh process; skipped otherwise): opens the store, speculates
// step 3 and, three tiles in, tells the parent through the pipe and waits there for SIGKILL.
TEST(SwapSpeculationChild, SpeculatesUntilKilled) {
  const char* dir = std::getenv("ZOE_SPECULATION_CHILD_DIR");
  const char* fd = std::getenv("ZOE_SPECULATION_CHILD_FD");
  if (dir == nullptr || fd == nullptr) GTEST_SKIP() << "run by KilledDuringASpeculativeStepReopensAtTheLastCommit";
  Result<SwapStore> store = SwapStore::open(options_for(dir, SwapDurability::next_call, false), "r", kN, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  SwapModel model(kN, testing::default_specs(kN));
  model.make_grads(3);
  std::vector<SwapSegment> segs = model.segments();
  StepOptions o;
  o.step = 3;
  int tiles = 0;
  (void)store->speculate(segs, o, [&](std::size_t, std::size_t) {
    if (++tiles == 4) {
      (void)!::write(std::atoi(fd), "k", 1);
      for (;;) ::pause();
    }
    return Status::success();
  });
  FAIL() << "not killed";
}

TEST(SwapSpeculationCrash, KilledDuringASpeculativeStepReopensAtTheLastCommit) {
  TempDir dir;
  SwapModel model(kN, testing::default_specs(kN));
  {
    Result<SwapStore> made = SwapStore::create(options_for(dir.path(), SwapDurability::next_call, false), "r", kN, kTile);
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    ASSERT_TRUE(made->initialize(testing::fill_initial).ok());
    for (std::int64_t t = 1; t <= 2; ++t) {
      ASSERT_TRUE(testing::step(made.value(), model, t).ok());
      model.reference_step(t);
    }
  }  // closed: durable at step 2, and its owner lock released for the child
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const std::string filter = "--gtest_filter=SwapSpeculationChild.SpeculatesUntilKilled";
  const std::string env_dir = "ZOE_SPECULATION_CHILD_DIR=" + dir.path();
  const std::string env_fd = "ZOE_SPECULATION_CHILD_FD=" + std::to_string(ready[1]);
  std::vector<char*> argv = {const_cast<char*>("/proc/self/exe"), const_cast<char*>(filter.c_str()), nullptr};
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  envp.push_back(const_cast<char*>(env_dir.c_str()));
  envp.push_back(const_cast<char*>(env_fd.c_str()));
  envp.push_back(nullptr);
  pid_t child = 0;
  ASSERT_EQ(::posix_spawn(&child, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data()), 0);
  ::close(ready[1]);
  char byte = 0;
  const bool reached = ::read(ready[0], &byte, 1) == 1;
  ::close(ready[0]);
  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(reached) << "the child did not reach its fourth tile (exit status " << status << ")";
  ASSERT_TRUE(WIFSIGNALED(status));
  // Three tiles of step 3 were written into their other slots; the table on disk never named them.
  Result<SwapStore> reopened = SwapStore::open(options_for(dir.path(), SwapDurability::next_call, false), "r", kN, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  for (const TileRun& r : reopened->tile_runs()) EXPECT_EQ(r.step, 2) << reopened->describe_state();
  model.expect_matches(reopened.value(), false);
  ASSERT_TRUE(testing::step(reopened.value(), model, 3).ok());
  model.reference_step(3);
  model.expect_matches(reopened.value());
}

}  // namespace
}  // namespace zoe
