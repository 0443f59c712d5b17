// The swap store's durability modes (SwapDurability): each steps the same bits; a failed call is retried to
// the uninterrupted result in each; a crash (simulated: the files as they were at one moment put back after
// the store is gone) reopens next_call at the last durable step, never a mix, and on_flush at its last
// flush or not at all (refused by the tile checksums, never silently used).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/aio/aio_test_util.h"
#include "tests/nvme/swap_model.h"
#include "zoe/swap.h"

namespace zoe {
namespace {

using testing::FaultPlan;
using testing::mode_name;
using testing::step;
using testing::SwapModel;
using testing::TempDir;

constexpr std::size_t kTile = 4096;
constexpr std::size_t kTiles = 8;
constexpr std::size_t kN = kTiles * kTile - 1000;

SwapOptions options_for(const std::string& dir, SwapDurability durability, IoFaultHook hook = nullptr) {
  SwapOptions o;
  o.paths = {dir};
  o.buffer_count = 3;
  o.queue_depth = 4;
  o.block_size = 16 << 10;
  o.cpu.threads = 2;
  o.durability = durability;
  o.fault_hook = std::move(hook);
  return o;
}

// What a crash would leave: the store's files as they are on disk now, put back over the originals later.
class DiskImage {
 public:
  DiskImage(const std::string& dir, const std::string& backup) : dir_(dir), backup_(backup) {
    for (const char* suffix : kSuffixes) {
      std::filesystem::copy_file(dir + "/rank0" + suffix, backup + "/rank0" + suffix,
                                 std::filesystem::copy_options::overwrite_existing);
    }
  }
  void restore() const {
    for (const char* suffix : kSuffixes) {
      std::filesystem::copy_file(backup_ + "/rank0" + suffix, dir_ + "/rank0" + suffix,
                                 std::filesystem::copy_options::overwrite_existing);
    }
  }

