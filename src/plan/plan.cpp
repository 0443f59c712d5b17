// zoe plan's arithmetic (plan.h): the ZeRO memory formulas per placement with what zoe and the trainer
// hold, the fit check, the placement order, the step estimate and the DeepSpeed-style config.
#include "zoe/plan.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

namespace zoe::plan {
namespace {

using Json = nlohmann::ordered_json;

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

}  // namespace

std::string placement_name(const Placement& p) {
  return "stage " + std::to_string(p.stage) + ", optimizer " + std::string(offload_name(p.optimizer)) + ", params " +
         std::string(offload_name(p.param));
}

std::string zoe_gap(const Placement& p) {
  // Every stage and parameter home runs: stage 3 with FSDP2 (fully_shard) partitioning the 16-bit weights, zoe
  // stepping each rank's shards, and offload_parameters on that model keeping them in each rank's tier.
  return p.optimizer == Offload::none ? "the optimizer state stays with the model on its device, where zoe is not needed" : "";
}

std::uint64_t moment_bytes(std::uint64_t elements, DType d, std::uint64_t arrays) {
  switch (d) {
    case DType::bf16: return arrays * 2 * elements;
    case DType::i8: return arrays * (elements + 4 * ceil_div(elements, kInt8Block));
    default: return arrays * 4 * elements;
  }
}

const std::vector<Kind>& kinds() {
  static const std::vector<Kind> all = {
      {"weights16", "weights16", &Bytes::weights16},
      {"parameter tier (2 slots)", "param_tier", &Bytes::param_tier},
      {"gradient spill", "grad_spill", &Bytes::grad_spill},
      {"trainer's grads16", "grads16", &Bytes::grads16},
      {"master32", "master32", &Bytes::master32},
      {"moments", "moments", &Bytes::moments},
      {"swap store (2 slots)", "swap_store", &Bytes::swap_store},
      {"fetch window", "fetch_window", &Bytes::fetch_window},
      {"activations", "activations", &Bytes::activations},
      {"parameter pool", "param_pool", &Bytes::param_pool},
      {"parameter bounces", "param_bounces", &Bytes::param_bounces},
      {"swap buffers", "swap_buffers", &Bytes::swap_buffers},
      {"step windows", "step_windows", &Bytes::step_windows},
      {"staging", "staging", &Bytes::staging},
      {"accumulation", "accumulation", &Bytes::accumulation},
  };
  return all;
}

namespace {

// Korthikanti et al., 2022 ("Reducing Activation Recomputation in Large Transformer Models"): a layer's
// 16-bit activations are s b h (34 + 5 a s / h) bytes; with full checkpointing only each layer's input
// (2 s b h) is kept, plus one layer's activations while it is recomputed.
std::uint64_t activation_bytes(const Model& m, const Training& t) {
  if (t.micro_batch == 0 || t.seq_len == 0) return 0;
  const double s = static_cast<double>(t.seq_len), b = static_cast<double>(t.micro_batch);
  const double h = static_cast<double>(m.hidden), a = static_cast<double>(m.heads);
  const double layer = s * b * h * (34 + 5 * a * s / h);
  const double all = t.activation_checkpointing ? static_cast<double>(m.layers) * 2 * s * b * h + layer
                                                : static_cast<double>(m.layers) * layer;
  // s and b come from the command line and a from a config: saturated, so that the conversion is defined.
  return all < static_cast<double>(kMaxEstimateBytes) ? static_cast<std::uint64_t>(all) : kMaxEstimateBytes;
}

// What zoe's optimizer holds on the host besides its state: the step's staging or windows, the sums.
void step_buffers(const RankLayout& r, const Cluster& c, const Placement& p, const Training& t, Bytes& host) {
  if (p.optimizer == Offload::none) return;
  // Tier ram steps the model's own gradients and weights in place only where the CPU is the device and
  // the weights are not in a parameter tier; else whole 16-bit copies of both.
  if (p.optimizer == Offload::cpu && (!c.cpu_device || p.param != Offload::none)) host.staging = 2 * r.part + 2 * r.part;
  if (p.optimizer == Offload::nvme) {
    // Tier nvme with the sync schedule the plan sizes (footprint.cpp's staging_rule): in place where the CPU is
    // the device and the weights are the model's own; else streamed through windows — unless zoe sums
    // micro-batches, which keeps whole 16-bit copies as tier ram does.
    const bool in_place = c.cpu_device && p.param == Offload::none && !spills(p, t);
    if (!in_place && t.grad_accumulation > 1) host.staging = 2 * r.part + 2 * r.part;
    if (!in_place && t.grad_accumulation <= 1) host.step_windows = r.window_count * r.window_elements * 2;
  }
  if (t.grad_accumulation > 1) host.accumulation = 4 * r.part;
}

}  // namespace

Usage usage(const Model& m, const Cluster& c, const Placement& p, const Training& t) {
  const RankLayout r = rank_layout(m, c, p, t);
  const std::uint64_t psi = m.params, part = r.part, n = c.gpus_per_node;
  Bytes gpu, host, nvme;
  // The device's memory: a GPU's, or host RAM where the CPU is the device.
  Bytes& dev = c.cpu_device ? host : gpu;
  if (p.param == Offload::none) dev.weights16 = p.stage == 3 ? 2 * part : 2 * psi;
  if (p.param == Offload::cpu) host.weights16 = r.entry_bytes;
  if (p.param == Offload::nvme) nvme.param_tier = r.param_file_bytes;
  // The trainer's gradients: whole (stage 1), or the rank's partition; FSDP2's CPUOffloadPolicy puts its
  // shards in host RAM.
  if (spills(p, t)) {
    nvme.grad_spill = r.spill_file_bytes;  // on the first path, the busiest (its bounces: below)
  } else {
    (p.stage == 3 && t.grads_on_host ? host : dev).grads16 = p.stage >= 2 ? 2 * part : 2 * psi;
  }
  if (p.stage == 3 || p.param != Offload::none) {
    // FSDP2's gathered modules: the one computing and `prefetch` ahead (16-bit weights), and the gradient
    // of the one in backward before it is reduce-scattered.
    dev.fetch_window = (t.prefetch + 1) * m.largest_tensor * 2 + m.largest_tensor * 2;
  }
  if (p.optimizer == Offload::none || p.optimizer == Offload::cpu) {
    Bytes& state = p.optimizer == Offload::none ? dev : host;
    state.master32 = 4 * part;
    state.moments = moment_bytes(part, t.state, optimizer_rule(t.optimizer).states.size());
  } else {
    nvme.swap_store = r.store_file_bytes + r.table_file_bytes;
    host.swap_buffers = r.store_ram_bytes + r.spill_bounce_bytes;
  }
  step_buffers(r, c, p, t, host);
  dev.param_pool = r.pool_bytes;
  host.param_bounces = r.bounce_bytes;
  dev.activations = activation_bytes(m, t);
  // A node's n ranks each hold theirs; every rank's files are on every path. A config of absurd shapes (a
  // trillion one-element layers, each entry padded to 4096) on 1024 GPUs could pass 64 bits here: such a
  // figure is saturated, far beyond any machine, and the kinds' sum stays inside 64 bits.
  auto times = [n](Bytes x) {
    for (const Kind& k : kinds()) x.*k.member = x.*k.member > kMaxEstimateBytes / n ? kMaxEstimateBytes : x.*k.member * n;
    return x;
  };
  Usage u;
  if (!c.cpu_device) u.per_gpu = gpu;
  u.per_host = times(host);
  u.per_nvme_path = times(nvme);
  return u;
}

bool spills(const Placement& p, const Training& t) {
  return t.spill_grads && p.stage == 3 && p.optimizer == Offload::nvme && t.grad_accumulation <= 1;
}

std::uint64_t usable_gpu(const Cluster& c) { return c.gpu_mem / 100 * 95; }
std::uint64_t usable_host(const Cluster& c) { return c.host_ram / 10 * 9; }

namespace {

// "(the most: trainer's grads16 116.4 GiB)": what a resource that overflows holds most of.
std::string largest_kind(const Bytes& b) {
  const Kind* most = &kinds().front();
  for (const Kind& k : kinds()) {
    if (b.*k.member > b.*most->member) most = &k;
  }
  return std::string(" (the most: ") + most->label + " " + format_bytes(b.*most->member) + ")";
}

}  // namespace

Verdict check(const Usage& u, const Cluster& c) {
  Verdict v;
  if (!c.cpu_device && u.per_gpu.total() > usable_gpu(c)) {
    v.why = "GPU: needs " + format_bytes(u.per_gpu.total()) + ", " + format_bytes(usable_gpu(c)) + " usable of " +
            format_bytes(c.gpu_mem) + largest_kind(u.per_gpu);
    return v;
  }
  if (u.per_host.total() > usable_host(c)) {
    v.why = "host: needs " + format_bytes(u.per_host.total()) + ", " + format_bytes(usable_host(c)) + " usable of " +
            format_bytes(c.host_ram) + largest_kind(u.per_host);
    return v;
  }
  if (u.per_nvme_path.total() > 0) {
    if (c.nvme_paths.empty()) {
      v.why = "NVMe: needs " + format_bytes(u.per_nvme_path.total()) + " and no --nvme path was given";
      return v;
    }
    for (std::size_t i = 0; i < c.nvme_paths.size(); ++i) {
      if (u.per_nvme_path.total() > c.nvme_capacity[i]) {
        v.why = "NVMe: " + c.nvme_paths[i] + " needs " + format_bytes(u.per_nvme_path.total()) + ", holds " +
                format_bytes(c.nvme_capacity[i]);
        return v;
      }
    }
  }
  v.fits = true;
  return v;
}

std::vector<Placement> candidates() {
  std::vector<Placement> out;
  const std::pair<Offload, Offload> order[] = {{Offload::none, Offload::none}, {Offload::cpu, Offload::none},
                                               {Offload::cpu, Offload::cpu},   {Offload::nvme, Offload::none},
                                               {Offload::nvme, Offload::cpu},  {Offload::nvme, Offload::nvme}};
  for (auto [opt, param] : order) {
    for (int stage = param == Offload::none ? 1 : 3; stage <= 3; ++stage) out.push_back(Placement{stage, opt, param});
  }
  return out;
}

StepEstimate estimate_step(const Model& m, const Cluster& c, const Placement& p, const Training& t, const Rates& r) {
  StepEstimate e;
  const RankLayout l = rank_layout(m, c, p, t);
  const std::uint64_t n = c.gpus_per_node, part = l.part, node = part * n;
  if (p.optimizer != Offload::none && r.adam_params_per_s > 0) e.cpu_adam_s = node / r.adam_params_per_s;
  if (p.optimizer == Offload::nvme) {
    // Every tile's valid slot read, its other slot written: whole slots, padding and scales included.
    e.swap_read_bytes = e.swap_write_bytes = n * l.tiles * l.slot_bytes;
  }
  if (p.param == Offload::nvme) {
    // Each block read in forward and again in backward (reshard_after_forward dropped it), each entry
    // written once by the step.
    e.param_read_bytes = 2 * n * l.entry_bytes;
    e.param_write_bytes = n * l.entry_bytes;
  }
  e.nvme_read_bytes = e.swap_read_bytes + e.param_read_bytes;
  e.nvme_write_bytes = e.swap_write_bytes + e.param_write_bytes;
  if (spills(p, t)) {  // each gradient written in backward and read back by the step
    e.spill_bytes = n * l.spill_file_bytes;
    e.nvme_read_bytes += e.spill_bytes;
    e.nvme_write_bytes += e.spill_bytes;
  }
  const double paths = static_cast<double>(std::max<std::size_t>(1, c.nvme_paths.size()));
  if (e.nvme_read_bytes > 0 && r.nvme_read_gbps > 0 && r.nvme_write_gbps > 0) {
    e.nvme_s = e.nvme_read_bytes / (r.nvme_read_gbps * 1e9 * paths) + e.nvme_write_bytes / (r.nvme_write_gbps * 1e9 * paths);
  }
  // Around the step each GPU sends its gradient partition down (unless FSDP2 put it on the host already) and
  // takes its updated weights back (unless they go to the parameter tier). The CPU as the device copies nothing.
  if (p.optimizer != Offload::none && !c.cpu_device) {
    if (!(p.stage == 3 && t.grads_on_host)) e.pcie_bytes += 2 * part;
    if (p.param == Offload::none) e.pcie_bytes += 2 * part;
  }
  if (r.pcie_gbps > 0) e.pcie_s = e.pcie_bytes / (r.pcie_gbps * 1e9);
  e.total_s = std::max(e.cpu_adam_s, e.nvme_s) + e.pcie_s;
  return e;
}

std::string deepspeed_config(const Placement& p, const Cluster& c, const Training& t) {
  Json cfg = Json::object();
  if (t.grad_accumulation > 1) cfg["gradient_accumulation_steps"] = t.grad_accumulation;
  cfg["bf16"] = {{"enabled", true}};
  Json zero = {{"stage", p.stage}};
  Json opt = {{"device", offload_name(p.optimizer)}};
  // One path as DeepSpeed writes it, several as the list zoe's reader also takes.
  const Json paths = c.nvme_paths.size() == 1 ? Json(c.nvme_paths[0]) : Json(c.nvme_paths);
  if (p.optimizer == Offload::nvme) opt["nvme_path"] = paths;
  if (p.optimizer != Offload::none) {
    opt["pin_memory"] = true;
    if (p.optimizer == Offload::nvme) opt["buffer_count"] = t.buffer_count;
  }
  zero["offload_optimizer"] = opt;
  if (p.param != Offload::none) {
    Json param = {{"device", offload_name(p.param)}, {"pin_memory", true}};
    if (p.param == Offload::nvme) param["nvme_path"] = paths;
    zero["offload_param"] = param;
  }
  cfg["zero_optimization"] = zero;
  return cfg.dump(2);
}

}  // namespace zoe::plan
