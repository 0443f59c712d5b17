// zoe bench step: whole offloaded training iterations against a device whose forward/backward takes a set
// time. The ceiling is the device's compute alone: device_idle_fraction = 1 - compute / iteration.
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
#include "zoe/offload.h"

namespace zoe::cli {
namespace {

// bf16 weights and gradients in device memory, cut into `buckets` parameters.
class DeviceModel {
 public:
  DeviceModel(Device& device, std::uint64_t n, std::uint64_t buckets) : device_(device) {
    for (std::uint64_t b = 0; b < buckets; ++b) {
      ParamSpec p;
      p.n = n / buckets + (b < n % buckets ? 1 : 0);
      p.dtype = DType::bf16;
      specs_.push_back(p);
    }
  }
  ~DeviceModel() {
    for (void* p : owned_) device_.free(p);
  }
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  Status allocate() {
    std::uint32_t seed = 7;
    for (ParamSpec& p : specs_) {
      const std::size_t bytes = p.n * 2;
      Result<void*> w = device_.allocate(bytes);
      if (!w.ok()) return w.status();
      owned_.push_back(w.value());
      Result<void*> g = device_.allocate(bytes);
      if (!g.ok()) return g.status();
      owned_.push_back(g.value());
      Result<void*> host = device_.allocate_host(bytes);
      if (!host.ok()) return host.status();
      auto* h = static_cast<std::uint16_t*>(host.value());
      for (int which = 0; which < 2; ++which) {
        for (std::size_t i = 0; i < p.n; ++i) {
          seed = seed * 1664525u + 1013904223u;
          const float u = static_cast<float>(seed >> 8) / 16777216.0f - 0.5f;
          h[i] = float_to_bf16(which == 0 ? u : 1e-3f * u);
        }
        if (Status s = device_.copy_to_device(which == 0 ? w.value() : g.value(), h, bytes, Stream::h2d); !s.ok()) return s;
        if (Status s = device_.synchronize(); !s.ok()) return s;
      }
      device_.free_host(host.value());
      p.device_weights = w.value();
      p.device_grads = g.value();
    }
    return Status::success();
  }
  const std::vector<ParamSpec>& specs() const { return specs_; }

