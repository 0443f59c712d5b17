// zoe plan: sizes a run — bytes per GPU, per host and per NVMe path by kind, whether it fits, the cheapest
// placement that does, the optimizer step it should take, and its DeepSpeed-style config. The arithmetic is
// src/plan/plan.h; this file reads the command line, measures what it is not given (CPU Adam here, NVMe with
// zoe probe's measurement) and searches the placements; tools/plan_report.cpp prints.
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tools/args.h"
#include "tools/commands.h"
#include "tools/report.h"
#include "zoe/aligned_buffer.h"
#ifdef ZOE_HAVE_AIO
#include "tools/probe.h"
#endif
#include "tools/plan.h"
#include "zoe/adam.h"

namespace zoe::cli {
namespace {

using namespace zoe::plan;      // NOLINT: the planner's vocabulary
using namespace zoe::cli::planning;  // NOLINT: the command's

constexpr double kAssumedNvmeGbps = 2;    // a single PCIe 3/4 NVMe drive, reading and writing (no libaio build)
constexpr std::uint64_t kAssumedGpuMem = 80ull << 30;
// --gpu-mem, --host-ram, --nvme-capacity at most 1024T (2^50 bytes): sums of them stay inside 64 bits.
constexpr std::uint64_t kMaxBytes = std::uint64_t{1} << 50;
// --model: a Hugging Face config.json is a few KiB; 16M is far past any, and keeps /dev/zero from filling memory.
constexpr std::uint64_t kMaxConfigBytes = 16 << 20;

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

Evaluated evaluate(const Inputs& in, const Placement& p) {
  Evaluated e{p, usage(in.model, in.cluster, p, in.training), {}};
  e.verdict = check(e.usage, in.cluster);
  return e;
}

const char* kUsage =
    "usage: zoe plan (--params N | --model CONFIG.json) [options]\n\n"
    "Sizes a training run with ZeRO partitioning and zoe's offload: bytes per GPU, per host and per NVMe path\n"
    "by kind, whether the placement fits, the cheapest one that does (least offload first), the optimizer\n"
    "step it should take (with the NVMe traffic of the swap store and the parameter tier), and a DeepSpeed-\n"
    "style config. It counts the model's states (ZeRO paper, Rajbhandari et al., 2020), what the trainer\n"
    "holds (its 16-bit gradients: FSDP2's shards on the GPU, in host RAM with --grads-on-host or --gpus 0;\n"
    "FSDP2's gathered modules; activations with --micro-batch and --seq-len, after Korthikanti et al., 2022)\n"
    "and what zoe allocates: the swap store's two slots per tile, the parameter tier's two slots per entry,\n"
    "its pool and bounce buffers, the step's staging or windows (docs/cli.md, \"Sizing a run\").\n"
    "--gpus 0 describes a machine without a GPU: the CPU is the device (one rank per node), everything is in\n"
    "host RAM, and the step estimate has no PCIe.\n"
    "Parameter counts take decimal suffixes (350M, 7.5B, 1T); byte sizes binary ones (80G = 80 GiB).\n"
    "--nvme takes one or more paths (or a comma list). Without --stage/--offload-*, the cheapest fitting\n"
    "placement is reported.\n\noptions:\n";

// The command line as given, with the defaults.
struct Texts {
  std::string params, model, gpus = "1", nodes = "1", gpu_mem, host_ram, nvme_capacity, stage, offload_opt, offload_param,
      state_dtype = "fp32", optimizer = "adam", prefetch = "2", grad_accum = "1", micro_batch, seq_len, adam_rate, nvme_gbps, pcie_gbps;
  bool json = false, checkpointing = false, grads_on_host = false, spill_grads = false, help = false;
  std::vector<std::string> nvme_paths;
};

std::array<Option, 24> options_of(Texts& t) {
  return {{
      {"params", &t.params, nullptr, "parameter count, 1 to 100T (350M, 7.5B, 1T)"},
      {"model", &t.model, nullptr, "a Hugging Face-style config.json instead of --params"},
      {"gpus", &t.gpus, nullptr, "GPUs per node, 0 to 1024 (0: no GPU, the CPU is the device)"},
      {"nodes", &t.nodes, nullptr, "nodes, 1 to 64K"},
      {"gpu-mem", &t.gpu_mem, nullptr, "memory per GPU, 1 to 1024T (default 80G, assumed)"},
      {"host-ram", &t.host_ram, nullptr, "RAM per node, 1 to 1024T (default: this machine's)"},
      {"nvme-capacity", &t.nvme_capacity, nullptr, "bytes each --nvme path may hold, 0 to 1024T (default: its free space)"},
      {"stage", &t.stage, nullptr, "ZeRO stage 1, 2 or 3 (with --offload-*: the placement to size)"},
      {"offload-optimizer", &t.offload_opt, nullptr, "none, cpu or nvme"},
      {"offload-param", &t.offload_param, nullptr, "none, cpu or nvme (needs stage 3)"},
      {"state-dtype", &t.state_dtype, nullptr, "the moments: fp32, bf16 or int8 (the master stays fp32)"},
      {"optimizer", &t.optimizer, nullptr, "adam (AdamW), lion or adagrad: its state arrays (Adam 2, Lion and Adagrad 1)"},
      {"prefetch", &t.prefetch, nullptr, "modules fetched ahead, 0 to 32 (stage 3, parameter offload)"},
      {"grad-accum", &t.grad_accum, nullptr, "micro-batches per step, 1 to 64K (> 1: zoe's fp32 sums on the host)"},
      {"micro-batch", &t.micro_batch, nullptr, "sequences per GPU per micro-batch, 1 to 64K (activation estimate)"},
      {"seq-len", &t.seq_len, nullptr, "tokens per sequence, 1 to 16M (activation estimate)"},
      {"activation-checkpointing", nullptr, &t.checkpointing, "full activation checkpointing (activation estimate)"},
      {"grads-on-host", nullptr, &t.grads_on_host, "stage 3: FSDP2's CPUOffloadPolicy keeps the gradient shards in host RAM"},
      {"spill-grads", nullptr, &t.spill_grads, "stage 3, optimizer on NVMe: zoe spills the gradient shards to NVMe (spill_grads)"},
      {"adam-rate", &t.adam_rate, nullptr, "CPU Adam parameters/s per node, 1 to 100T (default: measured here)"},
      {"nvme-gbps", &t.nvme_gbps, nullptr, "NVMe GB/s per path, each direction, 0.001 to 1e5 (default: measured on the --nvme paths)"},
      {"pcie-gbps", &t.pcie_gbps, nullptr, "host-GPU GB/s per GPU, 0.001 to 1e5 (default 25, assumed)"},
      {"json", nullptr, &t.json, "one JSON object on stdout"},
      {"help", nullptr, &t.help, "this text"},
  }};
}

// --nvme takes every path up to the next option: those go to t.nvme_paths, the rest to parse_options.
std::vector<char*> split_nvme(std::span<char* const> args, Texts& t) {
  std::vector<char*> rest;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (std::string_view(args[i]) == "--nvme") {
      while (i + 1 < args.size() && !std::string_view(args[i + 1]).starts_with("--")) {
        for (const std::string& p : split_list(args[++i])) t.nvme_paths.push_back(p);
      }
      continue;
    }
    rest.push_back(args[i]);
  }
  return rest;
}

Status read_model(const Texts& t, Model& model) {
  if (t.params.empty() == t.model.empty()) {
    return invalid_argument("give the model as --params N (e.g. 7.5B) or --model CONFIG.json, one of them");
  }
  if (!t.params.empty()) {
    Result<std::uint64_t> n = parse_param_count(t.params);
    if (!n.ok()) return n.status();
    if (*n == 0) return invalid_argument("--params: 0 parameters need no plan");
    if (*n > kMaxParams) return invalid_argument("--params " + t.params + " is out of range: give 1 to 100T");
    model = model_from_params(*n);
    return Status::success();
  }
  Result<std::string> text = read_small_file(t.model, "--model", kMaxConfigBytes);
  if (!text.ok()) return text.status();
  Result<Model> m = model_from_config(*text, t.model);
  if (!m.ok()) return m.status();
  model = *m;
  return Status::success();
}

Status count(const std::string& text, const char* option, std::uint64_t min, std::uint64_t max, const char* counts,
             std::uint64_t* out) {
  Result<std::uint64_t> v = parse_count_in(text, option, min, max, counts);
  if (!v.ok()) return v.status();
  *out = *v;
  return Status::success();
}

// A size given on the command line, else the default and how it was obtained.
Status size(const std::string& text, const char* option, std::uint64_t fallback, const char* fallback_how,
            std::uint64_t* out, std::string* how) {
  *out = fallback;
  *how = fallback_how;
  if (text.empty()) return Status::success();
  Result<std::uint64_t> b = parse_bytes(text, option);
  if (!b.ok()) return b.status();
  if (*b == 0 || *b > kMaxBytes) return invalid_argument(std::string(option) + " " + text + " is out of range: give 1 to 1024T");
  *out = *b;
  *how = "given";
  return Status::success();
}

Status read_training(const Texts& t, Inputs& in) {
  Cluster& c = in.cluster;
  Training& tr = in.training;
  for (Status s : {count(t.gpus, "--gpus", 0, 1024, "GPUs per node", &c.gpus_per_node), count(t.nodes, "--nodes", 1, 64 << 10, "nodes", &c.nodes),
                   count(t.prefetch, "--prefetch", 0, 32, "modules fetched ahead", &tr.prefetch),
                   count(t.grad_accum, "--grad-accum", 1, 64 << 10, "micro-batches per step", &tr.grad_accumulation)}) {
    if (!s.ok()) return s;
  }
  if (!t.micro_batch.empty()) {
    if (Status s = count(t.micro_batch, "--micro-batch", 1, 64 << 10, "sequences per micro-batch", &tr.micro_batch); !s.ok()) return s;
  }
  if (!t.seq_len.empty()) {
    if (Status s = count(t.seq_len, "--seq-len", 1, 16 << 20, "tokens per sequence", &tr.seq_len); !s.ok()) return s;
  }
  // No GPU: the CPU is the device, one rank per node.
  c.cpu_device = c.gpus_per_node == 0;
  if (c.cpu_device) c.gpus_per_node = 1;
  tr.activation_checkpointing = t.checkpointing;
  tr.grads_on_host = t.grads_on_host;
  tr.spill_grads = t.spill_grads;
  Result<DType> sd = plan::parse_state_dtype(t.state_dtype);
  if (!sd.ok()) return sd.status();
  tr.state = *sd;
  const OptimizerRule* rule = find_optimizer_rule(t.optimizer);
  if (rule == nullptr) return invalid_argument("--optimizer " + t.optimizer + " is not one zoe runs: give adam, lion or adagrad");
  if (tr.state == DType::i8 && !rule->int8_state) {
    return invalid_argument("--state-dtype int8 with --optimizer " + t.optimizer + ": " + std::string(rule->name) +
                            " keeps its state as fp32 or bf16");
  }
  tr.optimizer = rule->rule;
  return Status::success();
}

Status read_memory(const Texts& t, Inputs& in) {
  Cluster& c = in.cluster;
  for (Status s : {size(t.gpu_mem, "--gpu-mem", kAssumedGpuMem, "assumed", &c.gpu_mem, &in.gpu_mem_how),
                   size(t.host_ram, "--host-ram", physical_ram(), "this machine's", &c.host_ram, &in.host_ram_how)}) {
    if (!s.ok()) return s;
  }
  if (c.cpu_device) {
    if (!t.gpu_mem.empty()) return invalid_argument("--gpu-mem " + t.gpu_mem + " with --gpus 0: there is no GPU (the CPU is the device)");
    c.gpu_mem = 0;
    in.gpu_mem_how = "no GPU";
  }
  c.nvme_paths = t.nvme_paths;
  std::uint64_t capacity = 0;
  if (!t.nvme_capacity.empty()) {
    Result<std::uint64_t> b = parse_bytes(t.nvme_capacity, "--nvme-capacity");
    if (!b.ok()) return b.status();
    if (*b > kMaxBytes) return invalid_argument("--nvme-capacity " + t.nvme_capacity + " is out of range: give 0 to 1024T");
    capacity = *b;
  }
  for (const std::string& p : c.nvme_paths) {
    if (::access(p.c_str(), F_OK) != 0) return invalid_argument("--nvme: " + p + " does not exist");
    c.nvme_capacity.push_back(t.nvme_capacity.empty() ? free_bytes(p) : capacity);
  }
  in.capacity_how = t.nvme_capacity.empty() ? "free space" : "given";
  return Status::success();
}

// The placement asked for, if any.
Status read_placement(const Texts& t, Request& r) {
  r.requested = !t.stage.empty() || !t.offload_opt.empty() || !t.offload_param.empty();
  Placement& asked = r.asked;
  if (!t.offload_opt.empty()) {
    Result<Offload> o = parse_offload(t.offload_opt, "--offload-optimizer");
    if (!o.ok()) return o.status();
    asked.optimizer = *o;
  }
  if (!t.offload_param.empty()) {
    Result<Offload> o = parse_offload(t.offload_param, "--offload-param");
    if (!o.ok()) return o.status();
    asked.param = *o;
  }
  asked.stage = asked.param != Offload::none ? 3 : 2;
  if (!t.stage.empty()) {
    if (t.stage != "1" && t.stage != "2" && t.stage != "3") {
      return invalid_argument("--stage: '" + t.stage + "' is not 1, 2 or 3");
    }
    asked.stage = t.stage[0] - '0';
  }
  if (asked.param != Offload::none && asked.stage != 3) {
    return invalid_argument("--offload-param " + std::string(offload_name(asked.param)) +
                            " needs --stage 3: parameters are offloaded as stage 3 partitions them");
  }
  return Status::success();
}

Status gbps(const std::string& text, const char* option, Figure* out) {
  Result<double> v = parse_number_in(text, option, 0.001, 1e5, "a rate in GB/s");
  if (!v.ok()) return v.status();
  *out = {*v, "given"};
  return Status::success();
}

// The rates given; those not given are measured (or assumed) by run when a shown placement needs them.
Status read_rates(const Texts& t, Request& r) {
  if (!t.adam_rate.empty()) {
    Result<std::uint64_t> rate = parse_param_count(t.adam_rate);
    if (!rate.ok() || *rate == 0 || *rate > kMaxParams) {
      return invalid_argument("--adam-rate: '" + t.adam_rate + "' is not a rate from 1 to 100T parameters/s (e.g. 2B)");
    }
    r.adam = {static_cast<double>(*rate), "given"};
  }
  if (!t.pcie_gbps.empty()) {
    if (Status s = gbps(t.pcie_gbps, "--pcie-gbps", &r.pcie); !s.ok()) return s;
  }
  if (!t.nvme_gbps.empty()) {
    if (Status s = gbps(t.nvme_gbps, "--nvme-gbps", &r.nvme); !s.ok()) return s;
    r.nvme_write = r.nvme;
  }
  return Status::success();
}

Result<Request> request(const Texts& t) {
  Request r;
  for (Status s : {read_model(t, r.in.model), read_training(t, r.in), read_memory(t, r.in), read_placement(t, r),
                   read_rates(t, r)}) {
    if (!s.ok()) return s;
  }
  return r;
}

// The rates not given, measured here when a shown placement needs them.
Status measure_rates([[maybe_unused]] const Request& r, PlanResult& p, const Report& report) {
  auto needs = [&p](auto pred) {
    return pred(p.shown.placement) || (p.find(p.cheapest) && pred(p.all[p.cheapest].placement)) ||
           (p.find(p.zoe_cheapest) && pred(p.all[p.zoe_cheapest].placement));
  };
  if (p.adam.how.empty() && needs([](const Placement& x) { return x.optimizer != Offload::none; })) {
    report.progress("measuring CPU Adam (pass --adam-rate to skip)...");
    Result<Figure> m = measure_adam();
    if (!m.ok()) return m.status();
    p.adam = *m;
  }
  if (p.nvme.how.empty() && needs([](const Placement& x) { return x.optimizer == Offload::nvme || x.param == Offload::nvme; })) {
    p.nvme = p.nvme_write = {kAssumedNvmeGbps, "assumed: one NVMe drive per path (pass --nvme-gbps)"};
#ifdef ZOE_HAVE_AIO
    // zoe probe's test on each path (256 MiB); the estimate takes their mean per path.
    const std::vector<std::string>& paths = r.in.cluster.nvme_paths;
    if (!paths.empty()) {
      report.progress("measuring the NVMe paths (pass --nvme-gbps to skip)...");
      double read = 0, write = 0;
      for (const std::string& path : paths) {
        double w = 0, rd = 0;
        if (Status s = measure_path(path, 256 << 20, &w, &rd); !s.ok()) return s;
        read += rd / paths.size();
        write += w / paths.size();
      }
      p.nvme = {read, "measured with zoe probe's test, 256 MiB per path"};
      p.nvme_write = {write, p.nvme.how};
    }
#endif
  }
  return Status::success();
}

Result<PlanResult> run(const Request& r, const Report& report) {
  PlanResult p;
  for (const Placement& c : candidates()) p.all.push_back(evaluate(r.in, c));
  const auto fits = [](const Evaluated& e) { return e.verdict.fits; };
  p.cheapest = std::find_if(p.all.begin(), p.all.end(), fits) - p.all.begin();
  p.zoe_cheapest = std::find_if(p.all.begin(), p.all.end(), [](const Evaluated& e) {
                     return e.verdict.fits && zoe_gap(e.placement).empty();
                   }) - p.all.begin();
  p.shown = r.requested ? evaluate(r.in, r.asked) : p.find(p.cheapest) ? p.all[p.cheapest] : p.all.back();
  p.adam = r.adam;
  p.nvme = r.nvme;
  p.nvme_write = r.nvme_write;
  p.pcie = r.pcie;
  if (Status s = measure_rates(r, p, report); !s.ok()) return s;
  p.rates.adam_params_per_s = p.adam.value;
  p.rates.nvme_read_gbps = p.nvme.value;
  p.rates.nvme_write_gbps = p.nvme_write.value;
  p.rates.pcie_gbps = p.pcie.value;
  return p;
}

}  // namespace

int plan(std::span<char* const> args) {
  constexpr std::string_view kCommand = "zoe plan";
  Texts text;
  const auto options = options_of(text);
  const std::vector<char*> rest = split_nvme(args, text);
  if (Status s = parse_options(rest, options); !s.ok()) return fail_message(kCommand, s);
  if (text.help) {
    print_help(kUsage, options, "  --nvme PATH...           NVMe folders for swap files\n");
    return 0;
  }
  Result<Request> r = request(text);
  if (!r.ok()) return fail_message(kCommand, r.status());
  Report report(kCommand, text.json);
  Result<PlanResult> p = run(*r, report);
  if (!p.ok()) return fail_message(kCommand, p.status());
  report.result(plan_json(*r, *p), plan_text(*r, *p));
  return 0;
}

}  // namespace zoe::cli
