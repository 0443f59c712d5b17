// The parameter tier on the test device (the host stand-in, or a GPU: param_test_device.h): what a fetch
// returns is the home's bytes, the pool never holds more than its budget, prefetch follows the order, a
// write never races a copy or a block in use, and NVMe faults name what failed and lose nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <vector>

#include "tests/param/param_test_device.h"
#include "zoe/param_tier.h"
#ifdef ZOE_HAVE_AIO
#include "tests/aio/aio_test_util.h"
#endif

namespace zoe {
namespace {

using ParamTierCpu = OnTestDevice;
using ParamTierNvme = OnTestDevice;

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// A model-like layout: block b has a weight matrix, a bias and a norm (sizes not multiples of anything).
std::vector<ParamBlockSpec> layer_blocks(std::size_t layers, std::size_t width) {
  std::vector<ParamBlockSpec> blocks;
  for (std::size_t b = 0; b < layers; ++b) {
    blocks.push_back({"layer." + std::to_string(b), {width * width * 2 + 2 * b, width * 2, width * 2 + 6}});
  }
  return blocks;
}

struct Fixture {
  std::unique_ptr<Device> device = make_test_device();
  std::vector<ParamBlockSpec> specs;
  std::vector<std::vector<std::vector<unsigned char>>> contents;  // [block][entry]

