// zoe bench adam: CPU optimizer step throughput (Adam, AdamW, AMSGrad, Lion, Adagrad) against a streams loop
// with the same loads and stores, measured alternately in the same run (BENCHMARKING.md).
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <optional>
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

const char* state_label(DType state) { return state == DType::f32 ? "fp32" : state == DType::bf16 ? "bf16" : "int8"; }

// The rules the engine steps, with the state arrays each keeps per parameter (what its bytes count).
enum class Optimizer { adamw, adam, amsgrad, lion, adagrad };
struct OptimizerInfo {
  const char* name;
  Optimizer id;
  int states;
};
constexpr OptimizerInfo kOptimizers[] = {{"adamw", Optimizer::adamw, 2},
                                         {"adam", Optimizer::adam, 2},
                                         {"amsgrad", Optimizer::amsgrad, 3},
                                         {"lion", Optimizer::lion, 1},
                                         {"adagrad", Optimizer::adagrad, 1}};
constexpr const char* kOptimizerList = "adamw, adam, amsgrad, lion, adagrad";

// The buffers of one benchmark case: `tensors` separately allocated tensors sharing n elements.
class Workload {
 public:
  // `states` state arrays per tensor (kOptimizers); both views of the tensors are made: AdamTensor (exp_avg,
  // exp_avg_sq and, with three, max_exp_avg_sq) and OneStateTensor (the first array).
  static Result<Workload> make(std::uint64_t n, std::uint64_t count, DType grad, bool has_out, DType out,
                               DType state, int states) {
    Workload w;
    std::uint32_t seed = 12345;
    auto uniform = [&seed] {  // [-1, 1)
      seed = seed * 1664525u + 1013904223u;
      return static_cast<float>(seed >> 8) * (2.0f / 16777216.0f) - 1.0f;
    };
    for (std::uint64_t k = 0; k < count; ++k) {
      const std::uint64_t elems = n / count + (k < n % count ? 1 : 0);
      AdamTensor t;
      t.n = elems;
      t.grad_dtype = grad;
      t.out_dtype = out;
      t.state_dtype = state;
      Result<AlignedBuffer> p = AlignedBuffer::allocate(elems * 4);
      if (!p.ok()) return p.status();
      t.param = p->as<float>();
      w.buffers_.push_back(std::move(p).value());
      void* arrays[3] = {};
      for (int a = 0; a < states; ++a) {
        Result<AlignedBuffer> b = AlignedBuffer::allocate(elems * dtype_size(state));
        if (!b.ok()) return b.status();
        std::memset(b->data(), 0, elems * dtype_size(state));  // zero state in every dtype
        arrays[a] = b->data();
        w.buffers_.push_back(std::move(b).value());
      }
      t.exp_avg = arrays[0];
      t.exp_avg_sq = arrays[1];
      t.max_exp_avg_sq = arrays[2];
      if (state == DType::i8) {
        for (float** scale : {&t.exp_avg_scale, &t.exp_avg_sq_scale}) {
          Result<AlignedBuffer> b = AlignedBuffer::allocate(moment_blocks(elems) * 4);
          if (!b.ok()) return b.status();
          std::memset(b->data(), 0, moment_blocks(elems) * 4);
          *scale = b->as<float>();
          w.buffers_.push_back(std::move(b).value());
        }
      }
      Result<AlignedBuffer> g = AlignedBuffer::allocate(elems * dtype_size(grad));
      if (!g.ok()) return g.status();
      t.grad = g->data();
      if (has_out) {
        Result<AlignedBuffer> o = AlignedBuffer::allocate(elems * 2);
        if (!o.ok()) return o.status();
        t.out = o->data();
        w.buffers_.push_back(std::move(o).value());
      }
      // Touch every page before timing: weights in [-1, 1), gradients in [-1e-2, 1e-2).
      for (std::uint64_t i = 0; i < elems; ++i) {
        t.param[i] = uniform();
        const float gv = 1e-2f * uniform();
        switch (grad) {
          case DType::f32: g->as<float>()[i] = gv; break;
          case DType::f16: g->as<std::uint16_t>()[i] = float_to_f16(gv); break;
          case DType::bf16: g->as<std::uint16_t>()[i] = float_to_bf16(gv); break;
          case DType::i8: break;  // not a gradient dtype: parse_dtype never gives it
        }
        if (has_out) static_cast<std::uint16_t*>(t.out)[i] = 0;
      }
      w.buffers_.push_back(std::move(g).value());
      w.tensors_.push_back(t);
      w.one_state_.push_back(one_state_of(t));
    }
    return w;
  }
  std::span<const AdamTensor> tensors() const { return tensors_; }
  std::span<const OneStateTensor> one_state() const { return one_state_; }

