// bf16 and 8-bit Adam moments (OffloadOptions::state_dtype) through the offloaded optimizer: every schedule
// steps the same bits, the moments really are bf16 / 8-bit, checkpoints hold them as fp32 (int8: and their
// codes) and convert both ways, and what is not built is refused.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>

#include "tests/aio/aio_test_util.h"
#include "tests/offload/trainer.h"

namespace zoe::test {
namespace {

OffloadOptions bf16_moments() {
  OffloadOptions o;
  o.state_dtype = DType::bf16;
  o.max_grad_norm = 0.05f;  // clipping bites: overlap undoes and redoes its speculative steps
  return o;
}

std::string temp_file(const char* tag) {
  return (std::filesystem::temp_directory_path() / (std::string("zoe-state-") + tag + "-" + std::to_string(::getpid()))).string();
}

bool all_bf16(const std::vector<float>& values, std::size_t from, std::size_t count) {
  for (std::size_t i = from; i < from + count; ++i) {
    if (bf16_to_float(float_to_bf16(values[i])) != values[i]) return false;
  }
  return true;
}

TEST(StateDtype, Bf16MomentsSyncOverlapAndDelayedAgreeBitwise) {
  const RunResult sync = train(Schedule::sync, DType::bf16, bf16_moments(), 16, random_grads(1e-2));
  const RunResult overlap = train(Schedule::overlap, DType::bf16, bf16_moments(), 16, random_grads(1e-2));
  expect_bitwise_equal(sync, overlap);
  EXPECT_GT(overlap.stats.redone, 0);
  // delayed after a warm-up as long as the run: every step sync, through the delayed schedule's code.
  const RunResult delayed = train(Schedule::delayed, DType::bf16, bf16_moments(), 16, random_grads(1e-2), 16);
  expect_bitwise_equal(sync, delayed);
}

TEST(StateDtype, Bf16MomentsAreBf16AndTheMasterStaysFp32) {
  const RunResult bf16 = train(Schedule::sync, DType::bf16, bf16_moments(), 12, random_grads(1e-2));
  OffloadOptions clipped;
  clipped.max_grad_norm = 0.05f;
  const RunResult fp32_clipped = train(Schedule::sync, DType::bf16, clipped, 12, random_grads(1e-2));
  // read_state gives p, m, v per parameter (sizes 1000, 37, 4096, 1): the moments widen bf16 exactly.
  std::size_t at = 0;
  bool masters_bf16 = true;
  for (std::size_t n : {1000, 37, 4096, 1}) {
    EXPECT_TRUE(all_bf16(bf16.state, at + n, 2 * n)) << "moments of a parameter of " << n;
    masters_bf16 = masters_bf16 && all_bf16(bf16.state, at, n);
    at += 3 * n;
  }
  EXPECT_FALSE(masters_bf16);  // fp32 masters
  EXPECT_NE(std::memcmp(bf16.state.data(), fp32_clipped.state.data(), bf16.state.size() * 4), 0);
}

TEST(StateDtype, CheckpointsHoldFp32MomentsAndConvertBothWays) {
  const GradFn grads = random_grads(1e-2);
  const RunResult whole = train(Schedule::sync, DType::bf16, bf16_moments(), 12, grads);
  const std::string path = temp_file("bf16");
  {
    Trainer first(Schedule::sync, DType::bf16, bf16_moments());
    first.run(1, 6, grads);
    ASSERT_TRUE(first.opt().save(path).ok());
  }
  Trainer second(Schedule::sync, DType::bf16, bf16_moments());
  const Status loaded = second.opt().load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  second.run(7, 12, grads);
  const RunResult resumed = second.result();  // bf16 -> fp32 file -> bf16 is exact
  EXPECT_EQ(std::memcmp(whole.state.data(), resumed.state.data(), whole.state.size() * 4), 0);
  EXPECT_EQ(whole.device_weights, resumed.device_weights);
  EXPECT_EQ(whole.steps, resumed.steps);

  // The same checkpoint into an fp32-moment optimizer: the moments widened, exactly.
  Trainer widened(Schedule::sync, DType::bf16, {});
  ASSERT_TRUE(widened.opt().load(path).ok());
  Trainer narrow(Schedule::sync, DType::bf16, bf16_moments());
  ASSERT_TRUE(narrow.opt().load(path).ok());
  const RunResult a = widened.result(), b = narrow.result();
  EXPECT_EQ(std::memcmp(a.state.data(), b.state.data(), a.state.size() * 4), 0);

  // An fp32 run's checkpoint into bf16 moments: each rounded to nearest even.
  const std::string fp32_path = temp_file("fp32");
  {
    Trainer f(Schedule::sync, DType::bf16, {});
    f.run(1, 6, grads);
    ASSERT_TRUE(f.opt().save(fp32_path).ok());
    const RunResult fr = f.result();
    Trainer into(Schedule::sync, DType::bf16, bf16_moments());
    ASSERT_TRUE(into.opt().load(fp32_path).ok());
    const RunResult ir = into.result();
    std::size_t at = 0;
    for (std::size_t n : {1000, 37, 4096, 1}) {
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(ir.state[at + i], fr.state[at + i]);  // master as saved
      for (std::size_t i = at + n; i < at + 3 * n; ++i) ASSERT_EQ(ir.state[i], bf16_to_float(float_to_bf16(fr.state[i])));
      at += 3 * n;
    }
  }
  std::remove(path.c_str());
  std::remove(fp32_path.c_str());
}

// Elements per slice a checkpoint streams (CheckpointWriter::kStreamSlice bytes of fp32).
constexpr std::size_t kCheckpointSlice = (std::size_t(8) << 20) / 4;

OffloadOptions int8_moments() {
  OffloadOptions o = bf16_moments();
  o.state_dtype = DType::i8;
  o.tile = 1000;  // pieces of 2048 (whole blocks): the parameter of 4096 is stepped and undone in two
  return o;
}

TEST(StateDtype, Int8MomentsSyncOverlapAndDelayedAgreeBitwise) {
  const RunResult sync = train(Schedule::sync, DType::bf16, int8_moments(), 16, random_grads(1e-2));
  const RunResult overlap = train(Schedule::overlap, DType::bf16, int8_moments(), 16, random_grads(1e-2));
  expect_bitwise_equal(sync, overlap);
  EXPECT_GT(overlap.stats.redone, 0);  // undone speculative steps restored codes and scales
  const RunResult delayed = train(Schedule::delayed, DType::bf16, int8_moments(), 16, random_grads(1e-2), 16);
  expect_bitwise_equal(sync, delayed);
  const RunResult bf16 = train(Schedule::sync, DType::bf16, bf16_moments(), 16, random_grads(1e-2));
  EXPECT_NE(std::memcmp(sync.state.data(), bf16.state.data(), sync.state.size() * 4), 0);
}

// read_state's moments are decoded 8-bit codes: at most 255 distinct m values and 256 v values per block of
// 2048, all finite, v >= 0; the masters stay fp32.
TEST(StateDtype, Int8MomentsHoldAtMost256ValuesPerBlock) {
  const RunResult q8 = train(Schedule::sync, DType::bf16, int8_moments(), 12, random_grads(1e-2));
  std::size_t at = 0;
  bool masters_bf16 = true;
  for (std::size_t n : {1000, 37, 4096, 1}) {
    for (std::size_t start = 0; start < n; start += kMomentBlock) {
      const std::size_t nb = std::min(kMomentBlock, n - start);
      std::set<float> m(q8.state.begin() + at + n + start, q8.state.begin() + at + n + start + nb);
      std::set<float> v(q8.state.begin() + at + 2 * n + start, q8.state.begin() + at + 2 * n + start + nb);
      EXPECT_LE(m.size(), 255u) << "parameter of " << n << ", block at " << start;
      EXPECT_LE(v.size(), 256u) << "parameter of " << n << ", block at " << start;
      EXPECT_GE(*v.begin(), 0.0f);
      if (nb > 300) {
        EXPECT_GT(m.size(), 100u);  // many codes in use: the moments are not degenerate
      }
    }
    masters_bf16 = masters_bf16 && all_bf16(q8.state, at, n);
    at += 3 * n;
  }
  EXPECT_FALSE(masters_bf16);
}

TEST(StateDtype, Int8CheckpointsResumeExactlyAndConvertBothWays) {
  const GradFn grads = random_grads(1e-2);
  const RunResult whole = train(Schedule::sync, DType::bf16, int8_moments(), 12, grads);
  const std::string path = temp_file("int8");
  RunResult at6;
  {
    Trainer first(Schedule::sync, DType::bf16, int8_moments());
    first.run(1, 6, grads);
    ASSERT_TRUE(first.opt().save(path).ok());
    at6 = first.result();
  }
  Trainer second(Schedule::sync, DType::bf16, int8_moments());
  const Status loaded = second.opt().load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  second.run(7, 12, grads);
  const RunResult resumed = second.result();  // the codes and scales came back as they were
  EXPECT_EQ(std::memcmp(whole.state.data(), resumed.state.data(), whole.state.size() * 4), 0);
  EXPECT_EQ(whole.device_weights, resumed.device_weights);

  // Into fp32 moments: the decoded values, as read_state gave them.
  Trainer widened(Schedule::sync, DType::bf16, {});
  ASSERT_TRUE(widened.opt().load(path).ok());
  const RunResult w = widened.result();
  EXPECT_EQ(std::memcmp(w.state.data(), at6.state.data(), w.state.size() * 4), 0);

  // An fp32 run's checkpoint into 8-bit moments: each parameter's moments encoded.
  const std::string fp32_path = temp_file("fp32-to-int8");
  Trainer f(Schedule::sync, DType::bf16, {});
  f.run(1, 6, grads);
  ASSERT_TRUE(f.opt().save(fp32_path).ok());
  const RunResult fr = f.result();
  Trainer into(Schedule::sync, DType::bf16, int8_moments());
  ASSERT_TRUE(into.opt().load(fp32_path).ok());
  const RunResult ir = into.result();
  std::size_t at = 0;
  for (std::size_t n : {1000, 37, 4096, 1}) {
    std::vector<std::int8_t> mq(n);
    std::vector<std::uint8_t> vq(n);
    std::vector<float> ms(moment_blocks(n)), vs(moment_blocks(n)), m(n), v(n);
    encode_moments(&fr.state[at + n], &fr.state[at + 2 * n], n, mq.data(), vq.data(), ms.data(), vs.data());
    decode_moments(mq.data(), vq.data(), ms.data(), vs.data(), n, m.data(), v.data());
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(ir.state[at + i], fr.state[at + i]);  // master as saved
      ASSERT_EQ(ir.state[at + n + i], m[i]);
      ASSERT_EQ(ir.state[at + 2 * n + i], v[i]);
    }
    at += 3 * n;
  }
  std::remove(path.c_str());
  std::remove(fp32_path.c_str());
}

TEST(StateDtype, AStateDtypeThatIsNoMomentDtypeIsRefused) {
  auto device = make_host_device();
  DeviceParams model(*device, DType::bf16, {64}, 1);
  OffloadOptions o;
  o.state_dtype = DType::f16;
  Result<OffloadOptimizer> opt = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs, o);
  ASSERT_FALSE(opt.ok());
  EXPECT_NE(opt.status().message().find("state_dtype f16 is invalid"), std::string::npos) << opt.status().message();
}

