#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "src/offload/checkpoint.h"
#include "base/crc32c.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;

// ---- CRC-32C ----

TEST(Crc32c, CheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c_software("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

// RFC 3720 (iSCSI) B.4 test vectors.
TEST(Crc32c, Rfc3720Vectors) {
  std::vector<unsigned char> buf(32, 0);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x8A9136AAu);
  std::fill(buf.begin(), buf.end(), 0xFF);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x113FDB5Cu);
}

// Any split of the input, at any alignment, gives the CRC of the whole: the slicing and the tail agree.
TEST(Crc32c, IncrementalMatchesWhole) {
  std::vector<unsigned char> data(1000);
  std::mt19937 rng(7);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (std::size_t offset : {0, 1, 3, 7}) {
    const std::size_t n = data.size() - offset;
    const std::uint32_t whole = crc32c(data.data() + offset, n);
    for (std::size_t cut : {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(8), std::size_t(9), n / 2, n}) {
      const std::uint32_t a = crc32c(data.data() + offset, cut);
      EXPECT_EQ(crc32c(data.data() + offset + cut, n - cut, a), whole) << "offset " << offset << " cut " << cut;
    }
  }
}

// ---- checkpoint ----

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    char t[] = "/tmp/zoe_ckpt_test_XXXXXX";
    ASSERT_NE(::mkdtemp(t), nullptr);
    dir_ = t;
    path_ = dir_ + "/state.zoeckpt";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Files in the directory other than the checkpoint itself: leftover temporary files.
  std::vector<std::string> strays() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().string() != path_) out.push_back(e.path().string());
    }
    return out;
  }

  void write(const std::string& manifest, const std::vector<std::pair<std::string, std::vector<char>>>& blobs) {
    Result<CheckpointWriter> w = CheckpointWriter::create(path_);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    for (const auto& [name, data] : blobs) {
      ASSERT_TRUE(w->add(name, data.data(), data.size()).ok());
    }
    const Status s = w->commit(manifest);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }

  std::vector<char> file_bytes() const {
    std::ifstream in(path_, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  void put_file_bytes(const std::vector<char>& bytes) const {
    std::ofstream(path_, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  void flip_byte(std::size_t offset) const {
    std::vector<char> b = file_bytes();
    ASSERT_LT(offset, b.size());
    b[offset] = static_cast<char>(b[offset] ^ 0x5A);
    put_file_bytes(b);
  }

  std::string dir_, path_;
};

std::vector<char> pattern(std::size_t n, unsigned seed) {
  std::vector<char> v(n);
  std::mt19937 rng(seed);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

void expect_message(const Status& s, const std::vector<std::string>& words) {
  for (const std::string& w : words) {
    EXPECT_NE(s.message().find(w), std::string::npos) << "'" << w << "' not in: " << s.to_string();
  }
}

TEST_F(Checkpoint, RoundTrip) {
  const std::vector<char> small = pattern(13, 1), big = pattern((5u << 20) + 3, 2), one = pattern(1, 3);
  const std::string manifest = R"({"step": 42, "params": ["a", "b"]})";
  write(manifest, {{"small", small}, {"empty", {}}, {"big", big}, {"one", one}});
  EXPECT_TRUE(strays().empty());

  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->manifest(), manifest);
  EXPECT_EQ(r->major_version(), kCheckpointMajor);
  EXPECT_EQ(r->names(), (std::vector<std::string>{"big", "empty", "one", "small"}));
  EXPECT_TRUE(r->has("empty"));
  EXPECT_FALSE(r->has("absent"));
  for (const auto& [name, data] : std::vector<std::pair<std::string, std::vector<char>>>{
           {"small", small}, {"empty", {}}, {"big", big}, {"one", one}}) {
    Result<std::size_t> size = r->size(name);
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(size.value(), data.size());
    std::vector<char> got(data.size());
    const Status s = r->read(name, got.data(), got.size());
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(got, data) << name;
  }
  EXPECT_EQ(r->read("absent", nullptr, 0).code(), StatusCode::invalid_argument);
  EXPECT_FALSE(r->size("absent").ok());
}

TEST_F(Checkpoint, EmptyCheckpoint) {
  write("", {});
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->names().empty());
  EXPECT_EQ(r->manifest(), "");
}

TEST_F(Checkpoint, SizeMismatchNamesBlob) {
  write("{}", {{"exp_avg", pattern(100, 4)}});
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok());
  std::vector<char> got(99);
  const Status s = r->read("exp_avg", got.data(), got.size());
  EXPECT_EQ(s.code(), StatusCode::corrupt);
  expect_message(s, {"exp_avg", path_, "100", "99"});
}

TEST_F(Checkpoint, WriterErrorsOnMisuse) {
  Result<CheckpointWriter> w = CheckpointWriter::create(path_);
  ASSERT_TRUE(w.ok());
  const char x = 1;
  EXPECT_TRUE(w->add("a", &x, 1).ok());
  EXPECT_EQ(w->add("a", &x, 1).code(), StatusCode::invalid_argument);
  EXPECT_EQ(w->add("", &x, 1).code(), StatusCode::invalid_argument);
  EXPECT_EQ(w->add("null", nullptr, 4).code(), StatusCode::invalid_argument);
  ASSERT_TRUE(w->commit("{}").ok());
  EXPECT_EQ(w->add("b", &x, 1).code(), StatusCode::invalid_argument);
  EXPECT_EQ(w->commit("{}").code(), StatusCode::invalid_argument);
}

// A writer that never commits leaves the previous checkpoint as it was and no temporary file behind.
TEST_F(Checkpoint, UncommittedWriterLeavesOldFileIntact) {
  const std::vector<char> old_data = pattern(4096, 5);
  write("old", {{"p", old_data}});
  const std::vector<char> before = file_bytes();
  {
    Result<CheckpointWriter> w = CheckpointWriter::create(path_);
    ASSERT_TRUE(w.ok());
    const std::vector<char> fresh = pattern(1 << 20, 6);
    ASSERT_TRUE(w->add("p", fresh.data(), fresh.size()).ok());
    EXPECT_TRUE(fs::exists(w->temp_path())) << "blobs stream to the temporary file as they are added";
    EXPECT_EQ(file_bytes(), before);
    CheckpointWriter moved = std::move(w.value());  // the moved-from writer must not remove the file
    EXPECT_TRUE(fs::exists(moved.temp_path()));
  }
  EXPECT_EQ(file_bytes(), before);
  EXPECT_TRUE(strays().empty()) << strays().front();
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->manifest(), "old");
}