 private:
  std::vector<AlignedBuffer> buffers_;
  std::vector<AdamTensor> tensors_;
  std::vector<OneStateTensor> one_state_;
};

// One step of the rule over the workload, with the hyper-parameters of a typical run (weight decay on), and
// its streams ceiling.
Status step_once(CpuAdam& engine, Optimizer rule, const Workload& w, const StepOptions& options) {
  switch (rule) {
    case Optimizer::lion: {
      LionHyper hyper;
      hyper.weight_decay = 0.01f;
      return engine.step(hyper, options, w.one_state());
    }
    case Optimizer::adagrad: {
      AdagradHyper hyper;
      hyper.weight_decay = 0.01f;
      return engine.step(hyper, options, w.one_state());
    }
    default: {
      AdamHyper hyper;
      hyper.weight_decay = 0.01f;
      hyper.adamw = rule != Optimizer::adam;
      hyper.amsgrad = rule == Optimizer::amsgrad;
      return engine.step(hyper, options, w.tensors());
    }
  }
}

Status streams_once(CpuAdam& engine, Optimizer rule, const Workload& w) {
  if (rule == Optimizer::lion || rule == Optimizer::adagrad) return engine.streams_pass(w.one_state());
  return engine.streams_pass(w.tensors());  // max_exp_avg_sq is set for amsgrad's workload only
}

struct Measured {
  TimeSummary adam, streams;
};

// Warm-up, then the step and the streams pass alternately, so that both see the same machine state.
Result<Measured> measure(CpuAdam& engine, Optimizer rule, const Workload& w, int reps) {
  StepOptions options;
  std::vector<double> adam_s, streams_s;
  for (int r = -2; r < reps; ++r) {
    Status s;
    const double ta = time_seconds([&] { s = step_once(engine, rule, w, options); });
    if (!s.ok()) return s;
    ++options.step;
    const double ts = time_seconds([&] { s = streams_once(engine, rule, w); });
    if (!s.ok()) return s;
    if (r >= 0) {
      adam_s.push_back(ta);
      streams_s.push_back(ts);
    }
  }
  return Measured{summarize(adam_s), summarize(streams_s)};
}

int default_reps(std::uint64_t n) {
  // About half a second of Adam steps at ~1 Gparam/s, between 10 and 200 repetitions.
  const std::uint64_t reps = n == 0 ? 200 : 500'000'000ull / n;
  return static_cast<int>(std::clamp<std::uint64_t>(reps, 10, 200));
}

// The command line as given, with the defaults.
struct Texts {
  std::string n = "64M", tensors = "1", isa = "auto", grad = "f32", out = "none", state = "fp32", threads = "0", reps,
              tile = std::to_string(CpuAdamOptions{}.tile), optimizer = "adamw";
  bool json = false, help = false;
};

std::array<Option, 12> options_of(Texts& t) {
  return {{
      {"optimizer", &t.optimizer, nullptr, "comma list of rules: adamw, adam (L2 decay), amsgrad (AdamW's), lion, adagrad"},
      {"n", &t.n, nullptr, "parameters per step, 1 to 1T (K, M, G, T suffixes are powers of 1024)"},
      {"tensors", &t.tensors, nullptr, "split the parameters into this many separately allocated tensors, 1 to 1M (at most --n)"},
      {"isa", &t.isa, nullptr, "comma list of auto, scalar, avx2, avx512, neon, sve"},
      {"grad", &t.grad, nullptr, "comma list of gradient dtypes: f32, f16, bf16"},
      {"out", &t.out, nullptr, "comma list of weight-copy dtypes: none, f16, bf16"},
      {"state", &t.state, nullptr, "comma list of moment dtypes: fp32, bf16, int8"},
      {"threads", &t.threads, nullptr, "worker threads, 0 to 1024 (0: all CPUs; ZOE_THREADS caps)"},
      {"reps", &t.reps, nullptr, "timed repetitions, 1 to 1M (default: about 0.5 s of steps, 10 to 200)"},
      {"tile", &t.tile, nullptr, "elements per unit of parallel work, 1 to 1T"},
      {"json", nullptr, &t.json, "one JSON object per line on stdout, nothing else"},
      {"help", nullptr, &t.help, "this help"},
  }};
}

