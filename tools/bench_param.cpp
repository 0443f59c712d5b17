// zoe bench step --offload-param cpu|nvme: training iterations whose layers' weights live in a parameter
// tier (zoe/param_tier.h) and are fetched per layer, forward then backward, against a device that computes
// each layer for a set time. The ceiling is the device's compute alone: device_idle_fraction = 1 - compute /
// iteration, for each prefetch depth asked. The fetch bandwidth (loads with no compute in the way) is
// reported against plain copies to the device and, for the NVMe home, against raw O_DIRECT reads of as many
// bytes of the same files, in the same run.

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tools/args.h"
#include "tools/bench_stats.h"
#include "tools/commands.h"
#include "tools/report.h"
#include "zoe/param_tier.h"

namespace zoe::cli {
namespace {

struct LayerRun {
  std::size_t layers = 0;
  double compute_s = 0;     // per layer, forward and backward each
  bool host_waits = false;  // the host waits for each layer's compute (a trainer that reads results back)
};

// Forward over every layer, then backward in reverse: fetch, compute, release; the host waits at the end.
Status iteration(Device& device, ParamTier& tier, const LayerRun& run) {
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t k = 0; k < run.layers; ++k) {
      const std::size_t layer = pass == 0 ? k : run.layers - 1 - k;
      Result<void*> block = tier.fetch(layer, pass == 1);
      if (!block.ok()) return block.status();
      if (run.compute_s > 0) {
        if (Status s = device.simulate_compute(run.compute_s, Stream::compute); !s.ok()) return s;
      }
      if (Status s = tier.release(layer); !s.ok()) return s;
      if (run.host_waits) {
        Result<EventId> done = device.record(Stream::compute);
        if (!done.ok()) return done.status();
        if (Status s = device.synchronize(done.value()); !s.ok()) return s;
      }
    }
  }
  return device.synchronize();
}

Result<ParamTier> make_tier(Device& device, std::size_t layers, std::size_t layer_bytes, const ParamTierOptions& o) {
  std::vector<ParamBlockSpec> blocks;
  // A transformer layer's shape: one large matrix and a few small vectors.
  for (std::size_t l = 0; l < layers; ++l) {
    blocks.push_back({"layer." + std::to_string(l), {layer_bytes - 3 * 4096, 4096, 4096, 4096}});
  }
  Result<ParamTier> tier = ParamTier::create(device, blocks, o);
  if (!tier.ok()) return tier;
  std::vector<unsigned char> fill(layer_bytes, 0x3c);
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t e = 0; e < blocks[l].entry_bytes.size(); ++e) {
      if (Status s = tier->write(l, e, fill.data(), 0, blocks[l].entry_bytes[e]); !s.ok()) return s;
    }
  }
  return tier;
}

// Plain copies of a layer's bytes from the device's page-locked host memory into device memory, one after
// another on the copy stream: the ceiling of what a fetch from the cpu home can move.
class CopyCeiling {
 public:
  static Result<CopyCeiling> open(Device& device, std::size_t bytes) {
    CopyCeiling c;
    c.device_ = &device;
    c.bytes_ = bytes;
    Result<void*> host = device.allocate_host(bytes);
    if (!host.ok()) return host.status();
    c.host_ = host.value();
    std::memset(c.host_, 0x3c, bytes);
    Result<void*> dev = device.allocate(bytes);
    if (!dev.ok()) return dev.status();
    c.device_memory_ = dev.value();
    return c;
  }
  CopyCeiling(CopyCeiling&& o) noexcept
      : device_(std::exchange(o.device_, nullptr)), bytes_(o.bytes_), host_(std::exchange(o.host_, nullptr)),
        device_memory_(std::exchange(o.device_memory_, nullptr)) {}
  CopyCeiling& operator=(CopyCeiling&&) = delete;
  ~CopyCeiling() {
    if (device_ == nullptr) return;
    if (device_memory_ != nullptr) device_->free(device_memory_);
    if (host_ != nullptr) device_->free_host(host_);
  }

  Result<double> pass(std::size_t copies) {
    Status s;
    const double seconds = time_seconds([&] {
      for (std::size_t k = 0; k < copies && s.ok(); ++k) {
        s = device_->copy_to_device(device_memory_, host_, bytes_, Stream::h2d);
      }
      if (s.ok()) s = device_->synchronize();
    });
    if (!s.ok()) return s;
    return seconds;
  }

