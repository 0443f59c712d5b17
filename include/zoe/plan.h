// zoe plan's arithmetic: where a run's bytes go for a ZeRO stage and an offload placement, whether they fit,
// the cheapest placement that does, and what its optimizer step should cost. Memory follows the ZeRO paper
// (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"): with
// Ψ parameters and N_d data-parallel ranks, 16-bit weights 2Ψ, 16-bit gradients 2Ψ and optimizer state KΨ,
// stage 1 partitioning the state (KΨ/N_d), stage 2 the gradients too (2Ψ/N_d), stage 3 the weights too
// (2Ψ/N_d); plus what zoe itself allocates, counted from the code that allocates it (the swap store's two
// slots per tile, the parameter tier's two slots per entry, pools, bounces, staging and step windows), and
// what the trainer holds (its gradients, FSDP2's gathered modules, activations). Everything here is pure
// arithmetic on its inputs (the CLI measures the rates), so that tests can check it against hand-computed
// cases. Model counting and the number parsers are in model.cpp, the arithmetic in plan.cpp and layout.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "zoe/adam.h"
#include "zoe/dtype.h"
#include "zoe/offload.h"
#include "zoe/optimizers.h"
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

// A parameter tensor as FSDP2 shards it: on its first dimension, rank 0 holding ceil(rows / ranks) rows;
// `copies` tensors alike (a mixture's experts).
struct Tensor {
  std::uint64_t rows = 0, cols = 1, copies = 1;
};

// The model as the arithmetic needs it.
struct Model {
  std::uint64_t params = 0;
  // The largest tensor fetched whole (parameter offload and stage 3 bring the weights to the GPU module by
  // module): it sizes the fetch window.
  std::uint64_t largest_tensor = 0;
  std::uint64_t layers = 0, hidden = 0, heads = 0;
  // The tensors as FSDP2 groups them (fully_shard per layer, the rest in the root module's group, which
  // comes first): they size the parameter tier's blocks and entries and the per-tensor rounding of zoe's
  // stores. Both empty (a model given by its count and largest tensor only): one group of that one tensor.
  std::vector<Tensor> layer_tensors;  // one layer's; each of the `layers` alike
  std::vector<Tensor> root_tensors;   // embeddings, the head when untied, learned positions, the final norm
  bool shape_assumed = false;  // layers/hidden/heads/largest_tensor come from an assumed shape, not a config
  std::string description;     // how the count was obtained, for the report
};

// "7.5B" -> 7500000000: decimal suffixes K, M, B (or G), T, as parameter counts are written; a decimal
// point is allowed.
Result<std::uint64_t> parse_param_count(std::string_view text);
// Byte sizes: suffixes K, M, G, T are powers of 1024 ("80G" is 80 GiB), a decimal point allowed.
Result<std::uint64_t> parse_bytes(std::string_view text, std::string_view option);

// A GPT-like shape for a bare parameter count: Ψ = 12 L h² with L = h / 128 (the aspect ratio of the
// GPT-3 family), the largest tensor an MLP matrix of 4h², heads of 128; a layer is four h x h matrices and
// the two MLP ones (embeddings are not assumed).
Model model_from_params(std::uint64_t params);
// A Hugging Face-style config.json: layers, hidden size, intermediate size, vocabulary, heads (and key/value
// heads), tied embeddings, learned positions, biases. Missing required fields are one error naming them.
Result<Model> model_from_config(std::string_view json_text, std::string_view source);

