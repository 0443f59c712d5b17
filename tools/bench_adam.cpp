// zoe bench adam: CPU Adam step throughput against a streams loop with the same loads and stores, measured
// alternately in the same run (BENCHMARKING.md).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "base/aligned_buffer.h"
#include "tools/args.h"
#include "tools/bench_stats.h"
#include "tools/commands.h"
#include "zoe/adam.h"

namespace zoe::cli {
namespace {

struct BenchConfig {
  std::uint64_t n = 0;
  std::uint64_t tensors = 1;
  int threads = 0;
  int reps = 0;
  std::size_t tile = 0;
  bool json = false;
};

const char* state_label(DType state) { return state == DType::f32 ? "fp32" : state == DType::bf16 ? "bf16" : "int8"; }

// The buffers of one benchmark case: `tensors` separately allocated tensors sharing n elements.
class Workload {
 public:
  static Result<Workload> make(std::uint64_t n, std::uint64_t count, DType grad, bool has_out, DType out,
                               DType state) {
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
      for (void** moment : {&t.exp_avg, &t.exp_avg_sq}) {
        Result<AlignedBuffer> b = AlignedBuffer::allocate(elems * dtype_size(state));
        if (!b.ok()) return b.status();
        std::memset(b->data(), 0, elems * dtype_size(state));  // zero moments in every dtype
        *moment = b->data();
        w.buffers_.push_back(std::move(b).value());
      }
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
    }
    return w;
  }
  std::span<const AdamTensor> tensors() const { return tensors_; }

