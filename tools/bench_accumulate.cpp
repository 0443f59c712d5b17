// zoe bench accumulate: gradient accumulation (acc += g over micro-batches) against a streams loop with the
// same loads and stores, measured alternately in the same run (BENCHMARKING.md).
#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "tools/args.h"
#include "tools/bench_stats.h"
#include "tools/commands.h"
#include "tools/report.h"
#include "zoe/adam.h"
#include "zoe/aligned_buffer.h"

namespace zoe::cli {
namespace {

struct Mode {
  const char* name;
  AccumulateOptions options;
};

// add is what every micro-batch after the first does; the others are measured on request.
constexpr Mode kModes[] = {
    {"add", {false, false}},
    {"add_zero", {false, true}},  // and zero the gradient buffer in the same pass
    {"first", {true, false}},     // acc = g, acc not read
    {"first_zero", {true, true}},
};

// The command line as given, with the defaults.
struct Texts {
  std::string n = "64M", isa = "auto", grad = "f32", mode = "add", threads = "0", reps,
              tile = std::to_string(CpuAdamOptions{}.tile);
  bool json = false, help = false;
};

std::array<Option, 9> options_of(Texts& t) {
  return {{
      {"n", &t.n, nullptr, "parameters per pass, 1 to 1T (K, M, G, T suffixes are powers of 1024)"},
      {"isa", &t.isa, nullptr, "comma list of auto, scalar, avx2, avx512, neon, sve"},
      {"grad", &t.grad, nullptr, "comma list of gradient dtypes: f32, f16, bf16"},
      {"mode", &t.mode, nullptr, "comma list of add, add_zero, first, first_zero"},
      {"threads", &t.threads, nullptr, "worker threads, 0 to 1024 (0: all CPUs; ZOE_THREADS caps)"},
      {"reps", &t.reps, nullptr, "timed repetitions, 1 to 1M (default: about 1 s of passes, 10 to 200)"},
      {"tile", &t.tile, nullptr, "elements per unit of parallel work, 1 to 1T"},
      {"json", nullptr, &t.json, "one JSON object per line on stdout, nothing else"},
      {"help", nullptr, &t.help, "this help"},
  }};
}

struct Settings {
  std::uint64_t n = 0;
  int threads = 0;
  int reps = 0;
  std::size_t tile = 0;
  std::vector<std::string> isas;
  std::vector<DType> grads;
  std::vector<Mode> modes;
};

// The bytes the kernel itself reads and writes per parameter: acc read (4, not for the first micro-batch),
// g read (4 or 2), acc written (4), g written (4 or 2, when zeroed). Cache-line fills for stores are not
// counted.
double bytes_per_param(DType grad, const AccumulateOptions& o) {
  const double g = static_cast<double>(dtype_size(grad));
  return (o.first ? 0.0 : 4.0) + g + 4.0 + (o.zero_source ? g : 0.0);
}

// One accumulator and one gradient buffer of n elements, every page touched before timing: acc uniform in
// [-1, 1), gradients in [-1e-2, 1e-2).
class Workload {
 public:
  static Result<Workload> make(std::uint64_t n, DType grad) {
    Result<AlignedBuffer> acc = AlignedBuffer::allocate(n * 4);
    if (!acc.ok()) return acc.status();
    Result<AlignedBuffer> g = AlignedBuffer::allocate(n * dtype_size(grad));
    if (!g.ok()) return g.status();
    std::uint32_t seed = 12345;
    auto uniform = [&seed] {  // [-1, 1)
      seed = seed * 1664525u + 1013904223u;
      return static_cast<float>(seed >> 8) * (2.0f / 16777216.0f) - 1.0f;
    };
    for (std::uint64_t i = 0; i < n; ++i) {
      acc->as<float>()[i] = uniform();
      const float gv = 1e-2f * uniform();
      switch (grad) {
        case DType::f32: g->as<float>()[i] = gv; break;
        case DType::f16: g->as<std::uint16_t>()[i] = float_to_f16(gv); break;
        case DType::bf16: g->as<std::uint16_t>()[i] = float_to_bf16(gv); break;
        case DType::i8: break;  // not a gradient dtype: parse_dtype never gives it
      }
    }
    Workload w;
    w.tensor_ = AccumulateTensor{acc->as<float>(), g->data(), grad, n};
    w.acc_ = std::move(acc).value();
    w.grad_ = std::move(g).value();
    return w;
  }
  const AccumulateTensor& tensor() const { return tensor_; }

