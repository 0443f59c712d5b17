// Bounded fuzzing (tests/fuzz.h) of the offload engine's readers: the DeepSpeed/zoe JSON config, the
// checkpoint container (raw files, and indexes and trailers re-sealed with valid checksums so the parser
// behind the checks is reached), and the optimizer's checkpoint manifest as OffloadOptimizer::load reads
// it. Each must give a clear error or a valid result, whatever the bytes.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "base/crc32c.h"
#include "src/offload/checkpoint.h"
#include "base/utf8.h"
#include "tests/fuzz.h"
#include "tests/offload/trainer.h"
#include "zoe/config.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;
using fuzz::Case;
using fuzz::Rng;
using fuzz::Verdict;
using fuzz::read_file;
using fuzz::write_file;

// Every section the reader maps, with values inside their ranges and keys it only notes.
constexpr const char* kValidConfig = R"({
  "train_batch_size": 16,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                "bias_correction": true, "adam_w_mode": true, "amsgrad": false, "torch_adam": false}},
  "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
           "hysteresis": 2, "consecutive_hysteresis": false, "min_loss_scale": 1},
  "bf16": {"enabled": false},
  "zero_optimization": {"stage": 2, "sub_group_size": 1e9, "reduce_bucket_size": 5e8, "stage3_max_live_parameters": 1,
                        "offload_optimizer": {"device": "nvme", "nvme_path": ["/local_nvme0", "/local_nvme1"],
                                              "buffer_count": 4, "pin_memory": true, "pipeline_read": true,
                                              "pipeline_write": true, "fast_init": false}},
  "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": false},
  "zoe": {"schedule": "overlap", "delayed_warmup_steps": 10, "tile": 1048576, "threads": 0, "isa": "auto",
          "pin_threads": true, "cpu_tile": 65536}
})";

// What any accepted config promises (the ranges docs/config.md documents); empty when it holds.
std::string config_violation(const LoadedConfig& c) {
  const OptimizerHyper& h = c.hyper;
  const OffloadOptions& o = c.options;
  const LossScaleOptions& ls = o.loss_scale;
  auto finite_ge0 = [](double x) { return std::isfinite(x) && x >= 0; };
  if (!finite_ge0(h.lr) || !finite_ge0(h.eps) || !finite_ge0(h.weight_decay)) return "lr, eps or weight_decay";
  if (!(h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1)) return "betas";
  if (!finite_ge0(o.max_grad_norm)) return "gradient_clipping";
  if (!(std::isfinite(ls.initial_scale) && ls.initial_scale > 0) || !(std::isfinite(ls.min_scale) && ls.min_scale > 0) ||
      (!ls.dynamic && !(std::isfinite(ls.static_scale) && ls.static_scale > 0)) || ls.growth_interval < 1 ||
      ls.hysteresis < 1) {
    return "fp16 loss scaling";
  }
  if (o.tier == Tier::nvme && o.nvme.paths.empty()) return "nvme without a path";
  if (std::set<std::string>(o.nvme.paths.begin(), o.nvme.paths.end()).size() != o.nvme.paths.size()) return "nvme_path twice";
  for (const std::string& p : o.nvme.paths) {
    if (p.empty()) return "empty nvme_path";
  }
  if (o.nvme.buffer_count < 1 || o.nvme.buffer_count > 1024) return "buffer_count";
  if (o.nvme.block_size < 4096 || o.nvme.block_size > (std::size_t(1) << 30) || o.nvme.block_size % 4096 != 0) return "block_size";
  if (o.nvme.queue_depth < 1 || o.nvme.queue_depth > 4096) return "queue_depth";
  if (o.tile < 1 || o.cpu.tile < 1 || o.cpu.threads < 0 || o.delayed_warmup_steps < 0) return "tile, cpu_tile, threads or warm-up";
  const std::set<std::string> isas{"auto", "scalar", "avx2", "avx512", "neon", "sve"};
  if (isas.count(o.cpu.isa) == 0) return "isa";
  return "";
}

