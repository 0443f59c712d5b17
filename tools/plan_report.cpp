// zoe plan's report (tools/plan.h): the shown placement's bytes by kind per GPU, per host and per NVMe path,
// each term's bytes per rank and where they come from, the step estimate, every candidate's verdict and the
// placement's DeepSpeed-style config, as text or as one JSON object.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tools/plan.h"
#include "tools/report.h"
#include "zoe/config.h"

namespace zoe::cli::planning {
namespace {

using Json = nlohmann::ordered_json;
using namespace zoe::plan;  // NOLINT: the planner's vocabulary

std::string human(std::uint64_t bytes) { return bytes == 0 ? "-" : format_bytes(bytes); }

// Every kind by its key, then zoe's buffers together (as before the kinds were named) and the total.
Json bytes_json(const Bytes& b) {
  Json j = Json::object();
  for (const Kind& k : kinds()) j[k.key] = b.*k.member;
  j["buffers"] = b.buffers();
  j["total"] = b.total();
  return j;
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
         {"usable_gpu_bytes", in.cluster.cpu_device ? 0 : usable_gpu(in.cluster)},
         {"usable_host_bytes", usable_host(in.cluster)},
         {"terms", explain(in.model, in.cluster, e.placement, in.training)},
         {"step_s_estimate", step.total_s},
         {"step", {{"cpu_adam_s", step.cpu_adam_s}, {"nvme_s", step.nvme_s}, {"pcie_s", step.pcie_s},
                   {"nvme_read_bytes_per_node", step.nvme_read_bytes},
                   {"nvme_write_bytes_per_node", step.nvme_write_bytes},
                   {"swap_read_bytes_per_node", step.swap_read_bytes},
                   {"swap_write_bytes_per_node", step.swap_write_bytes},
                   {"param_read_bytes_per_node", step.param_read_bytes},
                   {"spill_bytes_per_node", step.spill_bytes},
                   {"param_write_bytes_per_node", step.param_write_bytes},
                   {"pcie_bytes_per_gpu", step.pcie_bytes}}}};
  const std::string config = deepspeed_config(e.placement, in.cluster, in.training);
  j["config"] = Json::parse(config);
  j["config_notes"] = reader_notes(config);
  return j;
}

// The kinds the placement holds anywhere, one row each; no GPU column where the CPU is the device.
std::string usage_table(const Inputs& in, const Usage& u) {
  const bool gpu = !in.cluster.cpu_device;
  std::string out;
  auto row = [&out, gpu](const char* kind, std::uint64_t g, std::uint64_t h, std::uint64_t n) {
    out += format("  %-26s", kind);
    if (gpu) out += format(" %14s", human(g).c_str());
    out += format(" %14s %14s\n", human(h).c_str(), human(n).c_str());
  };
  out += format("  %-26s", "");
  if (gpu) out += format(" %14s", "per GPU");
  out += format(" %14s %14s\n", "per host", "per NVMe path");
  for (const Kind& k : kinds()) {
    const std::uint64_t g = u.per_gpu.*k.member, h = u.per_host.*k.member, n = u.per_nvme_path.*k.member;
    if (g + h + n > 0) row(k.label, g, h, n);
  }
  row("total", u.per_gpu.total(), u.per_host.total(), u.per_nvme_path.total());
  const std::uint64_t capacity = in.cluster.nvme_capacity.empty() ? 0 : in.cluster.nvme_capacity[0];
  row("usable", gpu ? usable_gpu(in.cluster) : 0, usable_host(in.cluster), capacity);
  return out;
}

std::string step_text(const Inputs& in, const Evaluated& e, const Rates& rates) {
  const StepEstimate s = estimate_step(in.model, in.cluster, e.placement, in.training, rates);
  if (e.placement.optimizer == Offload::none) return "  optimizer step: with the model on its device (not estimated)\n";
  std::string out;
  if (in.cluster.cpu_device) {
    out += format("  optimizer step estimate: %.3f s = max(CPU Adam %.3f s, NVMe %.3f s) (the CPU is the device: no PCIe)\n",
                  s.total_s, s.cpu_adam_s, s.nvme_s);
  } else {
    out += format("  optimizer step estimate: %.3f s = max(CPU Adam %.3f s, NVMe %.3f s) + PCIe %.3f s\n", s.total_s,
                  s.cpu_adam_s, s.nvme_s, s.pcie_s);
  }
  if (s.swap_read_bytes > 0) {
    out += format("    NVMe per node per step, swap store: %s read, %s written (every tile's slot)\n",
                  human(s.swap_read_bytes).c_str(), human(s.swap_write_bytes).c_str());
  }
  if (s.param_read_bytes > 0) {
    out += format("    NVMe per node per step, parameter tier: %s read (forward and backward, each block twice), "
                  "%s written (the step's weights)\n",
                  human(s.param_read_bytes).c_str(), human(s.param_write_bytes).c_str());
  }
  if (s.spill_bytes > 0) {
    out += format("    NVMe per node per step, gradient spill: %s written (backward), %s read (the step)\n",
                  human(s.spill_bytes).c_str(), human(s.spill_bytes).c_str());
  }
  if (s.pcie_bytes > 0) {
    out += format("    PCIe per GPU per step: %s (sync schedule; overlap and delayed hide it)\n", human(s.pcie_bytes).c_str());
  }
  return out;
}

std::string placement_text(const Inputs& in, const Evaluated& e, const Rates& rates, const char* label) {
  std::string out = format("\n%s: %s -> %s\n", label, placement_name(e.placement).c_str(),
                           e.verdict.fits ? "fits" : ("does not fit (" + e.verdict.why + ")").c_str());
  out += usage_table(in, e.usage);
  const std::vector<std::string> terms = explain(in.model, in.cluster, e.placement, in.training);
  if (!terms.empty()) out += "  per rank:\n";
  for (const std::string& t : terms) out += format("    %s\n", t.c_str());
  const std::string gap = zoe_gap(e.placement);
  out += format("  zoe: %s\n", gap.empty() ? "runs this placement" : ("cannot run it as planned: " + gap).c_str());
  return out + step_text(in, e, rates);
}

std::string cluster_text(const Request& r) {
  const Cluster& c = r.in.cluster;
  if (c.cpu_device) {
    return format("cluster: no GPU, the CPU as the device (1 rank per node x %llu nodes), %s RAM per node (%s)\n",
                  static_cast<unsigned long long>(c.nodes), human(c.host_ram).c_str(), r.in.host_ram_how.c_str());
  }
  return format("cluster: %llu GPUs (%llu per node x %llu nodes), %s per GPU (%s), %s RAM per node (%s)\n",
                static_cast<unsigned long long>(c.ranks()), static_cast<unsigned long long>(c.gpus_per_node),
                static_cast<unsigned long long>(c.nodes), human(c.gpu_mem).c_str(), r.in.gpu_mem_how.c_str(),
                human(c.host_ram).c_str(), r.in.host_ram_how.c_str());
}

// The model, the cluster and the state, above the shown placement; then the rates and what the figures leave out.
std::string summary_text(const Request& r, const PlanResult& p) {
  const Cluster& c = r.in.cluster;
  const Training& t = r.in.training;
  std::string out = format("zoe plan: %s\n", r.in.model.description.c_str()) + cluster_text(r);
  for (std::size_t i = 0; i < c.nvme_paths.size(); ++i) {
    out += format("NVMe path %s: %s (%s)\n", c.nvme_paths[i].c_str(), human(c.nvme_capacity[i]).c_str(),
                  r.in.capacity_how.c_str());
  }
  const OptimizerRule& rule = optimizer_rule(t.optimizer);
  out += format("optimizer state (%s): fp32 master + %zu %s state array%s (%.2f bytes per parameter)%s\n",
                rule.name.data(), rule.states.size(), state_dtype_name(t.state).data(), rule.states.size() == 1 ? "" : "s",
                4 + moment_bytes(1 << 20, t.state, rule.states.size()) / double(1 << 20),
                t.spill_grads     ? "; stage 3's gradient shards spilled to NVMe (spill_grads)"
                : t.grads_on_host ? "; stage 3's gradient shards in host RAM (CPUOffloadPolicy)"
                                  : "");
  out += placement_text(r.in, p.shown, p.rates,
                        r.requested            ? "requested"
                        : p.find(p.cheapest) ? "cheapest placement that fits"
                                               : "nothing fits; the most offloaded");
  if (p.adam.value > 0) {
    out += format("  CPU Adam: %.2f billion parameters/s per node (%s)\n", p.adam.value / 1e9, p.adam.how.c_str());
  }
  if (p.nvme.value > 0) {
    out += format("  NVMe: %.2f GB/s read, %.2f GB/s write per path (%s)\n", p.nvme.value, p.nvme_write.value,
                  p.nvme.how.c_str());
  }
  if (!c.cpu_device) out += format("  PCIe: %.3g GB/s per GPU (%s)\n", p.pcie.value, p.pcie.how.c_str());
  if (r.in.model.shape_assumed) {
    out += "  the fetch window and the parameter tier's blocks use the assumed shape: --model gives the real one\n";
  }
  if (t.micro_batch == 0 || t.seq_len == 0) {
    return out + "  activations are not included: --micro-batch and --seq-len give an estimate\n";
  }
  return out + format("  activations are an estimate (Korthikanti et al., 2022: s b h (34 + 5 a s / h) bytes a layer%s)\n",
                      t.activation_checkpointing ? "; checkpointed: each layer's input and one layer's" : "");
}

// The cheapest placements, every candidate with its verdict, and the shown placement's config.
std::string placements_text(const Request& r, const PlanResult& p) {
  const Evaluated *cheapest = p.find(p.cheapest), *zoe_cheapest = p.find(p.zoe_cheapest);
  std::string out;
  if (r.requested && cheapest) out += format("\ncheapest placement that fits: %s\n", placement_name(cheapest->placement).c_str());
  if (zoe_cheapest && zoe_cheapest != cheapest) {
    out += format("cheapest placement that fits and zoe runs: %s (optimizer step estimate %.3f s)\n",
                  placement_name(zoe_cheapest->placement).c_str(),
                  estimate_step(r.in.model, r.in.cluster, zoe_cheapest->placement, r.in.training, p.rates).total_s);
  }
  out += "\nplacements, least offload first:\n";
  for (const Evaluated& e : p.all) {
    out += format("  %-40s %s%s\n", placement_name(e.placement).c_str(), e.verdict.fits ? "fits" : e.verdict.why.c_str(),
                  &e == cheapest ? "   <- cheapest" : "");
  }
  if (!cheapest) {
    out += r.in.training.spill_grads ? "  nothing fits: more GPUs or nodes, more host RAM, or NVMe paths (--nvme)\n"
           : r.in.training.grads_on_host || r.in.cluster.cpu_device
               ? "  nothing fits: more GPUs or nodes, more host RAM, NVMe paths (--nvme), or stage 3's gradient shards "
                 "spilled to NVMe (--spill-grads)\n"
               : "  nothing fits: more GPUs or nodes, more host RAM, NVMe paths (--nvme), or stage 3's gradient shards "
                 "in host RAM (--grads-on-host) or spilled to NVMe (--spill-grads)\n";
  }
  const std::string config = deepspeed_config(p.shown.placement, r.in.cluster, r.in.training);
  out += format("\nconfig (%s):\n%s\n", placement_name(p.shown.placement).c_str(), config.c_str());
  const std::vector<std::string> notes = reader_notes(config);
  out += format("zoe's config reader: %s\n", notes.empty() ? "loads it without notes" : "loads it with these notes:");
  for (const std::string& n : notes) out += format("  %s\n", n.c_str());
  return out;
}

}  // namespace