 private:
  AlignedBuffer acc_, grad_;
  AccumulateTensor tensor_;
};

struct Measured {
  TimeSummary kernel, streams;
};

// Warm-up, then the kernel and the streams pass alternately, so that both see the same machine state. With
// zero_source the gradients are zero after the first pass; the loads and stores stay the same.
Result<Measured> measure(CpuAdam& engine, const AccumulateTensor& t, const AccumulateOptions& o, int reps) {
  std::vector<double> kernel_s, streams_s;
  for (int r = -2; r < reps; ++r) {
    Status s;
    const double tk = time_seconds([&] { s = engine.accumulate(t, o); });
    if (!s.ok()) return s;
    const double ts = time_seconds([&] { s = engine.accumulate_streams_pass(std::span(&t, 1), o); });
    if (!s.ok()) return s;
    if (r >= 0) {
      kernel_s.push_back(tk);
      streams_s.push_back(ts);
    }
  }
  return Measured{summarize(kernel_s), summarize(streams_s)};
}

int default_reps(std::uint64_t n) {
  // About a second of passes at ~1 Gparam/s, between 10 and 200 repetitions.
  return static_cast<int>(std::clamp<std::uint64_t>(1'000'000'000ull / n, 10, 200));
}

void report_case(Report& report, const Settings& cfg, const CpuAdam& engine, DType grad, const Mode& mode,
                 const Measured& m) {
  const double params = static_cast<double>(cfg.n);
  const double bytes = bytes_per_param(grad, mode.options);
  const double params_per_s = params / m.kernel.median;
  const double gbps = params * bytes / m.kernel.median / 1e9;
  const double ceiling = params * bytes / m.streams.median / 1e9;
  const std::string isa(isa_name(engine.isa()));
  JsonLine line;
  line.add("bench", "accumulate").add("mode", mode.name).add("isa", isa).add("n", cfg.n)
      .add("grad", dtype_name(grad)).add("threads", engine.threads()).add("bytes_per_param", bytes)
      .add("median_s", m.kernel.median).add("min_s", m.kernel.min).add("max_s", m.kernel.max)
      .add("params_per_s", params_per_s).add("gbps", gbps).add("ceiling_gbps", ceiling)
      .add("ratio", gbps / ceiling).add("reps", cfg.reps);
  report.result(line, format("%-7s %-5s %-10s %12llu %4d %10.3f %10.1f %8.1f %9.1f %6.3f\n", isa.c_str(),
                             std::string(dtype_name(grad)).c_str(), mode.name, static_cast<unsigned long long>(cfg.n),
                             engine.threads(), m.kernel.median * 1e3, params_per_s / 1e6, gbps, ceiling,
                             gbps / ceiling));
}

// The counts and lists after parse_options, checked: nothing here may be zero or empty.
Result<Settings> settings(const Texts& text) {
  Settings cfg;
  // The ranges of docs/cli.md: --n times the 8 bytes a parameter holds stays far inside 64 bits, and the
  // buffers must fit this machine's RAM (checked before anything is allocated).
  Result<std::uint64_t> n = parse_count_in(text.n, "--n", 1, kMaxBenchParams, "parameters per pass");
  Result<std::uint64_t> threads = parse_count_in(text.threads, "--threads", 0, kMaxThreads, "worker threads; 0: all CPUs");
  Result<std::uint64_t> tile = parse_count_in(text.tile, "--tile", 1, kMaxBenchParams, "elements per unit of work");
  Result<std::uint64_t> reps = text.reps.empty() ? Result<std::uint64_t>(std::uint64_t{0})
                                                 : parse_count_in(text.reps, "--reps", 1, kMaxReps, "timed repetitions");
  for (const Status& s : {n.status(), threads.status(), tile.status(), reps.status()}) {
    if (!s.ok()) return s;
  }
  cfg.n = n.value();
  if (Status s = require_memory(cfg.n * 8, "--n", text.n); !s.ok()) return s;
  cfg.threads = static_cast<int>(threads.value());
  cfg.tile = tile.value();
  cfg.reps = text.reps.empty() ? default_reps(cfg.n) : static_cast<int>(reps.value());
  cfg.isas = split_list(text.isa);
  const std::vector<std::string> grads = split_list(text.grad), modes = split_list(text.mode);
  for (const Status& s : {require_items(cfg.isas, "--isa", "auto, scalar, avx2, avx512, neon, sve"),
                          require_items(grads, "--grad", "f32, f16, bf16"),
                          require_items(modes, "--mode", "add, add_zero, first, first_zero")}) {
    if (!s.ok()) return s;
  }
  for (const std::string& g : grads) {
    const auto d = parse_dtype(g);
    if (!d) return invalid_argument("--grad " + g + " is not f32, f16 or bf16");
    cfg.grads.push_back(*d);
  }
  for (const std::string& name : modes) {
    const auto it = std::find_if(std::begin(kModes), std::end(kModes), [&](const Mode& m) { return name == m.name; });
    if (it == std::end(kModes)) return invalid_argument("--mode " + name + " is not add, add_zero, first or first_zero");
    cfg.modes.push_back(*it);
  }
  return cfg;
}

// Every case, each reported as soon as it is measured.
Status run(const Settings& cfg, Report& report) {
  report.header(format("%-7s %-5s %-10s %12s %4s %10s %10s %8s %9s %6s\n", "isa", "grad", "mode", "n", "thr",
                       "median ms", "Mparam/s", "GB/s", "ceil GB/s", "ratio"));
  for (const std::string& isa : cfg.isas) {
    CpuAdamOptions engine_options;
    engine_options.isa = isa;
    engine_options.threads = cfg.threads;
    engine_options.tile = cfg.tile;
    Result<CpuAdam> engine = CpuAdam::create(engine_options);
    if (!engine.ok()) return engine.status();
    for (DType grad : cfg.grads) {
      Result<Workload> w = Workload::make(cfg.n, grad);
      if (!w.ok()) return w.status();
      for (const Mode& mode : cfg.modes) {
        Result<Measured> m = measure(*engine, w->tensor(), mode.options, cfg.reps);
        if (!m.ok()) return m.status();
        report_case(report, cfg, *engine, grad, mode, *m);
      }
    }
  }
  return Status::success();
}

}  // namespace

int bench_accumulate(std::span<char* const> args) {
  constexpr std::string_view kCommand = "zoe bench accumulate";
  Texts text;
  const auto options = options_of(text);
  if (Status s = parse_options(args, options); !s.ok()) return fail(kCommand, s);
  if (text.help) {
    print_help("usage: zoe bench accumulate [options]\n\n", options,
               "\nEach case runs CpuAdam::accumulate and a streams loop with the same loads and stores\n"
               "alternately; ratio = kernel GB/s / streams GB/s. Bytes per parameter: acc read (4, not in the\n"
               "first modes) + gradient read (4 or 2) + acc written (4) + gradient written (4 or 2, _zero modes).\n");
    return 0;
  }
  Result<Settings> cfg = settings(text);
  if (!cfg.ok()) return fail(kCommand, cfg.status());
  Report report(kCommand, text.json);
  if (Status s = run(*cfg, report); !s.ok()) return fail(kCommand, s);
  return 0;
}

}  // namespace zoe::cli
