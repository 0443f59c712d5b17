// base/files.h: a file replaced atomically (AtomicFile, replace_file) leaves the old contents or the new,
// never a mix, and never a temporary behind; failures name the path.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
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
  Result<AtomicFile> file = AtomicFile::create(path("f"));
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
    Result<AtomicFile> file = AtomicFile::create(path("f"));
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE(file->write("half", 4).ok());
  }
  EXPECT_EQ(read_whole_file(path("f")).value(), "old");
  EXPECT_EQ(entries(), 1u);
}

// The temporary's name has an unguessable part: two writers never share one, and a link planted at any
// name beside the file is never written through.
TEST_F(Files, TemporariesHaveUnpredictableNamesAndTheirTag) {
  Result<AtomicFile> a = AtomicFile::create(path("f"), AtomicFile::Options{0600, "tag"});
  Result<AtomicFile> b = AtomicFile::create(path("f"), AtomicFile::Options{0600, "tag"});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->temp_path(), b->temp_path());
  const std::string prefix = path("f.tmp-tag-");
  ASSERT_EQ(a->temp_path().substr(0, prefix.size()), prefix);
  const std::string random = a->temp_path().substr(prefix.size());
  EXPECT_EQ(random.size(), 16u);
  EXPECT_EQ(random.find_first_not_of("0123456789abcdef"), std::string::npos) << random;
}

TEST_F(Files, ARenamedAwayTemporaryIsNeverWrittenThroughALinkAndTheSaveFails) {
  ASSERT_TRUE(replace_file(path("victim"), "intact").ok());
  ASSERT_TRUE(replace_file(path("f"), "old").ok());
  Result<AtomicFile> file = AtomicFile::create(path("f"));
  ASSERT_TRUE(file.ok());
  // What another user who can write the folder can do: move the temporary away, put a link in its place.
  ASSERT_EQ(::rename(file->temp_path().c_str(), path("moved").c_str()), 0);
  ASSERT_EQ(::symlink(path("victim").c_str(), file->temp_path().c_str()), 0);
  ASSERT_TRUE(file->write("new", 3).ok());
  const Status s = file->commit();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("replaced"), std::string::npos) << s.message();
  EXPECT_EQ(read_whole_file(path("victim")).value(), "intact");
  EXPECT_FALSE(fs::exists(fs::symlink_status(path("f"))));  // the planted link is not left at the path
}

TEST_F(Files, AFolderCreatesExclusivelyAndFollowsNoLink) {
  ASSERT_TRUE(replace_file(path("victim"), "intact").ok());
  ASSERT_EQ(::symlink(path("victim").c_str(), path("link").c_str()), 0);
  Result<Folder> folder = Folder::open(dir_);
  ASSERT_TRUE(folder.ok());
  Result<UniqueFd> made = folder->create("link", O_RDWR, 0600);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().sys_errno(), EEXIST);
  Result<UniqueFd> opened = folder->open_file("link", O_RDWR);
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("symbolic link"), std::string::npos) << opened.status().message();
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  Result<UniqueFd> fifo = folder->open_file("fifo", O_RDWR);
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find("not a regular file"), std::string::npos) << fifo.status().message();
  ASSERT_TRUE(folder->remove("link").ok());
  EXPECT_EQ(read_whole_file(path("victim")).value(), "intact");
  EXPECT_TRUE(folder->remove("missing").ok());
}

TEST_F(Files, AFolderOthersCanWriteIsRefusedWithOwnerModeAndRemedy) {
  Result<Folder> folder = Folder::open(dir_);
  ASSERT_TRUE(folder.ok());
  ASSERT_EQ(::chmod(dir_.c_str(), 0700), 0);
  EXPECT_TRUE(folder->check_private("swap path").ok());
  ASSERT_EQ(::chmod(dir_.c_str(), 0777), 0);
  const Status open_to_all = folder->check_private("swap path");
  ASSERT_FALSE(open_to_all.ok());
  for (const char* part : {"swap path", "mode 0777", "owner", "chmod go-w"}) {
    EXPECT_NE(open_to_all.message().find(part), std::string::npos) << part << ": " << open_to_all.message();
  }
  EXPECT_NE(open_to_all.message().find(dir_), std::string::npos);
  ASSERT_EQ(::chmod(dir_.c_str(), 01777), 0);  // as /tmp: others may create, not rename or remove ours
  EXPECT_TRUE(folder->check_private("swap path").ok());
  ASSERT_EQ(::chmod(dir_.c_str(), 0700), 0);
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
    Result<AtomicFile> file = AtomicFile::create(path("f"));
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
