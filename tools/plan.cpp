// zoe plan: sizes a run — bytes per GPU, per host and per NVMe path by kind, whether it fits, the cheapest
// placement that does, the optimizer step it should take, and its DeepSpeed-style config. The arithmetic is
// src/plan/plan.h; this file reads the command line, measures what it is not given (CPU Adam here, NVMe with
// zoe probe's measurement) and prints.
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "base/aligned_buffer.h"
#include "tools/args.h"
#include "tools/commands.h"
#ifdef ZOE_HAVE_AIO
#include "tools/probe.h"
#endif
#include "src/plan/plan.h"
#include "zoe/adam.h"
#include "zoe/config.h"

namespace zoe::cli {
namespace {

using Json = nlohmann::ordered_json;
using namespace zoe::plan;  // NOLINT: the planner's vocabulary

constexpr double kAssumedPcieGbps = 25;   // PCIe 4.0 x16, what a pinned copy reaches in practice
constexpr double kAssumedNvmeGbps = 2;    // a single PCIe 3/4 NVMe drive, reading and writing (no libaio build)
constexpr std::uint64_t kAssumedGpuMem = 80ull << 30;

struct Figure {
  double value = 0;
  std::string how;  // "measured: ...", "given", "assumed: ..."
};

// CPU Adam as the offloaded step runs it (fp32 state, bf16 gradients in, bf16 weights out) over 16M
// parameters on every core: the median of 3 steps after one warm-up.
Result<Figure> measure_adam() {
  constexpr std::size_t n = 16 << 20;
  Result<CpuAdam> adam = CpuAdam::create();
  if (!adam.ok()) return adam.status();
  std::vector<Result<AlignedBuffer>> bufs;
  for (std::size_t bytes : {4 * n, 4 * n, 4 * n, 2 * n, 2 * n}) bufs.push_back(AlignedBuffer::allocate(bytes));
  for (auto& b : bufs) {
    if (!b.ok()) return b.status();
    std::memset(b->data(), 0, b->size());
  }
  AdamTensor t{bufs[0]->as<float>(), bufs[1]->as<float>(), bufs[2]->as<float>(), DType::f32, bufs[3]->data(), DType::bf16,
               bufs[4]->data(), DType::bf16, n};
  std::vector<double> times;
  for (int rep = 0; rep < 4; ++rep) {
    StepOptions o;
    o.step = rep + 1;
    const auto t0 = std::chrono::steady_clock::now();
    if (Status s = adam->step(AdamHyper{}, o, t); !s.ok()) return s;
    if (rep > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return Figure{n / times[1], "measured on this CPU: " + std::string(isa_name(adam->isa())) + ", " +
                                  std::to_string(adam->threads()) + " threads, 16M parameters"};
}

std::uint64_t free_bytes(const std::string& path) {
  struct statvfs st {};
  if (::statvfs(path.c_str(), &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
}

std::uint64_t physical_ram() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

std::string human(std::uint64_t bytes) { return bytes == 0 ? "-" : format_bytes(bytes); }

Json bytes_json(const Bytes& b) {
  return Json{{"weights16", b.weights16}, {"grads16", b.grads16}, {"master32", b.master32}, {"moments", b.moments},
              {"buffers", b.buffers},     {"activations", b.activations}, {"total", b.total()}};
}

struct Inputs {
  Model model;
  Cluster cluster;
  Training training;
  std::string gpu_mem_how, host_ram_how, capacity_how;
};

struct Evaluated {
  Placement placement;
  Usage usage;
  Verdict verdict;
};

Evaluated evaluate(const Inputs& in, const Placement& p) {
  Evaluated e{p, usage(in.model, in.cluster, p, in.training), {}};
  e.verdict = check(e.usage, in.cluster);
  return e;
}

// What zoe's own config reader says of an emitted config: nothing, for a placement zoe runs.
std::vector<std::string> reader_notes(const std::string& config) {
  Result<LoadedConfig> loaded = parse_config(config, "the plan's config");
  if (!loaded.ok()) return {"zoe's config reader refuses it: " + loaded.status().message()};
  return loaded->notes;
}

Json placement_json(const Inputs& in, const Evaluated& e, const Rates& rates) {
  const StepEstimate step = estimate_step(in.model, in.cluster, e.placement, in.training, rates);
  const std::string gap = zoe_gap(e.placement);
  Json j{{"stage", e.placement.stage},
         {"offload_optimizer", offload_name(e.placement.optimizer)},
         {"offload_param", offload_name(e.placement.param)},
         {"fits", e.verdict.fits},
         {"why_not", e.verdict.why},
         {"zoe_runs_it", gap.empty()},
         {"zoe_gap", gap},
         {"per_gpu_bytes", bytes_json(e.usage.per_gpu)},
         {"per_host_bytes", bytes_json(e.usage.per_host)},
         {"per_nvme_bytes", bytes_json(e.usage.per_nvme_path)},
         {"usable_gpu_bytes", usable_gpu(in.cluster)},
         {"usable_host_bytes", usable_host(in.cluster)},
         {"step_s_estimate", step.total_s},
         {"step", {{"cpu_adam_s", step.cpu_adam_s}, {"nvme_s", step.nvme_s}, {"pcie_s", step.pcie_s},
                   {"nvme_read_bytes_per_node", step.nvme_read_bytes},
                   {"nvme_write_bytes_per_node", step.nvme_write_bytes}, {"pcie_bytes_per_gpu", step.pcie_bytes}}}};
  const std::string config = deepspeed_config(e.placement, in.cluster, in.training);
  j["config"] = Json::parse(config);
  j["config_notes"] = reader_notes(config);
  return j;
}

void print_placement(const Inputs& in, const Evaluated& e, const Rates& rates, const char* label) {
  std::printf("\n%s: %s -> %s\n", label, placement_name(e.placement).c_str(),
              e.verdict.fits ? "fits" : ("does not fit (" + e.verdict.why + ")").c_str());
  const Usage& u = e.usage;
  std::printf("  %-12s %14s %14s %14s\n", "", "per GPU", "per host", "per NVMe path");
  auto row = [](const char* kind, std::uint64_t g, std::uint64_t h, std::uint64_t n) {
    std::printf("  %-12s %14s %14s %14s\n", kind, human(g).c_str(), human(h).c_str(), human(n).c_str());
  };
  row("weights16", u.per_gpu.weights16, u.per_host.weights16, u.per_nvme_path.weights16);
  row("grads16", u.per_gpu.grads16, u.per_host.grads16, u.per_nvme_path.grads16);
  row("master32", u.per_gpu.master32, u.per_host.master32, u.per_nvme_path.master32);
  row("moments", u.per_gpu.moments, u.per_host.moments, u.per_nvme_path.moments);
  row("buffers", u.per_gpu.buffers, u.per_host.buffers, u.per_nvme_path.buffers);
  if (u.per_gpu.activations > 0) row("activations", u.per_gpu.activations, 0, 0);  // an estimate, said below
  row("total", u.per_gpu.total(), u.per_host.total(), u.per_nvme_path.total());
  const std::uint64_t capacity = in.cluster.nvme_capacity.empty() ? 0 : in.cluster.nvme_capacity[0];
  row("usable", usable_gpu(in.cluster), usable_host(in.cluster), capacity);
  const std::string gap = zoe_gap(e.placement);
  std::printf("  zoe: %s\n", gap.empty() ? "runs this placement" : ("cannot run it as planned: " + gap).c_str());
  const StepEstimate s = estimate_step(in.model, in.cluster, e.placement, in.training, rates);
  if (e.placement.optimizer == Offload::none) {
    std::printf("  optimizer step: on the GPU (not estimated)\n");
  } else {
    std::printf("  optimizer step estimate: %.3f s = max(CPU Adam %.3f s, NVMe %.3f s) + PCIe %.3f s\n", s.total_s,
                s.cpu_adam_s, s.nvme_s, s.pcie_s);
    if (s.nvme_read_bytes > 0) {
      std::printf("    NVMe per node per step: %s read, %s written\n", human(s.nvme_read_bytes).c_str(),
                  human(s.nvme_write_bytes).c_str());
    }
    if (s.pcie_bytes > 0) std::printf("    PCIe per GPU per step: %s (sync schedule; overlap and delayed hide it)\n", human(s.pcie_bytes).c_str());
  }
}

const char* kUsage =
    "usage: zoe plan (--params N | --model CONFIG.json) [options]\n\n"
    "Sizes a training run with ZeRO partitioning and zoe's offload: bytes per GPU, per host and per NVMe path\n"
    "by kind (16-bit weights and gradients, fp32 master, moments, zoe's buffers, activations), whether the\n"
    "placement fits, the cheapest one that does (least offload first), the optimizer step it should take,\n"
    "and a DeepSpeed-style config. Memory follows the ZeRO paper (Rajbhandari et al., 2020); activations\n"
    "(with --micro-batch and --seq-len) are an estimate after Korthikanti et al., 2022.\n"
    "Parameter counts take decimal suffixes (350M, 7.5B, 1T); byte sizes binary ones (80G = 80 GiB).\n"
    "--nvme takes one or more paths (or a comma list). Without --stage/--offload-*, the cheapest fitting\n"
    "placement is reported.\n\noptions:\n";

}  // namespace

int plan(std::span<char* const> args) {
  std::string params_text, model_path, gpus = "1", nodes = "1", gpu_mem, host_ram, nvme_capacity, stage_text,
      offload_opt, offload_param, state_dtype = "fp32", prefetch = "2", grad_accum = "1", micro_batch, seq_len,
      adam_rate, nvme_gbps, pcie_gbps;
  bool json = false, checkpointing = false, help = false;
  // --nvme takes every path up to the next option.
  std::vector<std::string> nvme_paths;
  std::vector<char*> rest;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (std::string_view(args[i]) == "--nvme") {
      while (i + 1 < args.size() && !std::string_view(args[i + 1]).starts_with("--")) {
        for (const std::string& p : split_list(args[++i])) nvme_paths.push_back(p);
      }
      continue;
    }
    rest.push_back(args[i]);
  }
  const Option options[] = {
      {"params", &params_text, nullptr, "parameter count (350M, 7.5B, 1T)"},
      {"model", &model_path, nullptr, "a Hugging Face-style config.json instead of --params"},
      {"gpus", &gpus, nullptr, "GPUs per node"},
      {"nodes", &nodes, nullptr, "nodes"},
      {"gpu-mem", &gpu_mem, nullptr, "memory per GPU (default 80G, assumed)"},
      {"host-ram", &host_ram, nullptr, "RAM per node (default: this machine's)"},
      {"nvme-capacity", &nvme_capacity, nullptr, "bytes each --nvme path may hold (default: its free space)"},
      {"stage", &stage_text, nullptr, "ZeRO stage 1, 2 or 3 (with --offload-*: the placement to size)"},
      {"offload-optimizer", &offload_opt, nullptr, "none, cpu or nvme"},
      {"offload-param", &offload_param, nullptr, "none, cpu or nvme (needs stage 3)"},
      {"state-dtype", &state_dtype, nullptr, "the moments: fp32, bf16 or int8 (the master stays fp32)"},
      {"prefetch", &prefetch, nullptr, "modules fetched ahead (stage 3, parameter offload)"},
      {"grad-accum", &grad_accum, nullptr, "micro-batches per step (> 1: zoe's fp32 sums on the host)"},
      {"micro-batch", &micro_batch, nullptr, "sequences per GPU per micro-batch (activation estimate)"},
      {"seq-len", &seq_len, nullptr, "tokens per sequence (activation estimate)"},
      {"activation-checkpointing", nullptr, &checkpointing, "full activation checkpointing (activation estimate)"},
      {"adam-rate", &adam_rate, nullptr, "CPU Adam parameters/s per node (default: measured here)"},
      {"nvme-gbps", &nvme_gbps, nullptr, "NVMe GB/s per path, each direction (default: measured on the --nvme paths)"},
      {"pcie-gbps", &pcie_gbps, nullptr, "host-GPU GB/s per GPU (default 25, assumed)"},
      {"json", nullptr, &json, "one JSON object on stdout"},
      {"help", nullptr, &help, "this text"},
  };
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "zoe plan: %s\n", s.message().c_str());
    return exit_status(s);
  };
  if (Status s = parse_options(rest, options); !s.ok()) return fail(s);
  if (help) {
    std::printf("%s%s  --nvme PATH...           NVMe folders for swap files\n", kUsage, options_help(options).c_str());
    return 0;
  }
  Inputs in;
  if (params_text.empty() == model_path.empty()) {
    return fail(invalid_argument("give the model as --params N (e.g. 7.5B) or --model CONFIG.json, one of them"));
  }
  if (!params_text.empty()) {
    Result<std::uint64_t> n = parse_param_count(params_text);
    if (!n.ok()) return fail(n.status());
    if (*n == 0) return fail(invalid_argument("--params: 0 parameters need no plan"));
    in.model = model_from_params(*n);
  } else {
    std::ifstream f(model_path);
    if (!f) return fail(invalid_argument("--model: cannot read " + model_path));
    std::stringstream text;
    text << f.rdbuf();
    Result<Model> m = model_from_config(text.str(), model_path);
    if (!m.ok()) return fail(m.status());
    in.model = *m;
  }
  auto count = [](const std::string& text, const char* option, std::uint64_t min, std::uint64_t* out) {
    Result<std::uint64_t> v = parse_count(text, option);
    if (!v.ok()) return v.status();
    if (Status s = require_at_least(*v, min, option, "of them"); !s.ok()) return s;
    *out = *v;
    return Status::success();
  };
  Cluster& c = in.cluster;
  Training& t = in.training;
  for (Status s : {count(gpus, "--gpus", 1, &c.gpus_per_node), count(nodes, "--nodes", 1, &c.nodes),
                   count(prefetch, "--prefetch", 0, &t.prefetch), count(grad_accum, "--grad-accum", 1, &t.grad_accumulation)}) {
    if (!s.ok()) return fail(s);
  }
  if (!micro_batch.empty()) {
    if (Status s = count(micro_batch, "--micro-batch", 1, &t.micro_batch); !s.ok()) return fail(s);
  }
  if (!seq_len.empty()) {
    if (Status s = count(seq_len, "--seq-len", 1, &t.seq_len); !s.ok()) return fail(s);
  }
  t.activation_checkpointing = checkpointing;
  Result<StateDtype> sd = plan::parse_state_dtype(state_dtype);
  if (!sd.ok()) return fail(sd.status());
  t.state = *sd;
  // A size given on the command line, else the default and how it was obtained.
  auto size = [](const std::string& text, const char* option, std::uint64_t fallback, const char* fallback_how,
                 std::uint64_t* out, std::string* how) {
    *out = fallback;
    *how = fallback_how;
    if (text.empty()) return Status::success();
    Result<std::uint64_t> b = parse_bytes(text, option);
    if (!b.ok()) return b.status();
    if (*b == 0) return invalid_argument(std::string(option) + ": 0 bytes");
    *out = *b;
    *how = "given";
    return Status::success();
  };
  for (Status s : {size(gpu_mem, "--gpu-mem", kAssumedGpuMem, "assumed", &c.gpu_mem, &in.gpu_mem_how),
                   size(host_ram, "--host-ram", physical_ram(), "this machine's", &c.host_ram, &in.host_ram_how)}) {
    if (!s.ok()) return fail(s);
  }
  c.nvme_paths = nvme_paths;
  std::uint64_t capacity = 0;
  if (!nvme_capacity.empty()) {
    Result<std::uint64_t> b = parse_bytes(nvme_capacity, "--nvme-capacity");
    if (!b.ok()) return fail(b.status());
    capacity = *b;
  }
  for (const std::string& p : c.nvme_paths) {
    if (::access(p.c_str(), F_OK) != 0) return fail(invalid_argument("--nvme: " + p + " does not exist"));
    c.nvme_capacity.push_back(nvme_capacity.empty() ? free_bytes(p) : capacity);
  }
  in.capacity_how = nvme_capacity.empty() ? "free space" : "given";

  // The placement asked for, if any; every candidate, least offload first; the cheapest that fits.
  const bool requested = !stage_text.empty() || !offload_opt.empty() || !offload_param.empty();
  Placement asked;
  if (!offload_opt.empty()) {
    Result<Offload> o = parse_offload(offload_opt, "--offload-optimizer");
    if (!o.ok()) return fail(o.status());
    asked.optimizer = *o;
  }
  if (!offload_param.empty()) {
    Result<Offload> o = parse_offload(offload_param, "--offload-param");
    if (!o.ok()) return fail(o.status());
    asked.param = *o;
  }
  asked.stage = asked.param != Offload::none ? 3 : 2;
  if (!stage_text.empty()) {
    if (stage_text != "1" && stage_text != "2" && stage_text != "3") {
      return fail(invalid_argument("--stage: '" + stage_text + "' is not 1, 2 or 3"));
    }
    asked.stage = stage_text[0] - '0';
  }
  if (asked.param != Offload::none && asked.stage != 3) {
    return fail(invalid_argument("--offload-param " + std::string(offload_name(asked.param)) +
                                 " needs --stage 3: parameters are offloaded as stage 3 partitions them"));
  }
  std::vector<Evaluated> all;
  for (const Placement& p : candidates()) all.push_back(evaluate(in, p));
  const auto cheapest = std::find_if(all.begin(), all.end(), [](const Evaluated& e) { return e.verdict.fits; });
  const auto zoe_cheapest = std::find_if(all.begin(), all.end(), [&in](const Evaluated& e) {
    return e.verdict.fits && zoe_gap(e.placement).empty();
  });
  const Evaluated shown = requested ? evaluate(in, asked) : cheapest != all.end() ? *cheapest : all.back();

  // Rates: given, or measured when a shown placement needs them.
  Rates rates;
  Figure adam, nvme, pcie{kAssumedPcieGbps, "assumed: PCIe 4.0 x16"};
  auto needs = [&](auto pred) {
    return pred(shown.placement) || (cheapest != all.end() && pred(cheapest->placement)) ||
           (zoe_cheapest != all.end() && pred(zoe_cheapest->placement));
  };
  if (!adam_rate.empty()) {
    Result<std::uint64_t> r = parse_param_count(adam_rate);
    if (!r.ok() || *r == 0) return fail(invalid_argument("--adam-rate: '" + adam_rate + "' is not a rate (e.g. 2B)"));
    adam = {static_cast<double>(*r), "given"};
  } else if (needs([](const Placement& p) { return p.optimizer != Offload::none; })) {
    if (!json) std::fprintf(stderr, "zoe plan: measuring CPU Adam (pass --adam-rate to skip)...\n");
    Result<Figure> m = measure_adam();
    if (!m.ok()) return fail(m.status());
    adam = *m;
  }
  auto gbps = [](const std::string& text, const char* option, Figure* out) {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !(v > 0)) return invalid_argument(std::string(option) + ": '" + text + "' is not a rate in GB/s");
    *out = {v, "given"};
    return Status::success();
  };
  if (!pcie_gbps.empty()) {
    if (Status s = gbps(pcie_gbps, "--pcie-gbps", &pcie); !s.ok()) return fail(s);
  }
  Figure nvme_write;
  if (!nvme_gbps.empty()) {
    if (Status s = gbps(nvme_gbps, "--nvme-gbps", &nvme); !s.ok()) return fail(s);
    nvme_write = nvme;
  } else if (needs([](const Placement& p) { return p.optimizer == Offload::nvme || p.param == Offload::nvme; })) {
    nvme = nvme_write = {kAssumedNvmeGbps, "assumed: one NVMe drive per path (pass --nvme-gbps)"};
#ifdef ZOE_HAVE_AIO
    // zoe probe's test on each path (256 MiB); the estimate takes their mean per path.
    if (!c.nvme_paths.empty()) {
      if (!json) std::fprintf(stderr, "zoe plan: measuring the NVMe paths (pass --nvme-gbps to skip)...\n");
      double read = 0, write = 0;
      for (const std::string& p : c.nvme_paths) {
        double w = 0, r = 0;
        if (Status s = measure_path(p, 256 << 20, &w, &r); !s.ok()) return fail(s);
        read += r / c.nvme_paths.size();
        write += w / c.nvme_paths.size();
      }
      nvme = {read, "measured with zoe probe's test, 256 MiB per path"};
      nvme_write = {write, nvme.how};
    }
#endif
  }
  rates.adam_params_per_s = adam.value;
  rates.nvme_read_gbps = nvme.value;
  rates.nvme_write_gbps = nvme_write.value;
  rates.pcie_gbps = pcie.value;

