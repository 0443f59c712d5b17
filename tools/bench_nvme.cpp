// zoe bench nvme: optimizer steps with p, m, v streamed from swap files, against raw O_DIRECT I/O of the same
// bytes (same files, request size and queue depth) measured alternately in the same run (BENCHMARKING.md).
#include <sys/resource.h>

#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "tools/args.h"
#include "tools/bench_stats.h"
#include "tools/commands.h"
#include "tools/report.h"
#include "zoe/swap.h"

namespace zoe::cli {
namespace {

struct Config {
  std::vector<std::string> paths;
  std::uint64_t n = 0, tile = 0, chunk = 0;
  int buffers = 0, queue_depth = 0, reps = 0;
  std::size_t block = 0;
  DType grad = DType::bf16;
  bool has_out = true;
  DType out = DType::bf16;
  DType state = DType::f32;  // the moments in the swap slots
  bool keep = false, durable = true;
  SwapDurability durability = SwapDurability::each_call;
};

std::uint64_t peak_rss_bytes() {
  struct rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<std::uint64_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

struct Measured {
  TimeSummary step, raw_read, raw_write, io_bound;
  SwapStats last;  // of the median-time step
  std::uint64_t moved = 0;  // bytes one step reads (and writes)
  bool direct = false;
  std::size_t tiles = 0;
};

// One step as the trainer would issue it: the range in calls of `chunk` elements (tile-aligned), each with
// its gradients in a reused host buffer, so that host RAM does not grow with n.
Status one_step(SwapStore& store, const Config& cfg, std::int64_t step, std::vector<std::uint16_t>& grads,
                std::vector<float>& grads32, std::vector<std::uint16_t>& out, SwapStats& sum) {
  OptimizerHyper hyper;  // AdamW
  hyper.weight_decay = 0.01f;
  StepOptions options;
  options.step = step;
  sum = {};
  for (std::uint64_t off = 0; off < cfg.n; off += cfg.chunk) {
    SwapSegment seg;
    seg.offset = off;
    seg.n = std::min(cfg.chunk, cfg.n - off);
    seg.hyper = &hyper;
    seg.grad = cfg.grad == DType::f32 ? static_cast<const void*>(grads32.data()) : grads.data();
    seg.grad_dtype = cfg.grad;
    seg.out = cfg.has_out ? out.data() : nullptr;
    seg.out_dtype = cfg.out;
    if (Status s = store.step(std::span<const SwapSegment>(&seg, 1), options); !s.ok()) return s;
    const SwapStats& st = store.last_stats();
    sum.read_bytes += st.read_bytes;
    sum.write_bytes += st.write_bytes;
    sum.read_s += st.read_s;
    sum.write_s += st.write_s;
    sum.adam_s += st.adam_s;
    sum.crc_s += st.crc_s;
    sum.wait_s += st.wait_s;
    sum.sync_s += st.sync_s;
    sum.total_s += st.total_s;
    sum.tiles_stepped += st.tiles_stepped;
  }
  return Status::success();
}

// Bytes of p, m and v of n parameters as the swap slots hold them (int8 moments: and a scale per block each).
std::uint64_t slot_state_bytes(std::uint64_t n, DType state) {
  const std::uint64_t scales = state == DType::i8 ? 2 * 4 * moment_blocks(n) : 0;
  return n * (4 + 2 * dtype_size(state)) + scales;
}

Result<Measured> measure(const Config& cfg) {
  SwapOptions o;
  o.paths = cfg.paths;
  o.buffer_count = cfg.buffers;
  o.queue_depth = cfg.queue_depth;
  o.block_size = cfg.block;
  o.durable = cfg.durable;
  o.durability = cfg.durability;
  o.state_dtype = cfg.state;
  const std::string name = "zoe-bench-nvme";
  (void)SwapStore::remove(o, name);  // a store left by an interrupted run
  Result<SwapStore> made = SwapStore::create(o, name, cfg.n, cfg.tile);
  if (!made.ok()) return made.status();
  SwapStore& store = made.value();
  struct Cleanup {
    const SwapOptions& o;
    const std::string& name;
    bool keep;
    ~Cleanup() {
      if (!keep) (void)SwapStore::remove(o, name);
    }
  } cleanup{o, name, cfg.keep};

  Status s = store.initialize([](std::size_t offset, std::size_t count, float* p) {
    for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<float>((offset + i) % 1000) * 1e-3f - 0.5f;
    return Status::success();
  });
  if (!s.ok()) return s;
  std::vector<std::uint16_t> grads(cfg.grad == DType::f32 ? 0 : cfg.chunk), out(cfg.has_out ? cfg.chunk : 0);
  std::vector<float> grads32(cfg.grad == DType::f32 ? cfg.chunk : 0);
  for (std::size_t i = 0; i < cfg.chunk; ++i) {
    const float g = static_cast<float>(static_cast<int>(i % 2001) - 1000) * 1e-5f;
    if (cfg.grad == DType::f32) grads32[i] = g;
    else grads[i] = cfg.grad == DType::f16 ? float_to_f16(g) : float_to_bf16(g);
  }
  Measured m;
  m.direct = store.direct_io();
  m.tiles = store.tiles();
  SwapStats st;
  // Warm-up: after initialize and one step both slots of every tile hold written data, so neither the raw
  // pass nor the step meets unwritten extents (which read as zeros without touching the disk).
  if (s = one_step(store, cfg, 1, grads, grads32, out, st); !s.ok()) return s;
  std::vector<double> step_s, read_s, write_s, bound_s;
  std::vector<SwapStats> stats;
  for (int r = 0; r < cfg.reps; ++r) {
    Result<std::pair<double, double>> raw = store.raw_io_pass();
    if (!raw.ok()) return raw.status();
    read_s.push_back(raw->first);
    write_s.push_back(raw->second);
    bound_s.push_back(raw->first + raw->second);
    if (s = one_step(store, cfg, 2 + r, grads, grads32, out, st); !s.ok()) return s;
    step_s.push_back(st.total_s);
    stats.push_back(st);
    m.moved = st.read_bytes;
  }
  m.step = summarize(step_s);
  m.raw_read = summarize(read_s);
  m.raw_write = summarize(write_s);
  m.io_bound = summarize(bound_s);
  for (const SwapStats& x : stats) {
    if (x.total_s == m.step.median) m.last = x;
  }
  if (m.last.total_s == 0 && !stats.empty()) m.last = stats.back();
  return m;
}

// The command line as given, with the defaults.
struct Texts {
  std::string path, n = "256M", tile = "12M", buffers = "4", queue_depth = "8", block = "1M", reps = "3", chunk,
              grad = "bf16", out = "bf16", durability = "call", state = "fp32";
  bool json = false, keep = false, help = false, no_sync = false;
};

std::array<Option, 16> options_of(Texts& t) {
  return {{
      {"path", &t.path, nullptr, "swap folder (a comma list stripes over several); required"},
      {"n", &t.n, nullptr, "parameters, 1 to 1T (K, M, G, T suffixes are powers of 1024)"},
      {"tile", &t.tile, nullptr, "bytes of p, m and v per tile, up to 64G (12 per parameter, 8 with --state bf16, 6 with int8; rounded down to whole 4 KiB blocks, int8: 2048 parameters)"},
      {"state", &t.state, nullptr, "the moments in the swap files: fp32, bf16 or int8"},
      {"buffers", &t.buffers, nullptr, "tiles in RAM at once, 2 to 1024 (DeepSpeed buffer_count)"},
      {"queue-depth", &t.queue_depth, nullptr, "I/O requests in flight, 1 to 1024 (DeepSpeed aio.queue_depth)"},
      {"block-size", &t.block, nullptr, "bytes per I/O request, 4K to 1G (DeepSpeed aio.block_size)"},
      {"reps", &t.reps, nullptr, "timed repetitions of raw pass + step, 1 to 1M"},
      {"chunk", &t.chunk, nullptr, "parameters per step() call, 1 to 1T, gradients reused (default: n, one call)"},
      {"grad", &t.grad, nullptr, "gradient dtype: f32, f16, bf16"},
      {"out", &t.out, nullptr, "weight-copy dtype: none, f16, bf16"},
      {"keep", nullptr, &t.keep, "leave the swap files in place"},
      {"durability", &t.durability, nullptr,
       "call (synced before each step returns), step (in the background, as OffloadOptimizer's durability step) "
       "or checkpoint (never during the run)"},
      {"no-sync", nullptr, &t.no_sync, "skip fdatasync in the step and the raw pass (not crash-safe; to see its cost)"},
      {"json", nullptr, &t.json, "one JSON object on stdout, nothing else"},
      {"help", nullptr, &t.help, "this help"},
  }};
}

Status read_paths(const Texts& text, Config& cfg) {
  if (text.path.empty()) return invalid_argument("--path DIR is required");
  cfg.paths = split_list(text.path);
  for (const std::string& p : cfg.paths) {
    if (p.empty()) return invalid_argument("--path " + text.path + " has an empty folder name in its list");
  }
  cfg.keep = text.keep;
  cfg.durable = !text.no_sync;
  return Status::success();
}

Status read_durability(const Texts& text, Config& cfg) {
  if (text.durability == "call") {
    cfg.durability = SwapDurability::each_call;
  } else if (text.durability == "step") {
    cfg.durability = SwapDurability::next_call;
  } else if (text.durability == "checkpoint") {
    cfg.durability = SwapDurability::on_flush;
  } else {
    return invalid_argument("--durability " + text.durability + " is unknown: use call, step or checkpoint");
  }
  return Status::success();
}

Status read_counts(const Texts& text, Config& cfg) {
  // The ranges of docs/cli.md. Zero parameters, repetitions, buffers or queue slots leave nothing to time or
  // no way to move a byte; the maxima keep buffers x tile and n x 12 bytes inside 64 bits.
  Result<std::uint64_t> n = parse_count_in(text.n, "--n", 1, kMaxBenchParams, "parameters"),
                        tile = parse_count_in(text.tile, "--tile", 1, 64ull << 30, "bytes of p, m and v per tile"),
                        buffers = parse_count_in(text.buffers, "--buffers", 2, 1024, "tiles in RAM; one in Adam while another is in I/O"),
                        qd = parse_count_in(text.queue_depth, "--queue-depth", 1, 1024, "I/O requests in flight"),
                        block = parse_count_in(text.block, "--block-size", 4096, 1ull << 30, "bytes per request, whole 4 KiB blocks"),
                        reps = parse_count_in(text.reps, "--reps", 1, kMaxReps, "timed repetitions");
  for (const Status& s : {n.status(), tile.status(), buffers.status(), qd.status(), block.status(), reps.status()}) {
    if (!s.ok()) return s;
  }
  if (Status s = require_memory(buffers.value() * tile.value(), "--tile", text.tile + " x --buffers " + text.buffers);
      !s.ok()) {
    return s;
  }
  cfg.n = n.value();
  Result<DType> state = parse_state_dtype(text.state);
  if (!state.ok()) return invalid_argument("--state " + text.state + " is not fp32, bf16 or int8");
  cfg.state = state.value();
  // Whole 4 KiB blocks of p per tile; int8 moments: whole blocks of codes (kMomentBlock elements) too.
  const std::uint64_t unit = cfg.state == DType::i8 ? kMomentBlock : 1024;
  const std::uint64_t bytes_per_param = 4 + 2 * dtype_size(cfg.state);
  cfg.tile = tile.value() / bytes_per_param / unit * unit;
  if (cfg.tile == 0) {
    return invalid_argument("--tile " + text.tile + " is below " + std::to_string(bytes_per_param * unit) + " bytes (" +
                            std::to_string(unit) + " parameters of " + std::to_string(bytes_per_param) + " bytes)");
  }
  cfg.buffers = static_cast<int>(buffers.value());
  cfg.queue_depth = static_cast<int>(qd.value());
  cfg.block = block.value();
  cfg.reps = static_cast<int>(reps.value());
  return Status::success();
}

// After read_counts: the step's calls and dtypes.
Status read_step(const Texts& text, Config& cfg) {
  cfg.chunk = cfg.n;
  if (!text.chunk.empty()) {
    Result<std::uint64_t> c = parse_count_in(text.chunk, "--chunk", 1, kMaxBenchParams, "parameters per step() call");
    if (!c.ok()) return c.status();
    cfg.chunk = std::min(cfg.n, std::max<std::uint64_t>(c.value() / cfg.tile, 1) * cfg.tile);  // whole tiles per call
  }
  const auto g = parse_dtype(text.grad);
  if (!g) return invalid_argument("--grad " + text.grad + " is not f32, f16 or bf16");
  cfg.grad = *g;
  cfg.has_out = text.out != "none";
  if (text.out != "none" && text.out != "f16" && text.out != "bf16") {
    return invalid_argument("--out " + text.out + " is not none, f16 or bf16");
  }
  cfg.out = text.out == "f16" ? DType::f16 : DType::bf16;
  // The gradients and weight copies of one call are held in RAM (4 + 2 bytes per parameter at most).
  return require_memory(cfg.chunk * 6, text.chunk.empty() ? "--n" : "--chunk", text.chunk.empty() ? text.n : text.chunk);
}

void report_nvme(Report& report, const Texts& text, const Config& cfg, const Measured& m) {
  const double moved = static_cast<double>(m.moved);
  const double read_gbps = moved / m.raw_read.median / 1e9, write_gbps = moved / m.raw_write.median / 1e9;
  const double ratio = m.io_bound.median / m.step.median;
  const std::uint64_t state_bytes = slot_state_bytes(cfg.n, cfg.state);
  const std::uint64_t rss = peak_rss_bytes();
  std::string paths;
  for (const auto& p : cfg.paths) paths += (paths.empty() ? "" : ",") + p;
  JsonLine line;
  line.add("bench", "nvme").add("n", cfg.n).add("state", state_dtype_name(cfg.state)).add("state_bytes", state_bytes).add("raw_read_gbps", read_gbps)
      .add("raw_write_gbps", write_gbps).add("io_bound_s", m.io_bound.median).add("step_s", m.step.median)
      .add("ratio", ratio).add("peak_rss_bytes", rss).add("direct_io", m.direct)
      .add("paths", paths).add("tile", static_cast<std::uint64_t>(cfg.tile)).add("tiles", static_cast<std::uint64_t>(m.tiles))
      .add("buffers", cfg.buffers).add("queue_depth", cfg.queue_depth).add("block_size", static_cast<std::uint64_t>(cfg.block))
      .add("chunk", cfg.chunk).add("grad", dtype_name(cfg.grad)).add("out", cfg.has_out ? dtype_name(cfg.out) : "none")
      .add("reps", cfg.reps).add("bytes_moved_each_way", m.moved)
      .add("step_min_s", m.step.min).add("step_max_s", m.step.max)
      .add("raw_read_s", m.raw_read.median).add("raw_write_s", m.raw_write.median)
      .add("step_read_busy_s", m.last.read_s).add("step_write_busy_s", m.last.write_s)
      .add("step_adam_s", m.last.adam_s).add("step_crc_s", m.last.crc_s).add("step_wait_s", m.last.wait_s)
      .add("step_sync_s", m.last.sync_s).add("durable", cfg.durable).add("durability", text.durability);
  report.result(line,
      format("zoe bench nvme: %llu parameters, %.2f GiB of p, m, v (%s moments) under %s (direct I/O: %s)\n",
             static_cast<unsigned long long>(cfg.n), static_cast<double>(state_bytes) / (1ull << 30),
             std::string(state_dtype_name(cfg.state)).c_str(), paths.c_str(), m.direct ? "yes" : "NO, buffered") +
      format("tile %llu params (%.1f MiB), %d buffers, queue depth %d, %zu KiB requests, %d reps (median [min, max])\n",
             static_cast<unsigned long long>(cfg.tile),
             static_cast<double>(slot_state_bytes(cfg.tile, cfg.state)) / (1 << 20), cfg.buffers, cfg.queue_depth,
             cfg.block / 1024, cfg.reps) +
      format("  raw read         %8.3f s  [%.3f, %.3f]  %6.2f GB/s\n", m.raw_read.median, m.raw_read.min,
             m.raw_read.max, read_gbps) +
      format("  raw write        %8.3f s  [%.3f, %.3f]  %6.2f GB/s\n", m.raw_write.median, m.raw_write.min,
             m.raw_write.max, write_gbps) +
      format("  raw I/O bound    %8.3f s  (read + write)\n", m.io_bound.median) +
      format("  step             %8.3f s  [%.3f, %.3f]\n", m.step.median, m.step.min, m.step.max) +
      format("    of which: reads in flight %.3f s, writes in flight %.3f s, Adam %.3f s, CRC %.3f s, waiting on I/O "
             "%.3f s, fdatasync+table %.3f s\n",
             m.last.read_s, m.last.write_s, m.last.adam_s, m.last.crc_s, m.last.wait_s, m.last.sync_s) +
      format("  ratio            %8.3f  (raw I/O bound / step; 1.0 = the step runs at disk speed)\n", ratio) +
      format("  peak RSS         %8.1f MiB\n", static_cast<double>(rss) / (1 << 20)));
}

}  // namespace

int bench_nvme(std::span<char* const> args) {
  constexpr std::string_view kCommand = "zoe bench nvme";
  Texts text;
  const auto options = options_of(text);
  if (Status s = parse_options(args, options); !s.ok()) return fail_message(kCommand, s);
  if (text.help) {
    print_help("usage: zoe bench nvme --path DIR [options]\n\n", options,
               "\nEach repetition reads every tile's p, m, v and writes them back raw (no compute), then runs one\n"
               "pipelined Adam step over the same files. io_bound_s = raw read s + raw write s; ratio = io_bound_s /\n"
               "step_s (1.0: the step runs at the speed of the disks).\n");
    return 0;
  }
  Config cfg;
  if (Status s = read_paths(text, cfg); !s.ok()) return fail(kCommand, s);
  if (Status s = read_durability(text, cfg); !s.ok()) return fail_message(kCommand, s);
  for (auto read : {read_counts, read_step}) {
    if (Status s = read(text, cfg); !s.ok()) return fail(kCommand, s);
  }
  Result<Measured> m = measure(cfg);
  if (!m.ok()) return fail(kCommand, m.status());
  Report report(kCommand, text.json);
  report_nvme(report, text, cfg, *m);
  return 0;
}

}  // namespace zoe::cli
