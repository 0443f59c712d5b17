// What a rank of a placement holds, counted from the code that allocates it (plan.h: RankLayout, usage):
//  - tier nvme, src/offload/tier_nvme.cpp make_nvme_tier: with int8 moments every parameter starts a block
//    of the swap range (its elements rounded up to kMomentBlock); the tile is rounded up to the O_DIRECT
//    block of fp32 values (4096 / 4) and to kMomentBlock. src/nvme/swap_store.cpp: a slot is the tile's
//    p, m, v and int8's scales (slot_payload) rounded up to the alignment, the file two slots per tile of
//    its path (t % paths), and setup_runtime allocates buffer_count slots; swap_table.cpp: the tile table's
//    file is two copies of 32 + 24 bytes per tile + 4, each rounded up to 4096.
//  - the step (the sync schedule, which FSDP2 always runs): tier ram on a GPU, or with weights in a
//    parameter tier, keeps a whole 16-bit gradient staging and weight staging (optimizer_step.cpp allocate);
//    tier nvme streams through a 16-bit weight window and, on a GPU, a gradient window, each of max(32M,
//    the largest tensor + 2 tiles) elements (where the CPU is the device the gradients are read in place).
//  - the parameter tier, src/param/param_tier.cpp create: each entry (a shard) aligned (4096 on NVMe, 256 in
//    RAM), a block the sum of its entries, the pool (prefetch + 2) x the largest block; from NVMe on a GPU
//    four loader bounces of the largest block. param_home_nvme.cpp: the file two slots per entry of its
//    path's blocks (b % paths), one entry's bounce, and write_blocks' two block bounces.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "zoe/plan.h"

namespace zoe::plan {
namespace {

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }
std::uint64_t round_up(std::uint64_t a, std::uint64_t b) { return ceil_div(a, b) * b; }

constexpr std::uint64_t kDirectAlignment = 4096;  // O_DIRECT's block: swap slots and parameter entries on NVMe
constexpr std::uint64_t kPoolAlignment = 256;     // the parameter tier's entries in RAM and its pool
constexpr std::uint64_t kTableHeader = 32, kTableEntry = 24;  // swap_table.cpp's tile table

// A rank's shard of each tensor as FSDP2 cuts it (the first dimension, rank 0's, the largest), with how many
// the rank holds of it; a model known only by its largest tensor is one group of that tensor.
struct Shards {
  struct Shard {
    std::uint64_t elements, copies;
  };
  std::vector<Shard> layer, root;
  std::uint64_t layers = 0;
};

Shards shards_of(const Model& m, std::uint64_t ranks) {
  Shards s;
  auto cut = [ranks](const std::vector<Tensor>& from, std::vector<Shards::Shard>& to) {
    for (const Tensor& t : from) to.push_back({ceil_div(t.rows, ranks) * t.cols, t.copies});
  };
  cut(m.layer_tensors, s.layer);
  cut(m.root_tensors, s.root);
  s.layers = s.layer.empty() ? 0 : m.layers;
  if (s.layer.empty() && s.root.empty()) s.root.push_back({ceil_div(m.largest_tensor, ranks), 1});
  return s;
}

// Sum over every shard the rank holds of f(elements).
template <typename F>
std::uint64_t over_shards(const Shards& s, F f) {
  std::uint64_t layer = 0, root = 0;
  for (const Shards::Shard& x : s.layer) layer += x.copies * f(x.elements);
  for (const Shards::Shard& x : s.root) root += x.copies * f(x.elements);
  return s.layers * layer + root;
}

void swap_store_layout(RankLayout& r, const Shards& s, const Cluster& c, const Training& t) {
  const bool q8 = t.state == DType::i8;
  const std::uint64_t unit = q8 ? kMomentBlock : 1;
  r.store_elements = r.part + over_shards(s, [unit](std::uint64_t n) { return round_up(n, unit) - n; });
  r.tile = round_up(std::max<std::uint64_t>(t.tile, 1), std::max<std::uint64_t>(kDirectAlignment / 4, unit));
  r.tiles = ceil_div(r.store_elements, r.tile);
  const std::uint64_t moment = t.state == DType::f32 ? 4 : t.state == DType::bf16 ? 2 : 1;
  const std::uint64_t arrays = optimizer_rule(t.optimizer).states.size();  // Adam's m and v, or one
  const std::uint64_t scales = q8 ? arrays * (r.tile / kMomentBlock) * 4 : 0;  // one per block and array
  r.slot_bytes = round_up(r.tile * (4 + arrays * moment) + scales, kDirectAlignment);
  const std::uint64_t paths = std::max<std::uint64_t>(1, c.nvme_paths.size());
  r.store_file_bytes = 2 * ceil_div(r.tiles, paths) * r.slot_bytes;
  r.table_file_bytes = 2 * round_up(kTableHeader + kTableEntry * r.tiles + 4, kDirectAlignment);
  r.store_ram_bytes = t.buffer_count * r.slot_bytes + kTableEntry * r.tiles;
  r.window_elements = std::max(kStepWindowElements, r.largest_local + 2 * r.tile);
  r.window_count = c.cpu_device ? 1 : 2;
}

void spill_layout(RankLayout& r, const Shards& s) {
  r.spill_file_bytes = 2 * r.part + over_shards(s, [](std::uint64_t n) { return round_up(2 * n, kDirectAlignment) - 2 * n; });
  r.spill_bounce_bytes = 2 * kSpillBounceBytes;
  r.window_count = 2;  // the gradients come back from the file into a window of their own
}

void param_tier_layout(RankLayout& r, const Shards& s, const Cluster& c, const Placement& p, const Training& t) {
  const bool nvme = p.param == Offload::nvme;
  const std::uint64_t align = nvme ? kDirectAlignment : kPoolAlignment;
  const auto entry = [align](std::uint64_t n) { return round_up(2 * n, align); };
  // One copy of every entry: the partition's 16-bit bytes and each entry's padding to the alignment.
  r.entry_bytes = 2 * r.part + over_shards(s, [&entry](std::uint64_t n) { return entry(n) - 2 * n; });
  std::uint64_t layer_block = 0, root_block = 0;
  for (const Shards::Shard& x : s.layer) {
    layer_block += x.copies * entry(x.elements);
    r.largest_entry = std::max(r.largest_entry, entry(x.elements));
  }
  for (const Shards::Shard& x : s.root) {
    root_block += x.copies * entry(x.elements);
    r.largest_entry = std::max(r.largest_entry, entry(x.elements));
  }
  r.largest_block = std::max(layer_block, root_block);
  r.pool_bytes = r.largest_block * (t.prefetch + 2) / kPoolAlignment * kPoolAlignment;
  if (!nvme) return;
  // Blocks go round the paths: no path holds more than its even share and one block.
  const std::uint64_t paths = std::max<std::uint64_t>(1, c.nvme_paths.size());
  r.param_file_bytes = 2 * std::min(r.entry_bytes, ceil_div(r.entry_bytes, paths) + r.largest_block);
  const std::uint64_t block = std::max(r.largest_block, kDirectAlignment);
  // A GPU's loaders read through four pinned bounces; the CPU's read into the pool itself.
  r.bounce_bytes = std::max(r.largest_entry, kDirectAlignment) + 2 * block + (c.cpu_device ? 0 : 4 * block);
}

}  // namespace