  explicit Fixture(std::vector<ParamBlockSpec> s) : specs(std::move(s)) {
    for (std::size_t b = 0; b < specs.size(); ++b) {
      contents.emplace_back();
      for (std::size_t e = 0; e < specs[b].entry_bytes.size(); ++e) {
        contents[b].push_back(random_bytes(specs[b].entry_bytes[e], static_cast<unsigned>(b * 31 + e)));
      }
    }
  }
  Status write_all(ParamTier& tier) {
    for (std::size_t b = 0; b < specs.size(); ++b) {
      for (std::size_t e = 0; e < specs[b].entry_bytes.size(); ++e) {
        if (Status s = tier.write(b, e, contents[b][e].data(), 0, contents[b][e].size()); !s.ok()) return s;
      }
    }
    return Status::success();
  }
  // What the compute stream sees at `address` after a fetch, compared with the contents.
  void expect_on_device(ParamTier& tier, std::size_t b, void* address) {
    for (std::size_t e = 0; e < specs[b].entry_bytes.size(); ++e) {
      std::vector<unsigned char> seen(specs[b].entry_bytes[e]);
      ASSERT_TRUE(device->copy_to_host(seen.data(), static_cast<unsigned char*>(address) + tier.entry_offset(b, e),
                                       seen.size(), Stream::compute).ok());
      Result<EventId> ev = device->record(Stream::compute);
      ASSERT_TRUE(ev.ok());
      ASSERT_TRUE(device->synchronize(ev.value()).ok());
      ASSERT_EQ(seen, contents[b][e]) << "block " << b << " entry " << e;
    }
  }
  // Forward then backward over every block, as a trainer's hooks would, checking each fetch.
  void iteration(ParamTier& tier) {
    for (std::size_t b = 0; b < specs.size(); ++b) {
      Result<void*> a = tier.fetch(b);
      ASSERT_TRUE(a.ok()) << a.status().to_string();
      ASSERT_TRUE(device->simulate_compute(1e-4, Stream::compute).ok());
      expect_on_device(tier, b, a.value());
      ASSERT_TRUE(tier.release(b).ok());
    }
    for (std::size_t b = specs.size(); b-- > 0;) {
      Result<void*> a = tier.fetch(b, true);
      ASSERT_TRUE(a.ok()) << a.status().to_string();
      expect_on_device(tier, b, a.value());
      ASSERT_TRUE(tier.release(b).ok());
    }
  }
};

std::size_t largest_block(ParamTier& tier) {
  std::size_t m = 0;
  for (std::size_t b = 0; b < tier.blocks(); ++b) m = std::max(m, tier.block_bytes(b));
  return m;
}

TEST_F(ParamTierCpu, FetchesTheHomesBytesWithinTheBudget) {
  Fixture f(layer_blocks(12, 64));
  ParamTierOptions o;
  o.budget_bytes = 1;  // replaced below, once the block size is known
  Result<ParamTier> probe = ParamTier::create(*f.device, f.specs, ParamTierOptions{});
  ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  o.budget_bytes = 3 * largest_block(probe.value()) + 1000;
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  for (int it = 0; it < 3; ++it) f.iteration(tier.value());
  ASSERT_TRUE(tier->synchronize().ok());
  const ParamTierStats s = tier->stats();
  EXPECT_LE(s.pool_peak_bytes, o.budget_bytes / 256 * 256);
  EXPECT_GT(s.evictions, 0u);  // 12 blocks through room for 3
  EXPECT_EQ(s.fetches, 3u * 24u);
  for (std::size_t b = 0; b < tier->blocks(); ++b) EXPECT_EQ(tier->in_use(b), 0u);
}

TEST_F(ParamTierCpu, PrefetchFollowsTheOrderForwardAndBackward) {
  Fixture f(layer_blocks(8, 32));
  ParamTierOptions o;
  o.prefetch = 2;
  o.budget_bytes = 1 << 20;  // everything fits: loads count first arrivals only
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  ASSERT_TRUE(tier->set_order({7, 6, 5, 4, 3, 2, 1, 0}).ok());
  Result<void*> a = tier->fetch(7);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(tier->stats().loads, 3u);  // 7, and 6 and 5 ahead
  ASSERT_TRUE(tier->release(7).ok());
  a = tier->fetch(6);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(tier->stats().hits, 1u);
  EXPECT_EQ(tier->stats().loads, 4u);  // 4 now
  ASSERT_TRUE(tier->release(6).ok());
  // Backward from block 2 prefetches the blocks before it in the order: 3 and 4 (both resident already).
  a = tier->fetch(2, true);
  ASSERT_TRUE(a.ok());
  f.expect_on_device(tier.value(), 2, a.value());
  ASSERT_TRUE(tier->release(2).ok());
  EXPECT_FALSE(tier->set_order({1, 1}).ok());
  EXPECT_FALSE(tier->set_order({9}).ok());
}

TEST_F(ParamTierCpu, ABlockLargerThanTheBudgetIsRefusedAtSetUp) {
  Fixture f({{"small", {1000}}, {"huge.mlp", {1 << 20}}});
  ParamTierOptions o;
  o.budget_bytes = 1 << 16;
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(tier.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(tier.status().message().find("'huge.mlp' needs 1048576 bytes"), std::string::npos) << tier.status().message();
  EXPECT_NE(tier.status().message().find("65536"), std::string::npos);
}

TEST_F(ParamTierCpu, NoRoomWhileEveryBlockIsInUseIsAnErrorNamingThem) {
  Fixture f({{"a", {4096}}, {"b", {4096}}, {"c", {4096}}});
  ParamTierOptions o;
  o.budget_bytes = 2 * 4096;
  o.prefetch = 0;
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok());
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  ASSERT_TRUE(tier->fetch(0).ok());
  ASSERT_TRUE(tier->fetch(1).ok());
  Result<void*> c = tier->fetch(2);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::out_of_memory);
  EXPECT_NE(c.status().message().find("'a' (4096 bytes), 'b' (4096 bytes)"), std::string::npos) << c.status().message();
  ASSERT_TRUE(tier->release(0).ok());
  c = tier->fetch(2);  // a's room, once a is released
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  f.expect_on_device(tier.value(), 2, c.value());
  EXPECT_FALSE(tier->release(0).ok());  // released more often than fetched
}

TEST_F(ParamTierCpu, AWriteReachesTheNextFetchAndNeverTheCopyInUse) {
  Fixture f(layer_blocks(3, 48));
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, ParamTierOptions{});
  ASSERT_TRUE(tier.ok());
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  Result<void*> a = tier->fetch(1);
  ASSERT_TRUE(a.ok());
  std::vector<unsigned char> update = random_bytes(f.specs[1].entry_bytes[0], 99);
  ASSERT_TRUE(tier->write(1, 0, update.data(), 0, update.size()).ok());
  f.expect_on_device(tier.value(), 1, a.value());  // the copy in use stays whole: the old bytes
  ASSERT_TRUE(tier->release(1).ok());              // ... and is dropped now
  f.contents[1][0] = update;
  a = tier->fetch(1);
  ASSERT_TRUE(a.ok());
  f.expect_on_device(tier.value(), 1, a.value());
  ASSERT_TRUE(tier->release(1).ok());
  // Released and still pooled: the write drops the stale pooled copy.
  update = random_bytes(f.specs[1].entry_bytes[0], 100);
  ASSERT_TRUE(tier->write(1, 0, update.data(), 0, update.size()).ok());
  f.contents[1][0] = update;
  // A part of an entry.
  std::vector<unsigned char> part = random_bytes(10, 7);
  ASSERT_TRUE(tier->write(1, 2, part.data(), 5, part.size()).ok());
  std::copy(part.begin(), part.end(), f.contents[1][2].begin() + 5);
  a = tier->fetch(1);
  ASSERT_TRUE(a.ok());
  f.expect_on_device(tier.value(), 1, a.value());
  ASSERT_TRUE(tier->release(1).ok());
  std::vector<unsigned char> back(f.specs[1].entry_bytes[2]);
  ASSERT_TRUE(tier->read(1, 2, back.data(), 0, back.size()).ok());
  EXPECT_EQ(back, f.contents[1][2]);
  EXPECT_FALSE(tier->write(1, 3, part.data(), 0, 1).ok());                            // no entry 3
  EXPECT_FALSE(tier->write(1, 1, part.data(), f.specs[1].entry_bytes[1], 1).ok());    // past its end
  EXPECT_FALSE(tier->fetch(3).ok());
}

