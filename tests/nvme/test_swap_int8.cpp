// A swap store of i8 moments: its slots hold the codes and each block's scales, stepped bit for bit as
// CpuAdam steps the same tensors in RAM; read/read_q8 give the decoded moments and the raw codes; the block
// rules (tile and segments on blocks) are refused with the reason; a failed write is retried to the
// uninterrupted result; a damaged scale fails the checksum.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "tests/aio/aio_test_util.h"
#include "tests/nvme/swap_model.h"
#include "tests/reference.h"
#include "zoe/swap.h"

namespace zoe {
namespace {

using testing::TempDir;

constexpr std::size_t kTile = 2 * kMomentBlock;   // two blocks per tile
constexpr std::size_t kN = 4 * kTile + 123;       // five tiles, the last one partial (one short block)
// Two tensors, as the optimizer's tier lays them out: each starts a block; the elements between them belong
// to no segment and keep their values.
constexpr std::size_t kSplit = 3 * kMomentBlock;
constexpr std::size_t kFirstN = kSplit - 700;

SwapOptions int8_options(const std::string& path) {
  SwapOptions o;
  o.paths = {path};
  o.buffer_count = 3;  // fewer than the tiles: every call streams
  o.queue_depth = 4;
  o.block_size = 16 << 10;
  o.cpu.threads = 2;
  o.state_dtype = DType::i8;
  return o;
}

// The same two tensors stepped in RAM by CpuAdam: the oracle the store must equal bit for bit.
struct RamTensors {
  std::vector<float> p;
  std::vector<std::int8_t> mq;
  std::vector<std::uint8_t> vq;
  std::vector<float> ms, vs;
  RamTensors() : p(kN), mq(kN, 0), vq(kN, 0), ms(moment_blocks(kN), 0.0f), vs(moment_blocks(kN), 0.0f) {
    (void)testing::fill_initial(0, kN, p.data());  // cannot fail
  }
  AdamTensor tensor(std::size_t at, std::size_t n, const float* g, std::uint16_t* out) {
    AdamTensor t;
    t.param = p.data() + at;
    t.exp_avg = mq.data() + at;
    t.exp_avg_sq = vq.data() + at;
    t.state_dtype = DType::i8;
    t.exp_avg_scale = ms.data() + at / kMomentBlock;
    t.exp_avg_sq_scale = vs.data() + at / kMomentBlock;
    t.grad = g;
    t.grad_dtype = DType::f32;
    t.out = out;
    t.out_dtype = DType::bf16;
    t.n = n;
    return t;
  }
};

TEST(SwapStoreInt8, StepsMatchCpuAdamBitwiseAndHoldCodesAndScales) {
  TempDir dir;
  const SwapOptions o = int8_options(dir.path());
  Result<SwapStore> store = SwapStore::create(o, "rank0", kN, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
  Result<CpuAdam> adam = CpuAdam::create(o.cpu);
  ASSERT_TRUE(adam.ok());
  RamTensors ram;
  OptimizerHyper first, second;
  first.lr = 1e-2f;
  second.lr = 3e-3f;
  second.adamw = false;
  second.weight_decay = 0.1f;
  std::vector<float> g(kN);
  std::vector<std::uint16_t> out(kN), ram_out(kN);
  for (std::int64_t step = 1; step <= 4; ++step) {
    test::Random rng(static_cast<std::uint64_t>(step));
    for (float& x : g) x = static_cast<float>(rng.uniform(-1e-2, 1e-2));
    const SwapSegment segments[2] = {{0, kFirstN, &first, g.data(), DType::f32, out.data(), DType::bf16},
                                     {kSplit, kN - kSplit, &second, g.data() + kSplit, DType::f32, out.data() + kSplit, DType::bf16}};
    StepOptions so;
    so.step = step;
    const Status s = store->step(segments, so);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_TRUE(adam->step(first.adam(), so, ram.tensor(0, kFirstN, g.data(), ram_out.data())).ok());
    ASSERT_TRUE(adam->step(second.adam(), so, ram.tensor(kSplit, kN - kSplit, g.data() + kSplit, ram_out.data() + kSplit)).ok());
  }
  EXPECT_EQ(std::memcmp(out.data(), ram_out.data(), kFirstN * 2), 0);
  EXPECT_EQ(std::memcmp(out.data() + kSplit, ram_out.data() + kSplit, (kN - kSplit) * 2), 0);

  std::vector<float> p(kN), m(kN), v(kN), rm(kN), rv(kN);
  ASSERT_TRUE(store->read(0, kN, p.data(), m.data(), v.data()).ok());
  decode_moments(ram.mq.data(), ram.vq.data(), ram.ms.data(), ram.vs.data(), kN, rm.data(), rv.data());
  EXPECT_EQ(std::memcmp(p.data(), ram.p.data(), kN * 4), 0);  // the gap kept its initial weights
  EXPECT_EQ(std::memcmp(m.data(), rm.data(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(v.data(), rv.data(), kN * 4), 0);
  std::vector<std::int8_t> mq(kN);
  std::vector<std::uint8_t> vq(kN);
  std::vector<float> ms(moment_blocks(kN)), vs(moment_blocks(kN));
  ASSERT_TRUE(store->read_q8(0, kN, mq.data(), vq.data(), ms.data(), vs.data()).ok());
  EXPECT_EQ(mq, ram.mq);
  EXPECT_EQ(vq, ram.vq);
  EXPECT_EQ(ms, ram.ms);
  EXPECT_EQ(vs, ram.vs);
  EXPECT_GT(ms[0], 0.0f);
  // A range off the blocks: its codes, and the scales of the blocks it falls in (from block 1).
  std::vector<float> ms2(3);
  ASSERT_TRUE(store->read_q8(kMomentBlock + 5, 2 * kMomentBlock, mq.data(), nullptr, ms2.data(), nullptr).ok());
  EXPECT_EQ(std::memcmp(mq.data(), ram.mq.data() + kMomentBlock + 5, 2 * kMomentBlock), 0);
  EXPECT_EQ(std::memcmp(ms2.data(), ram.ms.data() + 1, 3 * 4), 0);

  // Each slot: p fp32, m and v a byte each, two scales per moment, rounded up to the O_DIRECT block.
  const std::size_t slot = (kTile * 6 + 2 * 2 * 4 + 4095) / 4096 * 4096;
  EXPECT_EQ(std::filesystem::file_size(store->files()[0]), 2 * 5 * slot);
  EXPECT_EQ(store->buffer_bytes(), 3 * slot);
}

TEST(SwapStoreInt8, WriteEncodesTheBlocksItTouchesAndReadQ8RoundTrips) {
  TempDir dir;
  Result<SwapStore> store = SwapStore::create(int8_options(dir.path()), "rank0", kN, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
  test::Random rng(7);
  std::vector<float> m(kN), v(kN);
  for (std::size_t i = 0; i < kN; ++i) {
    m[i] = static_cast<float>(rng.uniform(-1, 1));
    v[i] = static_cast<float>(rng.uniform(0, 1));
  }
  ASSERT_TRUE(store->write(0, kN, nullptr, m.data(), v.data()).ok());
  // What the store reads back is what encode_moments makes of the whole blocks.
  std::vector<std::int8_t> mq(kN);
  std::vector<std::uint8_t> vq(kN);
  std::vector<float> ms(moment_blocks(kN)), vs(moment_blocks(kN)), em(kN), ev(kN), got_m(kN), got_v(kN);
  encode_moments(m.data(), v.data(), kN, mq.data(), vq.data(), ms.data(), vs.data());
  decode_moments(mq.data(), vq.data(), ms.data(), vs.data(), kN, em.data(), ev.data());
  ASSERT_TRUE(store->read(0, kN, nullptr, got_m.data(), got_v.data()).ok());
  EXPECT_EQ(std::memcmp(got_m.data(), em.data(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(got_v.data(), ev.data(), kN * 4), 0);
  // Writing m alone leaves v's codes and scales as they were, bit for bit.
  std::vector<std::uint8_t> vq_before(kN), vq_after(kN);
  std::vector<float> vs_before(moment_blocks(kN)), vs_after(moment_blocks(kN));
  ASSERT_TRUE(store->read_q8(0, kN, nullptr, vq_before.data(), nullptr, vs_before.data()).ok());
  ASSERT_TRUE(store->write(100, 3000, nullptr, m.data(), nullptr).ok());
  ASSERT_TRUE(store->read_q8(0, kN, nullptr, vq_after.data(), nullptr, vs_after.data()).ok());
  EXPECT_EQ(vq_before, vq_after);
  EXPECT_EQ(vs_before, vs_after);
  // Raw codes and scales in and out: a second store takes the first's exactly.
  TempDir other;
  Result<SwapStore> copy = SwapStore::create(int8_options(other.path()), "rank0", kN, kTile);
  ASSERT_TRUE(copy.ok());
  ASSERT_TRUE(copy->initialize(testing::fill_initial).ok());
  ASSERT_TRUE(store->read_q8(0, kN, mq.data(), vq.data(), ms.data(), vs.data()).ok());
  ASSERT_TRUE(copy->write_q8(0, kN, mq.data(), vq.data(), ms.data(), vs.data()).ok());
  std::vector<float> cm(kN), cv(kN);
  ASSERT_TRUE(store->read(0, kN, nullptr, got_m.data(), got_v.data()).ok());
  ASSERT_TRUE(copy->read(0, kN, nullptr, cm.data(), cv.data()).ok());
  EXPECT_EQ(std::memcmp(cm.data(), got_m.data(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(cv.data(), got_v.data(), kN * 4), 0);
}

TEST(SwapStoreInt8, BlockRulesAreRefusedWithTheReason) {
  TempDir dir;
  Result<SwapStore> bad_tile = SwapStore::create(int8_options(dir.path()), "rank0", kN, 1024);
  ASSERT_FALSE(bad_tile.ok());
  EXPECT_NE(bad_tile.status().message().find("not a multiple of 2048"), std::string::npos) << bad_tile.status().to_string();
  SwapOptions f16 = int8_options(dir.path());
  f16.state_dtype = DType::f16;
  Result<SwapStore> bad_dtype = SwapStore::create(f16, "rank0", kN, kTile);
  ASSERT_FALSE(bad_dtype.ok());
  EXPECT_NE(bad_dtype.status().message().find("not a moment dtype"), std::string::npos) << bad_dtype.status().to_string();

  Result<SwapStore> store = SwapStore::create(int8_options(dir.path()), "rank0", kN, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
  OptimizerHyper h;
  std::vector<float> g(kN, 1e-3f);
  const SwapSegment off_block{100, 500, &h, g.data(), DType::f32, nullptr, DType::bf16};
  StepOptions so;
  const Status s = store->step({&off_block, 1}, so);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not on a block of 2048"), std::string::npos) << s.to_string();
  for (std::size_t t = 0; t < store->tiles(); ++t) EXPECT_EQ(store->tile_step(t), 0);

  SwapOptions f32 = int8_options(dir.sub("f32"));
  f32.state_dtype = DType::f32;
  {
    Result<SwapStore> other = SwapStore::create(f32, "rank0", kN, kTile);
    ASSERT_TRUE(other.ok());
  }
  f32.state_dtype = DType::i8;
  Result<SwapStore> reopened = SwapStore::open(f32, "rank0", kN, kTile);
  ASSERT_FALSE(reopened.ok());
  EXPECT_NE(reopened.status().message().find("state_dtype = f32, this run asks for i8"), std::string::npos)
      << reopened.status().to_string();
}

// Steps 1..3 of the two segments on `store`, step 3 failing once on its 3rd tile write when `faults` is set
// (then retried with the same gradients); returns p, codes and scales as stored.
struct Stored {
  std::vector<float> p, ms, vs;
  std::vector<std::int8_t> mq;
  std::vector<std::uint8_t> vq;
};

Stored three_steps(SwapStore& store, testing::FaultPlan* faults) {
  OptimizerHyper h;
  h.lr = 1e-2f;
  std::vector<float> g(kN);
  for (std::int64_t step = 1; step <= 3; ++step) {
    test::Random rng(static_cast<std::uint64_t>(step));
    for (float& x : g) x = static_cast<float>(rng.uniform(-1e-2, 1e-2));
    const SwapSegment segments[2] = {{0, kFirstN, &h, g.data(), DType::f32, nullptr, DType::bf16},
                                     {kSplit, kN - kSplit, &h, g.data() + kSplit, DType::f32, nullptr, DType::bf16}};
    StepOptions so;
    so.step = step;
    if (faults != nullptr && step == 3) {
      faults->arm(IoOp::write, 2, EIO);
      const Status failed = store.step(segments, so);
      EXPECT_FALSE(failed.ok());
      EXPECT_NE(failed.message().find("step 3 incomplete"), std::string::npos) << failed.to_string();
      faults->clear();
    }
    const Status s = store.step(segments, so);
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  Stored out{std::vector<float>(kN), std::vector<float>(moment_blocks(kN)), std::vector<float>(moment_blocks(kN)),
             std::vector<std::int8_t>(kN), std::vector<std::uint8_t>(kN)};
  EXPECT_TRUE(store.read(0, kN, out.p.data(), nullptr, nullptr).ok());
  EXPECT_TRUE(store.read_q8(0, kN, out.mq.data(), out.vq.data(), out.ms.data(), out.vs.data()).ok());
  return out;
}

// A tile write that fails mid-step leaves every tile's codes and scales at a step it names; the step called
// again completes the rest, and the store equals one that never failed, bit for bit.
TEST(SwapStoreInt8, AFailedWriteIsRetriedToTheUninterruptedResult) {
  TempDir clean_dir, faulty_dir;
  Result<SwapStore> clean = SwapStore::create(int8_options(clean_dir.path()), "rank0", kN, kTile);
  testing::FaultPlan faults;
  SwapOptions o = int8_options(faulty_dir.path());
  o.fault_hook = faults.hook();
  Result<SwapStore> faulty = SwapStore::create(o, "rank0", kN, kTile);
  ASSERT_TRUE(clean.ok() && faulty.ok());
  ASSERT_TRUE(clean->initialize(testing::fill_initial).ok());
  ASSERT_TRUE(faulty->initialize(testing::fill_initial).ok());
  const Stored a = three_steps(*clean, nullptr), b = three_steps(*faulty, &faults);
  EXPECT_EQ(faults.fired.load(), 1);
  EXPECT_EQ(std::memcmp(a.p.data(), b.p.data(), kN * 4), 0);
  EXPECT_EQ(a.mq, b.mq);
  EXPECT_EQ(a.vq, b.vq);
  EXPECT_EQ(a.ms, b.ms);
  EXPECT_EQ(a.vs, b.vs);
}

// A block scale altered on disk is caught by the tile's m checksum, never used.
TEST(SwapStoreInt8, ADamagedScaleFailsTheChecksum) {
  TempDir dir;
  Result<SwapStore> store = SwapStore::create(int8_options(dir.path()), "rank0", kN, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE(store->initialize(testing::fill_initial).ok());
  std::vector<float> m(kN, 0.5f), v(kN, 0.25f);
  ASSERT_TRUE(store->write(0, kN, nullptr, m.data(), v.data()).ok());
  // Tile 0's first m scale, in both slots (one holds the valid copy): a scale of 0.5 becomes another value.
  const std::string file = store->files()[0];
  const std::uint64_t half = std::filesystem::file_size(file) / 2;
  const int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const float altered = 0.75f;
  for (std::uint64_t slot : {std::uint64_t{0}, half}) {
    ASSERT_EQ(::pwrite(fd, &altered, 4, static_cast<off_t>(slot + kTile * 6)), 4);
  }
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
  std::vector<float> got(kN);
  const Status s = store->read(0, 10, nullptr, got.data(), nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("fails its checksum (m: stored"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace zoe
