// Finding swap stores in a folder and judging whether a run still uses them (what zoe probe reports): a
// store held open is in use; one whose owner is gone from this scope is abandoned, with an rm command that
// removes all of it; one whose owner cannot be judged here (another host, an older zoe) is unknown.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "aio/files.h"
#include "src/nvme/swap_inventory.h"
#include "tests/aio/aio_test_util.h"
#include "tests/child_process.h"
#include "zoe/swap.h"

namespace zoe {
namespace {

using test::dead_pid;
using testing::TempDir;

constexpr std::size_t kTile = 4096;

SwapOptions options(std::vector<std::string> paths) {
  SwapOptions o;
  o.paths = std::move(paths);
  o.buffer_count = 2;
  o.cpu.threads = 1;
  return o;
}

// Rewrites the owner record of a manifest, as a run of that owner would have left it (null: none, as an
// older zoe wrote it).
void set_owner(const std::string& manifest, const nlohmann::json& owner) {
  Result<std::string> text = read_whole_file(manifest);
  ASSERT_TRUE(text.ok());
  nlohmann::json m = nlohmann::json::parse(text.value());
  if (owner.is_null()) m.erase("owner");
  else m["owner"] = owner;
  std::ofstream(manifest) << m.dump(2);
}

nlohmann::json owner_with(std::int64_t pid, const std::string& scope) {
  return {{"host", this_process().host}, {"scope", scope}, {"pid", pid}};
}

TEST(SwapInventory, StoreHeldOpenIsInUse) {
  TempDir dir;
  Result<SwapStore> store = SwapStore::create(options({dir.path()}), "rank0", 3 * kTile, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  const std::vector<aio::FoundStore> found = aio::find_swap_stores(dir.path());
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].name, "rank0");
  EXPECT_EQ(found[0].state, aio::StoreState::in_use) << found[0].who;
  EXPECT_NE(found[0].who.find("in use by pid " + std::to_string(::getpid())), std::string::npos) << found[0].who;
  EXPECT_EQ(found[0].files.size(), 4u);  // manifest, tile table, data file, owner lock
  std::uint64_t bytes = 0;
  for (const auto& f : found[0].files) bytes += std::filesystem::file_size(f);
  EXPECT_EQ(found[0].bytes, bytes);
  EXPECT_GE(bytes, 2 * 3 * kTile * 12) << "two slots of p, m, v per tile";
}

TEST(SwapInventory, StoreOfADeadOwnerIsAbandonedAndItsRemoveCommandRemovesAllOfIt) {
  TempDir dir;
  const std::string a = dir.sub("a b"), b = dir.sub("b");  // a space: the command must quote it
  {
    Result<SwapStore> store = SwapStore::create(options({a, b}), "rank0", 3 * kTile, kTile);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
  }
  if (this_process().scope.empty()) GTEST_SKIP() << "no scope on this machine (no /proc): owners are never judged";
  for (const std::string& d : {a, b}) set_owner(d + "/rank0.zoe-swap.json", owner_with(dead_pid(), this_process().scope));
  std::ofstream(dir.path() + "/unrelated.json") << "{}";
  for (const std::string& d : {a, b}) {  // found from either of its paths, with the files of both
    const std::vector<aio::FoundStore> found = aio::find_swap_stores(d);
    ASSERT_EQ(found.size(), 1u);
    EXPECT_EQ(found[0].state, aio::StoreState::abandoned) << found[0].who;
    EXPECT_NE(found[0].who.find("which is not running"), std::string::npos) << found[0].who;
    EXPECT_EQ(found[0].files.size(), 7u);  // two manifests, the table, two data files, two owner locks
    EXPECT_EQ(found[0].files.front(), d + "/rank0.zoe-swap.json") << "manifests go first";
  }
  const std::string cmd = aio::remove_command(aio::find_swap_stores(a).front());
  EXPECT_NE(cmd.find("'" + a + "/rank0.zoe-swap'"), std::string::npos) << cmd;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  EXPECT_TRUE(std::filesystem::is_empty(a));
  EXPECT_TRUE(std::filesystem::is_empty(b));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/unrelated.json"));
}

TEST(SwapInventory, OwnerThatCannotBeJudgedHereIsUnknown) {
  TempDir dir;
  {
    Result<SwapStore> store = SwapStore::create(options({dir.path()}), "rank0", kTile, kTile);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
  }
  const std::string manifest = dir.path() + "/rank0.zoe-swap.json";
  set_owner(manifest, owner_with(dead_pid(), "0123456789abcdef"));  // another host or container
  std::vector<aio::FoundStore> found = aio::find_swap_stores(dir.path());
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].state, aio::StoreState::unknown) << found[0].who;
  EXPECT_NE(found[0].who.find("another host or container"), std::string::npos) << found[0].who;
  set_owner(manifest, nullptr);  // an older zoe recorded no owner
  found = aio::find_swap_stores(dir.path());
  EXPECT_EQ(found[0].state, aio::StoreState::unknown) << found[0].who;
  EXPECT_NE(found[0].who.find("no owner recorded"), std::string::npos) << found[0].who;
}