#ifdef ZOE_HAVE_AIO
// bf16 moments on tier nvme: the swap tiles hold them as bf16 (8 bytes per element instead of 12), stepped
// by the same kernel as on tier ram — the same bits, every schedule; and checkpoints move between the tiers.
TEST(StateDtype, Bf16MomentsOnNvmeEqualRamBitwise) {
  testing::TempDir dir("zoe-state");
  OffloadOptions nvme = bf16_moments();
  nvme.tier = Tier::nvme;
  nvme.nvme.paths = {dir.path()};
  nvme.tile = 1024;  // several tiles per parameter, a short last one
  const RunResult ram = train(Schedule::sync, DType::bf16, bf16_moments(), 12, random_grads(1e-2));
  OffloadOptions fp32_nvme = nvme;
  fp32_nvme.state_dtype = DType::f32;
  for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
    SCOPED_TRACE(std::string(schedule_name(schedule)));
    const RunResult on_nvme = train(schedule, DType::bf16, nvme, 12, random_grads(1e-2));
    expect_bitwise_equal(ram, on_nvme);
    // The same tiles moved as with fp32 moments in the same schedule (overlap's redo after clipping reads
    // them again), 8 bytes per element instead of 12.
    const RunResult fp32 = train(schedule, DType::bf16, fp32_nvme, 12, random_grads(1e-2));
    EXPECT_EQ(on_nvme.stats.nvme_write_bytes * 12, fp32.stats.nvme_write_bytes * 8);
    EXPECT_EQ(on_nvme.stats.nvme_read_bytes * 12, fp32.stats.nvme_read_bytes * 8);
  }
  const std::string path = temp_file("bf16-nvme");
  {
    Trainer first(Schedule::sync, DType::bf16, nvme);
    first.run(1, 6, random_grads(1e-2));
    ASSERT_TRUE(first.opt().save(path).ok());
  }
  Trainer into_ram(Schedule::sync, DType::bf16, bf16_moments());
  ASSERT_TRUE(into_ram.opt().load(path).ok());
  into_ram.run(7, 12, random_grads(1e-2));
  const RunResult resumed = into_ram.result();
  EXPECT_EQ(std::memcmp(ram.state.data(), resumed.state.data(), ram.state.size() * 4), 0);
  std::remove(path.c_str());
}