 private:
  Device& device_;
  std::vector<ParamSpec> specs_;
  std::vector<void*> owned_;
};

// The copy ceiling: plain copies of every gradient down and every weight up between device memory and the
// device's own page-locked host memory (cudaMemcpyAsync on CUDA), one direction at a time, best of three.
Result<std::pair<double, double>> raw_copy_seconds(Device& device, const std::vector<ParamSpec>& specs) {
  std::size_t bytes = 0;
  for (const ParamSpec& p : specs) bytes += p.n * dtype_size(p.dtype);
  Result<void*> host = device.allocate_host(bytes);
  if (!host.ok()) return host.status();
  double best_down = 1e30, best_up = 1e30;
  Status s;
  for (int rep = 0; rep < 3 && s.ok(); ++rep) {
    for (int up = 0; up < 2 && s.ok(); ++up) {
      const double t = time_seconds([&] {
        std::size_t at = 0;
        for (const ParamSpec& p : specs) {
          const std::size_t b = p.n * dtype_size(p.dtype);
          auto* h = static_cast<unsigned char*>(host.value()) + at;
          if (s.ok()) s = up ? device.copy_to_device(p.device_weights, h, b, Stream::h2d)
                             : device.copy_to_host(h, p.device_grads, b, Stream::d2h);
          at += b;
        }
        if (s.ok()) s = device.synchronize();
      });
      (up ? best_up : best_down) = std::min(up ? best_up : best_down, t);
    }
  }
  device.free_host(host.value());
  if (!s.ok()) return s;
  return std::pair{best_down, best_up};
}

// One training iteration as a trainer issues it: forward (a third of the compute), then backward bucket
// by bucket from the last, each bucket reported as its gradient is enqueued, then step().
Status iteration(Device& device, OffloadOptimizer& opt, std::size_t buckets, double compute_s) {
  if (compute_s > 0) {
    if (Status s = device.simulate_compute(compute_s / 3, Stream::compute); !s.ok()) return s;
  }
  for (std::size_t b = buckets; b-- > 0;) {
    if (compute_s > 0) {
      if (Status s = device.simulate_compute(compute_s * 2 / 3 / buckets, Stream::compute); !s.ok()) return s;
    }
    if (Status s = opt.grad_ready(b); !s.ok()) return s;
  }
  return opt.step();
}

constexpr int kCpuProbes = 3;  // iterations without compute that time the CPU step; sync for delayed

// The command line as given, with the defaults.
struct Texts {
  std::string device = "host", schedule = "sync", n = "64M", buckets = "16", compute, iters = "10", tier = "ram", path,
              durability = "step", state = "fp32", optimizer = "adam", tile;
  bool json = false, help = false;
};

std::array<Option, 15> options_of(Texts& t) {
  return {{
      {"device", &t.device, nullptr, "host (the stand-in), cpu (the CPU itself: device memory is host memory) or cuda"},
      {"schedule", &t.schedule, nullptr, "sync, overlap or delayed"},
      {"tier", &t.tier, nullptr, "where p, m, v live: ram or nvme"},
      {"path", &t.path, nullptr, "tier nvme: swap folder(s), comma-separated"},
      {"durability", &t.durability, nullptr, "tier nvme: step (durable in the background) or checkpoint (at save)"},
      {"state", &t.state, nullptr, "the state arrays' dtype: fp32, bf16 or int8 (Adam only)"},
      {"optimizer", &t.optimizer, nullptr, "adam (AdamW), lion or adagrad, with its defaults (zoe/optimizers.h)"},
      {"n", &t.n, nullptr, "parameters, 1 to 1T (K, M, G, T suffixes are powers of 1024)"},
      {"buckets", &t.buckets, nullptr, "gradient buckets reported during backward, 1 to 1M (at most --n)"},
      {"compute-ms", &t.compute, nullptr, "device forward+backward time, 0 to 1e6 (default: 1.5x the CPU step measured at start)"},
      {"iters", &t.iters, nullptr, "timed iterations, 1 to 1M"},
      {"tile", &t.tile, nullptr, "elements per piece, 1 to 1T: the unit each gradient comes down and is stepped in (overlap) "
                                 "(default 4M with --device cuda and tier ram, as the Python adapter's; else 1M)"},
      {"offload-param", nullptr, nullptr, "cpu|nvme: the layers' weights in a parameter tier instead (see --offload-param cpu --help)"},
      {"json", nullptr, &t.json, "one JSON object on stdout, nothing else"},
      {"help", nullptr, &t.help, "this help"},
  }};
}

struct Settings {
  std::uint64_t n = 0, buckets = 0, iters = 0;
  OffloadOptions offload;
  std::optional<double> compute_s;  // --compute-ms; else 1.5x the CPU step measured at start
  OptimizerHyper hyper;             // --optimizer's rule with its defaults
};

// The counts after parse_options, checked: nothing here may be zero, and every bucket needs a parameter.
Status read_counts(const Texts& text, Settings& cfg) {
  // The ranges of docs/cli.md; the state must fit this machine's RAM, checked before anything is allocated.
  Result<std::uint64_t> n = parse_count_in(text.n, "--n", 1, kMaxBenchParams, "parameters");
  Result<std::uint64_t> buckets = parse_count_in(text.buckets, "--buckets", 1, 1 << 20, "gradient buckets, at most --n");
  Result<std::uint64_t> iters = parse_count_in(text.iters, "--iters", 1, kMaxReps, "timed iterations");
  // On CUDA a piece is a copy with its gradient statistics behind it on the copy stream: 1M-element pieces
  // brought gradients down at 0.67 of plain copies' speed on an H100, 4M ones at 0.87 (docs/performance.md).
  const bool cuda_ram = text.device == "cuda" && text.tier == "ram";
  Result<std::uint64_t> tile = parse_count_in(!text.tile.empty() ? text.tile : cuda_ram ? "4M" : "1M", "--tile", 1,
                                              kMaxBenchParams, "elements per piece");
  for (const Status& s : {n.status(), buckets.status(), iters.status(), tile.status()}) {
    if (!s.ok()) return s;
  }
  // Tier ram: p, m, v (12 bytes), the staging and the device's weights and gradients (2 each, twice);
  // tier nvme keeps only the latter in RAM.
  if (Status s = require_memory(n.value() * (text.tier == "nvme" ? 8 : 20), "--n", text.n); !s.ok()) return s;
  if (buckets.value() > n.value()) {
    return invalid_argument("--buckets " + text.buckets + " is more than --n " + text.n +
                            ": every bucket needs at least one parameter");
  }
  cfg.n = n.value();
  cfg.buckets = buckets.value();
  cfg.iters = iters.value();
  cfg.offload.tile = tile.value();
  return Status::success();
}

Result<Settings> settings(const Texts& text) {
  Settings cfg;
  OffloadOptions& o = cfg.offload;
  Result<Schedule> schedule = parse_schedule(text.schedule);
  if (!schedule.ok()) return schedule.status();
  Result<Tier> tier = parse_tier(text.tier);
  if (!tier.ok()) return tier.status();
  Result<Durability> durability = parse_durability(text.durability);
  if (!durability.ok()) return durability.status();
  if (Status s = read_counts(text, cfg); !s.ok()) return s;
  o.schedule = schedule.value();
  o.tier = tier.value();
  o.nvme.paths = split_list(text.path);
  o.nvme.durability = durability.value();
  Result<DType> state = parse_state_dtype(text.state);
  if (!state.ok()) return invalid_argument("--state " + text.state + " is not fp32, bf16 or int8");
  o.state_dtype = state.value();
  const OptimizerRule* rule = find_optimizer_rule(text.optimizer);
  if (rule == nullptr) return invalid_argument("--optimizer " + text.optimizer + " is not adam, lion or adagrad");
  cfg.hyper = hyper_defaults(rule->rule);
  if (o.tier == Tier::nvme && o.nvme.paths.empty()) return invalid_argument("--tier nvme needs --path DIR[,DIR...]");
  o.delayed_warmup_steps = kCpuProbes;
  if (!text.compute.empty()) {
    Result<double> ms = parse_number_in(text.compute, "--compute-ms", 0, 1e6, "milliseconds of device compute");
    if (!ms.ok()) return ms.status();
    cfg.compute_s = *ms / 1e3;
  }
  return cfg;
}

// The CPU step and the optimizer's own copies, from iterations with no device compute.
struct Calibration {
  double cpu_step_s = 0;
  bool copies_measured = false;  // sync and delayed: overlap's copies run beside Adam
  double copy_gbps = 0, d2h_gbps = 0, h2d_gbps = 0;
  double copy_ceiling_gbps = 0, d2h_ceiling_gbps = 0, h2d_ceiling_gbps = 0;
};

Result<Calibration> calibrate(Device& device, OffloadOptimizer& opt, const DeviceModel& model, const Settings& cfg) {
  std::vector<double> probes;
  const StepStats before_probes = opt.stats();
  double h2d_s = 0;  // the probes' waits after step() returned: the weights still going up
  for (int i = 0; i < kCpuProbes; ++i) {
    Status s;
    probes.push_back(time_seconds([&] {
      s = iteration(device, opt, cfg.buckets, 0);
      if (s.ok()) h2d_s += time_seconds([&] { s = opt.wait(); });
    }));
    if (!s.ok()) return s;
  }
  Calibration c;
  c.cpu_step_s = summarize(probes).median;
  // The optimizer's own copies, from the sync probes (the delayed schedule's warm-up is sync): the time in
  // step() not spent in Adam brought the gradients down; step() returns with the weights' copies enqueued,
  // and the wait after it is their time.
  const StepStats& after_probes = opt.stats();
  const double d2h_s = (after_probes.step_call_s - before_probes.step_call_s) - (after_probes.adam_s - before_probes.adam_s);
  const double d2h_bytes = static_cast<double>(after_probes.d2h_bytes - before_probes.d2h_bytes);
  const double h2d_bytes = static_cast<double>(after_probes.h2d_bytes - before_probes.h2d_bytes);
  Result<std::pair<double, double>> raw = raw_copy_seconds(device, model.specs());
  if (!raw.ok()) return raw.status();
  double model_bytes = 0;
  for (const ParamSpec& p : model.specs()) model_bytes += static_cast<double>(p.n * dtype_size(p.dtype));
  c.copy_ceiling_gbps = 2 * model_bytes / (raw->first + raw->second) / 1e9;
  c.d2h_ceiling_gbps = model_bytes / raw->first / 1e9, c.h2d_ceiling_gbps = model_bytes / raw->second / 1e9;
  // Nothing copied (the CPU as the device: gradients and weights in place) leaves no copy rate to report;
  // nor does tier nvme's sync step, whose copies run window by window inside it (src/offload/step_windows.h).
  const bool streamed = cfg.offload.tier == Tier::nvme && cfg.offload.schedule == Schedule::sync;
  c.copies_measured = cfg.offload.schedule != Schedule::overlap && !streamed && d2h_s > 0 && h2d_s > 0 &&
                      d2h_bytes > 0 && h2d_bytes > 0;
  c.copy_gbps = c.copies_measured ? (d2h_bytes + h2d_bytes) / (d2h_s + h2d_s) / 1e9 : 0;
  c.d2h_gbps = c.copies_measured ? d2h_bytes / d2h_s / 1e9 : 0;
  c.h2d_gbps = c.copies_measured ? h2d_bytes / h2d_s / 1e9 : 0;
  return c;
}

struct StepResult {
  Calibration calibration;
  double compute_s = 0, step_s = 0, adam_s = 0, trainer_waits = 0, worker_waits = 0;
  // Tier nvme, per timed iteration: the swap store's bytes, and the steps redone (a wrong speculation re-reads).
  double nvme_read_bytes = 0, nvme_write_bytes = 0, redone = 0;
};

// The timed iterations, in the schedule's steady state: per iteration, the time, Adam and the waits.
Status timed(Device& device, OffloadOptimizer& opt, const Settings& cfg, StepResult& r) {
  for (int i = 0; i < 2; ++i) {  // reach the schedule's steady state (delayed: one step in flight)
    if (Status s = iteration(device, opt, cfg.buckets, r.compute_s); !s.ok()) return s;
  }
  // The device's view: from the end of one iteration's compute to the end of the last one's, so a step
  // still in flight at either end is neither counted nor hidden.
  auto compute_done = [&device] {
    Result<EventId> e = device.record(Stream::compute);
    return e.ok() ? device.synchronize(e.value()) : e.status();
  };
  if (Status s = compute_done(); !s.ok()) return s;
  const StepStats before = opt.stats();
  const double adam_before = before.adam_s;
  const HostWaits waits_before = device.host_waits();
  HostWaits waits_after;  // the iterations' own: before the benchmark's wait for the last compute
  Status s;
  const double total = time_seconds([&] {
    for (std::uint64_t i = 0; i < cfg.iters && s.ok(); ++i) s = iteration(device, opt, cfg.buckets, r.compute_s);
    waits_after = device.host_waits();
    if (s.ok()) s = compute_done();
  });
  if (s.ok()) s = opt.wait();
  if (!s.ok()) return s;
  const double per_iter = 1.0 / static_cast<double>(cfg.iters);
  r.step_s = total / static_cast<double>(cfg.iters);
  r.trainer_waits = static_cast<double>(waits_after.trainer_calls - waits_before.trainer_calls) * per_iter;
  r.worker_waits = static_cast<double>(waits_after.worker_calls - waits_before.worker_calls) * per_iter;
  r.adam_s = (opt.stats().adam_s - adam_before) / static_cast<double>(cfg.iters);
  const StepStats& after = opt.stats();
  r.nvme_read_bytes = static_cast<double>(after.nvme_read_bytes - before.nvme_read_bytes) * per_iter;
  r.nvme_write_bytes = static_cast<double>(after.nvme_write_bytes - before.nvme_write_bytes) * per_iter;
  r.redone = static_cast<double>(after.redone - before.redone) * per_iter;
  return Status::success();
}

Result<StepResult> run(const Texts& text, const Settings& cfg, const Report& report) {
  Result<std::unique_ptr<Device>> opened = open_bench_device(text.device);
  if (!opened.ok()) return opened.status();
  std::unique_ptr<Device> device = std::move(opened).value();
  DeviceModel model(*device, cfg.n, cfg.buckets);
  if (Status s = model.allocate(); !s.ok()) return s;
  Result<OffloadOptimizer> opt = OffloadOptimizer::create(*device, {ParamGroup{cfg.hyper}}, model.specs(), cfg.offload);
  if (!opt.ok()) return opt.status();
  StepResult r;
  Result<Calibration> c = calibrate(*device, *opt, model, cfg);
  if (!c.ok()) return c.status();
  r.calibration = *c;
  r.compute_s = cfg.compute_s.value_or(1.5 * c->cpu_step_s);
  report.progress(format("%s device, %s schedule, n = %llu in %llu buckets; CPU step %.1f ms, device compute %.1f ms "
                         "per iteration", device->name().c_str(), text.schedule.c_str(),
                         static_cast<unsigned long long>(cfg.n), static_cast<unsigned long long>(cfg.buckets),
                         c->cpu_step_s * 1e3, r.compute_s * 1e3));
  if (Status s = timed(*device, *opt, cfg, r); !s.ok()) return s;
  return r;
}

void report_step(Report& report, const Texts& text, const Settings& cfg, const StepResult& r) {
  const Calibration& c = r.calibration;
  const double idle = 1.0 - r.compute_s / r.step_s;
  JsonLine line;
  line.add("bench", "step").add("device", text.device).add("schedule", text.schedule).add("tier", text.tier).add("n", cfg.n)
      .add("durability", text.durability).add("state", text.state).add("optimizer", text.optimizer)
      .add("buckets", cfg.buckets).add("device_compute_s", r.compute_s).add("step_s", r.step_s)
      .add("device_idle_fraction", idle).add("cpu_step_s", c.cpu_step_s).add("cpu_adam_s", r.adam_s)
      .add("iters", cfg.iters).add("tile", static_cast<std::uint64_t>(cfg.offload.tile))
      .add("host_waits_per_step", r.trainer_waits)
      .add("worker_waits_per_step", r.worker_waits).add("copy_ceiling_gbps", c.copy_ceiling_gbps)
      .add("d2h_ceiling_gbps", c.d2h_ceiling_gbps).add("h2d_ceiling_gbps", c.h2d_ceiling_gbps);
  std::string text_lines =
      format("%-8s %-8s %12s %8s %12s %10s %8s %12s %10s\n", "device", "schedule", "n", "buckets", "compute ms",
             "step ms", "idle", "cpu step ms", "adam ms") +
      format("%-8s %-8s %12llu %8llu %12.1f %10.1f %8.3f %12.1f %10.1f\n", text.device.c_str(), text.schedule.c_str(),
             static_cast<unsigned long long>(cfg.n), static_cast<unsigned long long>(cfg.buckets), r.compute_s * 1e3,
             r.step_s * 1e3, idle, c.cpu_step_s * 1e3, r.adam_s * 1e3);
  if (c.copies_measured) {
    line.add("copy_gbps", c.copy_gbps).add("copy_ratio", c.copy_gbps / c.copy_ceiling_gbps)
        .add("d2h_gbps", c.d2h_gbps).add("d2h_ratio", c.d2h_gbps / c.d2h_ceiling_gbps)
        .add("h2d_gbps", c.h2d_gbps).add("h2d_ratio", c.h2d_gbps / c.h2d_ceiling_gbps);
    text_lines += format("copies (D2H + H2D): %.2f GB/s in the optimizer, %.2f GB/s plain copies of the same bytes: "
                         "ratio %.3f (D2H %.3f, H2D %.3f)\n", c.copy_gbps, c.copy_ceiling_gbps,
                         c.copy_gbps / c.copy_ceiling_gbps, c.d2h_gbps / c.d2h_ceiling_gbps,
                         c.h2d_gbps / c.h2d_ceiling_gbps);
  }
  if (text.tier == "nvme") {
    line.add("nvme_read_bytes_per_step", r.nvme_read_bytes).add("nvme_write_bytes_per_step", r.nvme_write_bytes)
        .add("redone_per_step", r.redone);
    text_lines += format("nvme per step: %.1f MB read, %.1f MB written; steps redone %.2f\n", r.nvme_read_bytes / 1e6,
                         r.nvme_write_bytes / 1e6, r.redone);
  }
  report.result(line, text_lines);
}

}  // namespace

int bench_step(std::span<char* const> args) {
  for (const char* a : args) {
    const std::string_view arg(a);
    if (arg == "--offload-param" || arg.starts_with("--offload-param=")) return bench_param_offload(args);
  }
  constexpr std::string_view kCommand = "zoe bench step";
  Texts text;
  const auto options = options_of(text);
  if (Status s = parse_options(args, options); !s.ok()) return fail(kCommand, s);
  if (text.help) {
    print_help("usage: zoe bench step [options]\n\n", options,
               "\nstep_s is the wall time per training iteration; device_idle_fraction = 1 - compute / step_s.\n"
               "cpu_step_s is one iteration with no device compute (copies and CPU Adam alone).\n"
               "copy_gbps (sync, delayed) is what the optimizer's D2H + H2D achieved; copy_ceiling_gbps plain copies\n"
               "of the same bytes to and from page-locked host memory (cudaMemcpyAsync on CUDA); copy_ratio their ratio.\n"
               "d2h_gbps / h2d_gbps and their ratios: each direction alone (the gradients' copies in step(), the\n"
               "weights' copies after it returns) against d2h_ceiling_gbps / h2d_ceiling_gbps. Not reported for tier\n"
               "nvme's sync step, which copies window by window inside its streamed step.\n"
               "Tier nvme: nvme_read_bytes_per_step / nvme_write_bytes_per_step, the swap store's traffic, and\n"
               "redone_per_step, the steps overlap stepped again after a wrong speculation (each reads the state again).\n");
    return 0;
  }
  Result<Settings> cfg = settings(text);
  if (!cfg.ok()) return fail(kCommand, cfg.status());
  Report report(kCommand, text.json);
  Result<StepResult> r = run(text, *cfg, report);
  if (!r.ok()) return fail(kCommand, r.status());
  report_step(report, text, *cfg, *r);
  return 0;
}

}  // namespace zoe::cli
