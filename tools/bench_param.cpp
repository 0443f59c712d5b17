// zoe bench step --offload-param cpu|nvme: training iterations whose layers' weights live in a parameter
// tier (zoe/param_tier.h) and are fetched per layer, forward then backward, against a device that computes
// each layer for a set time. The ceiling is the device's compute alone: device_idle_fraction = 1 - compute /
// iteration, for each prefetch depth asked. The fetch bandwidth (loads with no compute in the way) is
// reported against plain copies to the device and, for the NVMe home, against raw O_DIRECT reads of as many
// bytes of the same files, in the same run.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
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
#include "zoe/param_tier.h"
#ifdef ZOE_HAVE_AIO
#include "aio/files.h"
#include "aio/io_engine.h"
#include "base/aligned_buffer.h"
#endif

namespace zoe::cli {
namespace {

std::string two_places(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", x);
  return text;
}

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

#ifdef ZOE_HAVE_AIO
// Raw O_DIRECT reads of `bytes` from the start of each file, spread evenly, with the tier's request size
// and queue depth: the ceiling of what a fetch can read. Written once, every entry's valid copy is in the
// first half of its file, back to back: these are the very bytes the fetches read.
class RawReader {
 public:
  static Result<RawReader> open(const std::vector<std::string>& files, std::uint64_t bytes, const ParamTierOptions& o) {
    RawReader r;
    r.request_bytes_ = o.request_bytes;
    r.engine_options_.queue_depth = static_cast<unsigned>(o.queue_depth);
    r.engine_options_.request_bytes = o.request_bytes;
    for (const std::string& f : files) {
      aio::FileHandle fd(::open(f.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
      if (fd.get() < 0) return Status(StatusCode::io_error, "cannot open " + f + " with O_DIRECT", errno);
      r.files_.push_back({f, std::move(fd)});
    }
    r.per_file_ = (bytes / files.size() + o.request_bytes - 1) / o.request_bytes * o.request_bytes;
    // Memory of the kind the tier's bounces are (huge pages where the kernel gives them), touched before
    // the clock starts as theirs are: the ceiling is the disk's, not first-touch page faults'. Every file
    // reads into the same buffer; the bytes are not looked at.
    Result<AlignedBuffer> buffer = AlignedBuffer::allocate_for_io(r.per_file_, 4096);
    if (!buffer.ok()) return buffer.status();
    std::memset(buffer->data(), 0, buffer->size());
    r.buffer_ = std::move(buffer).value();
    return r;
  }

  Result<double> pass() {
    Result<std::unique_ptr<aio::IoEngine>> engine = aio::IoEngine::create(engine_options_);
    if (!engine.ok()) return engine.status();
    std::vector<int> ids;
    for (const auto& [path, fd] : files_) ids.push_back(engine.value()->add_file(fd.get(), path));
    Status s;
    const double seconds = time_seconds([&] {
      std::vector<aio::IoEngine::Ticket> tickets;
      for (std::size_t k = 0; k < ids.size() && s.ok(); ++k) {
        for (std::uint64_t at = 0; at < per_file_ && s.ok(); at += request_bytes_) {
          Result<aio::IoEngine::Ticket> t =
              engine.value()->submit(IoOp::read, ids[k], at, buffer_.as<unsigned char>() + at, request_bytes_);
          if (!t.ok()) s = t.status();
          else tickets.push_back(t.value());
        }
      }
      for (aio::IoEngine::Ticket t : tickets) {
        if (Status w = engine.value()->wait(t); !w.ok() && s.ok()) s = w;
      }
    });
    if (!s.ok()) return s;
    return seconds;
  }

 private:
  aio::EngineOptions engine_options_;
  std::size_t request_bytes_ = 0;
  std::vector<std::pair<std::string, aio::FileHandle>> files_;
  std::uint64_t per_file_ = 0;
  AlignedBuffer buffer_;
};
#endif

}  // namespace

int bench_param_offload(std::span<char* const> args) {
  std::string home_text, device_name = "host", path_text, layers_text = "24", layer_bytes_text = "16M",
              prefetch_text = "0,1,2,4", ratio_text = "1.5", iters_text = "5";
  bool json = false, help = false, host_waits = false;
  const Option options[] = {
      {"offload-param", &home_text, nullptr, "where the layers' 16-bit weights live: cpu (pinned RAM) or nvme"},
      {"device", &device_name, nullptr, "host (the stand-in) or cuda"},
      {"path", &path_text, nullptr, "nvme: folder(s) for the parameter file, comma-separated"},
      {"layers", &layers_text, nullptr, "layers (one block each)"},
      {"layer-bytes", &layer_bytes_text, nullptr, "bytes of 16-bit weights per layer (K, M, G suffixes)"},
      {"prefetch", &prefetch_text, nullptr, "blocks fetched ahead; a comma list runs each"},
      {"compute-ratio", &ratio_text, nullptr, "each layer's compute (forward, and again backward) as a multiple of "
                                              "its fetch time, measured at start"},
      {"iters", &iters_text, nullptr, "timed iterations per prefetch depth"},
      {"host-waits", nullptr, &host_waits, "the host waits for each layer's compute before the next fetch (no run-ahead)"},
      {"json", nullptr, &json, "JSON lines on stdout, nothing else"},
      {"help", nullptr, &help, "this help"},
  };
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "zoe bench step --offload-param: %s\n", s.to_string().c_str());
    return exit_status(s);
  };
  if (Status s = parse_options(args, options); !s.ok()) return fail(s);
  if (help) {
    std::printf("usage: zoe bench step --offload-param cpu|nvme [options]\n\n%s", options_help(options).c_str());
    std::printf("\ndevice_idle_fraction = 1 - compute / iteration; the pool holds the block in use, `prefetch`\n"
                "ahead and one released. fetch_gbps is what fetches move with no compute in the way,\n"
                "copy_ceiling_gbps plain copies of as many bytes from page-locked memory to the device\n"
                "(cudaMemcpyAsync on CUDA), copy_ratio = fetch_gbps / copy_ceiling_gbps. nvme: raw_read_gbps\n"
                "is O_DIRECT reads of as many bytes of the same files, fetch_ratio = fetch_gbps / raw_read_gbps.\n"
                "The passes alternate, best of 5 each.\n");
    return 0;
  }
  Result<ParamHome> home = parse_param_home(home_text);
  if (!home.ok()) return fail(home.status());
  Result<std::uint64_t> layers = parse_count(layers_text, "--layers");
  Result<std::uint64_t> layer_bytes = parse_count(layer_bytes_text, "--layer-bytes");
  Result<std::uint64_t> iters = parse_count(iters_text, "--iters");
  for (const Status& s : {layers.status(), layer_bytes.status(), iters.status()}) {
    if (!s.ok()) return fail(s);
  }
  for (const Status& s : {require_at_least(layers.value(), 2, "--layers", "layers; prefetch needs a next one"),
                          require_at_least(layer_bytes.value(), 64 * 1024, "--layer-bytes", "bytes per layer"),
                          require_at_least(iters.value(), 1, "--iters", "timed iterations")}) {
    if (!s.ok()) return fail(s);
  }
  std::vector<int> depths;
  for (const std::string& d : split_list(prefetch_text)) {
    Result<std::uint64_t> k = parse_count(d, "--prefetch");
    if (!k.ok()) return fail(k.status());
    depths.push_back(static_cast<int>(k.value()));
  }
  if (Status s = require_items(split_list(prefetch_text), "--prefetch", "depths such as 0,1,2,4"); !s.ok()) return fail(s);
  char* end = nullptr;
  const double ratio = std::strtod(ratio_text.c_str(), &end);
  if (end == ratio_text.c_str() || *end != '\0' || !(ratio > 0)) {
    return fail(invalid_argument("--compute-ratio " + ratio_text + " is not a positive number"));
  }
  ParamTierOptions base;
  base.home = home.value();
  base.nvme_paths = split_list(path_text);
  if (base.home == ParamHome::nvme && base.nvme_paths.empty()) {
    return fail(invalid_argument("--offload-param nvme needs --path DIR[,DIR...]"));
  }
  const std::size_t bytes = (layer_bytes.value() + 4095) / 4096 * 4096;
  Result<std::unique_ptr<Device>> opened = open_bench_device(device_name);
  if (!opened.ok()) return fail(opened.status());
  std::unique_ptr<Device> device = std::move(opened).value();