// int8 moments on tier nvme: the swap tiles hold codes and block scales, each parameter starting a block of
// the store, stepped by the same kernel as on tier ram — the same bits; the checkpoint's codes move between
// the tiers both ways (exact resume), and fp32 moments are encoded as tier ram encodes them.
TEST(StateDtype, Int8MomentsOnNvmeEqualRamBitwise) {
  testing::TempDir dir("zoe-state");
  OffloadOptions nvme = int8_moments();
  nvme.tier = Tier::nvme;
  nvme.nvme.paths = {dir.path()};
  const GradFn grads = random_grads(1e-2);
  const RunResult ram = train(Schedule::sync, DType::bf16, int8_moments(), 12, grads);
  for (Schedule schedule : {Schedule::sync, Schedule::overlap}) {
    SCOPED_TRACE(std::string(schedule_name(schedule)));
    const RunResult on_nvme = train(schedule, DType::bf16, nvme, 12, grads);
    expect_bitwise_equal(ram, on_nvme);
    EXPECT_GT(on_nvme.stats.nvme_write_bytes, 0u);
  }
  const std::string from_nvme = temp_file("int8-nvme"), from_ram = temp_file("int8-ram");
  {
    Trainer a(Schedule::sync, DType::bf16, nvme);
    a.run(1, 6, grads);
    ASSERT_TRUE(a.opt().save(from_nvme).ok());
    Trainer b(Schedule::sync, DType::bf16, int8_moments());
    b.run(1, 6, grads);
    ASSERT_TRUE(b.opt().save(from_ram).ok());
  }
  for (const auto& [path, options] : {std::pair{from_nvme, int8_moments()}, std::pair{from_ram, nvme}}) {
    Trainer resumed(Schedule::sync, DType::bf16, options);
    const Status s = resumed.opt().load(path);
    ASSERT_TRUE(s.ok()) << s.to_string();
    resumed.run(7, 12, grads);
    const RunResult r = resumed.result();
    EXPECT_EQ(std::memcmp(ram.state.data(), r.state.data(), ram.state.size() * 4), 0) << path;
    EXPECT_EQ(ram.device_weights, r.device_weights) << path;
  }
  std::remove(from_nvme.c_str());
  std::remove(from_ram.c_str());
}