TEST_F(ParamTierCpu, RandomUseNeverServesStaleOrForeignBytes) {
  // Fetches, releases and rewrites in random order against a model of the contents, with a pool that
  // holds about three blocks: every reuse of room and every dropped copy is exercised.
  Fixture f(layer_blocks(10, 40));
  ParamTierOptions o;
  o.prefetch = 1;
  Result<ParamTier> probe = ParamTier::create(*f.device, f.specs, ParamTierOptions{});
  ASSERT_TRUE(probe.ok());
  o.budget_bytes = 3 * largest_block(probe.value());
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok());
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  std::mt19937 rng(5);
  std::vector<std::size_t> held;
  for (int step = 0; step < 400; ++step) {
    const int what = static_cast<int>(rng() % 3);
    const std::size_t b = rng() % f.specs.size();
    if (what == 0 && held.size() < 2) {
      Result<void*> a = tier->fetch(b, rng() % 2 == 0);
      ASSERT_TRUE(a.ok()) << a.status().to_string();
      f.expect_on_device(tier.value(), b, a.value());
      held.push_back(b);
    } else if (what == 1 && !held.empty()) {
      ASSERT_TRUE(tier->release(held.back()).ok());
      held.pop_back();
    } else if (std::find(held.begin(), held.end(), b) == held.end()) {  // in use: the test's model would be stale
      const std::size_t e = rng() % f.specs[b].entry_bytes.size();
      f.contents[b][e] = random_bytes(f.contents[b][e].size(), static_cast<unsigned>(1000 + step));
      ASSERT_TRUE(tier->write(b, e, f.contents[b][e].data(), 0, f.contents[b][e].size()).ok());
    }
  }
  for (std::size_t b : held) ASSERT_TRUE(tier->release(b).ok());
  ASSERT_TRUE(tier->synchronize().ok());
  EXPECT_LE(tier->stats().pool_peak_bytes, o.budget_bytes);
}

#ifdef ZOE_HAVE_AIO
using testing::FaultPlan;
using testing::TempDir;

TEST_F(ParamTierNvme, FetchesTheHomesBytesFromTheFile) {
  TempDir dir("zoe-param");
  Fixture f(layer_blocks(12, 64));
  ParamTierOptions o = nvme_home({dir.sub("a"), dir.sub("b")});
  o.prefetch = 2;
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_EQ(tier->files().size(), 2u);
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  for (int it = 0; it < 2; ++it) f.iteration(tier.value());
  ASSERT_TRUE(tier->synchronize().ok());
  const ParamTierStats s = tier->stats();
  EXPECT_LE(s.pool_peak_bytes, s.budget_bytes);
  EXPECT_GE(s.read_bytes, s.loaded_bytes);  // every load came from the file
  const std::vector<std::string> files = tier->files();
  tier = Status(StatusCode::internal, "destroyed");
  for (const std::string& p : files) EXPECT_FALSE(std::filesystem::exists(p)) << p;  // scratch, removed
}

