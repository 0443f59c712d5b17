// zoe plan's arithmetic: where a run's bytes go for a ZeRO stage and an offload placement, whether they fit,
// the cheapest placement that does, and what its optimizer step should cost. Memory follows the ZeRO paper
// (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"): with
// Ψ parameters and N_d data-parallel ranks, 16-bit weights 2Ψ, 16-bit gradients 2Ψ and optimizer state KΨ,
// stage 1 partitioning the state (KΨ/N_d), stage 2 the gradients too (2Ψ/N_d), stage 3 the weights too
// (2Ψ/N_d); plus the buffers zoe itself holds. Everything here is pure arithmetic on its inputs (the CLI
// measures the rates), so that tests can check it against hand-computed cases.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "zoe/adam.h"
#include "zoe/dtype.h"
#include "zoe/offload.h"
#include "zoe/status.h"

namespace zoe::plan {

enum class Offload { none, cpu, nvme };
std::string_view offload_name(Offload o);
Result<Offload> parse_offload(std::string_view text, std::string_view option);
// --state-dtype's value, by the names OffloadOptions::state_dtype has (zoe/offload.h).
Result<DType> parse_state_dtype(std::string_view text);

// Blockwise 8-bit moments (state dtype int8, zoe/adam.h): one fp32 scale per block of this many elements, per
// moment.
constexpr std::uint64_t kInt8Block = kMomentBlock;

// The largest model zoe plan sizes, a hundred times today's largest: with the command line's ranges
// (docs/cli.md: up to 1024 GPUs per node, prefetch 32) every byte count below, a node's sum of 16 bytes per
// parameter and fetch windows included, stays inside 64 bits. A larger --params or config is refused.
constexpr std::uint64_t kMaxParams = 100'000'000'000'000;  // 100T
// The activation estimate's figures are saturated here (far beyond any memory) before they become integers.
constexpr std::uint64_t kMaxEstimateBytes = std::uint64_t{1} << 60;

// The model as the arithmetic needs it.
struct Model {
  std::uint64_t params = 0;
  // The largest tensor fetched whole (parameter offload and stage 3 bring the weights to the GPU module by
  // module): it sizes the GPU's fetch window.
  std::uint64_t largest_tensor = 0;
  std::uint64_t layers = 0, hidden = 0, heads = 0;
  bool shape_assumed = false;  // layers/hidden/heads/largest_tensor come from an assumed shape, not a config
  std::string description;     // how the count was obtained, for the report
};

// "7.5B" -> 7500000000: decimal suffixes K, M, B (or G), T, as parameter counts are written; a decimal
// point is allowed.
Result<std::uint64_t> parse_param_count(std::string_view text);
// Byte sizes: suffixes K, M, G, T are powers of 1024 ("80G" is 80 GiB), a decimal point allowed.
Result<std::uint64_t> parse_bytes(std::string_view text, std::string_view option);

// A GPT-like shape for a bare parameter count: Ψ = 12 L h² with L = h / 128 (the aspect ratio of the
// GPT-3 family), the largest tensor an MLP matrix of 4h², heads of 128.
Model model_from_params(std::uint64_t params);
// A Hugging Face-style config.json: layers, hidden size, intermediate size, vocabulary, heads (and key/value
// heads), tied embeddings, learned positions, biases. Missing required fields are one error naming them.
Result<Model> model_from_config(std::string_view json_text, std::string_view source);

struct Cluster {
  std::uint64_t gpus_per_node = 1, nodes = 1;
  std::uint64_t gpu_mem = 0;   // bytes per GPU
  std::uint64_t host_ram = 0;  // bytes per node
  std::vector<std::string> nvme_paths;
  std::vector<std::uint64_t> nvme_capacity;  // bytes each path may hold
  std::uint64_t ranks() const { return gpus_per_node * nodes; }
};

struct Placement {
  int stage = 2;
  Offload optimizer = Offload::none, param = Offload::none;
};
std::string placement_name(const Placement& p);
// "14.0 GiB", "1.82 TiB", "578.0 MiB": binary units, as the plan prints them.
std::string format_bytes(std::uint64_t bytes);
// What zoe cannot run of this placement yet ("" when it runs it); every state dtype runs on both tiers.
std::string zoe_gap(const Placement& p);

struct Training {
  DType state = DType::f32;  // of the moments: f32, bf16 or i8
  std::uint64_t prefetch = 2;        // modules fetched ahead of the one computing (parameter offload, stage 3)
  std::uint64_t grad_accumulation = 1;
  std::uint64_t buffer_count = 4;    // NVMe tier: tile buffers per rank
  std::uint64_t tile = 1 << 20;      // NVMe tier: elements per tile
  // Activations, estimated only when both are given (and the shape is known or assumed).
  std::uint64_t micro_batch = 0, seq_len = 0;
  bool activation_checkpointing = false;
};

// Bytes by kind.
struct Bytes {
  std::uint64_t weights16 = 0, grads16 = 0, master32 = 0, moments = 0, buffers = 0, activations = 0;
  std::uint64_t total() const { return weights16 + grads16 + master32 + moments + buffers + activations; }
};

struct Usage {
  Bytes per_gpu, per_host, per_nvme_path;
};

// Bytes of the two moments of `elements` parameters in the state dtype (int8: one byte each, plus an fp32
// scale per block of each).
std::uint64_t moment_bytes(std::uint64_t elements, DType d);
Usage usage(const Model& m, const Cluster& c, const Placement& p, const Training& t);

// What may be used of each resource: GPUs keep 5% for the CUDA context and allocator fragmentation, hosts
// 10% for the OS and the trainer's own process, NVMe paths their capacity.
std::uint64_t usable_gpu(const Cluster& c);
std::uint64_t usable_host(const Cluster& c);

struct Verdict {
  bool fits = false;
  std::string why;  // the first resource that overflows, with the figures
};
Verdict check(const Usage& u, const Cluster& c);

// Every placement, least offload first: all on the GPU, then the optimizer state on the CPU, the weights
// on the CPU too, the state on NVMe, the weights on NVMe; within each, the lowest stage (least
// communication) first. Parameter offload needs stage 3.
std::vector<Placement> candidates();

struct Rates {
  double adam_params_per_s = 0;  // CPU Adam, one node's cores
  double nvme_read_gbps = 0, nvme_write_gbps = 0;  // per path
  double pcie_gbps = 0;          // per GPU, each direction
};

// One optimizer step (sync schedule), per node: CPU Adam over the node's partitions, the NVMe traffic of
// the state (pipelined with Adam: the larger of the two counts), and the PCIe transfers each GPU makes
// around the step (its gradient partition down, its weights up), which the sync schedule does not overlap.
struct StepEstimate {
  double cpu_adam_s = 0, nvme_s = 0, pcie_s = 0, total_s = 0;
  std::uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;  // per node
  std::uint64_t pcie_bytes = 0;                              // per GPU
};
StepEstimate estimate_step(const Model& m, const Cluster& c, const Placement& p, const Training& t, const Rates& r);

// The DeepSpeed-style config of a placement, as JSON text that zoe's config reader loads.
std::string deepspeed_config(const Placement& p, const Cluster& c, const Training& t);

}  // namespace zoe::plan
