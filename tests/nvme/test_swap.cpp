// The swap store: the pipelined step against CpuAdam in RAM (bitwise), striping over two paths, the
// manifest round trip and its refusals, read/write/set_step, and the buffered fallback.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <fstream>
#include <string>
#include <vector>

#include "tests/aio/aio_test_util.h"
#include "tests/nvme/swap_model.h"
#include "zoe/swap.h"

namespace zoe {
namespace {

using testing::SwapModel;
using testing::TempDir;

constexpr std::size_t kTile = 4096;             // elements: 16 KiB per array, a multiple of 4 KiB
constexpr std::size_t kN = 5 * kTile + 123;     // six tiles, the last one partial

SwapOptions small_options(std::vector<std::string> paths) {
  SwapOptions o;
  o.paths = std::move(paths);
  o.buffer_count = 3;
  o.queue_depth = 4;
  o.block_size = 16 << 10;  // several requests per tile
  o.cpu.threads = 2;
  return o;
}

Result<SwapStore> make_store(const SwapOptions& o, std::size_t n = kN) {
  Result<SwapStore> s = SwapStore::create(o, "rank0", n, kTile);
  if (!s.ok()) return s;
  if (Status i = s->initialize(testing::fill_initial); !i.ok()) return i;
  return s;
}

void run_steps(SwapStore& store, SwapModel& model, std::int64_t first, std::int64_t last) {
  for (std::int64_t step = first; step <= last; ++step) {
    model.make_grads(step);
    std::vector<SwapSegment> segs = model.segments();
    StepOptions o;
    o.step = step;
    Status s = store.step(segs, o);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.to_string();
    model.reference_step(step);
  }
}

TEST(SwapStore, StepsMatchCpuAdamBitwise) {
  TempDir dir;
  Result<SwapStore> store = make_store(small_options({dir.path()}));
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_EQ(store->tiles(), 6u);
  EXPECT_EQ(store->direct_io(), testing::direct_io_works(dir.path()));
  SwapModel model(kN, testing::default_specs(kN));
  run_steps(*store, model, 1, 6);
  model.expect_matches(*store);
  for (std::size_t t = 0; t < store->tiles(); ++t) EXPECT_EQ(store->tile_step(t), 6);
  // Every tile went through the pipeline once each way in the last step.
  model.make_grads(7);
  std::vector<SwapSegment> segs = model.segments();
  StepOptions o;
  o.step = 7;
  ASSERT_TRUE(store->step(segs, o).ok());
  const SwapStats& st = store->last_stats();
  EXPECT_EQ(st.read_bytes, 6 * 12 * kTile);
  EXPECT_EQ(st.write_bytes, 6 * 12 * kTile);
  EXPECT_EQ(st.tiles_stepped, 6u);
  EXPECT_GT(st.total_s, 0.0);
  EXPECT_EQ(store->buffer_bytes(), 3 * 12 * kTile);
}

TEST(SwapStore, TwoPathsStripeTheTiles) {
  TempDir dir;
  const std::string a = dir.sub("disk0"), b = dir.sub("disk1");
  Result<SwapStore> store = make_store(small_options({a, b}));
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  SwapModel model(kN, testing::default_specs(kN));
  run_steps(*store, model, 1, 4);
  model.expect_matches(*store);
  // Six tiles: three on each path, two slots each.
  for (const std::string& f : store->files()) {
    EXPECT_EQ(std::filesystem::file_size(f), 2u * 3 * 12 * kTile) << f;
    struct stat st{};
    ASSERT_EQ(::stat(f.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
  }
  EXPECT_EQ(store->files()[0], a + "/rank0.zoe-swap");
  EXPECT_EQ(store->files()[1], b + "/rank0.zoe-swap");
  EXPECT_TRUE(std::filesystem::exists(a + "/rank0.zoe-swap.json"));
  EXPECT_TRUE(std::filesystem::exists(b + "/rank0.zoe-swap.json"));
}

TEST(SwapStore, ManifestRoundTripsAcrossRuns) {
  TempDir dir;
  const std::string a = dir.sub("disk0"), b = dir.sub("disk1");
  SwapModel model(kN, testing::default_specs(kN));
  {
    Result<SwapStore> store = make_store(small_options({a, b}));
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    run_steps(*store, model, 1, 3);
  }
  Result<SwapStore> reopened = SwapStore::open(small_options({a, b}), "rank0", kN, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  model.expect_matches(*reopened, false);
  for (std::size_t t = 0; t < reopened->tiles(); ++t) EXPECT_EQ(reopened->tile_step(t), 3);
  run_steps(*reopened, model, 4, 5);
  model.expect_matches(*reopened);
  { SwapStore closed = std::move(reopened).value(); }  // the next run opens it once this one has let go
  reopened = SwapStore::open_or_create(small_options({a, b}), "rank0", kN, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  EXPECT_EQ(reopened->tile_step(0), 5);
}

void expect_refused(const Result<SwapStore>& r, const std::string& needle) {
  ASSERT_FALSE(r.ok()) << "expected a refusal mentioning '" << needle << "'";
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
}

TEST(SwapStore, OpenRefusesAMismatchWithTheReason) {
  TempDir dir;
  const std::string a = dir.sub("disk0"), b = dir.sub("disk1"), c = dir.sub("disk2");
  {
    Result<SwapStore> store = make_store(small_options({a, b}));
    ASSERT_TRUE(store.ok()) << store.status().to_string();
  }
  expect_refused(SwapStore::open(small_options({a, b}), "rank0", kN + 1, kTile), "n = ");
  expect_refused(SwapStore::open(small_options({a, b}), "rank0", kN, 2 * kTile), "tile = ");
  SwapOptions bf16 = small_options({a, b});
  bf16.state_dtype = DType::bf16;  // its slots are laid out for 2-byte moments
  expect_refused(SwapStore::open(bf16, "rank0", kN, kTile), "state_dtype = f32, this run asks for bf16");
  bf16.state_dtype = DType::i8;
  expect_refused(SwapStore::open(bf16, "rank0", kN, kTile), "state_dtype = f32, this run asks for i8");
  expect_refused(SwapStore::open(small_options({b, a}), "rank0", kN, kTile), "paths = ");
  expect_refused(SwapStore::open(small_options({a, c}), "rank0", kN, kTile), "paths = ");
  expect_refused(SwapStore::open(small_options({c}), "rank0", kN, kTile), "no swap store named rank0");
  expect_refused(SwapStore::open(small_options({a}), "rank0", kN, kTile), "paths = ");
  expect_refused(SwapStore::open(small_options({a, b}), "rank1", kN, kTile), "no swap store named rank1");
  expect_refused(SwapStore::create(small_options({a, b}), "rank0", kN, kTile), "already exists");
  // A manifest from a future format version.
  const std::string manifest = a + "/rank0.zoe-swap.json";
  std::ifstream in(manifest);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t at = text.find("\"version\": 1");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 12, "\"version\": 9");
  std::ofstream(manifest) << text;
  expect_refused(SwapStore::open(small_options({a, b}), "rank0", kN, kTile), "format version = 9");
  std::ofstream(manifest) << "not json";
  expect_refused(SwapStore::open(small_options({a, b}), "rank0", kN, kTile), "not a zoe swap manifest");
  // remove() clears everything; the name is free again.
  ASSERT_TRUE(SwapStore::remove(small_options({a, b}), "rank0").ok());
  EXPECT_TRUE(std::filesystem::is_empty(a));
  EXPECT_TRUE(std::filesystem::is_empty(b));
  EXPECT_TRUE(make_store(small_options({a, b})).ok());
}

// Found by the fuzzer (test_fuzz_swap): a field of the wrong type made json::value() throw out of open(),
// and a float count was converted to an integer unchecked (undefined behaviour for -1.0 or 1e20).
TEST(SwapStore, ManifestFieldsOfTheWrongTypeAreRefusedNotThrown) {
  TempDir dir;
  const std::string a = dir.sub("disk0");
  {
    Result<SwapStore> store = make_store(small_options({a}));
    ASSERT_TRUE(store.ok()) << store.status().to_string();
  }
  const std::string manifest = a + "/rank0.zoe-swap.json";
  std::ifstream in(manifest);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const std::size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from << " not in " << t;
    if (at != std::string::npos) t.replace(at, from.size(), to);
    std::ofstream(manifest) << t;
  };
  const std::string n = "\"n\": " + std::to_string(kN);
  with("\"paths\": [", "\"paths\": [7, ");
  expect_refused(SwapStore::open(small_options({a}), "rank0", kN, kTile), "paths = (missing or not a list of strings)");
  with("\"version\": 1", "\"version\": \"1\"");
  expect_refused(SwapStore::open(small_options({a}), "rank0", kN, kTile), "format version = (missing or not a count)");
  with("\"format\": \"zoe-swap\"", "\"format\": 3");
  expect_refused(SwapStore::open(small_options({a}), "rank0", kN, kTile), "not a zoe swap manifest");
  for (const char* bad : {"-1.0", "1e20", "-1", "null"}) {
    with(n, std::string("\"n\": ") + bad);
    expect_refused(SwapStore::open(small_options({a}), "rank0", kN, kTile), "n = (missing or not a count)");
  }
  with(n, n);
  EXPECT_TRUE(SwapStore::open(small_options({a}), "rank0", kN, kTile).ok());
}

TEST(SwapStore, ReadWriteRangesAndSetStep) {
  TempDir dir;
  Result<SwapStore> store = make_store(small_options({dir.path()}));
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  std::vector<float> p(kN), m(kN), v(kN);
  ASSERT_TRUE(store->read(0, kN, p.data(), m.data(), v.data()).ok());
  for (std::size_t i = 0; i < kN; i += 997) {
    EXPECT_EQ(p[i], testing::initial_weight(i));
    EXPECT_EQ(m[i], 0.0f);
    EXPECT_EQ(v[i], 0.0f);
  }
  // A range across tile boundaries, only m and v: p keeps its values.
  const std::size_t off = kTile - 10, cnt = 2 * kTile + 20;
  std::vector<float> nm(cnt), nv(cnt);
  for (std::size_t i = 0; i < cnt; ++i) {
    nm[i] = static_cast<float>(i);
    nv[i] = static_cast<float>(i) * 0.5f;
  }
  ASSERT_TRUE(store->write(off, cnt, nullptr, nm.data(), nv.data()).ok());
  std::vector<float> p2(kN), m2(kN), v2(kN);
  ASSERT_TRUE(store->read(0, kN, p2.data(), m2.data(), v2.data()).ok());
  EXPECT_EQ(p2, p);
  for (std::size_t i = 0; i < kN; ++i) {
    const bool in_range = i >= off && i < off + cnt;
    ASSERT_EQ(m2[i], in_range ? nm[i - off] : 0.0f) << i;
    ASSERT_EQ(v2[i], in_range ? nv[i - off] : 0.0f) << i;
  }
  // Partial reads of single arrays.
  std::vector<float> one(5);
  ASSERT_TRUE(store->read(kN - 5, 5, one.data(), nullptr, nullptr).ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(one[i], p[kN - 5 + i]);
  EXPECT_FALSE(store->read(kN - 5, 6, one.data(), nullptr, nullptr).ok());
  EXPECT_EQ(store->tile_step(1), 0);
  ASSERT_TRUE(store->set_step(41).ok());
  EXPECT_EQ(store->tile_step(5), 41);
  EXPECT_EQ(store->describe_state(), "tiles [0, 6) (elements [0, " + std::to_string(kN) + ")) at step 41");
}

TEST(SwapStore, RefusesBadCallsWithoutChangingAnything) {
  TempDir dir;
  Result<SwapStore> fresh = SwapStore::create(small_options({dir.path()}), "rank0", kN, kTile);
  ASSERT_TRUE(fresh.ok()) << fresh.status().to_string();
  SwapModel model(kN, testing::default_specs(kN));
  model.make_grads(1);
  std::vector<SwapSegment> segs = model.segments();
  StepOptions o;
  Status s = fresh->step(segs, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("never written"), std::string::npos) << s.message();
  ASSERT_TRUE(fresh->initialize(testing::fill_initial).ok());
  // Overlapping or unsorted segments.
  std::vector<SwapSegment> bad = segs;
  std::swap(bad[0], bad[1]);
  EXPECT_FALSE(fresh->step(bad, o).ok());
  bad = segs;
  bad[2].n += 1;
  EXPECT_FALSE(fresh->step(bad, o).ok());
  // A NaN gradient with check_finite: refused before any tile changes.
  std::vector<float> g(10, 0.0f);
  g[7] = std::numeric_limits<float>::quiet_NaN();
  OptimizerHyper h;
  SwapSegment nan_seg{kTile * 2, 10, &h, g.data(), DType::f32, nullptr, DType::bf16};
  StepOptions finite = o;
  finite.check_finite = true;
  std::vector<SwapSegment> only_nan{nan_seg};
  s = fresh->step(only_nan, finite);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::non_finite);
  for (std::size_t t = 0; t < fresh->tiles(); ++t) EXPECT_EQ(fresh->tile_step(t), 0);
  ASSERT_TRUE(fresh->step(segs, o).ok());
  model.reference_step(1);
  model.expect_matches(*fresh);
  // Going backwards is refused.
  s = fresh->step(segs, StepOptions{});  // step 1 again = a retry: fine, no tile changes
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(fresh->last_stats().tiles_stepped, 0u);
  ASSERT_TRUE(fresh->set_step(5).ok());
  StepOptions back;
  back.step = 3;
  s = fresh->step(segs, back);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("past step 3"), std::string::npos) << s.message();
  // Shapes and options.
  EXPECT_FALSE(SwapStore::create(small_options({dir.path()}), "other", kN, 1000).ok());
  SwapOptions one = small_options({dir.path()});
  one.buffer_count = 1;
  EXPECT_FALSE(SwapStore::create(one, "other", kN, kTile).ok());
  EXPECT_FALSE(SwapStore::create(small_options({}), "other", kN, kTile).ok());
  EXPECT_FALSE(SwapStore::create(small_options({dir.path(), dir.path()}), "other", kN, kTile).ok());
}

// A step issued as several calls on tile boundaries (a trainer stepping bucket by bucket) equals one call.
TEST(SwapStore, StepInCallsOnTileBoundariesEqualsOneCall) {
  TempDir dir;
  Result<SwapStore> store = make_store(small_options({dir.path()}));
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  testing::SegmentSpec whole{0, kN, AdamHyper{}, DType::bf16, true, DType::bf16};
  SwapModel model(kN, {whole});
  for (std::int64_t step = 1; step <= 3; ++step) {
    model.make_grads(step);
    const SwapSegment seg = model.segments()[0];
    const std::size_t cut = 2 * kTile;
    SwapSegment first = seg, second = seg;
    first.n = cut;
    second.offset = cut;
    second.n = kN - cut;
    second.grad = static_cast<const std::uint16_t*>(seg.grad) + cut;
    second.out = static_cast<std::uint16_t*>(seg.out) + cut;
    StepOptions o;
    o.step = step;
    ASSERT_TRUE(store->step({&second, 1}, o).ok());  // any order
    ASSERT_TRUE(store->step({&first, 1}, o).ok());
    model.reference_step(step);
  }
  model.expect_matches(*store);
}

// The tile table keeps two copies: one damaged copy falls back to the other; both damaged is refused.
TEST(SwapStore, TileTableSurvivesOneDamagedCopy) {
  TempDir dir;
  SwapModel model(kN, testing::default_specs(kN));
  {
    Result<SwapStore> store = make_store(small_options({dir.path()}));
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    run_steps(*store, model, 1, 2);
  }
  const std::string table = dir.path() + "/rank0.zoe-swap.table";
  auto damage = [&](std::size_t region) {
    std::fstream f(table, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(region * 4096 + 40));
    f.put('\x5A');
  };
  damage(0);
  Result<SwapStore> one = SwapStore::open(small_options({dir.path()}), "rank0", kN, kTile);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  std::vector<float> p(kN);
  EXPECT_TRUE(one->read(0, kN, p.data(), nullptr, nullptr).ok()) << "the surviving copy names intact slots";
  one = Status(StatusCode::internal, "closed");
  damage(1);
  Result<SwapStore> none = SwapStore::open(small_options({dir.path()}), "rank0", kN, kTile);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("tile table"), std::string::npos) << none.status().to_string();
  EXPECT_EQ(none.status().code(), StatusCode::corrupt);
}


// A filesystem without O_DIRECT: ramfs where this process may mount one, else the seam refusing O_DIRECT
// at open. Either way: buffered I/O, direct_io() false, same results.
TEST(SwapStore, BufferedFallbackWhenODirectIsRefused) {
  TempDir dir;
  const std::string mnt = dir.sub("ramfs");
  testing::TestMount ramfs(mnt, "ramfs", "");
  SwapOptions o = small_options({mnt});
  if (!ramfs.ok()) {
    std::printf("ramfs not available (%s): refusing O_DIRECT through the fault seam instead\n", ramfs.reason().c_str());
    o.fault_hook = [](const IoSite& s) -> IoFault { return s.op == IoOp::open && s.direct ? IoFault{EINVAL, -1} : IoFault{}; };
  }
  {
    Result<SwapStore> store = make_store(o);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    EXPECT_FALSE(store->direct_io());
    SwapModel model(kN, testing::default_specs(kN));
    run_steps(*store, model, 1, 3);
    model.expect_matches(*store);
  }
  ASSERT_TRUE(SwapStore::remove(o, "rank0").ok());
}

}  // namespace
}  // namespace zoe