// --tensors: each is a handful of allocations; a million is already far past what a model holds.
constexpr std::uint64_t kMaxTensors = std::uint64_t{1} << 20;

struct Settings {
  std::uint64_t n = 0;
  std::uint64_t tensors = 1;
  int threads = 0;
  int reps = 0;
  std::size_t tile = 0;
  std::vector<std::string> isas, outs;
  std::vector<DType> grads, states;
  std::vector<OptimizerInfo> optimizers;
};

// The counts after parse_options, checked: nothing here may be zero.
Status read_counts(const Texts& text, Settings& cfg) {
  // The ranges of docs/cli.md; the buffers must fit this machine's RAM, checked before anything is allocated.
  Result<std::uint64_t> n = parse_count_in(text.n, "--n", 1, kMaxBenchParams, "parameters per step");
  Result<std::uint64_t> tensors = parse_count_in(text.tensors, "--tensors", 1, kMaxTensors, "tensors, at most --n");
  Result<std::uint64_t> threads = parse_count_in(text.threads, "--threads", 0, kMaxThreads, "worker threads; 0: all CPUs");
  Result<std::uint64_t> tile = parse_count_in(text.tile, "--tile", 1, kMaxBenchParams, "elements per unit of work");
  for (const Status& s : {n.status(), tensors.status(), threads.status(), tile.status()}) {
    if (!s.ok()) return s;
  }
  cfg.n = n.value();
  cfg.tensors = tensors.value();
  // Per parameter at most 4 (p) + 4 per state array + 4 (gradient) + 2 (weight copy) bytes and int8's scales
  // (read_lists, run first, gave the rules); with --tensors > 1 the one-array workload is made beside the split one.
  int states = 0;
  for (const OptimizerInfo& o : cfg.optimizers) states = std::max(states, o.states);
  const std::uint64_t bytes_per_param = 11 + 4 * static_cast<std::uint64_t>(states);
  if (Status s = require_memory(cfg.n * bytes_per_param * (cfg.tensors > 1 ? 2 : 1), "--n", text.n); !s.ok()) {
    return s;
  }
  cfg.threads = static_cast<int>(threads.value());
  cfg.tile = tile.value();
  if (cfg.tensors == 0 || cfg.tensors > cfg.n) {
    return invalid_argument("--tensors " + text.tensors + " must be between 1 and --n");
  }
  cfg.reps = default_reps(cfg.n);
  if (!text.reps.empty()) {
    Result<std::uint64_t> reps = parse_count_in(text.reps, "--reps", 1, kMaxReps, "timed repetitions");
    if (!reps.ok()) return reps.status();
    cfg.reps = static_cast<int>(reps.value());
  }
  return Status::success();
}

// 8-bit state is Adam's (two moments in blocks); the other rules keep fp32 or bf16 state.
Status check_int8_rules(const Settings& cfg) {
  if (std::find(cfg.states.begin(), cfg.states.end(), DType::i8) == cfg.states.end()) return Status::success();
  for (const OptimizerInfo& o : cfg.optimizers) {
    if (o.id != Optimizer::adamw && o.id != Optimizer::adam) {
      return invalid_argument(std::string("--state int8 is adamw's and adam's only: --optimizer ") + o.name +
                              " keeps fp32 or bf16 state");
    }
  }
  return Status::success();
}

