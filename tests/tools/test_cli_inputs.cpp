// Crafted files given to zoe (issue 49): checkpoints whose checksums are all valid but whose element counts or
// shapes lie, and paths that are not regular files. Each must be refused by name, by the library's checkpoint
// reader (what `zoe export`, OffloadOptimizer::load and Python's consolidate_state_dicts use) and by the
// command, quickly, and without reading without end.
//
// Before: an element count of n + 2^62 wrapped the arrays' byte count back to n's, which the checksums then
// vouched for (`zoe export`: "internal error: vector::_M_default_append"); a shape of [2^40, 2^40] over n
// elements was exported as a safetensors header no reader accepts; `zoe plan --model /dev/zero` read until
// memory ran out; a config holding 1e400 was "not a JSON object".
#include <gtest/gtest.h>

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "base/crc32c.h"
#include "src/offload/optimizer_manifest.h"
#include "tests/tools/cli_runner.h"
#include "zoe/checkpoint.h"

namespace zoe::test {
namespace {

void put_le(std::string& s, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

// A checkpoint container written byte by byte after the format at the top of src/offload/checkpoint.cpp,
// every checksum valid: only the manifest lies.
std::string container(const std::vector<std::pair<std::string, std::string>>& blobs, const std::string& manifest) {
  std::string file = "ZOECKPT";
  file.push_back('\0');
  put_le(file, 1, 4);  // major
  put_le(file, 0, 4);  // minor
  file.resize(64, '\0');
  std::string entries;
  for (const auto& [name, data] : blobs) {
    file.resize((file.size() + 63) / 64 * 64, '\0');
    put_le(entries, name.size(), 4);
    entries += name;
    put_le(entries, file.size(), 8);
    put_le(entries, data.size(), 8);
    put_le(entries, crc32c(data.data(), data.size()), 4);
    file += data;
  }
  file.resize((file.size() + 7) / 8 * 8, '\0');
  std::string index;
  put_le(index, blobs.size(), 4);
  index += entries;
  put_le(index, manifest.size(), 8);
  index += manifest;
  std::string trailer;
  put_le(trailer, file.size(), 8);
  put_le(trailer, index.size(), 8);
  put_le(trailer, crc32c(index.data(), index.size()), 4);
  put_le(trailer, 1, 4);
  put_le(trailer, 0, 4);
  put_le(trailer, crc32c(trailer.data(), trailer.size()), 4);
  trailer += std::string("ZOEINDX\0", 8);
  return file + index + trailer;
}

// The manifest of one rank (of one) whose parameters are recorded as `params`.
std::string manifest(const std::vector<ManifestParam>& params) {
  OptimizerManifest m;
  m.step = 1;
  m.loss_scale.hysteresis_left = 1;
  m.groups = {AdamHyper{}};
  m.params = params;
  return m.dump();
}

// Its checkpoint, whose state arrays hold `elements` fp32 values.
std::string checkpoint(const std::vector<ManifestParam>& params, std::size_t elements) {
  const std::string array(elements * 4, '\0');
  return container({{"master", array}, {"exp_avg", array}, {"exp_avg_sq", array}, {"weights16", ""}}, manifest(params));
}

class CraftedInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zoe-cli-inputs-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string write(const std::string& name, const std::string& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  // `zoe export` of `path` is refused (exit 1, the checkpoint is at fault, not the command line) with
  // `message`, and writes nothing.
  void expect_export_refused(const std::string& path, const std::string& message) {
    const Ran r = run_zoe({"export", path, "--out", dir_ + "/out"}, 30);
    EXPECT_FALSE(r.signaled || r.timed_out) << r.how();
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << "said:\n" << r.output;
    EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/out/model.safetensors"));
  }
  std::string dir_;
};

ManifestParam param(std::string name, std::uint64_t n, std::vector<std::int64_t> shape) {
  return ManifestParam{static_cast<std::size_t>(n), "f32", 0, std::move(name), std::move(shape)};
}

TEST_F(CraftedInputs, AValidCheckpointExports) {
  const std::string path = write("good.zoe", checkpoint({param("w", 12, {3, 4}), param("b", 4, {})}, 16));
  ASSERT_TRUE(PartitionedCheckpoint::open({path}).ok());
  const Ran r = run_zoe({"export", path, "--out", dir_ + "/out"}, 30);
  EXPECT_EQ(r.code, 0) << r.how() << "\n" << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/out/model.safetensors"));
}

// A checkpoint of an Adagrad run holds "master" and "sum" (the optimizer table's state names): --moments
// exports sum.safetensors, and nothing of Adam's.
TEST_F(CraftedInputs, AnAdagradCheckpointExportsItsSum) {
  OptimizerManifest m;
  m.step = 1;
  m.loss_scale.hysteresis_left = 1;
  m.rule = Rule::adagrad;
  m.groups = {hyper_defaults(Rule::adagrad)};
  m.params = {param("w", 12, {3, 4})};
  const std::string array(12 * 4, '\0');
  const std::string path = write("adagrad.zoe", container({{"master", array}, {"sum", array}, {"weights16", ""}}, m.dump()));
  Result<PartitionedCheckpoint> opened = PartitionedCheckpoint::open({path});
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  EXPECT_EQ(opened->rule(), Rule::adagrad);
  const Ran r = run_zoe({"export", path, "--out", dir_ + "/out", "--moments"}, 30);
  EXPECT_EQ(r.code, 0) << r.how() << "\n" << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/out/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/out/sum.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/out/exp_avg_sq.safetensors"));
}

TEST_F(CraftedInputs, AnElementCountPast2To60IsRefused) {
  // n + 2^62 elements: 4 bytes each wrap to the 4 n bytes the arrays hold.
  const std::string path = write("huge.zoe", checkpoint({param("w", (std::uint64_t{1} << 62) + 16, {})}, 16));
  Result<PartitionedCheckpoint> c = PartitionedCheckpoint::open({path});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::corrupt);
  EXPECT_NE(c.status().message().find("parameter 0 ('w') has 4611686018427387920 elements"), std::string::npos)
      << c.status().message();
  expect_export_refused(path, "parameter 0 ('w') has 4611686018427387920 elements, more than a checkpoint holds");
}

TEST_F(CraftedInputs, ElementCountsWhoseSumWrapsAreRefused) {
  // Sixteen parameters of 2^60 and one of 16: each passes alone, their sum wraps 64 bits to 16.
  std::vector<ManifestParam> params;
  for (int i = 0; i < 16; ++i) params.push_back(param("big." + std::to_string(i), std::uint64_t{1} << 60, {}));
  params.push_back(param("small", 16, {}));
  const std::string path = write("sum.zoe", checkpoint(params, 16));
  Result<PartitionedCheckpoint> c = PartitionedCheckpoint::open({path});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("would hold more than 2^60 elements"), std::string::npos) << c.status().message();
  expect_export_refused(path, "would hold more than 2^60 elements");
}

TEST_F(CraftedInputs, AShapeThatDoesNotMultiplyToTheElementCountIsRefused) {
  const std::vector<std::pair<std::vector<std::int64_t>, std::string>> cases = {
      // 2^80 elements: its product wraps to 0 in 64 bits.
      {{std::int64_t{1} << 40, std::int64_t{1} << 40}, "its shape [1099511627776, 1099511627776] holds more than 2^64"},
      // 2^64 + 2^32: wraps to 2^32, and past that to 16 with a last dimension.
      {{std::int64_t{1} << 32, (std::int64_t{1} << 32) + 1}, "holds more than 2^64 elements"},
      {{3, 5}, "its shape [3, 5] holds 15 elements, and it has 16"},
      {{16, 0}, "its shape [16, 0] holds 0 elements, and it has 16"},
  };
  for (const auto& [shape, message] : cases) {
    const std::string path = write("shape.zoe", checkpoint({param("w", 16, shape)}, 16));
    Result<PartitionedCheckpoint> c = PartitionedCheckpoint::open({path});
    ASSERT_FALSE(c.ok()) << message;
    EXPECT_EQ(c.status().code(), StatusCode::corrupt);
    EXPECT_NE(c.status().message().find("parameter 0 ('w'): its shape ["), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find(message), std::string::npos) << c.status().message();
    // OffloadOptimizer::load (and so Python's load_state_dict) reads the same manifest.
    Result<OptimizerManifest> m = OptimizerManifest::parse(manifest({param("w", 16, shape)}), path);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find(message), std::string::npos) << m.status().message();
    expect_export_refused(path, message);
  }
}