// Opening a store records the new run as its owner, and an older manifest without an owner still opens.
TEST(SwapInventory, OpenRecordsTheNewOwnerAndOlderManifestsStillOpen) {
  TempDir dir;
  {
    Result<SwapStore> store = SwapStore::create(options({dir.path()}), "rank0", kTile, kTile);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
  }
  const std::string manifest = dir.path() + "/rank0.zoe-swap.json";
  set_owner(manifest, nullptr);
  Result<SwapStore> reopened = SwapStore::open(options({dir.path()}), "rank0", kTile, kTile);
  ASSERT_TRUE(reopened.ok()) << reopened.status().to_string();
  const std::optional<ProcessIdentity> owner =
      aio::parse_owner(nlohmann::json::parse(read_whole_file(manifest).value()));
  ASSERT_TRUE(owner.has_value());
  EXPECT_EQ(owner->pid, ::getpid());
  EXPECT_EQ(owner->scope, this_process().scope);
  EXPECT_EQ(aio::find_swap_stores(dir.path()).front().state, aio::StoreState::in_use);
}

}  // namespace
}  // namespace zoe

namespace zoe {
namespace {

// One live SwapStore per store: a second create(), open() or remove() — here in the same process, as a
// second optimizer on the same nvme_path would be — is refused naming the folder, the holder and what to do,
// and changes nothing; once the holder is gone the store opens as before.
TEST(SwapOwnership, ASecondOpenerIsRefusedNamingTheHolderUntilTheFirstLetsGo) {
  TempDir dir;
  Result<SwapStore> first = SwapStore::create(options({dir.path()}), "rank0", 3 * kTile, kTile);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  ASSERT_TRUE(first->initialize([](std::size_t offset, std::size_t count, float* p) {
    for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<float>(offset + i);
    return Status::success();
  }).ok());
  const std::string holder = "pid " + std::to_string(::getpid());
  for (const Status& s : {SwapStore::open(options({dir.path()}), "rank0", 3 * kTile, kTile).status(),
                          SwapStore::create(options({dir.path()}), "rank0", 3 * kTile, kTile).status(),
                          SwapStore::open_or_create(options({dir.path()}), "rank0", 3 * kTile, kTile).status(),
                          SwapStore::remove(options({dir.path()}), "rank0")}) {
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.sys_errno(), EBUSY) << s.to_string();
    for (const std::string& part : {dir.path(), holder, std::string("this process"), std::string("nvme_path")}) {
      EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in: " << s.message();
    }
  }
  // The first store is whole: every file there, every value as written.
  std::vector<float> p(3 * kTile);
  ASSERT_TRUE(first->read(0, p.size(), p.data(), nullptr, nullptr).ok());
  for (std::size_t i = 0; i < p.size(); ++i) ASSERT_EQ(p[i], static_cast<float>(i));
  { SwapStore closed = std::move(first).value(); }
  Result<SwapStore> second = SwapStore::open(options({dir.path()}), "rank0", 3 * kTile, kTile);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  ASSERT_TRUE(second->read(0, p.size(), p.data(), nullptr, nullptr).ok());
  EXPECT_EQ(p.back(), static_cast<float>(p.size() - 1));
}

// Starts at the same moment (what two ranks given one folder do): exactly one owns the store, every other
// is refused as in use — never a failure of a shared temporary file, never two owners.
TEST(SwapOwnership, SimultaneousCreatorsGiveOneOwner) {
  TempDir dir;
  constexpr int kStarters = 6;
  std::vector<std::optional<Result<SwapStore>>> made(kStarters);
  std::vector<std::thread> starters;
  std::atomic<int> ready{0};
  for (int k = 0; k < kStarters; ++k) {
    starters.emplace_back([&, k] {
      ++ready;
      while (ready.load() < kStarters) {
      }
      const SwapOptions o = options({dir.path()});
      (void)SwapStore::remove(o, "rank0");  // what a new optimizer does with a store it finds
      made[k].emplace(SwapStore::create(o, "rank0", 3 * kTile, kTile));
    });
  }
  for (std::thread& t : starters) t.join();
  int owners = 0;
  for (const std::optional<Result<SwapStore>>& r : made) {
    ASSERT_TRUE(r.has_value());
    if (r->ok()) {
      ++owners;
    } else {
      EXPECT_EQ(r->status().sys_errno(), EBUSY) << r->status().to_string();
    }
  }
  EXPECT_EQ(owners, 1);
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path() << " left behind";
  }
}

// The probe reports the live owner from its lock, and never offers to remove what it holds.
TEST(SwapOwnership, ProbeCallsAHeldStoreInUseWhateverItsManifestSays) {
  TempDir dir;
  Result<SwapStore> store = SwapStore::create(options({dir.path()}), "rank0", kTile, kTile);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  if (!this_process().scope.empty()) {  // a manifest claiming a dead owner does not fool it
    set_owner(dir.path() + "/rank0.zoe-swap.json", owner_with(dead_pid(), this_process().scope));
  }
  const std::vector<aio::FoundStore> found = aio::find_swap_stores(dir.path());
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].state, aio::StoreState::in_use) << found[0].who;
  EXPECT_NE(found[0].who.find("pid " + std::to_string(::getpid())), std::string::npos) << found[0].who;
}

}  // namespace
}  // namespace zoe