std::string plan_json(const Request& r, const PlanResult& p) {
  const Model& m = r.in.model;
  const Cluster& c = r.in.cluster;
  Json out{{"command", "plan"},
           {"params", m.params},
           {"model", m.description},
           {"shape_assumed", m.shape_assumed},
           {"gpus_per_node", c.cpu_device ? 0 : c.gpus_per_node},
           {"cpu_device", c.cpu_device},
           {"nodes", c.nodes},
           {"ranks", c.ranks()},
           {"gpu_mem_bytes", c.gpu_mem},
           {"host_ram_bytes", c.host_ram},
           {"nvme_paths", c.nvme_paths},
           {"nvme_capacity_bytes", c.nvme_capacity},
           {"state_dtype", state_dtype_name(r.in.training.state)},
           {"optimizer", optimizer_rule(r.in.training.optimizer).name},
           {"grads_on_host", r.in.training.grads_on_host},
           {"spill_grads", r.in.training.spill_grads},
           {"requested", r.requested}};
  const Json shown_json = placement_json(r.in, p.shown, p.rates);
  for (const auto& [k, v] : shown_json.items()) out[k] = v;
  const Evaluated *cheapest = p.find(p.cheapest), *zoe_cheapest = p.find(p.zoe_cheapest);
  out["cheapest"] = cheapest ? placement_json(r.in, *cheapest, p.rates) : Json(nullptr);
  out["cheapest_zoe_runs"] = zoe_cheapest ? placement_json(r.in, *zoe_cheapest, p.rates) : Json(nullptr);
  Json cands = Json::array();
  for (const Evaluated& e : p.all) {
    cands.push_back({{"stage", e.placement.stage}, {"offload_optimizer", offload_name(e.placement.optimizer)},
                     {"offload_param", offload_name(e.placement.param)}, {"fits", e.verdict.fits},
                     {"why_not", e.verdict.why}});
  }
  out["candidates"] = cands;
  out["rates"] = {{"adam_params_per_s", p.adam.value}, {"adam", p.adam.how}, {"nvme_read_gbps", p.nvme.value},
                  {"nvme_write_gbps", p.nvme_write.value}, {"nvme", p.nvme.how}, {"pcie_gbps", p.pcie.value},
                  {"pcie", p.pcie.how}};
  return out.dump();
}

std::string plan_text(const Request& r, const PlanResult& p) { return summary_text(r, p) + placements_text(r, p); }

}  // namespace zoe::cli::planning
