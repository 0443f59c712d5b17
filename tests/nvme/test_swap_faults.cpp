// The swap store under faults: bad paths, a read-only or full filesystem, I/O errors and short transfers
// mid-step, a failed fdatasync, swap files truncated or altered between steps. Each must fail with a
// message naming what and where, leave a state the caller can read off, and — once the fault clears — a
// retried step must give exactly the result of an uninterrupted run.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/aio/aio_test_util.h"
#include "tests/nvme/swap_model.h"
#include "zoe/swap.h"

namespace zoe {
namespace {

using testing::FaultPlan;
using testing::SwapModel;
using testing::TempDir;

constexpr std::size_t kTile = 4096;
constexpr std::size_t kTiles = 8;
constexpr std::size_t kN = kTiles * kTile - 1000;
constexpr std::size_t kSlot = 12 * kTile;

SwapOptions options_for(const std::string& dir, FaultPlan* faults = nullptr) {
  SwapOptions o;
  o.paths = {dir};
  o.buffer_count = 3;
  o.queue_depth = 4;
  o.block_size = 16 << 10;
  o.cpu.threads = 2;
  if (faults != nullptr) o.fault_hook = faults->hook();
  return o;
}

void expect_message(const Status& s, std::initializer_list<std::string> needles) {
  ASSERT_FALSE(s.ok());
  for (const std::string& n : needles) EXPECT_NE(s.message().find(n), std::string::npos) << "'" << n << "' not in: " << s.to_string();
}

// ---- creation faults ----

TEST(SwapFaults, PathMissing) {
  TempDir dir;
  Result<SwapStore> r = SwapStore::create(options_for(dir.path() + "/nope"), "rank0", kN, kTile);
  ASSERT_FALSE(r.ok());
  expect_message(r.status(), {dir.path() + "/nope", "does not exist"});
}

TEST(SwapFaults, PathIsNotADirectory) {
  TempDir dir;
  const std::string file = dir.path() + "/plain";
  std::ofstream(file) << "x";
  Result<SwapStore> r = SwapStore::create(options_for(file), "rank0", kN, kTile);
  ASSERT_FALSE(r.ok());
  expect_message(r.status(), {file, "is not a directory"});
}

TEST(SwapFaults, PathIsReadOnly) {
  TempDir dir;
  const std::string mnt = dir.sub("ro");
  testing::TestMount ro(mnt, "tmpfs", "size=4m", /*read_only=*/true);
  if (ro.ok()) {
    Result<SwapStore> r = SwapStore::create(options_for(mnt), "rank0", kN, kTile);
    ASSERT_FALSE(r.ok());
    expect_message(r.status(), {mnt, "read-only"});
  } else {
    std::printf("read-only mount not available (%s): the seam reports EROFS at open instead\n", ro.reason().c_str());
  }
  // The same refusal as the OS gives it at open (a read-only bind, or a mount turned read-only later).
  SwapOptions o = options_for(dir.sub("seam"));
  o.fault_hook = [](const IoSite& s) -> IoFault { return s.op == IoOp::open ? IoFault{EROFS, -1} : IoFault{}; };
  Result<SwapStore> r = SwapStore::create(o, "rank0", kN, kTile);
  ASSERT_FALSE(r.ok());
  expect_message(r.status(), {"rank0.zoe-swap", "read-only"});
}

TEST(SwapFaults, NoSpaceNamesPathAndBytes) {
  TempDir dir;
  const std::string mnt = dir.sub("small");
  testing::TestMount small(mnt, "tmpfs", "size=512k");
  if (small.ok()) {
    Result<SwapStore> r = SwapStore::create(options_for(mnt), "rank0", kN, kTile);  // needs 768 KiB
    ASSERT_FALSE(r.ok());
    expect_message(r.status(), {mnt + "/rank0.zoe-swap", "needs", std::to_string(2 * kTiles * kSlot) + " bytes"});
    EXPECT_FALSE(std::filesystem::exists(mnt + "/rank0.zoe-swap.json"));
  } else {
    std::printf("small tmpfs not available (%s): only the injected ENOSPC runs\n", small.reason().c_str());
  }
  // fallocate itself saying ENOSPC (free space looked sufficient, then ran out): nothing is left behind.
  const std::string seam = dir.sub("seam");
  SwapOptions o = options_for(seam);
  o.fault_hook = [](const IoSite& s) -> IoFault { return s.op == IoOp::allocate ? IoFault{ENOSPC, -1} : IoFault{}; };
  Result<SwapStore> r = SwapStore::create(o, "rank0", kN, kTile);
  ASSERT_FALSE(r.ok());
  expect_message(r.status(), {seam + "/rank0.zoe-swap", "no space", std::to_string(2 * kTiles * kSlot) + " bytes"});
  EXPECT_EQ(r.status().sys_errno(), ENOSPC);
  EXPECT_TRUE(std::filesystem::is_empty(seam));
}

// ---- faults in the middle of a step ----

struct StepFault {
  const char* name;
  IoOp op;
  int nth;              // which request of that kind (completion order) fails
  int error;
  std::int64_t transferred;
  const char* expect;   // in the message
};

void PrintTo(const StepFault& f, std::ostream* os) { *os << f.name; }

// 8 tiles of 3 requests each way per step: nth picks a request in the middle of the step.
class SwapStepFaults : public ::testing::TestWithParam<StepFault> {};

TEST_P(SwapStepFaults, RetryAfterTheFaultClearsEqualsAnUninterruptedRun) {
  const StepFault& f = GetParam();
  TempDir dir;
  FaultPlan faults;
  Result<SwapStore> store = SwapStore::create(options_for(dir.path(), &faults), "rank0", kN, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
  SwapModel model(kN, testing::default_specs(kN));
  StepOptions o;
  for (o.step = 1; o.step <= 2; ++o.step) {
    model.make_grads(o.step);
    auto segs = model.segments();
    ASSERT_TRUE(store->step(segs, o).ok());
    model.reference_step(o.step);
  }
  o.step = 3;
  model.make_grads(3);
  auto segs = model.segments();
  faults.arm(f.op, f.nth, f.error, f.transferred);
  Status s = store->step(segs, o);
  ASSERT_FALSE(s.ok()) << "the fault did not fail the step";
  EXPECT_GE(faults.fired.load(), 1);
  expect_message(s, {"step 3 incomplete", f.expect, "valid state now"});
  if (f.op != IoOp::sync) expect_message(s, {dir.path() + "/rank0.zoe-swap", "offset"});
  // Every tile is validly at step 2 or 3; the state is readable and says which.
  std::size_t at3 = 0;
  for (std::size_t t = 0; t < store->tiles(); ++t) {
    ASSERT_TRUE(store->tile_step(t) == 2 || store->tile_step(t) == 3) << t;
    at3 += store->tile_step(t) == 3;
  }
  EXPECT_LT(at3, store->tiles());
  if (f.op == IoOp::sync) {
    EXPECT_EQ(at3, 0u) << "a failed fdatasync rolls the call back";
  }
  std::printf("after the fault: %s\n", store->describe_state().c_str());
  faults.clear();
  // Retry with the same gradients (fresh out buffers: the retry must refill the copies of finished tiles).
  model.make_grads(3);
  segs = model.segments();
  s = store->step(segs, o);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(store->last_stats().tiles_stepped, store->tiles() - at3);
  EXPECT_EQ(store->last_stats().tiles_skipped, at3);
  model.reference_step(3);
  model.expect_matches(*store);
  o.step = 4;
  model.make_grads(4);
  segs = model.segments();
  ASSERT_TRUE(store->step(segs, o).ok());
  model.reference_step(4);
  model.expect_matches(*store);
  // And the next run sees the same, once this one has let go.
  { SwapStore closed = std::move(store).value(); }
  Result<SwapStore> reopened = SwapStore::open(options_for(dir.path()), "rank0", kN, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  model.expect_matches(*reopened, false);
}

INSTANTIATE_TEST_SUITE_P(
    Injected, SwapStepFaults,
    ::testing::Values(StepFault{"EioOnRead", IoOp::read, 10, EIO, -1, "Input/output error"},
                      StepFault{"EioOnWrite", IoOp::write, 12, EIO, -1, "Input/output error"},
                      StepFault{"EnospcOnWrite", IoOp::write, 7, ENOSPC, -1, "No space left"},
                      StepFault{"ShortRead", IoOp::read, 11, 0, 4096, "short read"},
                      StepFault{"ShortWrite", IoOp::write, 9, 0, 8192, "short write"},
                      StepFault{"EioOnFirstRead", IoOp::read, 0, EIO, -1, "reading tile"},
                      StepFault{"FdatasyncFails", IoOp::sync, 0, EIO, -1, "fdatasync"}),
    [](const auto& tp) { return std::string(tp.param.name); });

// ---- swap files changed between steps ----

class SwapTamper : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<SwapStore> s = SwapStore::create(options_for(dir_.path()), "rank0", kN, kTile);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    store_ = std::make_unique<SwapStore>(std::move(s).value());
    ASSERT_TRUE(store_->initialize(testing::fill_initial).ok());
    model_ = std::make_unique<SwapModel>(kN, testing::default_specs(kN));
    StepOptions o;
    o.step = 1;
    model_->make_grads(1);
    auto segs = model_->segments();
    ASSERT_TRUE(store_->step(segs, o).ok());
    model_->reference_step(1);
    file_ = store_->files()[0];
  }
  Status step2() {
    StepOptions o;
    o.step = 2;
    model_->make_grads(2);
    auto segs = model_->segments();
    return store_->step(segs, o);
  }
  TempDir dir_;
  std::unique_ptr<SwapStore> store_;
  std::unique_ptr<SwapModel> model_;
  std::string file_;
};

TEST_F(SwapTamper, TruncatedFileIsRefused) {
  std::filesystem::resize_file(file_, std::filesystem::file_size(file_) - kSlot);
  Status s = step2();
  expect_message(s, {file_, "truncated"});
  EXPECT_EQ(s.code(), StatusCode::corrupt);
  std::vector<float> p(kN);
  expect_message(store_->read(0, kN, p.data(), nullptr, nullptr), {file_, "truncated"});
  for (std::size_t t = 0; t < store_->tiles(); ++t) EXPECT_EQ(store_->tile_step(t), 1);
  store_.reset();  // the next run's open, once this one has let go
  expect_message(SwapStore::open(options_for(dir_.path()), "rank0", kN, kTile).status(), {file_, "truncated"});
}

TEST_F(SwapTamper, AlteredTileIsDetectedAndNeverUsed) {
  // Flip one byte of tile 5's m in both slots: whichever is valid is now wrong.
  const std::size_t half = std::filesystem::file_size(file_) / 2;
  for (std::size_t slot = 0; slot < 2; ++slot) {
    const int fd = ::open(file_.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t at = static_cast<off_t>(slot * half + 5 * kSlot + 4 * kTile + 100);
    unsigned char b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, at), 1);
    b ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
    ::close(fd);
  }
  Status s = step2();
  expect_message(s, {"tile 5 (elements [20480, 24576))", file_, "fails its checksum", "m: stored", "restore"});
  EXPECT_EQ(s.code(), StatusCode::corrupt);
  EXPECT_EQ(store_->tile_step(5), 1) << "the altered tile must not be stepped";
  std::vector<float> p(kN);
  expect_message(store_->read(5 * kTile, 10, p.data(), nullptr, nullptr), {"tile 5", "fails its checksum"});
  // Tiles outside the damage stay readable.
  EXPECT_TRUE(store_->read(0, kTile, p.data(), nullptr, nullptr).ok());
}

}  // namespace
}  // namespace zoe