RankLayout rank_layout(const Model& m, const Cluster& c, const Placement& p, const Training& t) {
  RankLayout r;
  const std::uint64_t ranks = std::max<std::uint64_t>(1, c.ranks());
  r.part = ceil_div(m.params, ranks);
  const Shards s = shards_of(m, ranks);
  r.tensors = over_shards(s, [](std::uint64_t) { return std::uint64_t{1}; });
  // FSDP2 (stage 3) steps shards; zoe's own partition (stages 1, 2) pieces of at most the partition.
  r.largest_local = p.stage == 3 ? ceil_div(m.largest_tensor, ranks) : std::min(m.largest_tensor, r.part);
  for (const std::vector<Shards::Shard>* group : {&s.layer, &s.root}) {
    for (const Shards::Shard& x : *group) {
      if (p.stage == 3) r.largest_local = std::max(r.largest_local, x.elements);
    }
  }
  if (p.optimizer == Offload::nvme) swap_store_layout(r, s, c, t);
  if (spills(p, t)) spill_layout(r, s);
  if (p.param != Offload::none) param_tier_layout(r, s, c, p, t);
  return r;
}

namespace {

std::string count(std::uint64_t n) {
  char b[32];
  if (n >= 1'000'000'000) {
    std::snprintf(b, sizeof b, "%.2fG", n / 1e9);
  } else if (n >= 1'000'000) {
    std::snprintf(b, sizeof b, "%.2fM", n / 1e6);
  } else {
    std::snprintf(b, sizeof b, "%llu", static_cast<unsigned long long>(n));
  }
  return b;
}

std::string bytes(std::uint64_t n) { return format_bytes(n); }

// The swap store's terms (tier nvme).
void explain_store(const RankLayout& r, const Cluster& c, const Training& t, std::vector<std::string>& out) {
  const std::string arrays = std::to_string(optimizer_rule(t.optimizer).states.size());
  const std::string moments = t.state == DType::f32    ? arrays + " x 4 B"
                              : t.state == DType::bf16 ? arrays + " x 2 B"
                                                       : arrays + " x 1 B + " + arrays + " x 4 B / 2048";
  out.push_back("swap store (2 slots): " + count(r.store_elements) + " elements" +
                (t.state == DType::i8 ? " (each tensor rounded up to 2048)" : "") + " in " + count(r.tiles) +
                " tiles of " + std::to_string(r.tile) + "; a slot is a tile's master 4 B + moments " + moments +
                " per element, rounded up to 4096 = " + bytes(r.slot_bytes) +
                "; two slots per tile (a step writes the slot the table does not name) = " +
                bytes(r.store_file_bytes) + " on the busiest of " +
                std::to_string(std::max<std::size_t>(1, c.nvme_paths.size())) + " path(s), tile table " +
                bytes(r.table_file_bytes));
  out.push_back("swap buffers: " + std::to_string(t.buffer_count) + " slots of " + bytes(r.slot_bytes) +
                " (buffer_count) and the tile table's 24 B per tile = " + bytes(r.store_ram_bytes));
  out.push_back("step windows: " + std::to_string(r.window_count) + " x max(32M, largest tensor " +
                count(r.largest_local) + " + 2 tiles) x 2 B = " + bytes(r.window_count * r.window_elements * 2) +
                (r.window_count == 1 ? " (16-bit weights; the CPU's gradients are read in place)"
                                     : " (16-bit weights, and the gradients back: no model-sized copy on the host)"));
}

// The parameter tier's terms.
void explain_tier(const RankLayout& r, const Cluster& c, const Placement& p, std::vector<std::string>& out) {
  const char* dev = c.cpu_device ? "host RAM (the CPU is the device)" : "GPU memory";
  if (p.param == Offload::cpu) {
    out.push_back("weights16: the parameter tier's RAM home, pinned: " + count(r.tensors) +
                  " entries of 2 B per element, each 256-aligned = " + bytes(r.entry_bytes));
  } else {
    out.push_back("parameter tier (2 slots): " + count(r.tensors) + " entries of 2 B per element, each 4096-aligned = " +
                  bytes(r.entry_bytes) + "; two slots per entry (a write never overwrites the valid copy) = " +
                  bytes(2 * r.entry_bytes) + ", at most " + bytes(r.param_file_bytes) + " on the busiest path");
    out.push_back("parameter bounces: one entry " + bytes(std::max<std::uint64_t>(r.largest_entry, 4096)) +
                  ", two blocks for the step's writes" +
                  (c.cpu_device ? "" : " and four for the loaders' reads") + ", the largest block " +
                  bytes(r.largest_block) + " = " + bytes(r.bounce_bytes));
  }
  out.push_back("parameter pool: (prefetch + 2) x the largest block " + bytes(r.largest_block) + " = " +
                bytes(r.pool_bytes) + ", in " + dev);
}

}  // namespace