 private:
  static constexpr const char* kSuffixes[3] = {".zoe-swap", ".zoe-swap.table", ".zoe-swap.json"};
  std::string dir_, backup_;
};

class Durability : public ::testing::TestWithParam<SwapDurability> {};

TEST_P(Durability, StepsTheSameBitsAndACleanCloseKeepsThem) {
  TempDir dir;
  SwapModel model(kN, testing::default_specs(kN));
  {
    Result<SwapStore> store = SwapStore::create(options_for(dir.path(), GetParam()), "rank0", kN, kTile);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
    for (std::int64_t t = 1; t <= 4; ++t) {
      ASSERT_TRUE(step(*store, model, t).ok());
      model.reference_step(t);
      model.expect_matches(*store);
    }
  }
  Result<SwapStore> reopened = SwapStore::open(options_for(dir.path(), GetParam()), "rank0", kN, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  EXPECT_EQ(reopened->tile_step(0), 4);
  model.expect_matches(*reopened, false);
}

TEST_P(Durability, RetryAfterAFailedWriteEqualsAnUninterruptedRun) {
  TempDir dir;
  FaultPlan faults;
  Result<SwapStore> store = SwapStore::create(options_for(dir.path(), GetParam(), faults.hook()), "rank0", kN, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
  SwapModel model(kN, testing::default_specs(kN));
  for (std::int64_t t = 1; t <= 2; ++t) {
    ASSERT_TRUE(step(*store, model, t).ok());
    model.reference_step(t);
  }
  faults.arm(IoOp::write, 12, EIO);
  Status s = step(*store, model, 3);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("step 3 incomplete"), std::string::npos) << s.to_string();
  faults.clear();
  ASSERT_TRUE(step(*store, model, 3).ok());
  model.reference_step(3);
  model.expect_matches(*store);
}

INSTANTIATE_TEST_SUITE_P(Modes, Durability,
                         ::testing::Values(SwapDurability::each_call, SwapDurability::next_call, SwapDurability::on_flush),
                         [](const auto& p) { return mode_name(p.param); });

// next_call: the fdatasync runs after the call returned. When it fails for good, the next call fails before
// rewriting any slot, and once the fault clears a retry gives the uninterrupted result.
TEST(DurabilityNextCall, AFailedBackgroundSyncStopsTheNextCallBeforeItWrites) {
  TempDir dir;
  FaultPlan faults;
  Result<SwapStore> store =
      SwapStore::create(options_for(dir.path(), SwapDurability::next_call, faults.hook()), "rank0", kN, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
  SwapModel model(kN, testing::default_specs(kN));
  ASSERT_TRUE(step(*store, model, 1).ok());
  model.reference_step(1);
  ASSERT_TRUE(store->flush().ok());
  faults.arm(IoOp::sync, 0, EIO, -1, true);  // every fdatasync from now on fails
  ASSERT_TRUE(step(*store, model, 2).ok()) << "its sync runs after it returned";
  model.reference_step(2);
  Status s = step(*store, model, 3);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("could not be made durable"), std::string::npos) << s.to_string();
  for (std::size_t t = 0; t < store->tiles(); ++t) EXPECT_EQ(store->tile_step(t), 2) << "nothing of step 3 was written";
  faults.clear();
  ASSERT_TRUE(step(*store, model, 3).ok());
  model.reference_step(3);
  model.expect_matches(*store);
}

// A crash right after a call returned reopens at that call or the one before (the background sync may or
// may not have finished), every tile at the same step and with exactly that step's state.
TEST(DurabilityNextCall, ACrashReopensAtTheLastDurableStep) {
  TempDir dir;
  const std::string backup = dir.sub("backup"), swap = dir.sub("swap");
  // A slow disk: each fdatasync takes 200 ms, so a crash right after step 2 catches its sync in flight.
  auto slow = [](const IoSite& site) -> IoFault {
    if (site.op == IoOp::sync) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return {};
  };
  SwapModel at1(kN, testing::default_specs(kN)), at2(kN, testing::default_specs(kN));
  std::unique_ptr<DiskImage> image;
  {
    Result<SwapStore> store = SwapStore::create(options_for(swap, SwapDurability::next_call, slow), "rank0", kN, kTile);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
    ASSERT_TRUE(step(*store, at1, 1).ok());
    at1.reference_step(1);
    at2.make_grads(1);
    at2.reference_step(1);
    ASSERT_TRUE(store->flush().ok());
    ASSERT_TRUE(step(*store, at2, 2).ok());
    at2.reference_step(2);
    image = std::make_unique<DiskImage>(swap, backup);  // the crash: step 2 is not yet durable
  }
  image->restore();
  Result<SwapStore> reopened = SwapStore::open(options_for(swap, SwapDurability::next_call), "rank0", kN, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  const std::int64_t at = reopened->tile_step(0);
  for (std::size_t t = 0; t < reopened->tiles(); ++t) ASSERT_EQ(reopened->tile_step(t), at) << "a mix of steps";
  EXPECT_EQ(at, 1) << "the sync of step 2 was still in flight";
  (at == 1 ? at1 : at2).expect_matches(*reopened, false);
}

// on_flush: until the next flush a crash may lose the store, but never hands out wrong state.
TEST(DurabilityOnFlush, ACrashReopensAtTheLastFlushOrIsRefused) {
  TempDir dir;
  const std::string backup1 = dir.sub("backup1"), backup3 = dir.sub("backup3"), swap = dir.sub("swap");
  SwapModel model(kN, testing::default_specs(kN)), at1(kN, testing::default_specs(kN));
  std::unique_ptr<DiskImage> after2, after3;
  {
    Result<SwapStore> store = SwapStore::create(options_for(swap, SwapDurability::on_flush), "rank0", kN, kTile);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
    ASSERT_TRUE(step(*store, model, 1).ok());
    model.reference_step(1);
    at1.make_grads(1);
    at1.reference_step(1);
    ASSERT_TRUE(store->flush().ok());
    for (std::int64_t t = 2; t <= 3; ++t) {
      ASSERT_TRUE(step(*store, model, t).ok());
      model.reference_step(t);
      if (t == 2) after2 = std::make_unique<DiskImage>(swap, backup1);
      if (t == 3) after3 = std::make_unique<DiskImage>(swap, backup3);
    }
  }
  // After step 2 the slots flushed at step 1 are untouched: the store reopens at step 1.
  after2->restore();
  {
    Result<SwapStore> reopened = SwapStore::open(options_for(swap, SwapDurability::on_flush), "rank0", kN, kTile);
    ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
    EXPECT_EQ(reopened->tile_step(0), 1);
    at1.expect_matches(*reopened, false);
  }
  // Step 3 rewrote them: reading is refused by the checksums.
  after3->restore();
  Result<SwapStore> reopened = SwapStore::open(options_for(swap, SwapDurability::on_flush), "rank0", kN, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  std::vector<float> p(kN);
  const Status s = reopened->read(0, kN, p.data(), nullptr, nullptr);
  ASSERT_FALSE(s.ok()) << "state the table does not describe was handed out";
  EXPECT_EQ(s.code(), StatusCode::corrupt) << s.to_string();
  EXPECT_NE(s.message().find("fails its checksum"), std::string::npos) << s.to_string();
}

// A store whose writer was killed before its first flush (on_flush: the tile table on disk still names no
// step) is refused for that reason, not as one nobody initialised. The kill is played by copying the files
// aside while the writer holds them and putting them back after it closed (its close would flush).
TEST(DurabilityOnFlush, AStoreKilledBeforeItsFirstFlushIsRefusedNamingWhy) {
  TempDir dir;
  const std::string swap = dir.sub("swap"), aside = dir.sub("aside");
  {
    Result<SwapStore> store = SwapStore::create(options_for(swap, SwapDurability::on_flush), "rank0", kN, kTile);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
    std::filesystem::copy(swap, aside, std::filesystem::copy_options::recursive);
  }
  std::filesystem::remove_all(swap);
  std::filesystem::copy(aside, swap);
  Result<SwapStore> reopened = SwapStore::open(options_for(swap, SwapDurability::on_flush), "rank0", kN, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  std::vector<float> p(kN);
  const Status s = reopened->read(0, kN, p.data(), nullptr, nullptr);
  ASSERT_FALSE(s.ok());
  for (const char* part : {"holds no durable state", "checkpoint", "restore from a checkpoint"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in: " << s.message();
  }
  EXPECT_EQ(s.message().find("call initialize()"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace zoe