struct Cluster {
  std::uint64_t gpus_per_node = 1, nodes = 1;
  // No GPU (--gpus 0): the CPU is the device (a CPU-only PyTorch model; FSDP2 over gloo), one rank per node
  // (gpus_per_node 1). What a GPU would hold is in host RAM, zoe's step reads the gradients in place and
  // nothing crosses PCIe.
  bool cpu_device = false;
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
  Rule optimizer = Rule::adam;  // its state arrays (zoe/optimizers.h): Adam's two moments, Lion's or Adagrad's one
  std::uint64_t prefetch = 2;        // modules fetched ahead of the one computing (parameter offload, stage 3)
  std::uint64_t grad_accumulation = 1;
  std::uint64_t buffer_count = 4;    // NVMe tier: tile buffers per rank
  std::uint64_t tile = 1 << 20;      // NVMe tier: elements per tile
  // Stage 3: FSDP2's CPUOffloadPolicy moves the reduce-scattered gradient shards to host RAM (where the CPU
  // is the device they are there anyway); without it they stay on the GPU until the step.
  bool grads_on_host = false;
  // Stage 3 with the optimizer on NVMe, one micro-batch per step: zoe spills each gradient shard to a file on
  // the first NVMe path as backward produces it (OffloadOptions::spill_grads), and neither the GPU nor the
  // host keeps the trainer's gradients. Ignored by other placements.
  bool spill_grads = false;
  // Activations, estimated only when both are given (and the shape is known or assumed).
  std::uint64_t micro_batch = 0, seq_len = 0;
  bool activation_checkpointing = false;
};

// Bytes by kind: the model's states and what the trainer holds, then what zoe allocates, each named as the
// report names it (docs/cli.md says where in the code each comes from).
struct Bytes {
  std::uint64_t weights16 = 0;      // the 16-bit weights: the model's on its device, or the parameter tier's RAM home
  std::uint64_t grads16 = 0;        // the trainer's 16-bit gradients (DDP's, zoe's partition's, FSDP2's shards)
  std::uint64_t master32 = 0;       // fp32 master weights in memory (tier ram; on the GPU without zoe)
  std::uint64_t moments = 0;        // Adam's moments in memory, int8's block scales included
  std::uint64_t activations = 0;
  std::uint64_t swap_store = 0;     // tier nvme's file: two slots per tile (master, moments, scales), the tile table
  std::uint64_t param_tier = 0;     // the parameter tier's NVMe file: two slots per entry, each aligned
  std::uint64_t grad_spill = 0;     // spill_grads: the gradient shards' file (first path), each 4096-aligned
  std::uint64_t fetch_window = 0;   // FSDP2's gathered modules (stage 3): prefetch + 1 of them and one's gradient
  std::uint64_t swap_buffers = 0;   // tier nvme's RAM: buffer_count slots and the tile table
  std::uint64_t param_pool = 0;     // the parameter tier's pool of fetched blocks (host RAM where the CPU is the device)
  std::uint64_t param_bounces = 0;  // the parameter tier's NVMe bounce buffers
  std::uint64_t staging = 0;        // tier ram: whole 16-bit gradient and weight staging
  std::uint64_t step_windows = 0;   // tier nvme: the 16-bit weight window and (GPU) the gradient window
  std::uint64_t accumulation = 0;   // the fp32 sums of the micro-batches (--grad-accum > 1)
  // Everything but the model's states and the activations: the fetch window and zoe's buffers.
  std::uint64_t buffers() const {
    return fetch_window + swap_buffers + param_pool + param_bounces + staging + step_windows + accumulation;
  }
  std::uint64_t total() const {
    return weights16 + grads16 + master32 + moments + activations + swap_store + param_tier + grad_spill + buffers();
  }
};

// Each kind as the report names it: the text table's row, the JSON field, and its member of Bytes.
struct Kind {
  const char* label;
  const char* key;
  std::uint64_t Bytes::*member;
};
const std::vector<Kind>& kinds();

struct Usage {
  Bytes per_gpu, per_host, per_nvme_path;
};

// Bytes of the state arrays (`arrays`: Adam's two moments, Lion's or Adagrad's one) of `elements` parameters in
// the state dtype (int8, Adam's and Lion's: one byte each, plus an fp32 scale per block of each).
std::uint64_t moment_bytes(std::uint64_t elements, DType d, std::uint64_t arrays = 2);