  const Model& m = in.model;
  if (json) {
    Json out{{"command", "plan"},
             {"params", m.params},
             {"model", m.description},
             {"shape_assumed", m.shape_assumed},
             {"gpus_per_node", c.gpus_per_node},
             {"nodes", c.nodes},
             {"ranks", c.ranks()},
             {"gpu_mem_bytes", c.gpu_mem},
             {"host_ram_bytes", c.host_ram},
             {"nvme_paths", c.nvme_paths},
             {"nvme_capacity_bytes", c.nvme_capacity},
             {"state_dtype", state_dtype_name(t.state)},
             {"requested", requested}};
    const Json shown_json = placement_json(in, shown, rates);
    for (const auto& [k, v] : shown_json.items()) out[k] = v;
    out["cheapest"] = cheapest != all.end() ? placement_json(in, *cheapest, rates) : Json(nullptr);
    out["cheapest_zoe_runs"] = zoe_cheapest != all.end() ? placement_json(in, *zoe_cheapest, rates) : Json(nullptr);
    Json cands = Json::array();
    for (const Evaluated& e : all) {
      cands.push_back({{"stage", e.placement.stage}, {"offload_optimizer", offload_name(e.placement.optimizer)},
                       {"offload_param", offload_name(e.placement.param)}, {"fits", e.verdict.fits},
                       {"why_not", e.verdict.why}});
    }
    out["candidates"] = cands;
    out["rates"] = {{"adam_params_per_s", adam.value}, {"adam", adam.how}, {"nvme_read_gbps", nvme.value},
                    {"nvme_write_gbps", nvme_write.value}, {"nvme", nvme.how}, {"pcie_gbps", pcie.value},
                    {"pcie", pcie.how}};
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("zoe plan: %s\n", m.description.c_str());
  std::printf("cluster: %llu GPUs (%llu per node x %llu nodes), %s per GPU (%s), %s RAM per node (%s)\n",
              static_cast<unsigned long long>(c.ranks()), static_cast<unsigned long long>(c.gpus_per_node),
              static_cast<unsigned long long>(c.nodes), human(c.gpu_mem).c_str(), in.gpu_mem_how.c_str(),
              human(c.host_ram).c_str(), in.host_ram_how.c_str());
  for (std::size_t i = 0; i < c.nvme_paths.size(); ++i) {
    std::printf("NVMe path %s: %s (%s)\n", c.nvme_paths[i].c_str(), human(c.nvme_capacity[i]).c_str(), in.capacity_how.c_str());
  }
  std::printf("optimizer state: fp32 master + %s moments (%.2f bytes per parameter)\n", state_dtype_name(t.state).data(),
              4 + moment_bytes(1 << 20, t.state) / double(1 << 20));
  print_placement(in, shown, rates,
                  requested ? "requested" : cheapest != all.end() ? "cheapest placement that fits" : "nothing fits; the most offloaded");
  if (adam.value > 0) std::printf("  CPU Adam: %.2f billion parameters/s per node (%s)\n", adam.value / 1e9, adam.how.c_str());
  if (nvme.value > 0) {
    std::printf("  NVMe: %.2f GB/s read, %.2f GB/s write per path (%s)\n", nvme.value, nvme_write.value, nvme.how.c_str());
  }
  std::printf("  PCIe: %.3g GB/s per GPU (%s)\n", pcie.value, pcie.how.c_str());
  if (m.shape_assumed) {
    std::printf("  the fetch window (buffers per GPU) uses the assumed shape's largest tensor: --model gives the real one\n");
  }
  if (t.micro_batch == 0 || t.seq_len == 0) {
    std::printf("  activations are not included: --micro-batch and --seq-len give an estimate\n");
  } else {
    std::printf("  activations are an estimate (Korthikanti et al., 2022: s b h (34 + 5 a s / h) bytes a layer%s)\n",
                t.activation_checkpointing ? "; checkpointed: each layer's input and one layer's" : "");
  }
  if (requested && cheapest != all.end()) {
    std::printf("\ncheapest placement that fits: %s\n", placement_name(cheapest->placement).c_str());
  }
  if (zoe_cheapest != all.end() && zoe_cheapest != cheapest) {
    std::printf("cheapest placement that fits and zoe runs: %s (optimizer step estimate %.3f s)\n",
                placement_name(zoe_cheapest->placement).c_str(),
                estimate_step(m, c, zoe_cheapest->placement, t, rates).total_s);
  }
  std::printf("\nplacements, least offload first:\n");
  for (const Evaluated& e : all) {
    std::printf("  %-40s %s%s\n", placement_name(e.placement).c_str(), e.verdict.fits ? "fits" : e.verdict.why.c_str(),
                cheapest != all.end() && &e == &*cheapest ? "   <- cheapest" : "");
  }
  if (cheapest == all.end()) std::printf("  nothing fits: more GPUs or nodes, more host RAM, or NVMe paths (--nvme)\n");
  const std::string config = deepspeed_config(shown.placement, c, t);
  std::printf("\nconfig (%s):\n%s\n", placement_name(shown.placement).c_str(), config.c_str());
  const std::vector<std::string> notes = reader_notes(config);
  std::printf("zoe's config reader: %s\n", notes.empty() ? "loads it without notes" : "loads it with these notes:");
  for (const std::string& n : notes) std::printf("  %s\n", n.c_str());
  return 0;
}

}  // namespace zoe::cli