TEST_F(CraftedInputs, APartitionedParameterLargerThanItsPiecesIsRefusedBeforeItIsAllocated) {
  // World 1 of a partitioned record (pieces recorded): the trainer's parameter claims 2^59 elements, its one
  // piece holds 16. join() sized each parameter before counting what the pieces hold.
  OptimizerManifest m;
  m.step = 1;
  m.loss_scale.hysteresis_left = 1;
  m.groups = {AdamHyper{}};
  m.rank = 0;
  m.world = 2;
  m.params = {param("", 16, {})};
  m.pieces_recorded = true;
  m.user_params = {param("w", std::uint64_t{1} << 59, {})};
  m.pieces = {CheckpointPiece{0, 0, 16}};
  const std::string array(64, '\0');
  const std::string blobs = container({{"master", array}, {"exp_avg", array}, {"exp_avg_sq", array}}, m.dump());
  m.rank = 1;
  m.pieces = {CheckpointPiece{0, 16, 16}};
  const std::string rank0 = write("r0.zoe", blobs);
  const std::string rank1 = write("r1.zoe", container({{"master", array}, {"exp_avg", array}, {"exp_avg_sq", array}}, m.dump()));
  Result<PartitionedCheckpoint> c = PartitionedCheckpoint::open({rank0, rank1});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("parameter w: the checkpoints hold 32 of its 576460752303423488 elements"),
            std::string::npos)
      << c.status().message();
}