TEST(FuzzReaders, Config) {
  Result<LoadedConfig> valid = parse_config(kValidConfig, "fuzz.json");
  ASSERT_TRUE(valid.ok()) << valid.status().to_string();
  ASSERT_EQ(config_violation(valid.value()), "");
  ASSERT_EQ(valid.value().options.tier, Tier::nvme);
  const fuzz::Tally t = fuzz::run(
      "config", fuzz::default_budget(),
      [](Rng& rng) {
        Case c;
        c.input = fuzz::mutate_json(kValidConfig, rng, &c.mutation);
        return c;
      },
      [](const Case& c) {
        Result<LoadedConfig> r = parse_config(c.input, "fuzz.json");
        if (!r.ok()) {
          EXPECT_FALSE(r.status().message().empty()) << c.mutation << ": an error without a message";
          // Python decodes messages strictly: a cut or foreign byte would replace zoe's error.
          EXPECT_TRUE(utf8_valid(r.status().message())) << c.mutation << ": a message that is not UTF-8: "
                                                        << r.status().message();
          return Verdict::refused;
        }
        EXPECT_EQ(config_violation(r.value()), "") << c.mutation << ": accepted a config out of range:\n" << c.input;
        for (const std::string& note : r.value().notes) EXPECT_TRUE(utf8_valid(note)) << c.mutation << ": " << note;
        return Verdict::accepted;
      });
  fuzz::expect_both_outcomes(t);
}

// ---- the checkpoint container ----

