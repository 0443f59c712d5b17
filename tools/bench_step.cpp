// zoe bench step: whole offloaded training iterations against a device whose forward/backward takes a set
// time. The ceiling is the device's compute alone: device_idle_fraction = 1 - compute / iteration.
#include <cstdio>
#include <cstring>
#include <utility>
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tools/args.h"
#include "tools/bench_stats.h"
#include "tools/commands.h"
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

}  // namespace

int bench_step(std::span<char* const> args) {
  for (const char* a : args) {
    const std::string_view arg(a);
    if (arg == "--offload-param" || arg.starts_with("--offload-param=")) return bench_param_offload(args);
  }
  std::string device_name = "host", schedule_text = "sync", n_text = "64M", buckets_text = "16", compute_text,
              iters_text = "10", tier_text = "ram", path_text, durability_text = "step", state_text = "fp32",
              tile_text = "1M";
  bool json = false, help = false;
  const Option options[] = {
      {"device", &device_name, nullptr, "host (the stand-in) or cuda"},
      {"schedule", &schedule_text, nullptr, "sync, overlap or delayed"},
      {"tier", &tier_text, nullptr, "where p, m, v live: ram or nvme"},
      {"path", &path_text, nullptr, "tier nvme: swap folder(s), comma-separated"},
      {"durability", &durability_text, nullptr, "tier nvme: step (durable in the background) or checkpoint (at save)"},
      {"state", &state_text, nullptr, "Adam moments: fp32, bf16 or int8"},
      {"n", &n_text, nullptr, "parameters (K, M, G suffixes are powers of 1024)"},
      {"buckets", &buckets_text, nullptr, "gradient buckets reported during backward"},
      {"compute-ms", &compute_text, nullptr, "device forward+backward time (default: 1.5x the CPU step measured at start)"},
      {"iters", &iters_text, nullptr, "timed iterations"},
      {"tile", &tile_text, nullptr, "elements per piece: the unit each gradient comes down and is stepped in (overlap)"},
      {"offload-param", nullptr, nullptr, "cpu|nvme: the layers' weights in a parameter tier instead (see --offload-param cpu --help)"},
      {"json", nullptr, &json, "one JSON object on stdout, nothing else"},
      {"help", nullptr, &help, "this help"},
  };
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "zoe bench step: %s\n", s.to_string().c_str());
    return exit_status(s);
  };
  if (Status s = parse_options(args, options); !s.ok()) return fail(s);
  if (help) {
    std::printf("usage: zoe bench step [options]\n\n%s", options_help(options).c_str());
    std::printf("\nstep_s is the wall time per training iteration; device_idle_fraction = 1 - compute / step_s.\n"
                "cpu_step_s is one iteration with no device compute (copies and CPU Adam alone).\n"
                "copy_gbps (sync, delayed) is what the optimizer's D2H + H2D achieved; copy_ceiling_gbps plain copies\n"
                "of the same bytes to and from page-locked host memory (cudaMemcpyAsync on CUDA); copy_ratio their ratio.\n"
                "d2h_gbps / h2d_gbps and their ratios: each direction alone (the gradients' copies in step(), the\n"
                "weights' copies after it returns) against d2h_ceiling_gbps / h2d_ceiling_gbps.\n");
    return 0;
  }
  Result<Schedule> schedule = parse_schedule(schedule_text);
  if (!schedule.ok()) return fail(schedule.status());
  Result<Tier> tier = parse_tier(tier_text);
  if (!tier.ok()) return fail(tier.status());
  Result<Durability> durability = parse_durability(durability_text);
  if (!durability.ok()) return fail(durability.status());
  Result<std::uint64_t> n = parse_count(n_text, "--n");
  Result<std::uint64_t> buckets = parse_count(buckets_text, "--buckets");
  Result<std::uint64_t> iters = parse_count(iters_text, "--iters");
  Result<std::uint64_t> tile = parse_count(tile_text, "--tile");
  for (const Status& s : {n.status(), buckets.status(), iters.status(), tile.status()}) {
    if (!s.ok()) return fail(s);
  }
  if (Status s = require_at_least(tile.value(), 1, "--tile", "elements per piece"); !s.ok()) return fail(s);
  for (const Status& s : {require_at_least(n.value(), 1, "--n", "parameters; 0 has no step to time"),
                          require_at_least(buckets.value(), 1, "--buckets", "gradient buckets, each of 1 parameter or more"),
                          require_at_least(iters.value(), 1, "--iters", "timed iterations")}) {
    if (!s.ok()) return fail(s);
  }
  if (buckets.value() > n.value()) {
    return fail(invalid_argument("--buckets " + buckets_text + " is more than --n " + n_text +
                                 ": every bucket needs at least one parameter"));
  }

  Result<std::unique_ptr<Device>> opened = open_bench_device(device_name);
  if (!opened.ok()) return fail(opened.status());
  std::unique_ptr<Device> device = std::move(opened).value();
  DeviceModel model(*device, n.value(), buckets.value());
  if (Status s = model.allocate(); !s.ok()) return fail(s);

  constexpr int kCpuProbes = 3;  // iterations without compute that time the CPU step; sync for delayed
  OffloadOptions o;
  o.schedule = schedule.value();
  o.tier = tier.value();
  o.nvme.paths = split_list(path_text);
  o.nvme.durability = durability.value();
  Result<DType> state = parse_state_dtype(state_text);
  if (!state.ok()) return fail(invalid_argument("--state " + state_text + " is not fp32, bf16 or int8"));
  o.state_dtype = state.value();
  if (o.tier == Tier::nvme && o.nvme.paths.empty()) return fail(invalid_argument("--tier nvme needs --path DIR[,DIR...]"));
  o.delayed_warmup_steps = kCpuProbes;
  o.tile = tile.value();
  Result<OffloadOptimizer> opt = OffloadOptimizer::create(*device, {ParamGroup{}}, model.specs(), o);
  if (!opt.ok()) return fail(opt.status());

  std::vector<double> probes;
  const StepStats before_probes = opt->stats();
  double h2d_s = 0;  // the probes' waits after step() returned: the weights still going up
  for (int i = 0; i < kCpuProbes; ++i) {
    Status s;
    probes.push_back(time_seconds([&] {
      s = iteration(*device, *opt, buckets.value(), 0);
      if (s.ok()) h2d_s += time_seconds([&] { s = opt->wait(); });
    }));
    if (!s.ok()) return fail(s);
  }
  const double cpu_step_s = summarize(probes).median;
  // The optimizer's own copies, from the sync probes (the delayed schedule's warm-up is sync): the time in
  // step() not spent in Adam brought the gradients down; step() returns with the weights' copies enqueued,
  // and the wait after it is their time.
  const StepStats& after_probes = opt->stats();
  const double d2h_s = (after_probes.step_call_s - before_probes.step_call_s) - (after_probes.adam_s - before_probes.adam_s);
  const double d2h_bytes = static_cast<double>(after_probes.d2h_bytes - before_probes.d2h_bytes);
  const double h2d_bytes = static_cast<double>(after_probes.h2d_bytes - before_probes.h2d_bytes);
  Result<std::pair<double, double>> raw = raw_copy_seconds(*device, model.specs());
  if (!raw.ok()) return fail(raw.status());
  double model_bytes = 0;
  for (const ParamSpec& p : model.specs()) model_bytes += static_cast<double>(p.n * dtype_size(p.dtype));
  const double copy_ceiling_gbps = 2 * model_bytes / (raw->first + raw->second) / 1e9;
  const double d2h_ceiling_gbps = model_bytes / raw->first / 1e9, h2d_ceiling_gbps = model_bytes / raw->second / 1e9;
  const bool copies_measured = o.schedule != Schedule::overlap && d2h_s > 0 && h2d_s > 0;
  const double copy_gbps = copies_measured ? (d2h_bytes + h2d_bytes) / (d2h_s + h2d_s) / 1e9 : 0;
  const double d2h_gbps = copies_measured ? d2h_bytes / d2h_s / 1e9 : 0;
  const double h2d_gbps = copies_measured ? h2d_bytes / h2d_s / 1e9 : 0;
  double compute_s = 1.5 * cpu_step_s;
  if (!compute_text.empty()) {
    char* end = nullptr;
    const double ms = std::strtod(compute_text.c_str(), &end);
    if (end == compute_text.c_str() || *end != '\0' || !(ms >= 0)) {
      return fail(invalid_argument("--compute-ms " + compute_text + " is not a time in milliseconds"));
    }
    compute_s = ms / 1e3;
  }
  if (!json) {
    std::fprintf(stderr, "zoe bench step: %s device, %s schedule, n = %llu in %llu buckets; CPU step %.1f ms, "
                 "device compute %.1f ms per iteration\n", device->name().c_str(), schedule_text.c_str(),
                 static_cast<unsigned long long>(n.value()), static_cast<unsigned long long>(buckets.value()),
                 cpu_step_s * 1e3, compute_s * 1e3);
  }
  for (int i = 0; i < 2; ++i) {  // reach the schedule's steady state (delayed: one step in flight)
    if (Status s = iteration(*device, *opt, buckets.value(), compute_s); !s.ok()) return fail(s);
  }
  // The device's view: from the end of one iteration's compute to the end of the last one's, so a step
  // still in flight at either end is neither counted nor hidden.
  auto compute_done = [&device] {
    Result<EventId> e = device->record(Stream::compute);
    return e.ok() ? device->synchronize(e.value()) : e.status();
  };
  if (Status s = compute_done(); !s.ok()) return fail(s);
  const double adam_before = opt->stats().adam_s;
  const HostWaits waits_before = device->host_waits();
  HostWaits waits_after;  // the iterations' own: before the benchmark's wait for the last compute
  Status s;
  const double total = time_seconds([&] {
    for (std::uint64_t i = 0; i < iters.value() && s.ok(); ++i) s = iteration(*device, *opt, buckets.value(), compute_s);
    waits_after = device->host_waits();
    if (s.ok()) s = compute_done();
  });
  if (s.ok()) s = opt->wait();
  if (!s.ok()) return fail(s);
  const double step_s = total / static_cast<double>(iters.value());
  const double per_iter = 1.0 / static_cast<double>(iters.value());
  const double trainer_waits = static_cast<double>(waits_after.trainer_calls - waits_before.trainer_calls) * per_iter;
  const double worker_waits = static_cast<double>(waits_after.worker_calls - waits_before.worker_calls) * per_iter;
  const double idle = 1.0 - compute_s / step_s;
  const double adam_s = (opt->stats().adam_s - adam_before) / static_cast<double>(iters.value());
  if (json) {
    JsonLine line;
    line.add("bench", "step").add("device", device_name).add("schedule", schedule_text).add("tier", tier_text).add("n", n.value())
        .add("durability", durability_text).add("state", state_text)
        .add("buckets", buckets.value()).add("device_compute_s", compute_s).add("step_s", step_s)
        .add("device_idle_fraction", idle).add("cpu_step_s", cpu_step_s).add("cpu_adam_s", adam_s)
        .add("iters", iters.value()).add("tile", tile.value()).add("host_waits_per_step", trainer_waits)
        .add("worker_waits_per_step", worker_waits).add("copy_ceiling_gbps", copy_ceiling_gbps)
        .add("d2h_ceiling_gbps", d2h_ceiling_gbps).add("h2d_ceiling_gbps", h2d_ceiling_gbps);
    if (copies_measured) {
      line.add("copy_gbps", copy_gbps).add("copy_ratio", copy_gbps / copy_ceiling_gbps)
          .add("d2h_gbps", d2h_gbps).add("d2h_ratio", d2h_gbps / d2h_ceiling_gbps)
          .add("h2d_gbps", h2d_gbps).add("h2d_ratio", h2d_gbps / h2d_ceiling_gbps);
    }
    std::printf("%s\n", line.str().c_str());
  } else {
    std::printf("%-8s %-8s %12s %8s %12s %10s %8s %12s %10s\n", "device", "schedule", "n", "buckets", "compute ms",
                "step ms", "idle", "cpu step ms", "adam ms");
    std::printf("%-8s %-8s %12llu %8llu %12.1f %10.1f %8.3f %12.1f %10.1f\n", device_name.c_str(),
                schedule_text.c_str(), static_cast<unsigned long long>(n.value()),
                static_cast<unsigned long long>(buckets.value()), compute_s * 1e3, step_s * 1e3, idle,
                cpu_step_s * 1e3, adam_s * 1e3);
    if (copies_measured) {
      std::printf("copies (D2H + H2D): %.2f GB/s in the optimizer, %.2f GB/s plain copies of the same bytes: "
                  "ratio %.3f (D2H %.3f, H2D %.3f)\n", copy_gbps, copy_ceiling_gbps, copy_gbps / copy_ceiling_gbps,
                  d2h_gbps / d2h_ceiling_gbps, h2d_gbps / h2d_ceiling_gbps);
    }
  }
  return 0;
}

}  // namespace zoe::cli