 private:
  CopyCeiling() = default;
  Device* device_ = nullptr;
  std::size_t bytes_ = 0;
  void* host_ = nullptr;
  void* device_memory_ = nullptr;
};


// The command line as given, with the defaults.
struct Texts {
  std::string home, device = "host", path, layers = "24", layer_bytes = "16M", prefetch = "0,1,2,4", ratio = "1.5",
              iters = "5";
  bool json = false, help = false, host_waits = false;
};

std::array<Option, 11> options_of(Texts& t) {
  return {{
      {"offload-param", &t.home, nullptr, "where the layers' 16-bit weights live: cpu (pinned RAM) or nvme"},
      {"device", &t.device, nullptr, "host (the stand-in), cpu (the CPU itself: device memory is host memory) or cuda"},
      {"path", &t.path, nullptr, "nvme: folder(s) for the parameter file, comma-separated"},
      {"layers", &t.layers, nullptr, "layers (one block each), 2 to 64K"},
      {"layer-bytes", &t.layer_bytes, nullptr, "bytes of 16-bit weights per layer, 64K to 64G (K, M, G suffixes)"},
      {"prefetch", &t.prefetch, nullptr, "blocks fetched ahead, each 0 to 1024; a comma list runs each"},
      {"compute-ratio", &t.ratio, nullptr, "each layer's compute (forward, and again backward) as a multiple of "
                                           "its fetch time, measured at start; 0.001 to 1000"},
      {"iters", &t.iters, nullptr, "timed iterations per prefetch depth, 1 to 1M"},
      {"host-waits", nullptr, &t.host_waits, "the host waits for each layer's compute before the next fetch (no run-ahead)"},
      {"json", nullptr, &t.json, "JSON lines on stdout, nothing else"},
      {"help", nullptr, &t.help, "this help"},
  }};
}

struct Settings {
  ParamTierOptions base;
  std::size_t layers = 0, bytes = 0;  // bytes per layer, whole 4 KiB pages
  std::uint64_t iters = 0;
  std::vector<int> depths;
  double ratio = 0;
};

Result<Settings> settings(const Texts& text) {
  Settings cfg;
  Result<ParamHome> home = parse_param_home(text.home);
  if (!home.ok()) return home.status();
  // The ranges of docs/cli.md: layers x bytes stays inside 64 bits, and a cpu home must fit this machine's RAM.
  Result<std::uint64_t> layers = parse_count_in(text.layers, "--layers", 2, 64 << 10, "layers; prefetch needs a next one");
  Result<std::uint64_t> layer_bytes = parse_count_in(text.layer_bytes, "--layer-bytes", 64 << 10, 64ull << 30, "bytes per layer");
  Result<std::uint64_t> iters = parse_count_in(text.iters, "--iters", 1, kMaxReps, "timed iterations");
  for (const Status& s : {layers.status(), layer_bytes.status(), iters.status()}) {
    if (!s.ok()) return s;
  }
  if (home.value() == ParamHome::ram) {
    if (Status s = require_memory(layers.value() * layer_bytes.value(), "--layer-bytes", text.layer_bytes + " x --layers " + text.layers);
        !s.ok()) {
      return s;
    }
  }
  for (const std::string& d : split_list(text.prefetch)) {
    Result<std::uint64_t> k = parse_count_in(d, "--prefetch", 0, 1024, "blocks fetched ahead");
    if (!k.ok()) return k.status();
    cfg.depths.push_back(static_cast<int>(k.value()));
  }
  if (Status s = require_items(split_list(text.prefetch), "--prefetch", "depths such as 0,1,2,4"); !s.ok()) return s;
  Result<double> ratio = parse_number_in(text.ratio, "--compute-ratio", 0.001, 1000, "compute per layer / its fetch time");
  if (!ratio.ok()) return ratio.status();
  cfg.ratio = *ratio;
  cfg.base.home = home.value();
  cfg.base.nvme_paths = split_list(text.path);
  if (cfg.base.home == ParamHome::nvme && cfg.base.nvme_paths.empty()) {
    return invalid_argument("--offload-param nvme needs --path DIR[,DIR...]");
  }
  cfg.layers = layers.value();
  cfg.bytes = (layer_bytes.value() + 4095) / 4096 * 4096;
  cfg.iters = iters.value();
  return cfg;
}

struct FetchResult {
  double fetch_s = 0;  // per layer
  double fetch_gbps = 0, copy_gbps = 0;
  bool raw_measured = false, direct_io = false;  // nvme: the raw O_DIRECT reads
  double raw_gbps = 0;
};