 private:
  std::vector<AlignedBuffer> buffers_;
  std::vector<AdamTensor> tensors_;
};

struct Measured {
  TimeSummary adam, streams;
};

// Warm-up, then the Adam step and the streams pass alternately, so that both see the same machine state.
Result<Measured> measure(CpuAdam& engine, const Workload& w, int reps) {
  AdamHyper hyper;
  hyper.weight_decay = 0.01f;
  StepOptions options;
  std::vector<double> adam_s, streams_s;
  for (int r = -2; r < reps; ++r) {
    Status s;
    const double ta = time_seconds([&] { s = engine.step(hyper, options, w.tensors()); });
    if (!s.ok()) return s;
    ++options.step;
    const double ts = time_seconds([&] { s = engine.streams_pass(w.tensors()); });
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

}  // namespace

int bench_adam(std::span<char* const> args) {
  std::string n_text = "64M", tensors_text = "1", isa_text = "auto", grad_text = "f32", out_text = "none",
              state_text = "fp32", threads_text = "0", reps_text, tile_text = std::to_string(CpuAdamOptions{}.tile);
  bool json = false, help = false;
  const Option options[] = {
      {"n", &n_text, nullptr, "parameters per step (K, M, G suffixes are powers of 1024)"},
      {"tensors", &tensors_text, nullptr, "split the parameters into this many separately allocated tensors"},
      {"isa", &isa_text, nullptr, "comma list of auto, scalar, avx2, avx512"},
      {"grad", &grad_text, nullptr, "comma list of gradient dtypes: f32, f16, bf16"},
      {"out", &out_text, nullptr, "comma list of weight-copy dtypes: none, f16, bf16"},
      {"state", &state_text, nullptr, "comma list of moment dtypes: fp32, bf16, int8"},
      {"threads", &threads_text, nullptr, "worker threads (0: all CPUs; ZOE_THREADS caps)"},
      {"reps", &reps_text, nullptr, "timed repetitions (default: about 0.5 s of steps, 10 to 200)"},
      {"tile", &tile_text, nullptr, "elements per unit of parallel work"},
      {"json", nullptr, &json, "one JSON object per line on stdout, nothing else"},
      {"help", nullptr, &help, "this help"},
  };
  if (Status s = parse_options(args, options); !s.ok()) {
    std::fprintf(stderr, "zoe bench adam: %s\n", s.message().c_str());
    return 2;
  }
  if (help) {
    std::printf("usage: zoe bench adam [options]\n\n%s", options_help(options).c_str());
    std::printf("\nEach case runs the Adam step and a streams loop with the same loads and stores alternately;\n"
                "ratio = Adam GB/s / streams GB/s. Bytes per parameter: p read and written (8), m and v read and\n"
                "written (16 in fp32, 8 in bf16, 4 in int8 plus 16 bytes of scales per 2048), the gradient read and\n"
                "the weight copy written.\n");
    return 0;
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "zoe bench adam: %s\n", s.to_string().c_str());
    return exit_status(s);
  };
  BenchConfig cfg;
  cfg.json = json;
  Result<std::uint64_t> n = parse_count(n_text, "--n");
  Result<std::uint64_t> tensors = parse_count(tensors_text, "--tensors");
  Result<std::uint64_t> threads = parse_count(threads_text, "--threads");
  Result<std::uint64_t> tile = parse_count(tile_text, "--tile");
  for (const Status& s : {n.status(), tensors.status(), threads.status(), tile.status()}) {
    if (!s.ok()) return fail(s);
  }
  cfg.n = n.value();
  if (Status s = require_at_least(cfg.n, 1, "--n", "parameters per step; 0 has no throughput"); !s.ok()) return fail(s);
  cfg.tensors = tensors.value();
  cfg.threads = static_cast<int>(threads.value());
  cfg.tile = tile.value();
  if (cfg.tensors == 0 || cfg.tensors > cfg.n) {
    return fail(invalid_argument("--tensors " + tensors_text + " must be between 1 and --n"));
  }
  cfg.reps = default_reps(cfg.n);
  if (!reps_text.empty()) {
    Result<std::uint64_t> reps = parse_count(reps_text, "--reps");
    if (!reps.ok()) return fail(reps.status());
    if (Status s = require_at_least(reps.value(), 1, "--reps", "timed repetitions"); !s.ok()) return fail(s);
    cfg.reps = static_cast<int>(reps.value());
  }
  const std::vector<std::string> isas = split_list(isa_text), grad_names = split_list(grad_text),
                                 outs = split_list(out_text), state_names = split_list(state_text);
  for (const Status& s : {require_items(isas, "--isa", "auto, scalar, avx2, avx512"),
                          require_items(grad_names, "--grad", "f32, f16, bf16"),
                          require_items(outs, "--out", "none, f16, bf16"),
                          require_items(state_names, "--state", "fp32, bf16, int8")}) {
    if (!s.ok()) return fail(s);
  }
  std::vector<DType> states;
  for (const std::string& st : state_names) {
    const auto d = st == "int8" || st == "i8" ? std::optional<DType>(DType::i8) : parse_dtype(st);
    if (!d || *d == DType::f16) return fail(invalid_argument("--state " + st + " is not fp32, bf16 or int8"));
    states.push_back(*d);
  }
  std::vector<DType> grads;
  for (const std::string& g : grad_names) {
    const auto d = parse_dtype(g);
    if (!d) return fail(invalid_argument("--grad " + g + " is not f32, f16 or bf16"));
    grads.push_back(*d);
  }
  for (const std::string& o : outs) {
    if (o != "none" && o != "f16" && o != "bf16") return fail(invalid_argument("--out " + o + " is not none, f16 or bf16"));
  }

  bool header = false;
  for (const std::string& isa : isas) {
    CpuAdamOptions engine_options;
    engine_options.isa = isa;
    engine_options.threads = cfg.threads;
    engine_options.tile = cfg.tile;
    Result<CpuAdam> engine = CpuAdam::create(engine_options);
    if (!engine.ok()) return fail(engine.status());
    for (DType grad : grads) {
      for (const std::string& out : outs) {
        for (DType state : states) {
          const bool has_out = out != "none";
          const DType out_dtype = out == "f16" ? DType::f16 : DType::bf16;
          const double scale_bytes = state == DType::i8 ? 2.0 * 2.0 * 4.0 / kMomentBlock : 0.0;
          const double bytes_per_param = 8.0 + 4.0 * static_cast<double>(dtype_size(state)) + scale_bytes +
                                         static_cast<double>(dtype_size(grad)) + (has_out ? 2.0 : 0.0);
          Result<Workload> w = Workload::make(cfg.n, cfg.tensors, grad, has_out, out_dtype, state);
          if (!w.ok()) return fail(w.status());
          Result<Measured> m = measure(*engine, *w, cfg.reps);
          if (!m.ok()) return fail(m.status());
          const double params = static_cast<double>(cfg.n);
          const double params_per_s = params / m->adam.median;
          const double gbps = params * bytes_per_param / m->adam.median / 1e9;
          const double ceiling = params * bytes_per_param / m->streams.median / 1e9;
          // Many tensors: the same parameters as one array, in the same run, for the ratio between the two.
          double single_params_per_s = 0;
          if (cfg.tensors > 1) {
            Result<Workload> single = Workload::make(cfg.n, 1, grad, has_out, out_dtype, state);
            if (!single.ok()) return fail(single.status());
            Result<Measured> ms = measure(*engine, *single, cfg.reps);
            if (!ms.ok()) return fail(ms.status());
            single_params_per_s = params / ms->adam.median;
          }
          const std::string isa_used(isa_name(engine->isa()));
          if (cfg.json) {
            JsonLine line;
            line.add("bench", "adam").add("isa", isa_used).add("n", cfg.n).add("grad", dtype_name(grad)).add("out", out)
                .add("state", state_label(state))
                .add("threads", engine->threads()).add("bytes_per_param", bytes_per_param)
                .add("median_s", m->adam.median).add("min_s", m->adam.min).add("max_s", m->adam.max)
                .add("params_per_s", params_per_s).add("gbps", gbps).add("ceiling_gbps", ceiling)
                .add("ratio", gbps / ceiling).add("tensors", cfg.tensors).add("reps", cfg.reps);
            if (cfg.tensors > 1) {
              line.add("single_array_params_per_s", single_params_per_s)
                  .add("vs_single_array", params_per_s / single_params_per_s);
            }
            std::printf("%s\n", line.str().c_str());
          } else {
            if (!header) {
              std::printf("%-7s %-5s %-5s %-5s %12s %8s %4s %10s %10s %8s %8s %6s%s\n", "isa", "grad", "out", "state", "n", "tensors",
                          "thr", "median ms", "Mparam/s", "GB/s", "ceil GB/s", "ratio",
                          cfg.tensors > 1 ? "  vs 1 array" : "");
              header = true;
            }
            std::printf("%-7s %-5s %-5s %-5s %12llu %8llu %4d %10.3f %10.1f %8.1f %8.1f %6.3f", isa_used.c_str(),
                        std::string(dtype_name(grad)).c_str(), out.c_str(), state_label(state),
                        static_cast<unsigned long long>(cfg.n),
                        static_cast<unsigned long long>(cfg.tensors), engine->threads(), m->adam.median * 1e3,
                        params_per_s / 1e6, gbps, ceiling, gbps / ceiling);
            if (cfg.tensors > 1) std::printf("  %10.3f", params_per_s / single_params_per_s);
            std::printf("\n");
          }
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}

}  // namespace zoe::cli