TEST_F(CraftedInputs, PathsThatAreNotRegularFilesAreRefusedByNameAndQuickly) {
  const std::string fifo = dir_ + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<std::pair<std::string, std::string>> paths = {
      {"/dev/zero", "/dev/zero is a character device, not a regular file"},
      {dir_, dir_ + " is a folder, not a regular file"},
      {fifo, fifo + " is a FIFO, not a regular file"},
  };
  for (const auto& [path, message] : paths) {
    const auto t0 = std::chrono::steady_clock::now();
    const Ran r = run_zoe({"plan", "--model", path}, 20);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_FALSE(r.signaled || r.timed_out) << path << ": " << r.how();
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("--model: " + message), std::string::npos) << r.output;
    EXPECT_LT(seconds, 10) << path;
    // A checkpoint given as one: refused by the reader, without waiting for a FIFO's writer.
    const Ran e = run_zoe({"export", path, "--out", dir_ + "/out"}, 20);
    EXPECT_FALSE(e.signaled || e.timed_out) << path << ": " << e.how();
    EXPECT_EQ(e.code, 1) << e.output;
    EXPECT_NE(e.output.find("is not a regular file"), std::string::npos) << e.output;
  }
}

TEST_F(CraftedInputs, AConfigLargerThanTheCapIsRefusedUnread) {
  const std::string path = write("big.json", "{\"pad\": \"" + std::string((16 << 20) + 16, 'x') + "\"}");
  const Ran r = run_zoe({"plan", "--model", path}, 20);
  EXPECT_EQ(r.code, 2) << r.how() << "\n" << r.output;
  EXPECT_NE(r.output.find("more than the 16M a config file may have"), std::string::npos) << r.output;
}

TEST_F(CraftedInputs, ANumberOutOfRangeInAConfigIsNamed) {
  const std::string path = write(
      "config.json", R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 1e400})");
  const Ran r = run_zoe({"plan", "--model", path}, 20);
  EXPECT_EQ(r.code, 2) << r.how() << "\n" << r.output;
  EXPECT_NE(r.output.find("config.json: a number is out of range (number overflow parsing '1e400')"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("not a JSON object"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace zoe::test