// The fetch time of a layer: every layer fetched in order and released, nothing computing, prefetch 2.
// Best of a few passes, so that a cold first touch of the pool does not count. Each pass is followed by
// plain copies of as many bytes from page-locked host memory to the device (cudaMemcpyAsync on CUDA) and,
// on NVMe, by a raw read of as many bytes of the same files, so that all see the machine as it is then.
Result<FetchResult> measure_fetch(Device& device, const Settings& cfg) {
  ParamTierOptions o = cfg.base;
  o.prefetch = 2;
  Result<ParamTier> tier = make_tier(device, cfg.layers, cfg.bytes, o);
  if (!tier.ok()) return tier.status();
  Result<CopyCeiling> copies = CopyCeiling::open(device, cfg.bytes);
  if (!copies.ok()) return copies.status();
  double fetch_s = 1e30, copy = 1e30, raw = 1e30;
#ifdef ZOE_HAVE_AIO
  std::optional<RawReadCeiling> raw_reader;
  if (cfg.base.home == ParamHome::nvme) {
    Result<RawReadCeiling> r = RawReadCeiling::open(tier->files(), cfg.bytes * cfg.layers, o);
    if (!r.ok()) return r.status();
    raw_reader.emplace(std::move(r).value());
  }
#endif
  for (int pass = 0; pass < 5; ++pass) {
    Status s;
    const double t = time_seconds([&] {
      for (std::size_t l = 0; l < cfg.layers && s.ok(); ++l) {
        Result<void*> b = tier->fetch(l);
        if (!b.ok()) s = b.status();
        if (s.ok()) s = tier->release(l);
      }
      if (s.ok()) s = tier->synchronize();
    });
    if (!s.ok()) return s;
    fetch_s = std::min(fetch_s, t / static_cast<double>(cfg.layers));
    Result<double> c = copies->pass(cfg.layers);
    if (!c.ok()) return c.status();
    copy = std::min(copy, c.value());
#ifdef ZOE_HAVE_AIO
    if (raw_reader) {
      Result<double> r = raw_reader->pass();
      if (!r.ok()) return r.status();
      raw = std::min(raw, r.value());
    }
#endif
  }
  const double total = static_cast<double>(cfg.bytes * cfg.layers);
  FetchResult f{fetch_s, static_cast<double>(cfg.bytes) / fetch_s / 1e9, total / copy / 1e9};
  f.raw_measured = raw < 1e30;
  f.direct_io = tier->direct_io();
  if (f.raw_measured) f.raw_gbps = total / raw / 1e9;
  return f;
}

void report_fetch(Report& report, const Texts& text, const Settings& cfg, const FetchResult& f) {
  const std::string home(param_home_name(cfg.base.home));
  JsonLine line;
  line.add("bench", "param_fetch").add("device", text.device).add("home", home)
      .add("layers", static_cast<std::uint64_t>(cfg.layers)).add("layer_bytes", static_cast<std::uint64_t>(cfg.bytes))
      .add("fetch_gbps", f.fetch_gbps).add("copy_ceiling_gbps", f.copy_gbps).add("copy_ratio", f.fetch_gbps / f.copy_gbps);
  std::string lines = home + " fetch: " + format("%.2f", f.fetch_gbps) + " GB/s" + ", plain copies to the device: " +
                      format("%.2f", f.copy_gbps) + " GB/s";
  if (f.raw_measured) {
    line.add("direct_io", f.direct_io).add("raw_read_gbps", f.raw_gbps).add("fetch_ratio", f.fetch_gbps / f.raw_gbps);
    lines += ", raw O_DIRECT read of as many bytes: " + format("%.2f", f.raw_gbps) + " GB/s" + ", fetch_ratio " +
             format("%.2f", f.fetch_gbps / f.raw_gbps) + (f.direct_io ? "" : " (buffered: O_DIRECT refused)");
  }
  report.result(line, lines + "\n");
}

struct DepthResult {
  TimeSummary iteration;
  double compute_s = 0, idle = 0;  // compute_s: the iteration's, every layer forward and backward
  ParamTierStats stats;
};

