// zoe plan's arithmetic against hand-computed cases: each expected number is written as its formula (Ψ
// parameters, N ranks, n GPUs per node, P = Ψ / N the partition), after the ZeRO paper's memory analysis.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "zoe/plan.h"
#include "zoe/config.h"

namespace zoe::plan {
namespace {

constexpr std::uint64_t kPsi = 7'500'000'000;  // the ZeRO paper's example: 7.5B parameters on 64 GPUs

Cluster dgx_cluster(std::uint64_t nodes = 8) {
  Cluster c;
  c.gpus_per_node = 8;
  c.nodes = nodes;
  c.gpu_mem = 80ull << 30;
  c.host_ram = 1ull << 40;
  return c;
}

Model bare(std::uint64_t params, std::uint64_t largest) {
  Model m;
  m.params = params;
  m.largest_tensor = largest;
  return m;
}

TEST(Plan, StagesOnTheGpuFollowTheZeroPaper) {
  const Model m = bare(kPsi, 100'000'000);
  const Cluster c = dgx_cluster();
  const std::uint64_t P = kPsi / 64;  // 117,187,500
  const Usage s1 = usage(m, c, {1, Offload::none, Offload::none}, {});
  EXPECT_EQ(s1.per_gpu.weights16, 2 * kPsi);
  EXPECT_EQ(s1.per_gpu.grads16, 2 * kPsi);
  EXPECT_EQ(s1.per_gpu.master32, 4 * P);
  EXPECT_EQ(s1.per_gpu.moments, 8 * P);
  EXPECT_EQ(s1.per_gpu.total(), 31'406'250'000u);  // 2Ψ + 2Ψ + 12Ψ/N: the paper's 31.4 GB
  const Usage s2 = usage(m, c, {2, Offload::none, Offload::none}, {});
  EXPECT_EQ(s2.per_gpu.grads16, 2 * P);
  EXPECT_EQ(s2.per_gpu.total(), 16'640'625'000u);  // 2Ψ + 14Ψ/N: the paper's 16.6 GB
  const Usage s3 = usage(m, c, {3, Offload::none, Offload::none}, {});
  EXPECT_EQ(s3.per_gpu.weights16, 2 * P);
  // 16Ψ/N (the paper's 1.9 GB) plus the fetch window: (prefetch 2 + 1) modules' weights and one's gradient.
  EXPECT_EQ(s3.per_gpu.fetch_window, (2 + 1) * 2 * 100'000'000u + 2 * 100'000'000u);
  EXPECT_EQ(s3.per_gpu.buffers(), s3.per_gpu.fetch_window);
  EXPECT_EQ(s3.per_gpu.total() - s3.per_gpu.buffers(), 1'875'000'000u);
  EXPECT_EQ(s1.per_host.total(), 0u);
  EXPECT_EQ(s1.per_nvme_path.total(), 0u);
}

// The 7.5B example on 64 GPUs, offloaded. The model is known by its largest tensor only (1e8 elements): one
// group of that tensor, whose shard is ceil(1e8 / 64) = 1,562,500 elements (3,125,000 bytes; 3,125,248 aligned
// to 256 in RAM and to 4096 on NVMe, both 12208 x 256 = 763 x 4096).
TEST(Plan, OffloadedStateLivesOnTheHostOrTheNvmePaths) {
  const Model m = bare(kPsi, 100'000'000);
  Cluster c = dgx_cluster();
  const std::uint64_t P = kPsi / 64, n = 8;
  const Usage cpu = usage(m, c, {2, Offload::cpu, Offload::none}, {});
  EXPECT_EQ(cpu.per_gpu.master32 + cpu.per_gpu.moments, 0u);
  EXPECT_EQ(cpu.per_host.master32, n * 4 * P);
  EXPECT_EQ(cpu.per_host.moments, n * 8 * P);
  // optimizer_step.cpp allocate(): on a GPU tier ram stages the whole 16-bit gradient and weight partitions.
  EXPECT_EQ(cpu.per_host.staging, n * (2 * P + 2 * P));
  EXPECT_EQ(cpu.per_host.buffers(), n * (2 * P + 2 * P));
  Training accumulating;
  accumulating.grad_accumulation = 4;
  EXPECT_EQ(usage(m, c, {2, Offload::cpu, Offload::none}, accumulating).per_host.accumulation, n * 4 * P);

  c.nvme_paths = {"/a", "/b"};
  c.nvme_capacity = {1ull << 40, 1ull << 40};
  Training t;
  const Usage nvme = usage(m, c, {2, Offload::nvme, Offload::none}, t);
  // The state's bytes are the swap store's file, not separate kinds.
  EXPECT_EQ(nvme.per_nvme_path.master32 + nvme.per_nvme_path.moments, 0u);
  // swap_store.cpp: a slot is 2^20 x 12 B (fp32 master and moments); ceil(P / 2^20) = 112 tiles, 56 on each
  // path, two slots each; the tile table (on the first path) two copies of 32 + 24 x 112 + 4 bytes -> 4096.
  const std::uint64_t slot = (1u << 20) * 12;
  EXPECT_EQ(nvme.per_nvme_path.swap_store, n * (2 * 56 * slot + 2 * 4096));
  // Its RAM: buffer_count slots and the table's 24 bytes per tile.
  EXPECT_EQ(nvme.per_host.swap_buffers, n * (4 * slot + 24 * 112));
  // No whole staging on tier nvme: a weight and a gradient window of max(32M, the largest piece 1e8 + 2
  // tiles) 16-bit elements each.
  EXPECT_EQ(nvme.per_host.staging, 0u);
  EXPECT_EQ(nvme.per_host.step_windows, n * 2 * (100'000'000u + 2 * (1u << 20)) * 2);
  EXPECT_EQ(nvme.per_gpu.grads16, 2 * P);  // the trainer's (stage 2) partition stays on the GPU

  const std::uint64_t shard = 3'125'248;  // one 16-bit shard, aligned (above)
  const Usage param_cpu = usage(m, c, {3, Offload::cpu, Offload::cpu}, t);
  EXPECT_EQ(param_cpu.per_gpu.weights16, 0u);
  EXPECT_EQ(param_cpu.per_gpu.grads16, 2 * P);  // FSDP2's gradient shards, on the GPU
  EXPECT_EQ(param_cpu.per_gpu.fetch_window, 4 * 2 * 100'000'000u);
  EXPECT_EQ(param_cpu.per_gpu.param_pool, (2 + 2) * shard);  // (prefetch + 2) x the largest block
  EXPECT_EQ(param_cpu.per_host.weights16, n * (2 * P + shard - 3'125'000));  // the RAM home, 256-aligned entries
  EXPECT_EQ(param_cpu.per_host.staging, n * 4 * P);  // tier ram with tiered weights stages too
  EXPECT_EQ(param_cpu.per_host.grads16, 0u);
  const Usage param_nvme = usage(m, c, {3, Offload::nvme, Offload::nvme}, t);
  EXPECT_EQ(param_nvme.per_nvme_path.weights16, 0u);
  // param_home_nvme.cpp: two slots per 4096-aligned entry; blocks go round the two paths, so the busiest
  // holds at most half the entries and one block.
  const std::uint64_t entries = 2 * P + shard - 3'125'000;
  EXPECT_EQ(param_nvme.per_nvme_path.param_tier, n * 2 * ((entries + 1) / 2 + shard));
  // Bounces: one entry, write_blocks' two blocks and the GPU loaders' four.
  EXPECT_EQ(param_nvme.per_host.param_bounces, n * (1 + 2 + 4) * shard);
  // Stage 3's pieces are shards of 1,562,500 elements: the windows are at their 32M floor.
  EXPECT_EQ(param_nvme.per_host.step_windows, n * 2 * (32u << 20) * 2);
  EXPECT_EQ(param_nvme.per_host.grads16, 0u);  // no gradient copy on the host
  EXPECT_EQ(param_nvme.per_gpu.grads16, 2 * P);
  Training on_host = t;
  on_host.grads_on_host = true;  // CPUOffloadPolicy
  const Usage policy = usage(m, c, {3, Offload::nvme, Offload::nvme}, on_host);
  EXPECT_EQ(policy.per_gpu.grads16, 0u);
  EXPECT_EQ(policy.per_host.grads16, n * 2 * P);
}

// A two-tensor model whose sizes are not multiples of anything, so that every rounding shows: a layer of one
// 3000-element tensor and a root group of one 5000-element tensor (8000 parameters).
Model odd_model() {
  Model m;
  m.params = 8000;
  m.largest_tensor = 5000;
  m.layers = 1;
  m.layer_tensors = {{3000, 1}};
  m.root_tensors = {{5000, 1}};
  return m;
}

TEST(Plan, SwapStoreSlotsFollowTheStoresLayout) {
  const Model m = odd_model();
  Cluster c;
  c.gpu_mem = 80ull << 30;
  c.nvme_paths = {"/a"};
  Training t;
  t.state = DType::i8;
  t.tile = 3000;
  const RankLayout r = rank_layout(m, c, {2, Offload::nvme, Offload::none}, t);
  // tier_nvme.cpp: with int8 moments each parameter starts a 2048-element block: 4096 + 6144.
  EXPECT_EQ(r.store_elements, 4096u + 6144u);
  // The tile: a multiple of 2048 (int8 blocks) and of 1024 (4096-byte fp32 arrays): 3000 -> 4096; 3 tiles.
  EXPECT_EQ(r.tile, 4096u);
  EXPECT_EQ(r.tiles, 3u);
  // swap_impl.h slot_payload: 4096 x (4 + 2 x 1) + 2 moments x 2 scales x 4 B = 24,592, rounded to 4096.
  EXPECT_EQ(r.slot_bytes, 28'672u);
  EXPECT_EQ(r.store_file_bytes, 2u * 3 * 28'672);
  EXPECT_EQ(r.table_file_bytes, 2u * 4096);
  EXPECT_EQ(r.store_ram_bytes, 4u * 28'672 + 24 * 3);
  c.nvme_paths = {"/a", "/b"};  // tiles 0 and 2 on the first path
  EXPECT_EQ(rank_layout(m, c, {2, Offload::nvme, Offload::none}, t).store_file_bytes, 2u * 2 * 28'672);
  t.state = DType::bf16;
  t.tile = 1000;  // bf16: no block rounding; the tile a multiple of 1024
  const RankLayout b = rank_layout(m, c, {2, Offload::nvme, Offload::none}, t);
  EXPECT_EQ(b.store_elements, 8000u);
  EXPECT_EQ(b.tile, 1024u);
  EXPECT_EQ(b.slot_bytes, 1024u * (4 + 2 * 2));
  t.state = DType::f32;
  t.tile = 1 << 20;
  EXPECT_EQ(rank_layout(m, c, {2, Offload::nvme, Offload::none}, t).slot_bytes, (1u << 20) * 12);
  // Lion and Adagrad keep one state array (zoe/optimizers.h): swap_impl.h's [p | m] slot, 8 bytes per element.
  t.optimizer = Rule::lion;
  EXPECT_EQ(rank_layout(m, c, {2, Offload::nvme, Offload::none}, t).slot_bytes, (1u << 20) * 8);
  t.state = DType::bf16;
  t.optimizer = Rule::adagrad;
  EXPECT_EQ(rank_layout(m, c, {2, Offload::nvme, Offload::none}, t).slot_bytes, (1u << 20) * 6);
}

TEST(Plan, ParameterTierEntriesPoolAndBounces) {
  const Model m = odd_model();
  Cluster c;
  c.gpus_per_node = 2;  // FSDP2 over two ranks: shards of 1500 and 2500 elements (rank 0's)
  c.gpu_mem = 80ull << 30;
  c.nvme_paths = {"/a"};
  const Training t;
  const RankLayout nv = rank_layout(m, c, {3, Offload::nvme, Offload::nvme}, t);
  // param_tier.cpp create: entries of 3000 and 5000 bytes, aligned to 4096 on NVMe.
  EXPECT_EQ(nv.entry_bytes, 4096u + 8192u);
  EXPECT_EQ(nv.largest_block, 8192u);
  EXPECT_EQ(nv.pool_bytes, (2u + 2) * 8192);
  EXPECT_EQ(nv.param_file_bytes, 2u * (4096 + 8192));  // param_home_nvme.cpp: two slots per entry
  EXPECT_EQ(nv.bounce_bytes, 8192u + 2 * 8192 + 4 * 8192);
  const Usage u = usage(m, c, {3, Offload::nvme, Offload::nvme}, t);
  EXPECT_EQ(u.per_nvme_path.param_tier, 2u * 2 * (4096 + 8192));  // both ranks' files
  EXPECT_EQ(u.per_gpu.param_pool, 4u * 8192);
  EXPECT_EQ(u.per_host.param_bounces, 2u * 7 * 8192);
  // The RAM home aligns entries to 256: 3072 and 5120, pinned.
  const RankLayout ram = rank_layout(m, c, {3, Offload::cpu, Offload::cpu}, t);
  EXPECT_EQ(ram.entry_bytes, 3072u + 5120u);
  EXPECT_EQ(ram.pool_bytes, 4u * 5120);
  EXPECT_EQ(ram.bounce_bytes, 0u);
  EXPECT_EQ(usage(m, c, {3, Offload::cpu, Offload::cpu}, t).per_host.weights16, 2u * (3072 + 5120));
  // The CPU as the device reads NVMe into the pool itself: no loader bounces, the pool in host RAM.
  c.cpu_device = true;
  c.gpus_per_node = 1;
  const Usage host = usage(m, c, {3, Offload::nvme, Offload::nvme}, t);
  EXPECT_EQ(host.per_gpu.total(), 0u);
  // One rank: whole tensors of 6000 and 10000 bytes, entries of 8192 and 12288.
  EXPECT_EQ(host.per_host.param_bounces, 12'288u + 2 * 12'288);
  EXPECT_EQ(host.per_host.param_pool, 4u * 12'288);
}

// issue 51: a 1.10B Llama (hidden 2048, 22 layers, intermediate 5632, vocab 32000, 32 heads, 4 kv heads,
// untied) on a machine without a GPU, FSDP2 world 1, weights and state on NVMe, int8 moments. Every tensor is
// a multiple of 2048 elements and 4096 bytes, so nothing is rounded: Ψ = 22 x 44,044,288 + 131,074,048.
Result<Model> llama_1b() {
  return model_from_config(R"({"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22,
      "intermediate_size": 5632, "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 4,
      "hidden_act": "silu", "tie_word_embeddings": false})", "llama-1b.json");
}

TEST(Plan, CpuOnlyMachineHoldsEverythingInHostRam) {
  Result<Model> m = llama_1b();
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const std::uint64_t psi = 1'100'048'384;
  ASSERT_EQ(m->params, psi);
  Cluster c;
  c.cpu_device = true;
  c.host_ram = 24ull << 30;
  c.nvme_paths = {"/nvme"};
  c.nvme_capacity = {66ull << 30};
  Training t;
  t.state = DType::i8;
  const Placement p{3, Offload::nvme, Offload::nvme};
  const Usage u = usage(*m, c, p, t);
  EXPECT_EQ(u.per_gpu.total(), 0u);
  const Bytes& h = u.per_host;
  EXPECT_EQ(h.grads16, 2 * psi);                      // FSDP2's bf16 gradients, on the CPU
  EXPECT_EQ(h.fetch_window, 4u * 65'536'000 * 2);     // (prefetch + 1) + 1 embeddings (32000 x 2048)
  EXPECT_EQ(h.param_pool, 4u * 262'148'096);           // the root group: two embeddings and the norm, 16-bit
  EXPECT_EQ(h.param_bounces, 131'072'000u + 2 * 262'148'096);  // one entry, two blocks; no loaders
  EXPECT_EQ(h.swap_buffers, 4u * 6'295'552 + 24 * 1050);  // slots of 2^20 x 6 B + 2 x 512 scales x 4 B
  EXPECT_EQ(h.step_windows, (65'536'000u + 2 * (1u << 20)) * 2);  // one window: the CPU's gradients in place
  EXPECT_EQ(h.weights16 + h.master32 + h.moments + h.staging, 0u);
  EXPECT_EQ(h.total(), 4'588'819'056u);  // 4.27 GiB
  // ceil(Ψ / 2^20) = 1050 tiles, two slots each; the table 2 x (32 + 24 x 1050 + 4 -> 28,672).
  EXPECT_EQ(u.per_nvme_path.swap_store, 2ull * 1050 * 6'295'552 + 2 * 28'672);
  EXPECT_EQ(u.per_nvme_path.param_tier, 2 * 2 * psi);
  EXPECT_EQ(u.per_nvme_path.total(), 17'620'910'080u);  // 16.41 GiB
  EXPECT_TRUE(check(u, c).fits);
  Rates r;
  r.adam_params_per_s = 1e9;
  r.nvme_read_gbps = r.nvme_write_gbps = 2;
  r.pcie_gbps = 25;
  const StepEstimate s = estimate_step(*m, c, p, t, r);
  EXPECT_EQ(s.swap_read_bytes, 1050ull * 6'295'552);
  EXPECT_EQ(s.param_read_bytes, 2 * 2 * psi);  // forward and backward read every block
  EXPECT_EQ(s.param_write_bytes, 2 * psi);
  EXPECT_EQ(s.pcie_bytes, 0u);  // the CPU is the device
  EXPECT_DOUBLE_EQ(s.nvme_s, (1050.0 * 6'295'552 + 4.0 * psi) / 2e9 + (1050.0 * 6'295'552 + 2.0 * psi) / 2e9);
  EXPECT_DOUBLE_EQ(s.total_s, s.nvme_s);
}

TEST(Plan, ConfigTensorsAddUpToTheCount) {
  Result<Model> m = llama_1b();
  ASSERT_TRUE(m.ok());
  std::uint64_t layer = 0, root = 0;
  for (const Tensor& x : m->layer_tensors) layer += x.rows * x.cols * x.copies;
  for (const Tensor& x : m->root_tensors) root += x.rows * x.cols * x.copies;
  EXPECT_EQ(layer, 44'044'288u);
  EXPECT_EQ(root, 131'074'048u);
  EXPECT_EQ(m->layers * layer + root, m->params);
  Result<Model> gpt2 = model_from_config(
      R"({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
          "n_positions": 1024})", "gpt2.json");
  ASSERT_TRUE(gpt2.ok());
  std::uint64_t total = 0;
  for (const Tensor& x : gpt2->layer_tensors) total += gpt2->layers * x.rows * x.cols * x.copies;
  for (const Tensor& x : gpt2->root_tensors) total += x.rows * x.cols * x.copies;
  EXPECT_EQ(total, gpt2->params);
}

// issue 51: the ZeRO-Infinity paper's DGX-2 (16 GPUs of 32 GB, 1.5 TB of RAM, NVMe) and a trillion
// parameters. zoe's host RAM holds buffers, not a copy of the gradients; but FSDP2 keeps its 16-bit gradient
// shards until the step: 2 TB in all, 116.4 GiB per GPU, or 1.82 TiB of host RAM with CPUOffloadPolicy.
TEST(Plan, ATrillionParametersOnOneDgx2) {
  const Model m = model_from_params(1'000'000'000'000);
  Cluster c;
  c.gpus_per_node = 16;
  c.gpu_mem = 32ull << 30;
  c.host_ram = 3ull << 39;  // 1.5 TiB
  c.nvme_paths = {"/nvme"};
  c.nvme_capacity = {30ull << 40};
  const Placement p{3, Offload::nvme, Offload::nvme};
  Training t;
  const Usage u = usage(m, c, p, t);
  const std::uint64_t part = 1'000'000'000'000 / 16;
  EXPECT_EQ(u.per_host.grads16, 0u);
  EXPECT_EQ(u.per_host.staging, 0u);
  EXPECT_LT(u.per_host.total(), usable_host(c) / 10);  // buffers: a few GiB per rank
  EXPECT_EQ(u.per_gpu.grads16, 2 * part);
  const Verdict v = check(u, c);
  EXPECT_FALSE(v.fits);
  EXPECT_EQ(v.why.rfind("GPU: needs", 0), 0u) << v.why;
  EXPECT_NE(v.why.find("trainer's grads16 116.4 GiB"), std::string::npos) << v.why;
  t.grads_on_host = true;
  const Verdict host = check(usage(m, c, p, t), c);
  EXPECT_FALSE(host.fits);
  EXPECT_NE(host.why.find("trainer's grads16 1.82 TiB"), std::string::npos) << host.why;
  // Two such nodes: each holds half the gradient shards (0.91 TiB) in host RAM, and the plan fits.
  c.nodes = 2;
  const Usage two = usage(m, c, p, t);
  EXPECT_EQ(two.per_host.grads16, 16 * 2 * (part / 2));
  EXPECT_TRUE(check(two, c).fits) << check(two, c).why;
  // One node again, the shards spilled to NVMe as backward produces them (spill_grads): neither the GPUs nor
  // the host keep them, the NVMe path holds them beside the swap store and the parameter tier, and it fits.
  c.nodes = 1;
  t.grads_on_host = false;
  t.spill_grads = true;
  const Usage spilled = usage(m, c, p, t);
  EXPECT_EQ(spilled.per_gpu.grads16, 0u);
  EXPECT_EQ(spilled.per_host.grads16, 0u);
  EXPECT_GE(spilled.per_nvme_path.grad_spill, 2 * m.params);
  EXPECT_LT(spilled.per_nvme_path.grad_spill, 2 * m.params + 16 * 4096 * (m.layers * 6 + 1));
  EXPECT_TRUE(check(spilled, c).fits) << check(spilled, c).why;
  // The spill's two bounces per rank join the swap buffers.
  t.spill_grads = false;
  EXPECT_EQ(spilled.per_host.swap_buffers, usage(m, c, p, t).per_host.swap_buffers + 16 * 2 * kSpillBounceBytes);
  t.spill_grads = true;
  // Spilling is for stage 3 with the optimizer on NVMe: any other placement keeps the trainer's gradients.
  EXPECT_EQ(usage(m, c, Placement{3, Offload::cpu, Offload::nvme}, t).per_gpu.grads16, 2 * part);
}

TEST(Plan, LowBitMoments) {
  EXPECT_EQ(moment_bytes(4096, DType::f32), 8 * 4096u);
  EXPECT_EQ(moment_bytes(4096, DType::bf16), 4 * 4096u);
  // One byte per moment and element, and one fp32 scale per block of 2048 per moment: 2 blocks here.
  EXPECT_EQ(moment_bytes(4096, DType::i8), 2 * 4096u + 2 * 4 * 2);
  EXPECT_EQ(moment_bytes(4097, DType::i8), 2 * 4097u + 2 * 4 * 3);
  // One state array (Lion, Adagrad): half of Adam's two, as tier ram allocates them.
  EXPECT_EQ(moment_bytes(4096, DType::f32, 1), 4 * 4096u);
  EXPECT_EQ(moment_bytes(4096, DType::bf16, 1), 2 * 4096u);
  const Model m = bare(kPsi, 100'000'000);
  Training lion;
  lion.optimizer = Rule::lion;
  const Usage u = usage(m, dgx_cluster(), {2, Offload::cpu, Offload::none}, lion);
  EXPECT_EQ(u.per_host.moments, 8 * 4 * (kPsi / 64));
}

TEST(Plan, ActivationEstimate) {
  Model m = bare(6'738'415'616, 1);
  m.layers = 32;
  m.hidden = 4096;
  m.heads = 32;
  Training t;
  t.micro_batch = 1;
  t.seq_len = 2048;
  // s b h (34 + 5 a s / h) per layer = 2048 * 4096 * (34 + 80) = 956,301,312; times 32 layers.
  EXPECT_EQ(usage(m, dgx_cluster(), {2, Offload::cpu, Offload::none}, t).per_gpu.activations, 32 * 956'301'312ull);
  t.activation_checkpointing = true;  // each layer's input (2 s b h) and one layer recomputed
  EXPECT_EQ(usage(m, dgx_cluster(), {2, Offload::cpu, Offload::none}, t).per_gpu.activations,
            32ull * 2 * 2048 * 4096 + 956'301'312ull);
}

TEST(Plan, ModelConfigsGiveTheKnownParameterCounts) {
  // GPT-2 small: 124,439,808 parameters (learned positions, biases, LayerNorm, tied embeddings).
  Result<Model> gpt2 = model_from_config(
      R"({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
          "n_positions": 1024, "activation_function": "gelu_new"})", "gpt2.json");
  ASSERT_TRUE(gpt2.ok()) << gpt2.status().to_string();
  EXPECT_EQ(gpt2->params, 124'439'808u);
  EXPECT_EQ(gpt2->largest_tensor, 50257u * 768);  // the embedding
  // Llama-2-7B: 6,738,415,616 (gated MLP, RMSNorm, untied head).
  Result<Model> llama = model_from_config(
      R"({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008,
          "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "hidden_act": "silu",
          "tie_word_embeddings": false})", "llama.json");
  ASSERT_TRUE(llama.ok()) << llama.status().to_string();
  EXPECT_EQ(llama->params, 6'738'415'616u);
  EXPECT_EQ(llama->largest_tensor, 4096u * 32000);

  Result<Model> partial = model_from_config(R"({"hidden_size": 64, "vocab_size": 10})", "bad.json");
  ASSERT_FALSE(partial.ok());
  EXPECT_EQ(partial.status().message(), "bad.json: missing num_hidden_layers (or n_layer), num_attention_heads (or n_head)");
  EXPECT_FALSE(model_from_config("[1, 2]", "list.json").ok());
  EXPECT_FALSE(model_from_config(R"({"n_layer": -1, "n_embd": 8, "n_head": 1, "vocab_size": 4})", "neg.json").ok());
}

// Issue 32: a key of the wrong type threw from nlohmann's value() and `zoe plan --model` aborted (25 of
// 250 mutated configs). Each is now an error naming the key, its value and the file.
TEST(Plan, ModelConfigKeysOfTheWrongTypeAreNamed) {
  const std::string base = R"("num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100)";
  for (const auto& [extra, message] : {
           std::pair{R"("tie_word_embeddings": 1)", "m.json: 'tie_word_embeddings' must be true or false, not 1"},
           std::pair{R"("model_type": 7)", "m.json: 'model_type' must be a string, not 7"},
           std::pair{R"("hidden_act": ["silu"])", "m.json: 'hidden_act' must be a string, not [\"silu\"]"},
           std::pair{R"("activation_function": {})", "m.json: 'activation_function' must be a string, not {}"},
           std::pair{R"("attention_bias": "yes")", "m.json: 'attention_bias' must be true or false, not \"yes\""},
           std::pair{R"("hidden_size": 64.0)", "m.json: 'hidden_size' must be a positive integer, not 64.0"},
           std::pair{R"("vocab_size": 18446744073709551615)",
                     "m.json: its sizes give 1.18e+21 parameters, more than zoe plan counts (100T)"},
       }) {
    Result<Model> m = model_from_config("{" + base + ", " + extra + "}", "m.json");
    ASSERT_FALSE(m.ok()) << extra;
    EXPECT_EQ(m.status().code(), StatusCode::invalid_argument);
    EXPECT_EQ(m.status().message(), message);
  }
  // Found by the fuzzer under AddressSanitizer: a deeply nested value before other keys overflowed the stack.
  const std::string deep = std::string(20000, '[') + std::string(20000, ']');
  Result<Model> nested = model_from_config(R"({"architectures": )" + deep + ", " + base + "}", "m.json");
  ASSERT_FALSE(nested.ok());
  EXPECT_EQ(nested.status().message(), "m.json: nests arrays or objects more than 64 levels deep: not a model config");
  // null stands for absent, as Hugging Face writes it.
  Result<Model> nulls = model_from_config("{" + base + R"(, "model_type": null, "tie_word_embeddings": null})", "m.json");
  ASSERT_TRUE(nulls.ok()) << nulls.status().to_string();
  EXPECT_NE(nulls->description.find("tied embeddings"), std::string::npos);
}

TEST(Plan, Sizes) {
  EXPECT_EQ(parse_param_count("7.5B").value(), 7'500'000'000u);
  EXPECT_EQ(parse_param_count("350M").value(), 350'000'000u);
  EXPECT_EQ(parse_param_count("1T").value(), 1'000'000'000'000u);
  EXPECT_EQ(parse_param_count("125000").value(), 125'000u);
  EXPECT_EQ(parse_bytes("80G", "--gpu-mem").value(), 80ull << 30);
  EXPECT_EQ(parse_bytes("1.5T", "--host-ram").value(), 3ull << 39);
  const Status bad = parse_param_count("7X").status();
  EXPECT_EQ(bad.message(), "--params: unknown suffix 'X' in '7X' (use e.g. 350M, 7.5B, 1T)");
  EXPECT_FALSE(parse_param_count("").ok());
  EXPECT_FALSE(parse_param_count("B").ok());
  EXPECT_FALSE(parse_param_count("-3B").ok());
  EXPECT_FALSE(parse_bytes("1e30", "--gpu-mem").ok());
}

TEST(Plan, PlacementsAreTriedLeastOffloadFirst) {
  const std::vector<Placement> all = candidates();
  ASSERT_EQ(all.size(), 12u);
  EXPECT_EQ(placement_name(all.front()), "stage 1, optimizer none, params none");
  EXPECT_EQ(placement_name(all.back()), "stage 3, optimizer nvme, params nvme");
  for (const Placement& p : all) {
    if (p.param != Offload::none) {
      EXPECT_EQ(p.stage, 3) << placement_name(p);
    }
  }
  // 7.5B on one 80 GiB GPU (76 GiB usable): all on the GPU is 16Ψ = 120e9 B = 111.8 GiB, too much.
  const Model m = bare(kPsi, 100'000'000);
  Cluster one;
  one.gpu_mem = 80ull << 30;
  one.host_ram = 100ull << 30;
  const Verdict gpu_only = check(usage(m, one, {1, Offload::none, Offload::none}, {}), one);
  EXPECT_FALSE(gpu_only.fits);
  EXPECT_EQ(gpu_only.why.rfind("GPU: needs 111.8 GiB", 0), 0u) << gpu_only.why;  // 16Ψ = 120e9 B
  // The state on the CPU: 4Ψ = 30e9 B on the GPU; 12Ψ + staging 4Ψ = 120e9 B = 111.8 GiB on the host,
  // over the 90 GiB usable of 100 GiB, within the 230.4 of 256 GiB.
  const Verdict offloaded = check(usage(m, one, {1, Offload::cpu, Offload::none}, {}), one);
  EXPECT_FALSE(offloaded.fits);
  EXPECT_EQ(offloaded.why.rfind("host: needs 111.8 GiB", 0), 0u) << offloaded.why;
  one.host_ram = 256ull << 30;
  EXPECT_TRUE(check(usage(m, one, {1, Offload::cpu, Offload::none}, {}), one).fits);
}

TEST(Plan, StepEstimate) {
  const Model m = bare(6'400'000'000, 1);
  Cluster c = dgx_cluster();  // 64 ranks: P = 1e8, 8e8 parameters per node
  Rates r;
  r.adam_params_per_s = 1e9;
  r.pcie_gbps = 25;
  r.nvme_read_gbps = r.nvme_write_gbps = 2;
  const StepEstimate cpu = estimate_step(m, c, {2, Offload::cpu, Offload::none}, {}, r);
  EXPECT_DOUBLE_EQ(cpu.cpu_adam_s, 8e8 / 1e9);
  EXPECT_EQ(cpu.pcie_bytes, 4u * 100'000'000);  // 2P down, 2P up
  EXPECT_DOUBLE_EQ(cpu.pcie_s, 4e8 / 25e9);
  EXPECT_DOUBLE_EQ(cpu.total_s, 0.8 + 4e8 / 25e9);
  c.nvme_paths = {"/a", "/b"};
  const StepEstimate nvme = estimate_step(m, c, {2, Offload::nvme, Offload::none}, {}, r);
  // Whole slots of master and moments: ceil(1e8 / 2^20) = 96 tiles of 2^20 x 12 B per rank, 8 ranks.
  const double slots = 8.0 * 96 * (1 << 20) * 12;
  EXPECT_EQ(nvme.nvme_read_bytes, static_cast<std::uint64_t>(slots));
  EXPECT_EQ(nvme.swap_write_bytes, static_cast<std::uint64_t>(slots));
  EXPECT_DOUBLE_EQ(nvme.nvme_s, 2 * slots / (2e9 * 2));  // read then written, over two paths
  EXPECT_DOUBLE_EQ(nvme.total_s, nvme.nvme_s + 4e8 / 25e9);  // NVMe is the slower of the pipelined pair
  EXPECT_EQ(estimate_step(m, c, {1, Offload::none, Offload::none}, {}, r).total_s, 0.0);
  // Weights on NVMe: the parameter tier reads every entry twice (forward, backward) and the step writes it
  // once (the bare model's one tensor, of 1 element, is a 2-byte shard padded to 4096 per rank); its gradient
  // partition still comes down PCIe, unless FSDP2's CPUOffloadPolicy put it on the host.
  const StepEstimate infinity = estimate_step(m, c, {3, Offload::nvme, Offload::nvme}, {}, r);
  const std::uint64_t entries = 2 * 100'000'000u + (4096 - 2);
  EXPECT_EQ(infinity.param_read_bytes, 8 * 2 * entries);
  EXPECT_EQ(infinity.param_write_bytes, 8 * entries);
  EXPECT_EQ(infinity.nvme_read_bytes, infinity.swap_read_bytes + infinity.param_read_bytes);
  EXPECT_EQ(infinity.pcie_bytes, 2u * 100'000'000);
  Training policy;
  policy.grads_on_host = true;
  EXPECT_EQ(estimate_step(m, c, {3, Offload::nvme, Offload::nvme}, policy, r).pcie_bytes, 0u);
}

TEST(Plan, EmittedConfigsRoundTripThroughTheReader) {
  Cluster c = dgx_cluster();
  c.nvme_paths = {"/mnt/nvme0", "/mnt/nvme1"};
  Training t;
  t.grad_accumulation = 4;
  Result<LoadedConfig> cpu = parse_config(deepspeed_config({2, Offload::cpu, Offload::none}, c, t), "plan");
  ASSERT_TRUE(cpu.ok()) << cpu.status().to_string();
  EXPECT_TRUE(cpu->notes.empty()) << cpu->notes[0];
  EXPECT_EQ(cpu->options.tier, Tier::ram);
  EXPECT_EQ(cpu->options.gradient_accumulation_steps, 4);
  Result<LoadedConfig> nvme = parse_config(deepspeed_config({1, Offload::nvme, Offload::none}, c, t), "plan");
  ASSERT_TRUE(nvme.ok()) << nvme.status().to_string();
  EXPECT_TRUE(nvme->notes.empty()) << nvme->notes[0];
  EXPECT_EQ(nvme->options.tier, Tier::nvme);
  EXPECT_EQ(nvme->options.nvme.paths, c.nvme_paths);
  // The parameter tier is read; the reader says that stage 3's partitioning is FSDP2's.
  Result<LoadedConfig> infinity = parse_config(deepspeed_config({3, Offload::nvme, Offload::nvme}, c, t), "plan");
  ASSERT_TRUE(infinity.ok()) << infinity.status().to_string();
  EXPECT_TRUE(infinity->offload_param);
  EXPECT_EQ(infinity->param_tier.home, ParamHome::nvme);
  ASSERT_EQ(infinity->notes.size(), 1u);
  EXPECT_NE(infinity->notes[0].find("zero_optimization.stage"), std::string::npos) << infinity->notes[0];
  EXPECT_NE(infinity->notes[0].find("FSDP2"), std::string::npos) << infinity->notes[0];
  EXPECT_TRUE(zoe_gap({3, Offload::nvme, Offload::nvme}).empty());
  EXPECT_TRUE(zoe_gap({3, Offload::cpu, Offload::none}).empty());
  EXPECT_FALSE(zoe_gap({3, Offload::none, Offload::none}).empty());  // zoe is not needed there
  EXPECT_TRUE(zoe_gap({2, Offload::nvme, Offload::none}).empty());
  EXPECT_TRUE(zoe_gap({2, Offload::cpu, Offload::none}).empty());
}

}  // namespace
}  // namespace zoe::plan