class TempFolder {
 public:
  TempFolder() {
    // tmpfs where there is one: every case writes a file, and fsync there costs nothing.
    const char* base = fs::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
    std::string t = std::string(base) + "/zoe_fuzz_XXXXXX";
    if (::mkdtemp(t.data()) != nullptr) path_ = t;
  }
  ~TempFolder() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::uint64_t get_u64(const std::string& s, std::size_t at) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

// The file's last 40 bytes (checkpoint.cpp's format comment): index offset, size and CRC, versions, the
// trailer's own CRC and magic.
constexpr std::size_t kTrailer = 40;

// Puts the file back together around a changed index, with the checksums a writer would compute: what a
// crafted file or a writer bug looks like to the reader once the checksums pass.
std::string reseal(const std::string& data, std::string index, std::string trailer) {
  fuzz::put_le(trailer, 0, data.size(), 8);
  fuzz::put_le(trailer, 8, index.size(), 8);
  fuzz::put_le(trailer, 16, crc32c(index.data(), index.size()), 4);
  fuzz::put_le(trailer, 28, crc32c(trailer.data(), 28), 4);
  return data + index + trailer;
}

// Opens what the case holds and reads every blob it lists, whole and in slices.
Verdict read_checkpoint(const std::string& path, const Case& c) {
  Result<CheckpointReader> r = CheckpointReader::open(path);
  if (!r.ok()) {
    EXPECT_FALSE(r.status().message().empty()) << c.mutation << ": an error without a message";
    return Verdict::refused;
  }
  bool all_read = true;
  for (const std::string& name : r->names()) {
    Result<std::size_t> size = r->size(name);
    EXPECT_TRUE(size.ok());
    if (!size.ok()) continue;
    // Bounds were checked against the file when it opened: a blob can never claim more than the file holds.
    EXPECT_LE(size.value(), c.input.size()) << c.mutation << ": blob '" << name << "'";
    if (size.value() > c.input.size()) return Verdict::accepted;
    std::vector<char> buf(size.value());
    const Status whole = r->read(name, buf.data(), buf.size());
    const Status sliced = r->read_streamed(name, buf.size(), 7, [](std::size_t, const void*, std::size_t) {
      return Status::success();
    });
    EXPECT_EQ(whole.ok(), sliced.ok()) << c.mutation << ": blob '" << name << "' whole and sliced reads disagree";
    EXPECT_TRUE(whole.ok() || !whole.message().empty()) << c.mutation;
    all_read = all_read && whole.ok();
    EXPECT_FALSE(r->read(name, buf.data(), buf.size() + 1).ok()) << c.mutation << ": a wrong size was accepted";
  }
  return all_read ? Verdict::accepted : Verdict::refused;
}

TEST(FuzzReaders, CheckpointContainer) {
  TempFolder dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string valid_path = dir.path() + "/valid.zoeckpt";
  {
    Result<CheckpointWriter> w = CheckpointWriter::create(valid_path);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    std::string big(3000, '\0');
    for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
    ASSERT_TRUE(w->add("empty", nullptr, 0).ok());
    ASSERT_TRUE(w->add("small", "0123456789", 10).ok());
    ASSERT_TRUE(w->add("master", big.data(), big.size()).ok());
    ASSERT_TRUE(w->commit(R"({"format":"fuzz","step":3})").ok());
  }
  const std::string valid = read_file(valid_path);
  ASSERT_GT(valid.size(), kTrailer);
  const std::size_t index_at = get_u64(valid, valid.size() - kTrailer);
  ASSERT_LT(index_at, valid.size() - kTrailer);
  const std::string data = valid.substr(0, index_at);
  const std::string index = valid.substr(index_at, valid.size() - kTrailer - index_at);
  const std::string trailer = valid.substr(valid.size() - kTrailer);
  {
    Case c{valid, "none"};
    ASSERT_EQ(read_checkpoint(valid_path, c), Verdict::accepted);
  }
  const std::string path = dir.path() + "/case.zoeckpt";
  const fuzz::Tally t = fuzz::run(
      "checkpoint", fuzz::default_budget(),
      [&](Rng& rng) {
        Case c;
        switch (rng() % 4) {
          case 0:
            c.input = fuzz::mutate_binary(valid, rng, &c.mutation);
            break;
          case 1:
            c.input = reseal(data, fuzz::mutate_binary(index, rng, &c.mutation), trailer);
            c.mutation = "resealed index: " + c.mutation;
            break;
          case 2: {
            // Index offset, size, versions: fields checked only after the trailer's CRC passed.
            std::string tr = trailer;
            const std::size_t fields[] = {0, 8, 20, 24};
            fuzz::put_le(tr, fields[fuzz::pick(rng, 4)], fuzz::kInterestingInts[fuzz::pick(rng, std::size(fuzz::kInterestingInts))], 8);
            fuzz::put_le(tr, 28, crc32c(tr.data(), 28), 4);
            c.input = data + index + tr;
            c.mutation = "resealed trailer field";
            break;
          }
          default:
            c.input = reseal(fuzz::mutate_binary(data, rng, &c.mutation), index, trailer);
            c.mutation = "header or blobs changed, index resealed: " + c.mutation;
            break;
        }
        return c;
      },
      [&](const Case& c) {
        write_file(path, c.input);
        return read_checkpoint(path, c);
      });
  fuzz::expect_both_outcomes(t);
}

// ---- the optimizer's manifest, through OffloadOptimizer::load ----

TEST(FuzzReaders, OptimizerCheckpointManifest) {
  TempFolder dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string saved = dir.path() + "/saved.zoeckpt";
  OffloadOptions o;
  o.loss_scale.enabled = true;
  test::Trainer trainer(Schedule::sync, DType::f16, o, 0, {300, 7, 1});
  ASSERT_TRUE(trainer.created());
  trainer.run(1, 2, test::random_grads(1e-2));
  ASSERT_TRUE(trainer.opt().save(saved).ok());
  // The blobs stay as saved; only the manifest changes from case to case.
  std::string manifest;
  std::map<std::string, std::vector<char>> blobs;
  {
    Result<CheckpointReader> r = CheckpointReader::open(saved);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    manifest = r->manifest();
    for (const std::string& name : r->names()) {
      std::vector<char>& b = blobs[name];
      b.resize(r->size(name).value());
      ASSERT_TRUE(r->read(name, b.data(), b.size()).ok());
    }
  }
  ASSERT_TRUE(trainer.opt().load(saved).ok());
  const std::string path = dir.path() + "/case.zoeckpt";
  const fuzz::Tally t = fuzz::run(
      "optimizer-manifest", fuzz::default_budget(),
      [&](Rng& rng) {
        Case c;
        c.input = fuzz::mutate_json(manifest, rng, &c.mutation);
        return c;
      },
      [&](const Case& c) {
        {
          Result<CheckpointWriter> w = CheckpointWriter::create(path);
          EXPECT_TRUE(w.ok()) << w.status().to_string();
          if (!w.ok()) return Verdict::refused;
          for (const auto& [name, b] : blobs) EXPECT_TRUE(w->add(name, b.data(), b.size()).ok());
          EXPECT_TRUE(w->commit(c.input).ok());
        }
        const Status s = trainer.opt().load(path);
        if (!s.ok()) {
          EXPECT_FALSE(s.message().empty()) << c.mutation << ": an error without a message";
          return Verdict::refused;
        }
        // Accepted means a state this optimizer could have reached: hyper-parameters the step takes, a
        // usable loss scale.
        EXPECT_GE(trainer.opt().step_count(), 0) << c.mutation;
        const float scale = trainer.opt().loss_scale();
        EXPECT_TRUE(std::isfinite(scale) && scale > 0) << c.mutation << ": loss scale " << scale;
        for (std::size_t g = 0; g < 2; ++g) {
          const Status h = validate_hyper(trainer.opt().group_hyper(g));
          EXPECT_TRUE(h.ok()) << c.mutation << ": group " << g << ": " << h.to_string();
        }
        return Verdict::accepted;
      });
  fuzz::expect_both_outcomes(t);
}

}  // namespace
}  // namespace zoe