TEST_F(Checkpoint, CommitReplacesOldFile) {
  write("old", {{"p", pattern(10, 7)}});
  write("new", {{"q", pattern(20, 8)}});
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->manifest(), "new");
  EXPECT_FALSE(r->has("p"));
  EXPECT_TRUE(strays().empty());
}

TEST_F(Checkpoint, FlippedBlobByteIsDetected) {
  const std::vector<char> a = pattern(1000, 9), b = pattern(1000, 10);
  write("{}", {{"a", a}, {"b", b}});
  flip_byte(64 + 500);  // inside blob "a", which starts right after the 64-byte header
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok()) << "the index is intact: " << r.status().to_string();
  std::vector<char> got(1000);
  const Status s = r->read("a", got.data(), got.size());
  EXPECT_EQ(s.code(), StatusCode::corrupt);
  expect_message(s, {"'a'", path_, "checksum"});
  EXPECT_TRUE(r->read("b", got.data(), got.size()).ok()) << "one damaged blob does not hide the others";
  EXPECT_EQ(got, b);
}

// Blobs larger than any one buffer: produced and consumed in slices, with the same checksums as whole ones.
TEST_F(Checkpoint, StreamedBlobsRoundTripAndDamageIsReportedAfterTheLastSlice) {
  const std::size_t bytes = 2 * CheckpointWriter::kStreamSlice + 12345;
  const std::vector<char> data = pattern(bytes, 21);
  {
    Result<CheckpointWriter> w = CheckpointWriter::create(path_);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    std::vector<std::size_t> slices;
    const Status s = w->add_streamed("big", bytes, [&](std::size_t offset, std::size_t n, const void** slice) {
      slices.push_back(n);
      *slice = data.data() + offset;
      return Status::success();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(slices.size(), 3u);
    // A producer's failure fails the writer, which then refuses to commit a partial file.
    const Status bad = w->add_streamed("fails", 10, [](std::size_t, std::size_t, const void**) {
      return Status(StatusCode::io_error, "source went away");
    });
    EXPECT_EQ(bad.code(), StatusCode::io_error);
    EXPECT_FALSE(w->commit("{}").ok());
  }
  EXPECT_FALSE(fs::exists(path_)) << "a failed writer leaves no file";

  write("{}", {{"big", data}});
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<char> got;
  Status s = r->read_streamed("big", bytes, 1 << 20, [&](std::size_t offset, const void* slice, std::size_t n) {
    EXPECT_EQ(offset, got.size());
    got.insert(got.end(), static_cast<const char*>(slice), static_cast<const char*>(slice) + n);
    return Status::success();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(got, data);

  flip_byte(64 + bytes - 1);  // the blob's last byte
  r = CheckpointReader::open(path_);
  ASSERT_TRUE(r.ok());
  s = r->read_streamed("big", bytes, 1 << 20, [](std::size_t, const void*, std::size_t) { return Status::success(); });
  EXPECT_EQ(s.code(), StatusCode::corrupt);
  expect_message(s, {"'big'", "checksum"});
}

TEST_F(Checkpoint, FlippedIndexByteIsDetected) {
  write(R"({"step": 1})", {{"a", pattern(100, 11)}});
  const std::size_t size = file_bytes().size();
  flip_byte(size - 40 - 3);  // in the manifest, the last part of the index before the 40-byte trailer
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::corrupt);
  expect_message(r.status(), {path_, "index checksum"});

  write(R"({"step": 1})", {{"a", pattern(100, 11)}});
  flip_byte(size - 40 - 12 - 10);  // in the blob table: part of blob a's entry
  r = CheckpointReader::open(path_);
  ASSERT_FALSE(r.ok());
  expect_message(r.status(), {path_, "index checksum"});

  write(R"({"step": 1})", {{"a", pattern(100, 11)}});
  flip_byte(size - 40 + 2);  // in the trailer's index offset
  r = CheckpointReader::open(path_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::corrupt);
  expect_message(r.status(), {path_, "trailer checksum"});
}

TEST_F(Checkpoint, TruncationIsDetected) {
  write("{}", {{"a", pattern(5000, 12)}});
  const std::vector<char> whole = file_bytes();
  for (std::size_t keep : {whole.size() - 1, whole.size() - 40, std::size_t(3000), std::size_t(100), std::size_t(64),
                           std::size_t(10), std::size_t(0)}) {
    put_file_bytes(std::vector<char>(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(keep)));
    Result<CheckpointReader> r = CheckpointReader::open(path_);
    ASSERT_FALSE(r.ok()) << "kept " << keep;
    EXPECT_EQ(r.status().code(), StatusCode::corrupt) << r.status().to_string();
    expect_message(r.status(), {path_});
  }
}

TEST_F(Checkpoint, BadMagicIsRefused) {
  write("{}", {{"a", pattern(10, 13)}});
  flip_byte(0);
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::corrupt);
  expect_message(r.status(), {path_, "not a zoe checkpoint"});
}

// Sets the version in the header (u32 major and minor after the 8-byte magic) and, with
// `trailer` true, in the trailer too (u32 major and minor at 20 and 24 of its 40 bytes), its checksum
// recomputed: what a newer zoe that kept this layout would write.
void set_version(std::vector<char>& b, std::uint32_t major, std::uint32_t minor, bool trailer) {
  auto put = [&b](std::size_t at, std::uint32_t v) {
    for (int i = 0; i < 4; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  };
  put(8, major);
  put(12, minor);
  if (!trailer) return;
  const std::size_t t = b.size() - 40;
  put(t + 20, major);
  put(t + 24, minor);
  put(t + 28, crc32c(b.data() + t, 28));
}

TEST_F(Checkpoint, NewerMajorVersionIsRefused) {
  write("{}", {{"a", pattern(10, 14)}});
  std::vector<char> b = file_bytes();
  set_version(b, kCheckpointMajor + 1, 3, true);
  put_file_bytes(b);
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::unsupported);
  expect_message(r.status(), {path_, "version " + std::to_string(kCheckpointMajor + 1) + ".3",
                              "up to " + std::to_string(kCheckpointMajor) + ".x", "newer zoe"});
  // A newer format may lay its trailer out differently: a nearby version is still taken for one.
  set_version(b, kCheckpointMajor + 1, 3, false);
  b[b.size() - 1] = 'X';
  put_file_bytes(b);
  r = CheckpointReader::open(path_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::unsupported) << r.status().to_string();
}

// Issue 32: byte 10 (the major version's third byte) flipped read as "format version 16711681 ... read
// it with a newer zoe". A damaged header is reported as damage, naming the file.
TEST_F(Checkpoint, DamagedHeaderVersionIsCorruptNotNewer) {
  write("{}", {{"a", pattern(10, 15)}});
  const std::vector<char> good = file_bytes();
  for (std::size_t at = 8; at < 16; ++at) {
    std::vector<char> b = good;
    b[at] = static_cast<char>(b[at] ^ 0xFF);
    put_file_bytes(b);
    Result<CheckpointReader> r = CheckpointReader::open(path_);
    ASSERT_FALSE(r.ok()) << "byte " << at;
    EXPECT_EQ(r.status().code(), StatusCode::corrupt) << "byte " << at << ": " << r.status().to_string();
    expect_message(r.status(), {path_, "header is damaged"});
    EXPECT_EQ(r.status().message().find("newer zoe"), std::string::npos) << r.status().message();
  }
  // With the trailer damaged too, the version alone decides: one far beyond this zoe's is damage.
  std::vector<char> b = good;
  b[10] = static_cast<char>(0xFF);
  b[b.size() - 1] = 'X';
  put_file_bytes(b);
  Result<CheckpointReader> r = CheckpointReader::open(path_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::corrupt) << r.status().to_string();
  expect_message(r.status(), {path_, "version 16711681.0", "header is damaged"});
}

TEST_F(Checkpoint, MissingFile) {
  Result<CheckpointReader> r = CheckpointReader::open(dir_ + "/absent");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::io_error);
  EXPECT_EQ(r.status().sys_errno(), ENOENT);
  expect_message(r.status(), {dir_ + "/absent"});
  Result<CheckpointReader> d = CheckpointReader::open(dir_);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::io_error);
}