// Two tiers given one folder and name (two optimizers with parameter offload on one nvme_path): the second
// is refused naming the holder, the first keeps its file and bytes, and a tier that ends leaves nothing.
TEST_F(ParamTierNvme, ASecondTierOnTheSameFileIsRefusedAndTheFirstKeepsItsBytes) {
  TempDir dir("zoe-param");
  Fixture f(layer_blocks(4, 64));
  const ParamTierOptions o = nvme_home({dir.path()});
  Result<ParamTier> first = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  ASSERT_TRUE(f.write_all(first.value()).ok());
  Result<ParamTier> second = ParamTier::create(*f.device, f.specs, o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().sys_errno(), EBUSY) << second.status().to_string();
  EXPECT_NE(second.status().message().find(dir.path()), std::string::npos) << second.status().to_string();
  f.iteration(first.value());  // the first tier's file is whole: every block fetches its own bytes
  ASSERT_TRUE(first->synchronize().ok());
  first = Status(StatusCode::internal, "destroyed");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  EXPECT_TRUE(ParamTier::create(*f.device, f.specs, o).ok());
}

TEST_F(ParamTierNvme, AFetchTakesTheRoomOfABlockStillBeingPrefetched) {
  TempDir dir("zoe-param");
  Fixture f({{"a", {1 << 20}}, {"b", {1 << 20}}, {"c", {1 << 20}}});
  ParamTierOptions o = nvme_home({dir.path()});
  o.prefetch = 1;
  o.budget_bytes = 2 << 20;
  for (int round = 0; round < 20; ++round) {  // the prefetch of b is caught in flight in some rounds
    Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
    ASSERT_TRUE(tier.ok()) << tier.status().to_string();
    ASSERT_TRUE(f.write_all(tier.value()).ok());
    Result<void*> a = tier->fetch(0);  // and b ahead, into the rest of the pool
    ASSERT_TRUE(a.ok());
    Result<void*> c = tier->fetch(2);  // a is in use: only b's room is left
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    f.expect_on_device(tier.value(), 2, c.value());
    f.expect_on_device(tier.value(), 0, a.value());
    ASSERT_TRUE(tier->release(0).ok());
    ASSERT_TRUE(tier->release(2).ok());
  }
}

// A pool of one block: b's load into a's room must wait for the work still reading a there (a slow compute
// stream). On the CPU as the device the read lands in the room itself, so the loader waits on the host.
TEST_F(ParamTierNvme, ARoomIsLoadedOnlyOnceTheWorkReadingItsLastBlockIsDone) {
  TempDir dir("zoe-param");
  Fixture f({{"a", {1 << 20}}, {"b", {1 << 20}}});
  ParamTierOptions o = nvme_home({dir.path()});
  o.prefetch = 0;
  o.budget_bytes = 1 << 20;
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  Result<void*> a = tier->fetch(0);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  std::vector<unsigned char> seen(f.contents[0][0].size());
  ASSERT_TRUE(f.device->simulate_compute(0.05, Stream::compute).ok());
  ASSERT_TRUE(f.device->copy_to_host(seen.data(), a.value(), seen.size(), Stream::compute).ok());
  Result<EventId> read = f.device->record(Stream::compute);
  ASSERT_TRUE(read.ok());
  ASSERT_TRUE(tier->release(0).ok());
  Result<void*> b = tier->fetch(1);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  ASSERT_EQ(b.value(), a.value());  // the one room
  ASSERT_TRUE(f.device->synchronize(read.value()).ok());
  EXPECT_TRUE(seen == f.contents[0][0]) << "the work reading block a saw block b's bytes";
  f.expect_on_device(tier.value(), 1, b.value());
  ASSERT_TRUE(tier->release(1).ok());
}

// Two loaders read two blocks at once, and the engine issues requests in the order they were queued. A
// block's requests must go in together: interleaved, each block's small entries would wait behind the
// other block's large one, and both blocks would complete together instead of one after the other. The
// fault hook sees every read with its issue index.
TEST_F(ParamTierNvme, ABlocksReadsAreIssuedTogether) {
  TempDir dir("zoe-param");
  constexpr std::size_t kBlocks = 8, kEntries = 6, kEntryBytes = 8192, kRequest = 4096;
  std::vector<ParamBlockSpec> specs;
  for (std::size_t b = 0; b < kBlocks; ++b) {
    specs.push_back({"layer." + std::to_string(b), std::vector<std::size_t>(kEntries, kEntryBytes)});
  }
  Fixture f(specs);
  std::mutex mutex;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> reads;  // issue index, file offset
  ParamTierOptions o = nvme_home({dir.path()});
  o.request_bytes = kRequest;
  o.queue_depth = 2;
  o.prefetch = 2;
  o.fault_hook = [&](const IoSite& site) {
    if (site.op == IoOp::read) {
      std::lock_guard lock(mutex);
      reads.emplace_back(site.index, site.offset);
    }
    return IoFault{};
  };
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  for (int it = 0; it < 10; ++it) f.iteration(tier.value());
  ASSERT_TRUE(tier->synchronize().ok());
  // Blocks lie back to back in each half of the file, entries unpadded (8 KiB is a multiple of the alignment).
  const std::uint64_t block_span = kEntries * kEntryBytes, half = kBlocks * block_span;
  std::sort(reads.begin(), reads.end());
  const std::size_t per_block = kEntries * kEntryBytes / kRequest;
  ASSERT_GE(reads.size(), 10 * per_block);
  std::size_t run = 0;
  for (std::size_t i = 0; i < reads.size(); ++i) {
    const std::uint64_t block = reads[i].second % half / block_span;
    ++run;
    const bool last = i + 1 == reads.size() || reads[i + 1].second % half / block_span != block;
    if (!last) continue;
    ASSERT_EQ(run % per_block, 0u) << "block " << block << "'s reads were split by another block's, ending at issue "
                                   << reads[i].first;
    run = 0;
  }
}

