// base/files.h: a file replaced atomically (AtomicFile, replace_file) leaves the old contents or the new,
// never a mix, and never a temporary behind; failures name the path.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "base/files.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

class Files : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/zoe-base-files-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::size_t entries() const { return static_cast<std::size_t>(std::distance(fs::directory_iterator(dir_), fs::directory_iterator())); }
  std::string dir_;
};

TEST_F(Files, CommitReplacesTheFileAndLeavesNoTemporary) {
  ASSERT_TRUE(replace_file(path("f"), "old").ok());
  Result<AtomicFile> file = AtomicFile::create(path("f"), path("f.tmp"));
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  ASSERT_TRUE(file->write("new ", 4).ok());
  ASSERT_TRUE(file->write("contents", 8).ok());
  EXPECT_EQ(file->offset(), 12u);
  EXPECT_EQ(read_whole_file(path("f")).value(), "old");  // not before commit
  ASSERT_TRUE(file->commit().ok());
  EXPECT_TRUE(file->committed());
  EXPECT_EQ(read_whole_file(path("f")).value(), "new contents");
  EXPECT_EQ(entries(), 1u);
}

TEST_F(Files, AFileNotCommittedIsRemovedAndTheOldOneKept) {
  ASSERT_TRUE(replace_file(path("f"), "old").ok());
  {
    Result<AtomicFile> file = AtomicFile::create(path("f"), path("f.tmp"));
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE(file->write("half", 4).ok());
  }
  EXPECT_EQ(read_whole_file(path("f")).value(), "old");
  EXPECT_EQ(entries(), 1u);
}

TEST_F(Files, AnExclusiveTemporaryThatExistsIsEexistAndKept) {
  ASSERT_TRUE(replace_file(path("f.tmp"), "someone else's").ok());
  Result<AtomicFile> file = AtomicFile::create(path("f"), path("f.tmp"));
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().sys_errno(), EEXIST);
  EXPECT_NE(file.status().message().find(path("f.tmp")), std::string::npos) << file.status().message();
  EXPECT_EQ(read_whole_file(path("f.tmp")).value(), "someone else's");
  // Not exclusive: that name is this writer's own, truncated and reused.
  Result<AtomicFile> reused = AtomicFile::create(path("f"), path("f.tmp"), AtomicFile::Options{0644, false});
  ASSERT_TRUE(reused.ok());
  ASSERT_TRUE(reused->write("x", 1).ok());
  ASSERT_TRUE(reused->commit().ok());
  EXPECT_EQ(read_whole_file(path("f")).value(), "x");
}

TEST_F(Files, AWriteThatFailsNamesTheFileAndLeavesTheOldOne) {
  ASSERT_TRUE(replace_file(path("f"), "old").ok());
  // A file size limit makes write() fail (EFBIG) as a full disk would, without one.
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  void (*previous)(int) = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limit = before;
  limit.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  Status s;
  {
    Result<AtomicFile> file = AtomicFile::create(path("f"), path("f.tmp"));
    ASSERT_TRUE(file.ok());
    const std::string big(8192, 'z');
    s = file->write(big.data(), big.size());
  }
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, previous);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(path("f.tmp")), std::string::npos) << s.message();
  EXPECT_EQ(read_whole_file(path("f")).value(), "old");
  EXPECT_EQ(entries(), 1u);
}

TEST_F(Files, FailuresNameThePath) {
  const Status dir = sync_dir(path("missing"));
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.message().find(path("missing")), std::string::npos) << dir.message();
  const Result<std::string> read = read_whole_file(path("missing"));
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find(path("missing")), std::string::npos);
  const Status replaced = replace_file(path("missing/f"), "x");
  ASSERT_FALSE(replaced.ok());
  EXPECT_NE(replaced.message().find(path("missing/f")), std::string::npos) << replaced.message();
}

TEST(ParentDir, OfEachKindOfPath) {
  EXPECT_EQ(parent_dir("a/b/c"), "a/b");
  EXPECT_EQ(parent_dir("/c"), "/");
  EXPECT_EQ(parent_dir("c"), ".");
}

}  // namespace
}  // namespace zoe
