// The libaio engine: alignment checks, many requests over several files, checked completions (errors and
// short transfers, real and injected), the file helpers, and the fast CRC-32C.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "aio/files.h"
#include "aio/io_engine.h"
#include "base/crc32c.h"
#include "tests/aio/aio_test_util.h"
#include "zoe/aligned_buffer.h"

namespace zoe {
namespace {

using testing::FaultPlan;
using testing::TempDir;

constexpr std::size_t kBlock = 4096;

struct EngineFixture {
  TempDir dir;
  std::vector<aio::OpenedFile> files;
  std::unique_ptr<aio::IoEngine> engine;
  FaultPlan faults;

  void make(int nfiles, std::size_t file_bytes, unsigned qd = 4, std::size_t request = 2 * kBlock) {
    aio::EngineOptions o;
    o.queue_depth = qd;
    o.request_bytes = request;
    o.alignment = kBlock;
    o.fault_hook = faults.hook();
    Result<std::unique_ptr<aio::IoEngine>> e = aio::IoEngine::create(o);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    engine = std::move(e).value();
    for (int i = 0; i < nfiles; ++i) {
      const std::string path = dir.path() + "/f" + std::to_string(i);
      Result<aio::OpenedFile> f = aio::open_swap_file(Folder::open(dir.path()).value(), base_name(path), true, {});
      ASSERT_TRUE(f.ok()) << f.status().to_string();
      ASSERT_TRUE(aio::allocate_file(f->fd.get(), path, file_bytes, {}).ok());
      engine->add_file(f->fd.get(), path);
      files.push_back(std::move(f).value());
    }
  }
};

AlignedBuffer pattern(std::size_t bytes, unsigned seed) {
  AlignedBuffer b = std::move(AlignedBuffer::allocate(bytes, kBlock)).value();
  std::mt19937 rng(seed);
  for (std::size_t i = 0; i < bytes / 4; ++i) b.as<std::uint32_t>()[i] = rng();
  return b;
}

TEST(AioEngine, ChecksAlignmentBeforeSubmitting) {
  EngineFixture fx;
  fx.make(1, 16 * kBlock);
  AlignedBuffer buf = std::move(AlignedBuffer::allocate(4 * kBlock, kBlock)).value();
  char* base = buf.as<char>();

  Result<aio::IoEngine::Ticket> bad_addr = fx.engine->submit(IoOp::read, 0, 0, base + 512, kBlock);
  ASSERT_FALSE(bad_addr.ok());
  EXPECT_EQ(bad_addr.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(bad_addr.status().message().find("buffer address"), std::string::npos) << bad_addr.status().message();

  Result<aio::IoEngine::Ticket> bad_offset = fx.engine->submit(IoOp::write, 0, 4100, base, kBlock);
  ASSERT_FALSE(bad_offset.ok());
  EXPECT_NE(bad_offset.status().message().find("file offset 4100"), std::string::npos) << bad_offset.status().message();

  Result<aio::IoEngine::Ticket> bad_len = fx.engine->submit(IoOp::read, 0, 0, base, kBlock + 1);
  ASSERT_FALSE(bad_len.ok());
  EXPECT_NE(bad_len.status().message().find("length 4097"), std::string::npos) << bad_len.status().message();
  EXPECT_NE(bad_len.status().message().find(fx.engine->file_path(0)), std::string::npos);

  Result<aio::IoEngine::Ticket> empty = fx.engine->submit(IoOp::read, 0, 0, base, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(fx.engine->wait(empty.value()).ok());
}

TEST(AioEngine, RejectsBadOptions) {
  aio::EngineOptions o;
  o.queue_depth = 0;
  EXPECT_FALSE(aio::IoEngine::create(o).ok());
  o.queue_depth = 4;
  o.request_bytes = 1000;
  EXPECT_FALSE(aio::IoEngine::create(o).ok());
  o.request_bytes = kBlock;
  o.alignment = 3000;
  EXPECT_FALSE(aio::IoEngine::create(o).ok());
}

// Many jobs, each cut into many requests, over three files, more than the queue depth in flight at once.
TEST(AioEngine, ManyRequestsAcrossFilesRoundTrip) {
  EngineFixture fx;
  constexpr std::size_t kJob = 10 * kBlock, kJobs = 6;
  fx.make(3, kJobs * kJob, /*qd=*/3, /*request=*/3 * kBlock);  // 10 blocks = 3+3+3+1: a short last request
  std::vector<AlignedBuffer> out, in;
  std::vector<aio::IoEngine::Ticket> tickets;
  for (int f = 0; f < 3; ++f) {
    for (std::size_t j = 0; j < kJobs; ++j) {
      out.push_back(pattern(kJob, static_cast<unsigned>(f * 100 + j)));
      Result<aio::IoEngine::Ticket> t = fx.engine->submit(IoOp::write, f, j * kJob, out.back().data(), kJob);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      tickets.push_back(t.value());
    }
  }
  for (auto t : tickets) ASSERT_TRUE(fx.engine->wait(t).ok());
  tickets.clear();
  for (int f = 0; f < 3; ++f) {
    for (std::size_t j = 0; j < kJobs; ++j) {
      in.push_back(std::move(AlignedBuffer::allocate(kJob, kBlock)).value());
      Result<aio::IoEngine::Ticket> t = fx.engine->submit(IoOp::read, f, j * kJob, in.back().data(), kJob);
      ASSERT_TRUE(t.ok());
      tickets.push_back(t.value());
    }
  }
  EXPECT_TRUE(fx.engine->wait_all().ok());
  for (std::size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(std::memcmp(out[i].data(), in[i].data(), kJob), 0) << "job " << i;
  }
  const aio::EngineCounters c = fx.engine->counters();
  EXPECT_EQ(c.write_bytes, 3 * kJobs * kJob);
  EXPECT_EQ(c.read_bytes, 3 * kJobs * kJob);
}

// I/O buffers from 2 MiB up sit on whole 2 MiB pages (where the kernel backs them with huge pages); smaller
// ones keep the alignment asked. Either way a transfer spanning page boundaries round-trips exactly.
TEST(AioEngine, IoBuffersOnHugePagesRoundTrip) {
  constexpr std::size_t kHuge = AlignedBuffer::kHugePage;
  AlignedBuffer small = std::move(AlignedBuffer::allocate_for_io(64 * 1024, kBlock)).value();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small.data()) % kBlock, 0u);
  EXPECT_EQ(small.size(), 64u * 1024);

  constexpr std::size_t kJob = 3 * kHuge + 5 * kBlock;  // ends inside a fourth huge page
  AlignedBuffer in = std::move(AlignedBuffer::allocate_for_io(kJob, kBlock)).value();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(in.data()) % kHuge, 0u);
  EXPECT_EQ(in.size(), 4 * kHuge);