TEST_F(ParamTierNvme, AFailedReadNamesBlockFileAndOffsetAndARetryFetches) {
  TempDir dir("zoe-param");
  Fixture f(layer_blocks(4, 32));
  FaultPlan plan;
  ParamTierOptions o = nvme_home({dir.path()});
  o.prefetch = 0;
  o.fault_hook = plan.hook();
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  // The fault goes on the bias's request (entry 1). The block's read has all its entries in flight at once,
  // and they complete in any order (in the emulated AArch64 machine, entry 2 before entry 1): the bias's file
  // offset is learned from a read of that entry alone.
  std::vector<unsigned char> bias(f.specs[2].entry_bytes[1]);
  ASSERT_TRUE(tier->read(2, 1, bias.data(), 0, bias.size()).ok());
  const std::int64_t bias_offset = plan.last_offset;
  ASSERT_GE(bias_offset, 0);
  plan.arm(IoOp::read, 0, EIO);
  plan.at_offset = bias_offset;
  Result<void*> a = tier->fetch(2);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().sys_errno(), EIO);
  EXPECT_NE(a.status().message().find("block 'layer.2' (2) entry 1"), std::string::npos) << a.status().message();
  EXPECT_NE(a.status().message().find(tier->files()[0] + " at offset "), std::string::npos) << a.status().message();
  EXPECT_EQ(tier->in_use(2), 0u);
  plan.clear();
  a = tier->fetch(2);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  f.expect_on_device(tier.value(), 2, a.value());
  ASSERT_TRUE(tier->release(2).ok());
}

TEST_F(ParamTierNvme, AFailedWriteKeepsThePreviousCopyAndARetryLands) {
  TempDir dir("zoe-param");
  Fixture f(layer_blocks(3, 32));
  FaultPlan plan;
  ParamTierOptions o = nvme_home({dir.path()});
  o.fault_hook = plan.hook();
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok());
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  std::vector<unsigned char> update = random_bytes(f.specs[0].entry_bytes[0], 42);
  for (int err : {ENOSPC, EIO}) {
    plan.arm(IoOp::write, 0, err);
    Status s = tier->write(0, 0, update.data(), 0, update.size());
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.sys_errno(), err);
    EXPECT_NE(s.message().find("keeps its previous copy"), std::string::npos) << s.message();
    plan.clear();
    Result<void*> a = tier->fetch(0);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    f.expect_on_device(tier.value(), 0, a.value());  // the old bytes, intact
    ASSERT_TRUE(tier->release(0).ok());
  }
  // A short write is a failure too.
  plan.arm(IoOp::write, 0, 0, 512);
  ASSERT_FALSE(tier->write(0, 0, update.data(), 0, update.size()).ok());
  plan.clear();
  ASSERT_TRUE(tier->write(0, 0, update.data(), 0, update.size()).ok());
  f.contents[0][0] = update;
  Result<void*> a = tier->fetch(0);
  ASSERT_TRUE(a.ok());
  f.expect_on_device(tier.value(), 0, a.value());
  ASSERT_TRUE(tier->release(0).ok());
}