std::vector<std::string> explain(const Model& m, const Cluster& c, const Placement& p, const Training& t) {
  const RankLayout r = rank_layout(m, c, p, t);
  std::vector<std::string> out;
  const bool host_grads = c.cpu_device || (p.stage == 3 && t.grads_on_host);
  const std::string grads = p.stage == 3 ? "FSDP2's reduce-scattered shards, kept until the step"
                            : p.stage == 2 ? "the rank's partition" : "the whole model's";
  if (spills(p, t)) {
    out.push_back("gradient spill (spill_grads): each shard's 16-bit gradient written to the first NVMe path as "
                  "backward ends, each 4096-aligned = " + bytes(r.spill_file_bytes) + "; two bounces = " +
                  bytes(r.spill_bounce_bytes) + " (in swap buffers); no trainer's grads16 kept");
  } else {
    out.push_back("trainer's grads16: 2 B per parameter, " + grads + ", in " +
                  (host_grads ? std::string(c.cpu_device ? "host RAM (the CPU is the device)" : "host RAM (CPUOffloadPolicy)")
                              : std::string("GPU memory")));
  }
  if (p.optimizer == Offload::cpu) {
    out.push_back("master32 + moments: " + count(r.part) + " parameters in host RAM (tier ram)");
    if (!c.cpu_device || p.param != Offload::none) {
      out.push_back("staging: whole 16-bit gradient and weight copies of the partition, 2 + 2 B x " + count(r.part) +
                    " = " + bytes(4 * r.part));
    }
  }
  if (p.optimizer == Offload::nvme) explain_store(r, c, t, out);
  if (p.param != Offload::none) explain_tier(r, c, p, out);
  if (p.optimizer != Offload::none && t.grad_accumulation > 1) {
    out.push_back("accumulation: fp32 sums of the micro-batches, 4 B x " + count(r.part) + " = " + bytes(4 * r.part));
  }
  return out;
}

}  // namespace zoe::plan