TEST_F(Checkpoint, MissingDirectory) {
  Result<CheckpointWriter> w = CheckpointWriter::create(dir_ + "/no/such/dir/state");
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::io_error);
  EXPECT_EQ(w.status().sys_errno(), ENOENT);
  expect_message(w.status(), {dir_ + "/no/such/dir"});
  EXPECT_TRUE(strays().empty());
}

TEST_F(Checkpoint, ParentIsAFile) {
  write("{}", {});
  Result<CheckpointWriter> w = CheckpointWriter::create(path_ + "/inner");
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::io_error);
  EXPECT_EQ(w.status().sys_errno(), ENOTDIR);
  expect_message(w.status(), {path_});
}

TEST_F(Checkpoint, ReadOnlyDirectory) {
  const std::string ro = dir_ + "/ro";
  ASSERT_EQ(::mkdir(ro.c_str(), 0555), 0);
  Result<CheckpointWriter> w = CheckpointWriter::create(ro + "/state");
  if (w.ok()) {
    ::chmod(ro.c_str(), 0755);
    GTEST_SKIP() << "a read-only directory does not stop this process from writing (root or CAP_DAC_OVERRIDE)";
  }
  EXPECT_EQ(w.status().code(), StatusCode::io_error);
  EXPECT_EQ(w.status().sys_errno(), EACCES);
  ::chmod(ro.c_str(), 0755);
}

}  // namespace
}  // namespace zoe