// An fp32 checkpoint loaded into int8 moments on tier nvme: the same codes as on tier ram, also where a
// parameter's block spans two of the slices a checkpoint streams in (8 MiB: the first parameter of 1001
// elements puts the slice boundary inside a block of the second). The gradients rise along each block, so
// that block's largest moments lie after the boundary: encoding its first part alone would give other scales.
TEST(StateDtype, Fp32CheckpointIntoInt8OnNvmeEncodesAsRam) {
  testing::TempDir dir("zoe-state");
  const std::vector<std::size_t> sizes = {1001, kCheckpointSlice + 5000, 77};
  const GradFn grads = [](DeviceParams& model, int t, float scale) {
    for (const ParamSpec& p : model.specs) {
      for (std::size_t i = 0; i < p.n; ++i) {
        const double rise = static_cast<double>(1 + i % kMomentBlock) / kMomentBlock;
        model.set(const_cast<void*>(p.device_grads), i, static_cast<float>(1e-2 * rise * t * scale));
      }
    }
  };
  const std::string path = temp_file("fp32-big");
  {
    Trainer f(Schedule::sync, DType::bf16, {}, 0, sizes);
    f.run(1, 2, grads);
    ASSERT_TRUE(f.opt().save(path).ok());
  }
  OffloadOptions nvme = int8_moments();
  nvme.tier = Tier::nvme;
  nvme.nvme.paths = {dir.path()};
  Trainer on_ram(Schedule::sync, DType::bf16, int8_moments(), 0, sizes);
  Trainer on_nvme(Schedule::sync, DType::bf16, nvme, 0, sizes);
  for (Trainer* t : {&on_ram, &on_nvme}) {
    const Status s = t->opt().load(path);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  const RunResult a = on_ram.result(), b = on_nvme.result();
  ASSERT_EQ(a.state.size(), b.state.size());
  EXPECT_EQ(std::memcmp(a.state.data(), b.state.data(), a.state.size() * 4), 0);
  std::remove(path.c_str());
}
#endif

}  // namespace
}  // namespace zoe::test