// What one rank allocates beyond the model's states, from the code that allocates it (layout.cpp names
// each source); usage(), the step estimate and the report's explanation read it. Where the placement has
// no swap store or parameter tier, its figures are 0.
struct RankLayout {
  std::uint64_t part = 0;           // ceil(Ψ / ranks): the rank's parameters
  std::uint64_t tensors = 0;        // tensors (or shards of them) the rank holds
  std::uint64_t largest_local = 0;  // the rank's largest tensor (elements): FSDP2's shard of it at stage 3
  // Tier nvme.
  std::uint64_t store_elements = 0;    // part, each tensor rounded up to kMomentBlock with int8 moments
  std::uint64_t tile = 0;              // elements: the tile rounded up to the O_DIRECT block (and kMomentBlock)
  std::uint64_t tiles = 0;
  std::uint64_t slot_bytes = 0;        // tile x (4 + 2 x moment bytes) + int8's scales, rounded up to 4096
  std::uint64_t store_file_bytes = 0;  // the busiest path's file: two slots of each of its ceil(tiles / paths) tiles
  std::uint64_t table_file_bytes = 0;  // the tile table's file, on the first path: two copies, 4096-aligned
  std::uint64_t store_ram_bytes = 0;   // buffer_count slots and the tile table's 24 bytes per tile
  std::uint64_t window_elements = 0;   // each step window: max(32M, largest_local + 2 tiles)
  std::uint64_t window_count = 0;      // 2 on a GPU or spilled (weights, gradients), 1 where the CPU is the device
  // spill_grads (spills()): the file's bytes, every shard's 16-bit gradient 4096-aligned, and its two bounces.
  std::uint64_t spill_file_bytes = 0, spill_bounce_bytes = 0;
  // The parameter tier: its entries are the rank's shards, each aligned (4096 on NVMe, 256 in RAM).
  std::uint64_t entry_bytes = 0;       // one copy of every entry
  std::uint64_t largest_entry = 0, largest_block = 0;
  std::uint64_t param_file_bytes = 0;  // the busiest path's file: two slots per entry of its blocks
  std::uint64_t pool_bytes = 0;        // (prefetch + 2) x the largest block
  std::uint64_t bounce_bytes = 0;      // NVMe: one entry's, two blocks' (the step's writes), and on a GPU the
                                       // loaders' four blocks
};
// The step windows' floor in elements (the sync step on tier nvme streams through windows of at least this).
constexpr std::uint64_t kStepWindowElements = std::uint64_t{32} << 20;
// The gradient spill's bounce buffers, two of them (src/offload/grad_spill.h counts the same).
constexpr std::uint64_t kSpillBounceBytes = std::uint64_t{8} << 20;
// Whether the placement spills the gradients (Training::spill_grads where zoe can).
bool spills(const Placement& p, const Training& t);
RankLayout rank_layout(const Model& m, const Cluster& c, const Placement& p, const Training& t);
Usage usage(const Model& m, const Cluster& c, const Placement& p, const Training& t);
// One line per term the placement holds, with its bytes per rank and where they come from (the report's).
std::vector<std::string> explain(const Model& m, const Cluster& c, const Placement& p, const Training& t);

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

// One optimizer step (sync schedule), per node: CPU Adam over the node's partitions; the NVMe traffic of the
// swap store's slots and of the parameter tier (pipelined with Adam: the larger of the two counts); and the
// PCIe transfers each GPU makes around the step (its gradient partition down unless it is on the host, its
// weights up unless they go to the tier), which the sync schedule does not overlap; none where the CPU is
// the device. The parameter tier's reads happen in forward and backward (each block read twice, once
// more in backward after reshard_after_forward dropped it), its write in the step: both are counted, as
// NVMe time the iteration cannot go below.
struct StepEstimate {
  double cpu_adam_s = 0, nvme_s = 0, pcie_s = 0, total_s = 0;
  std::uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;    // per node: the three below together
  std::uint64_t swap_read_bytes = 0, swap_write_bytes = 0;    // per node: the swap store's slots
  std::uint64_t param_read_bytes = 0, param_write_bytes = 0;  // per node: the parameter tier's entries
  std::uint64_t spill_bytes = 0;  // per node, each way: the gradient spill's (written in backward, read by the step)
  std::uint64_t pcie_bytes = 0;                               // per GPU
};
StepEstimate estimate_step(const Model& m, const Cluster& c, const Placement& p, const Training& t, const Rates& r);

// The DeepSpeed-style config of a placement, as JSON text that zoe's config reader loads.
std::string deepspeed_config(const Placement& p, const Cluster& c, const Training& t);

}  // namespace zoe::plan