  // The fetch time of a layer: every layer fetched in order and released, nothing computing, prefetch 2.
  // Best of a few passes, so that a cold first touch of the pool does not count. Each pass is followed by
  // plain copies of as many bytes from page-locked host memory to the device (cudaMemcpyAsync on CUDA) and,
  // on NVMe, by a raw read of as many bytes of the same files, so that all see the machine as it is then.
  double fetch_s = 1e30, fetch_gbps = 0;
  {
    ParamTierOptions o = base;
    o.prefetch = 2;
    Result<ParamTier> tier = make_tier(*device, layers.value(), bytes, o);
    if (!tier.ok()) return fail(tier.status());
    Result<CopyCeiling> copies = CopyCeiling::open(*device, bytes);
    if (!copies.ok()) return fail(copies.status());
    double copy = 1e30;
#ifdef ZOE_HAVE_AIO
    std::optional<RawReader> raw_reader;
    if (base.home == ParamHome::nvme) {
      Result<RawReader> r = RawReader::open(tier->files(), bytes * layers.value(), o);
      if (!r.ok()) return fail(r.status());
      raw_reader.emplace(std::move(r).value());
    }
    double raw = 1e30;
#endif
    for (int pass = 0; pass < 5; ++pass) {
      Status s;
      const double t = time_seconds([&] {
        for (std::size_t l = 0; l < layers.value() && s.ok(); ++l) {
          Result<void*> b = tier->fetch(l);
          if (!b.ok()) s = b.status();
          if (s.ok()) s = tier->release(l);
        }
        if (s.ok()) s = tier->synchronize();
      });
      if (!s.ok()) return fail(s);
      fetch_s = std::min(fetch_s, t / static_cast<double>(layers.value()));
      Result<double> c = copies->pass(layers.value());
      if (!c.ok()) return fail(c.status());
      copy = std::min(copy, c.value());
#ifdef ZOE_HAVE_AIO
      if (raw_reader) {
        Result<double> r = raw_reader->pass();
        if (!r.ok()) return fail(r.status());
        raw = std::min(raw, r.value());
      }
#endif
    }
    const double total = static_cast<double>(bytes * layers.value());
    fetch_gbps = static_cast<double>(bytes) / fetch_s / 1e9;
    const double copy_gbps = total / copy / 1e9;
    JsonLine line;
    line.add("bench", "param_fetch").add("device", device_name).add("home", param_home_name(base.home))
        .add("layers", layers.value()).add("layer_bytes", static_cast<std::uint64_t>(bytes))
        .add("fetch_gbps", fetch_gbps).add("copy_ceiling_gbps", copy_gbps).add("copy_ratio", fetch_gbps / copy_gbps);
    std::string text = std::string(param_home_name(base.home)) + " fetch: " + two_places(fetch_gbps) + " GB/s" +
                       ", plain copies to the device: " + two_places(copy_gbps) + " GB/s";
#ifdef ZOE_HAVE_AIO
    if (raw_reader) {
      const double raw_gbps = total / raw / 1e9;
      line.add("direct_io", tier->direct_io()).add("raw_read_gbps", raw_gbps).add("fetch_ratio", fetch_gbps / raw_gbps);
      text += ", raw O_DIRECT read of as many bytes: " + two_places(raw_gbps) + " GB/s" + ", fetch_ratio " +
              two_places(fetch_gbps / raw_gbps) + (tier->direct_io() ? "" : " (buffered: O_DIRECT refused)");
    }
#endif
    std::printf("%s\n", json ? line.str().c_str() : text.c_str());
  }
  const LayerRun run{layers.value(), ratio * fetch_s, host_waits};
  if (!json) {
    std::printf("%s home, %llu layers of %llu bytes; fetch %.2f ms per layer; compute %.2f ms per layer and pass\n",
                std::string(param_home_name(base.home)).c_str(), static_cast<unsigned long long>(layers.value()),
                static_cast<unsigned long long>(bytes), fetch_s * 1e3, run.compute_s * 1e3);
    std::printf("%8s %14s %14s %14s %8s\n", "prefetch", "budget bytes", "iteration ms", "compute ms", "idle");
  }
  for (int depth : depths) {
    ParamTierOptions o = base;
    o.prefetch = depth;
    Result<ParamTier> tier = make_tier(*device, layers.value(), bytes, o);
    if (!tier.ok()) return fail(tier.status());
    if (Status s = iteration(*device, tier.value(), run); !s.ok()) return fail(s);  // warm-up
    std::vector<double> times;
    for (std::uint64_t i = 0; i < iters.value(); ++i) {
      Status s;
      times.push_back(time_seconds([&] { s = iteration(*device, tier.value(), run); }));
      if (!s.ok()) return fail(s);
    }
    const TimeSummary t = summarize(times);
    const double compute = 2.0 * static_cast<double>(layers.value()) * run.compute_s;
    const double idle = std::max(0.0, 1.0 - compute / t.median);
    const ParamTierStats st = tier->stats();
    if (json) {
      JsonLine line;
      line.add("bench", "param_offload").add("device", device_name).add("home", param_home_name(base.home)).add("layers", layers.value())
          .add("layer_bytes", static_cast<std::uint64_t>(bytes)).add("prefetch", depth)
          .add("budget_bytes", static_cast<std::uint64_t>(st.budget_bytes))
          .add("pool_peak_bytes", static_cast<std::uint64_t>(st.pool_peak_bytes))
          .add("fetch_ms_per_layer", fetch_s * 1e3).add("compute_ms_per_layer", run.compute_s * 1e3)
          .add("iteration_ms", t.median * 1e3).add("iteration_ms_min", t.min * 1e3).add("iteration_ms_max", t.max * 1e3)
          .add("compute_ms", compute * 1e3).add("device_idle_fraction", idle).add("hits", st.hits).add("loads", st.loads)
          .add("fetch_wait_s", st.fetch_wait_s);
      std::printf("%s\n", line.str().c_str());
    } else {
      std::printf("%8d %14zu %14.1f %14.1f %8.3f\n", depth, st.budget_bytes, t.median * 1e3, compute * 1e3, idle);
    }
  }
  return 0;
}

}  // namespace zoe::cli
