// Bounded fuzzing (tests/fuzz.h) of what SwapStore::open reads from a previous run: the JSON manifest in
// each path and the binary tile table (raw, and re-sealed with a valid checksum so that the values behind
// the check are reached). open() must refuse with a clear error or give a store that reads back exactly
// the data written, never different data.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "base/crc32c.h"
#include "tests/aio/aio_test_util.h"
#include "tests/nvme/swap_model.h"
#include "tests/fuzz.h"
#include "zoe/swap.h"

namespace zoe {
namespace {

using fuzz::Case;
using fuzz::Rng;
using fuzz::Verdict;
using fuzz::read_file;
using fuzz::write_file;

constexpr std::size_t kTile = 4096;
constexpr std::size_t kN = 3 * kTile + 5;
constexpr std::size_t kTiles = 4;
// src/nvme/swap_store.cpp: a 32-byte header, 24 bytes per tile, the CRC-32C of both, in each of two regions
// rounded up to 4 KiB.
constexpr std::size_t kTableBody = 32 + kTiles * 24;
constexpr std::size_t kTableRegion = 4096;

SwapOptions options(const std::vector<std::string>& paths) {
  SwapOptions o;
  o.paths = paths;
  o.buffer_count = 2;
  o.queue_depth = 2;
  o.block_size = 16 << 10;
  o.durable = false;  // nothing here is written after creation
  o.cpu.threads = 1;
  return o;
}

TEST(FuzzReaders, SwapStoreManifestAndTable) {
  testing::TempDir dir("zoe-fuzz-swap");
  const std::vector<std::string> paths{dir.sub("disk0"), dir.sub("disk1")};
  {
    Result<SwapStore> s = SwapStore::create(options(paths), "rank0", kN, kTile);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    ASSERT_EQ(s->tiles(), kTiles);
    ASSERT_TRUE(s->initialize(testing::fill_initial).ok());
  }
  std::vector<float> expected(kN);
  ASSERT_TRUE(testing::fill_initial(0, kN, expected.data()).ok());
  const std::string files[3] = {paths[0] + "/rank0.zoe-swap.json", paths[1] + "/rank0.zoe-swap.json",
                                paths[0] + "/rank0.zoe-swap.table"};
  std::string valid[3];
  for (int k = 0; k < 3; ++k) valid[k] = read_file(files[k]);
  ASSERT_EQ(valid[2].size(), 2 * kTableRegion);

  // Opens the store as the case left its files: refused, or the same data as written.
  auto open_and_read = [&](const Case& c) {
    Result<SwapStore> s = SwapStore::open(options(paths), "rank0", kN, kTile);
    if (!s.ok()) {
      EXPECT_FALSE(s.status().message().empty()) << c.mutation << ": an error without a message";
      return Verdict::refused;
    }
    EXPECT_EQ(s->n(), kN);
    EXPECT_EQ(s->tile(), kTile);
    EXPECT_EQ(s->tiles(), kTiles);
    std::vector<float> p(kN, -1.0f);
    const Status r = s->read(0, kN, p.data(), nullptr, nullptr);
    if (!r.ok()) {
      EXPECT_FALSE(r.message().empty()) << c.mutation;
      return Verdict::refused;
    }
    EXPECT_EQ(p, expected) << c.mutation << ": an accepted store read back other data";
    return Verdict::accepted;
  };
  {
    Case c{"", "none"};
    ASSERT_EQ(open_and_read(c), Verdict::accepted);
  }

  int target = 0;  // the file the current case changed (restored after it)
  const fuzz::Tally t = fuzz::run(
      "swap-store", fuzz::default_budget(),
      [&](Rng& rng) {
        Case c;
        target = static_cast<int>(rng() % 4);
        if (target < 2) {
          c.input = fuzz::mutate_json(valid[target], rng, &c.mutation);
          c.mutation = "manifest " + std::to_string(target) + ": " + c.mutation;
        } else if (target == 2) {
          c.input = fuzz::mutate_binary(valid[2], rng, &c.mutation);
          c.mutation = "table: " + c.mutation;
        } else {
          // One region's header and entries changed in place, its checksum recomputed.
          target = 2;
          const std::size_t at = (rng() % 2) * kTableRegion;
          std::string body = fuzz::mutate_binary(valid[2].substr(at, kTableBody), rng, &c.mutation);
          body.resize(kTableBody, '\0');
          c.input = valid[2];
          c.input.replace(at, kTableBody, body);
          fuzz::put_le(c.input, at + kTableBody, crc32c(body.data(), body.size()), 4);
          c.mutation = "resealed table region: " + c.mutation;
        }
        return c;
      },
      [&](const Case& c) {
        // Put back even when the reader throws: the next case starts from valid files.
        struct Restore {
          const std::string& path;
          const std::string& bytes;
          ~Restore() { write_file(path, bytes); }
        } restore{files[target], valid[target]};
        write_file(files[target], c.input);
        return open_and_read(c);
      });
  fuzz::expect_both_outcomes(t);
  EXPECT_EQ(open_and_read(Case{"", "restored"}), Verdict::accepted);
}

}  // namespace
}  // namespace zoe
