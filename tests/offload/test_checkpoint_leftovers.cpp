// What a writer killed mid-save leaves behind, and who may remove it: the next save removes the temporary
// files of writers that are gone, and never one of a live writer or of a writer it cannot judge (another
// host, container or boot, a file that is not a checkpoint, a name of an older format).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "src/offload/checkpoint.h"
#include "base/process_identity.h"
#include "tests/child_process.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;
using test::dead_pid;

// A child that sleeps until killed: a live writer in this scope that is not this process.
class LiveChild {
 public:
  LiveChild() : pid_(::fork()) {
    if (pid_ == 0) {
      for (;;) ::pause();
    }
  }
  ~LiveChild() {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_;
};

class CheckpointLeftovers : public ::testing::Test {
 protected:
  void SetUp() override {
    char t[] = "/tmp/zoe_ckpt_leftovers_XXXXXX";
    ASSERT_NE(::mkdtemp(t), nullptr);
    dir_ = t;
    path_ = dir_ + "/state.zoeckpt";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A temporary file as a writer of `scope` with `pid` would have left it, starting like a checkpoint.
  std::string plant(const std::string& target, const std::string& scope, long pid, const std::string& body = "ZOECKPT") {
    const std::string name = target + ".tmp-" + file_name_host(this_process().host) + "-" + scope + "-" +
                             std::to_string(pid) + "-0";
    std::ofstream(name, std::ios::binary) << body << std::string(1, '\0') << "partial blob bytes";
    return name;
  }
  void save(const std::string& manifest) {
    Result<CheckpointWriter> w = CheckpointWriter::create(path_);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    const std::vector<char> blob(4096, 'x');
    ASSERT_TRUE(w->add("p", blob.data(), blob.size()).ok());
    const Status s = w->commit(manifest);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  std::vector<std::string> temps() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().filename().string().find(".tmp-") != std::string::npos) out.push_back(e.path().string());
    }
    return out;
  }

  std::string dir_, path_;
};

TEST(ProcessIdentity, JudgesOnlyItsOwnScope) {
  const ProcessIdentity self = this_process();
  if (self.scope.empty()) GTEST_SKIP() << "no /proc/sys/kernel/random/boot_id or /proc/self/ns/pid: no scope to judge in";
  EXPECT_EQ(self.scope.size(), 16u);
  EXPECT_EQ(self.pid, static_cast<std::int64_t>(::getpid()));
  EXPECT_EQ(liveness(self), Liveness::running);
  LiveChild child;
  EXPECT_EQ(liveness({self.host, self.scope, child.pid()}), Liveness::running);
  EXPECT_EQ(liveness({self.host, self.scope, dead_pid()}), Liveness::gone);
  EXPECT_EQ(liveness({self.host, "0123456789abcdef", dead_pid()}), Liveness::unknown) << "another host or namespace";
  EXPECT_EQ(liveness({self.host, "", dead_pid()}), Liveness::unknown);
  EXPECT_EQ(file_name_host("gpu-7.example/x y"), "gpu-7.example_x_y");
}

TEST_F(CheckpointLeftovers, DeadWritersTemporaryFilesAreRemovedByTheNextSave) {
  const std::string scope = this_process().scope;
  if (scope.empty()) GTEST_SKIP() << "no scope on this machine (no /proc): leftovers are never judged";
  save("old");
  const std::string dead = plant(path_, scope, dead_pid());
  const std::string other_rank = plant(dir_ + "/rank1.zoeckpt", scope, dead_pid());
  const std::string empty = path_ + ".tmp-" + file_name_host(this_process().host) + "-" + scope + "-" +
                            std::to_string(dead_pid()) + "-3";
  std::ofstream(empty).close();  // killed before its header was written
  ASSERT_EQ(temps().size(), 3u);
  save("new");
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_FALSE(fs::exists(other_rank)) << "a rank not run again leaves nothing either";
  EXPECT_FALSE(fs::exists(empty));
  EXPECT_TRUE(temps().empty());
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->manifest(), "new");
}

TEST_F(CheckpointLeftovers, LiveOrUnjudgeableWritersFilesAreKept) {
  const std::string scope = this_process().scope;
  if (scope.empty()) GTEST_SKIP() << "no scope on this machine (no /proc): leftovers are never judged";
  LiveChild child;
  const std::vector<std::string> kept = {
      plant(path_, scope, child.pid()),                       // a live writer in another process
      plant(dir_ + "/mine.zoeckpt", scope, ::getpid()),       // one of this process
      plant(path_, "0123456789abcdef", dead_pid()),           // another host or container: its pid means nothing here
      plant(dir_ + "/notes.txt", scope, dead_pid(), "hello"),  // the name fits, the contents are not a checkpoint
      path_ + ".tmp-" + std::to_string(dead_pid()) + "-0",     // the older name format, which carries no scope
  };
  std::ofstream(kept.back()) << "ZOECKPT";
  save("new");
  for (const std::string& f : kept) EXPECT_TRUE(fs::exists(f)) << f << " was removed";
}

// A live writer's own temporary file survives a concurrent save by another writer of the same checkpoint.
TEST_F(CheckpointLeftovers, ConcurrentWritersKeepEachOthersFiles) {
  Result<CheckpointWriter> first = CheckpointWriter::create(path_);
  ASSERT_TRUE(first.ok());
  const char x = 1;
  ASSERT_TRUE(first->add("p", &x, 1).ok());
  save("second");
  EXPECT_TRUE(fs::exists(first->temp_path()));
  ASSERT_TRUE(first->commit("first").ok());
  EXPECT_TRUE(temps().empty());
}

// The real thing: a child commits one checkpoint, starts the next and is killed with SIGKILL in the middle of
// a blob (it waits there, so the kill lands mid-save every time). The last committed checkpoint loads, the
// killed writer's temporary file is there, and the next save removes it.
TEST_F(CheckpointLeftovers, KillDashNineDuringSaveLeavesNothingAfterTheNextSave) {
  if (this_process().scope.empty()) GTEST_SKIP() << "no scope on this machine (no /proc): leftovers are never judged";
  save("before");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    const std::vector<char> blob(CheckpointWriter::kStreamSlice, 'y');
    for (int i = 0;; ++i) {
      Result<CheckpointWriter> w = CheckpointWriter::create(path_);
      if (!w.ok()) ::_exit(2);
      const Status s = w->add_streamed("master", 3 * blob.size(), [&](std::size_t offset, std::size_t, const void** out) {
        if (i == 1 && offset > 0) {  // the second save, one slice written: tell the parent, wait for the kill
          (void)!::write(ready[1], "k", 1);
          for (;;) ::pause();
        }
        *out = blob.data();
        return Status::success();
      });
      if (!s.ok() || !w->commit("child " + std::to_string(i)).ok()) ::_exit(3);
    }
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1) << "the child did not reach its second save";
  ::close(ready[0]);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_EQ(temps().size(), 1u) << "the killed writer's temporary file";
  EXPECT_GE(fs::file_size(temps().front()), CheckpointWriter::kStreamSlice);
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok()) << "the last committed checkpoint loads: " << r.status().to_string();
  EXPECT_EQ(r->manifest(), "child 0");
  save("after");
  EXPECT_TRUE(temps().empty()) << temps().front();
}

}  // namespace
}  // namespace zoe