// The comma lists, checked: none may be empty, every item must be a known one.
Status read_lists(const Texts& text, Settings& cfg) {
  cfg.isas = split_list(text.isa);
  cfg.outs = split_list(text.out);
  const std::vector<std::string> grad_names = split_list(text.grad), state_names = split_list(text.state);
  const std::vector<std::string> optimizer_names = split_list(text.optimizer);
  for (const Status& s : {require_items(cfg.isas, "--isa", "auto, scalar, avx2, avx512, neon, sve"),
                          require_items(grad_names, "--grad", "f32, f16, bf16"),
                          require_items(cfg.outs, "--out", "none, f16, bf16"),
                          require_items(state_names, "--state", "fp32, bf16, int8"),
                          require_items(optimizer_names, "--optimizer", kOptimizerList)}) {
    if (!s.ok()) return s;
  }
  for (const std::string& name : optimizer_names) {
    const auto* known = std::find_if(std::begin(kOptimizers), std::end(kOptimizers),
                                     [&](const OptimizerInfo& o) { return name == o.name; });
    if (known == std::end(kOptimizers)) return invalid_argument("--optimizer " + name + " is not " + kOptimizerList);
    cfg.optimizers.push_back(*known);
  }
  for (const std::string& st : state_names) {
    const auto d = st == "int8" || st == "i8" ? std::optional<DType>(DType::i8) : parse_dtype(st);
    if (!d || *d == DType::f16) return invalid_argument("--state " + st + " is not fp32, bf16 or int8");
    cfg.states.push_back(*d);
  }
  for (const std::string& g : grad_names) {
    const auto d = parse_dtype(g);
    if (!d) return invalid_argument("--grad " + g + " is not f32, f16 or bf16");
    cfg.grads.push_back(*d);
  }
  for (const std::string& o : cfg.outs) {
    if (o != "none" && o != "f16" && o != "bf16") return invalid_argument("--out " + o + " is not none, f16 or bf16");
  }
  return check_int8_rules(cfg);
}

// One case of the grid: the rule and the dtypes of the gradient, the weight copy and the state.
struct Case {
  OptimizerInfo rule;
  DType grad;
  std::string out;
  DType state;

  bool has_out() const { return out != "none"; }
  DType out_dtype() const { return out == "f16" ? DType::f16 : DType::bf16; }
  // p read and written, each state array read and written, the gradient read, the copy written.
  double bytes_per_param() const {
    const double scale_bytes = state == DType::i8 ? 2.0 * 2.0 * 4.0 / kMomentBlock : 0.0;
    return 8.0 + 2.0 * rule.states * static_cast<double>(dtype_size(state)) + scale_bytes +
           static_cast<double>(dtype_size(grad)) + (has_out() ? 2.0 : 0.0);
  }
};

struct CaseResult {
  std::string isa;
  int threads = 0;
  Measured m;
  double single_params_per_s = 0;  // with --tensors > 1: the same parameters as one array
};

Result<CaseResult> run_case(CpuAdam& engine, const Settings& cfg, const Case& c) {
  Result<Workload> w = Workload::make(cfg.n, cfg.tensors, c.grad, c.has_out(), c.out_dtype(), c.state, c.rule.states);
  if (!w.ok()) return w.status();
  Result<Measured> m = measure(engine, c.rule.id, *w, cfg.reps);
  if (!m.ok()) return m.status();
  CaseResult r{std::string(isa_name(engine.isa())), engine.threads(), *m, 0};
  // Many tensors: the same parameters as one array, in the same run, for the ratio between the two.
  if (cfg.tensors > 1) {
    Result<Workload> single = Workload::make(cfg.n, 1, c.grad, c.has_out(), c.out_dtype(), c.state, c.rule.states);
    if (!single.ok()) return single.status();
    Result<Measured> ms = measure(engine, c.rule.id, *single, cfg.reps);
    if (!ms.ok()) return ms.status();
    r.single_params_per_s = static_cast<double>(cfg.n) / ms->adam.median;
  }
  return r;
}