// write_blocks: a block's entries in flight together, the next block's behind them. One failing request
// leaves its entry's previous copy and only it; the others land; a retry lands all.
TEST_F(ParamTierNvme, BlockWritesFailingInOneEntryKeepThatEntrysCopy) {
  TempDir dir("zoe-param");
  Fixture f(layer_blocks(3, 32));
  // The failing request is picked by its issue number (the engine numbers requests as it issues them, in
  // submission order), not by the order of completions, which varies with timing.
  std::atomic<std::uint64_t> writes_issued{0};
  std::atomic<std::int64_t> fail_index{-1};
  ParamTierOptions o = nvme_home({dir.path()});
  o.fault_hook = [&](const IoSite& site) -> IoFault {
    if (site.op != IoOp::write) return {};
    if (site.index + 1 > writes_issued) writes_issued = site.index + 1;  // completions come from one thread
    return static_cast<std::int64_t>(site.index) == fail_index ? IoFault{EIO, -1} : IoFault{};
  };
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok());
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  const std::vector<std::size_t> order = {1, 2, 0};
  std::vector<std::vector<std::vector<unsigned char>>> update(f.specs.size());
  std::vector<ParamBlockWrite> writes;
  for (std::size_t b : order) {
    ParamBlockWrite w{b, {}};
    for (std::size_t e = 0; e < f.specs[b].entry_bytes.size(); ++e) {
      update[b].push_back(random_bytes(f.specs[b].entry_bytes[e], static_cast<unsigned>(100 + 10 * b + e)));
      w.src.push_back(update[b].back().data());
    }
    writes.push_back(w);
  }
  fail_index = static_cast<std::int64_t>(writes_issued.load()) + 1;  // the second entry of block 1
  Status s = tier->write_blocks(writes);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_NE(s.message().find("block 'layer.1' (1) entry 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("keeps its previous copy"), std::string::npos) << s.message();
  fail_index = -1;
  // Block 1: that entry old, the others new; block 2 (in flight with it) new; block 0 (behind the failure,
  // never submitted) old.
  const std::vector<std::size_t> expect_kept = {3, 1, 0};
  for (std::size_t b = 0; b < f.specs.size(); ++b) {
    std::size_t kept = 0;
    for (std::size_t e = 0; e < f.specs[b].entry_bytes.size(); ++e) {
      std::vector<unsigned char> seen(f.specs[b].entry_bytes[e]);
      ASSERT_TRUE(tier->read(b, e, seen.data(), 0, seen.size()).ok());
      if (seen == f.contents[b][e]) {
        ++kept;
      } else {
        EXPECT_EQ(seen, update[b][e]) << "block " << b << " entry " << e << " is neither its old nor its new bytes";
      }
    }
    EXPECT_EQ(kept, expect_kept[b]) << "block " << b;
  }
  ASSERT_TRUE(tier->write_blocks(writes).ok());
  f.contents = update;
  f.iteration(tier.value());  // every block fetched, checked against the new bytes
  // A source per entry, each block once, or the call is refused.
  std::vector<ParamBlockWrite> twice = {writes[0], writes[0]};
  EXPECT_EQ(tier->write_blocks(twice).code(), StatusCode::invalid_argument);
  writes[0].src.pop_back();
  EXPECT_EQ(tier->write_blocks(writes).code(), StatusCode::invalid_argument);
}

TEST_F(ParamTierNvme, ACorruptedFileIsRefusedByItsChecksum) {
  TempDir dir("zoe-param");
  Fixture f(layer_blocks(2, 32));
  ParamTierOptions o = nvme_home({dir.path()});
  o.prefetch = 0;
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_TRUE(tier.ok());
  ASSERT_TRUE(f.write_all(tier.value()).ok());
  {
    std::fstream file(tier->files()[0], std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(10);
    const char junk = static_cast<char>(f.contents[0][0][10] ^ 0x5a);
    file.write(&junk, 1);
  }
  Result<void*> a = tier->fetch(0);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::corrupt);
  EXPECT_NE(a.status().message().find("fails its CRC-32C"), std::string::npos) << a.status().message();
}

TEST_F(ParamTierNvme, AFullPathFailsAtSetUp) {
  TempDir dir("zoe-param");
  Fixture f(layer_blocks(2, 32));
  FaultPlan plan;
  ParamTierOptions o = nvme_home({dir.path()});
  o.fault_hook = plan.hook();
  plan.arm(IoOp::allocate, 0, ENOSPC);
  Result<ParamTier> tier = ParamTier::create(*f.device, f.specs, o);
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(tier.status().sys_errno(), ENOSPC);
  EXPECT_NE(tier.status().message().find(dir.path()), std::string::npos) << tier.status().message();
}
#endif

}  // namespace
}  // namespace zoe