  EngineFixture fx;
  fx.make(1, kJob, /*qd=*/4, /*request=*/256 * kBlock);
  const AlignedBuffer out = pattern(kJob, 7);
  Result<aio::IoEngine::Ticket> w = fx.engine->submit(IoOp::write, 0, 0, out.data(), kJob);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_TRUE(fx.engine->wait(w.value()).ok());
  std::memset(in.data(), 0xa5, in.size());
  Result<aio::IoEngine::Ticket> r = fx.engine->submit(IoOp::read, 0, 0, in.data(), kJob);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(fx.engine->wait(r.value()).ok());
  EXPECT_EQ(std::memcmp(out.data(), in.data(), kJob), 0);
  EXPECT_EQ(in.as<unsigned char>()[kJob], 0xa5) << "the read wrote past its length";
}

TEST(AioEngine, ReadPastTheEndIsAShortReadNamingFileAndOffset) {
  EngineFixture fx;
  fx.make(1, 4 * kBlock);
  AlignedBuffer buf = std::move(AlignedBuffer::allocate(4 * kBlock, kBlock)).value();
  Result<aio::IoEngine::Ticket> t = fx.engine->submit(IoOp::read, 0, 2 * kBlock, buf.data(), 4 * kBlock);
  ASSERT_TRUE(t.ok());
  Status s = fx.engine->wait(t.value());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::io_error);
  EXPECT_NE(s.message().find("short read"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(fx.engine->file_path(0)), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offset"), std::string::npos) << s.message();
}

struct InjectedCase {
  const char* name;
  IoOp op;
  int error;
  std::int64_t transferred;
  const char* expect;
};

class AioEngineFaults : public ::testing::TestWithParam<InjectedCase> {};

TEST_P(AioEngineFaults, CompletionIsCheckedAndNamed) {
  const InjectedCase& c = GetParam();
  EngineFixture fx;
  fx.make(1, 8 * kBlock, 2, kBlock);
  AlignedBuffer buf = pattern(8 * kBlock, 1);
  if (c.op == IoOp::read) {
    Result<aio::IoEngine::Ticket> w = fx.engine->submit(IoOp::write, 0, 0, buf.data(), 8 * kBlock);
    ASSERT_TRUE(w.ok() && fx.engine->wait(w.value()).ok());
  }
  fx.faults.arm(c.op, 0, c.error, c.transferred);
  fx.faults.at_offset = 5 * kBlock;
  Result<aio::IoEngine::Ticket> t = fx.engine->submit(c.op, 0, 0, buf.data(), 8 * kBlock);
  ASSERT_TRUE(t.ok());
  Status s = fx.engine->wait(t.value());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(fx.faults.fired.load(), 1);
  EXPECT_EQ(s.code(), StatusCode::io_error);
  EXPECT_EQ(s.sys_errno(), c.error);
  EXPECT_NE(s.message().find(c.expect), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offset 20480, length 4096"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(fx.engine->file_path(0)), std::string::npos) << s.message();
  fx.faults.clear();
  // The engine stays usable after a failed job.
  Result<aio::IoEngine::Ticket> again = fx.engine->submit(c.op, 0, 0, buf.data(), 8 * kBlock);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(fx.engine->wait(again.value()).ok());
}

INSTANTIATE_TEST_SUITE_P(Injected, AioEngineFaults,
                         ::testing::Values(InjectedCase{"EioRead", IoOp::read, EIO, -1, "read of"},
                                           InjectedCase{"EioWrite", IoOp::write, EIO, -1, "write of"},
                                           InjectedCase{"EnospcWrite", IoOp::write, ENOSPC, -1, "No space"},
                                           InjectedCase{"ShortRead", IoOp::read, 0, 512, "short read"},
                                           InjectedCase{"ShortWrite", IoOp::write, 0, 0, "short write"}),
                         [](const auto& tp) { return std::string(tp.param.name); });

TEST(AioFiles, OpenFallsBackToBufferedWhenODirectIsRefused) {
  TempDir dir;
  IoFaultHook refuse_direct = [](const IoSite& s) -> IoFault {
    return s.op == IoOp::open && s.direct ? IoFault{EINVAL, -1} : IoFault{};
  };
  const Folder folder = Folder::open(dir.path()).value();
  Result<aio::OpenedFile> f = aio::open_swap_file(folder, "x", true, refuse_direct);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_FALSE(f->direct);
  Result<aio::OpenedFile> g = aio::open_swap_file(folder, "y", true, {});
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->direct, testing::direct_io_works(dir.path()));
}

TEST(AioFiles, CreateRefusesAnExistingFileAndUses0600) {
  TempDir dir;
  const std::string p = dir.path() + "/x";
  const Folder folder = Folder::open(dir.path()).value();
  ASSERT_TRUE(aio::open_swap_file(folder, "x", true, {}).ok());
  struct stat st{};
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  Result<aio::OpenedFile> again = aio::open_swap_file(folder, "x", true, {});
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("already exists"), std::string::npos);
}

// A link at a swap file's name is never followed, created or opened: the writes cannot be redirected.
TEST(AioFiles, ALinkAtASwapFileNameIsNeverFollowed) {
  TempDir dir;
  const std::string victim = dir.path() + "/victim";
  { std::FILE* f = std::fopen(victim.c_str(), "w"); ASSERT_NE(f, nullptr); std::fputs("intact", f); std::fclose(f); }
  ASSERT_EQ(::symlink(victim.c_str(), (dir.path() + "/x").c_str()), 0);
  const Folder folder = Folder::open(dir.path()).value();
  EXPECT_FALSE(aio::open_swap_file(folder, "x", true, {}).ok());
  Result<aio::OpenedFile> existing = aio::open_swap_file(folder, "x", false, {});
  ASSERT_FALSE(existing.ok());
  EXPECT_NE(existing.status().message().find("symbolic link"), std::string::npos) << existing.status().message();
  struct stat st{};
  ASSERT_EQ(::stat(victim.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 6);
}

TEST(AioFiles, FsInfoNamesTheFilesystem) {
  Result<aio::FsInfo> info = aio::fs_info("/dev/shm");
  if (!info.ok()) GTEST_SKIP() << "no /dev/shm here: " << info.status().message();
  EXPECT_EQ(info->type, "tmpfs");
  EXPECT_EQ(aio::fs_type_name(0xEF53), "ext4");
  EXPECT_NE(aio::fs_type_name(0x1234).find("unknown"), std::string::npos);
}

TEST(AioCrc32c, FastMatchesSoftwareAtEveryLengthAndOffset) {
  std::vector<unsigned char> data(4096 + 64);
  std::mt19937 rng(3);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  std::printf("crc32c hardware path: %s\n", crc32c_hardware() ? "yes (SSE4.2 or Arm CRC32)" : "no (software)");
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  for (std::size_t off : {0, 1, 5}) {
    for (std::size_t len : {0, 1, 7, 8, 9, 63, 64, 1000, 4096}) {
      EXPECT_EQ(crc32c(data.data() + off, len), crc32c_software(data.data() + off, len)) << off << " " << len;
      EXPECT_EQ(crc32c(data.data() + off, len, 0x1234u), crc32c_software(data.data() + off, len, 0x1234u));
    }
  }
  // Long buffers run as three chains joined (crc_hw_long): lengths around the switch and not divisible by 24,
  // from every start, continuing from another CRC.
  std::vector<unsigned char> big(3 << 20);
  for (auto& b : big) b = static_cast<unsigned char>(rng());
  for (std::size_t len : {std::size_t{65535}, std::size_t{65536}, std::size_t{65537}, std::size_t{100003},
                          big.size() - 5}) {
    for (std::size_t off : {0, 3}) {
      EXPECT_EQ(crc32c(big.data() + off, len), crc32c_software(big.data() + off, len)) << off << " " << len;
      EXPECT_EQ(crc32c(big.data() + off, len, 0xDEADBEEFu), crc32c_software(big.data() + off, len, 0xDEADBEEFu))
          << off << " " << len;
    }
  }
  for (std::size_t len : {0, 3, 8, 17, 4096}) {
    std::uint32_t x3[3];
    crc32c_x3(data.data(), data.data() + 7, data.data() + 13, len, x3);
    EXPECT_EQ(x3[0], crc32c_software(data.data(), len));
    EXPECT_EQ(x3[1], crc32c_software(data.data() + 7, len));
    EXPECT_EQ(x3[2], crc32c_software(data.data() + 13, len));
  }
}

}  // namespace
}  // namespace zoe