void report_case(Report& report, const Settings& cfg, const Case& c, const CaseResult& r) {
  const double params = static_cast<double>(cfg.n), bytes_per_param = c.bytes_per_param();
  const double params_per_s = params / r.m.adam.median;
  const double gbps = params * bytes_per_param / r.m.adam.median / 1e9;
  const double ceiling = params * bytes_per_param / r.m.streams.median / 1e9;
  JsonLine line;
  line.add("bench", "adam").add("optimizer", c.rule.name).add("isa", r.isa).add("n", cfg.n).add("grad", dtype_name(c.grad)).add("out", c.out)
      .add("state", state_label(c.state))
      .add("threads", r.threads).add("bytes_per_param", bytes_per_param)
      .add("median_s", r.m.adam.median).add("min_s", r.m.adam.min).add("max_s", r.m.adam.max)
      .add("params_per_s", params_per_s).add("gbps", gbps).add("ceiling_gbps", ceiling)
      .add("ratio", gbps / ceiling).add("tensors", cfg.tensors).add("reps", cfg.reps);
  std::string row = format("%-8s %-7s %-5s %-5s %-5s %12llu %8llu %4d %10.3f %10.1f %8.1f %8.1f %6.3f", c.rule.name,
                           r.isa.c_str(),
                           std::string(dtype_name(c.grad)).c_str(), c.out.c_str(), state_label(c.state),
                           static_cast<unsigned long long>(cfg.n), static_cast<unsigned long long>(cfg.tensors),
                           r.threads, r.m.adam.median * 1e3, params_per_s / 1e6, gbps, ceiling, gbps / ceiling);
  if (cfg.tensors > 1) {
    line.add("single_array_params_per_s", r.single_params_per_s)
        .add("vs_single_array", params_per_s / r.single_params_per_s);
    row += format("  %10.3f", params_per_s / r.single_params_per_s);
  }
  report.result(line, row + "\n");
}

// Every case of the grid, each reported as soon as it is measured.
Status run(const Settings& cfg, Report& report) {
  report.header(format("%-8s %-7s %-5s %-5s %-5s %12s %8s %4s %10s %10s %8s %8s %6s%s\n", "optimizer", "isa", "grad",
                       "out", "state", "n",
                       "tensors", "thr", "median ms", "Mparam/s", "GB/s", "ceil GB/s", "ratio",
                       cfg.tensors > 1 ? "  vs 1 array" : ""));
  for (const std::string& isa : cfg.isas) {
    CpuAdamOptions engine_options;
    engine_options.isa = isa;
    engine_options.threads = cfg.threads;
    engine_options.tile = cfg.tile;
    Result<CpuAdam> engine = CpuAdam::create(engine_options);
    if (!engine.ok()) return engine.status();
    for (const OptimizerInfo& rule : cfg.optimizers) {
      for (DType grad : cfg.grads) {
        for (const std::string& out : cfg.outs) {
          for (DType state : cfg.states) {
            const Case c{rule, grad, out, state};
            Result<CaseResult> r = run_case(*engine, cfg, c);
            if (!r.ok()) return r.status();
            report_case(report, cfg, c, *r);
          }
        }
      }
    }
  }
  return Status::success();
}

}  // namespace

int bench_adam(std::span<char* const> args) {
  constexpr std::string_view kCommand = "zoe bench adam";
  Texts text;
  const auto options = options_of(text);
  if (Status s = parse_options(args, options); !s.ok()) return fail_message(kCommand, s);
  if (text.help) {
    print_help("usage: zoe bench adam [options]\n\n", options,
               "\nEach case runs the optimizer's step and a streams loop with the same loads and stores\n"
               "alternately; ratio = step GB/s / streams GB/s. Bytes per parameter: p read and written (8), each\n"
               "state array read and written (adamw, adam: m and v; amsgrad: m, v and max v; lion: m; adagrad: the\n"
               "sum; 8 each in fp32, 4 in bf16, 2 in int8 plus 16 bytes of scales per 2048 for m and v), the\n"
               "gradient read and the weight copy written. int8 state is adamw's and adam's only.\n");
    return 0;
  }
  Settings cfg;
  for (auto read : {read_lists, read_counts}) {
    if (Status s = read(text, cfg); !s.ok()) return fail(kCommand, s);
  }
  Report report(kCommand, text.json);
  if (Status s = run(cfg, report); !s.ok()) return fail(kCommand, s);
  return 0;
}

}  // namespace zoe::cli