Result<DepthResult> run_depth(Device& device, const Settings& cfg, const LayerRun& run, int depth) {
  ParamTierOptions o = cfg.base;
  o.prefetch = depth;
  Result<ParamTier> tier = make_tier(device, cfg.layers, cfg.bytes, o);
  if (!tier.ok()) return tier.status();
  if (Status s = iteration(device, tier.value(), run); !s.ok()) return s;  // warm-up
  std::vector<double> times;
  for (std::uint64_t i = 0; i < cfg.iters; ++i) {
    Status s;
    times.push_back(time_seconds([&] { s = iteration(device, tier.value(), run); }));
    if (!s.ok()) return s;
  }
  DepthResult r{summarize(times), 2.0 * static_cast<double>(cfg.layers) * run.compute_s, 0, tier->stats()};
  r.idle = std::max(0.0, 1.0 - r.compute_s / r.iteration.median);
  return r;
}

void report_depth(Report& report, const Texts& text, const Settings& cfg, const FetchResult& f, const LayerRun& run,
                  int depth, const DepthResult& r) {
  const ParamTierStats& st = r.stats;
  const TimeSummary& t = r.iteration;
  JsonLine line;
  line.add("bench", "param_offload").add("device", text.device).add("home", param_home_name(cfg.base.home))
      .add("layers", static_cast<std::uint64_t>(cfg.layers))
      .add("layer_bytes", static_cast<std::uint64_t>(cfg.bytes)).add("prefetch", depth)
      .add("budget_bytes", static_cast<std::uint64_t>(st.budget_bytes))
      .add("pool_peak_bytes", static_cast<std::uint64_t>(st.pool_peak_bytes))
      .add("fetch_ms_per_layer", f.fetch_s * 1e3).add("compute_ms_per_layer", run.compute_s * 1e3)
      .add("iteration_ms", t.median * 1e3).add("iteration_ms_min", t.min * 1e3).add("iteration_ms_max", t.max * 1e3)
      .add("compute_ms", r.compute_s * 1e3).add("device_idle_fraction", r.idle).add("hits", st.hits).add("loads", st.loads)
      .add("fetch_wait_s", st.fetch_wait_s);
  report.result(line, format("%8d %14zu %14.1f %14.1f %8.3f\n", depth, st.budget_bytes, t.median * 1e3,
                             r.compute_s * 1e3, r.idle));
}

}  // namespace

int bench_param_offload(std::span<char* const> args) {
  constexpr std::string_view kCommand = "zoe bench step --offload-param";
  Texts text;
  const auto options = options_of(text);
  if (Status s = parse_options(args, options); !s.ok()) return fail(kCommand, s);
  if (text.help) {
    print_help("usage: zoe bench step --offload-param cpu|nvme [options]\n\n", options,
               "\ndevice_idle_fraction = 1 - compute / iteration; the pool holds the block in use, `prefetch`\n"
               "ahead and one released. fetch_gbps is what fetches move with no compute in the way,\n"
               "copy_ceiling_gbps plain copies of as many bytes from page-locked memory to the device\n"
               "(cudaMemcpyAsync on CUDA), copy_ratio = fetch_gbps / copy_ceiling_gbps. nvme: raw_read_gbps\n"
               "is O_DIRECT reads of as many bytes of the same files, fetch_ratio = fetch_gbps / raw_read_gbps.\n"
               "The passes alternate, best of 5 each.\n");
    return 0;
  }
  Result<Settings> cfg = settings(text);
  if (!cfg.ok()) return fail(kCommand, cfg.status());
  Result<std::unique_ptr<Device>> device = open_bench_device(text.device);
  if (!device.ok()) return fail(kCommand, device.status());
  Report report(kCommand, text.json);
  Result<FetchResult> fetch = measure_fetch(**device, *cfg);
  if (!fetch.ok()) return fail(kCommand, fetch.status());
  report_fetch(report, text, *cfg, *fetch);
  const LayerRun run{cfg->layers, cfg->ratio * fetch->fetch_s, text.host_waits};
  report.lines(format("%s home, %llu layers of %llu bytes; fetch %.2f ms per layer; compute %.2f ms per layer and pass\n",
                      std::string(param_home_name(cfg->base.home)).c_str(), static_cast<unsigned long long>(cfg->layers),
                      static_cast<unsigned long long>(cfg->bytes), fetch->fetch_s * 1e3, run.compute_s * 1e3));
  report.header(format("%8s %14s %14s %14s %8s\n", "prefetch", "budget bytes", "iteration ms", "compute ms", "idle"));
  for (int depth : cfg->depths) {
    Result<DepthResult> r = run_depth(**device, *cfg, run, depth);
    if (!r.ok()) return fail(kCommand, r.status());
    report_depth(report, text, *cfg, *fetch, run, depth, *r);
  }
  return 0;
}

}  // namespace zoe::cli
