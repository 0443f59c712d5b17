// zoe plan's arithmetic against hand-computed cases: each expected number is written as its formula (Ψ
// parameters, N ranks, n GPUs per node, P = Ψ / N the partition), after the ZeRO paper's memory analysis.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "src/plan/plan.h"
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
  EXPECT_EQ(s3.per_gpu.buffers, (2 + 1) * 2 * 100'000'000u + 2 * 100'000'000u);
  EXPECT_EQ(s3.per_gpu.total() - s3.per_gpu.buffers, 1'875'000'000u);
  EXPECT_EQ(s1.per_host.total(), 0u);
  EXPECT_EQ(s1.per_nvme_path.total(), 0u);
}

TEST(Plan, OffloadedStateLivesOnTheHostOrTheNvmePaths) {
  const Model m = bare(kPsi, 100'000'000);
  Cluster c = dgx_cluster();
  const std::uint64_t P = kPsi / 64, n = 8;
  const Usage cpu = usage(m, c, {2, Offload::cpu, Offload::none}, {});
  EXPECT_EQ(cpu.per_gpu.master32 + cpu.per_gpu.moments, 0u);
  EXPECT_EQ(cpu.per_host.master32, n * 4 * P);
  EXPECT_EQ(cpu.per_host.moments, n * 8 * P);
  EXPECT_EQ(cpu.per_host.buffers, n * (2 * P + 2 * P));  // pinned staging: gradient and weight partitions
  Training accumulating;
  accumulating.grad_accumulation = 4;
  EXPECT_EQ(usage(m, c, {2, Offload::cpu, Offload::none}, accumulating).per_host.buffers, n * (4 * P + 4 * P));

  c.nvme_paths = {"/a", "/b"};
  c.nvme_capacity = {1ull << 40, 1ull << 40};
  Training t;
  const Usage nvme = usage(m, c, {2, Offload::nvme, Offload::none}, t);
  EXPECT_EQ(nvme.per_nvme_path.master32, n * 4 * P / 2);  // striped over both paths
  EXPECT_EQ(nvme.per_nvme_path.moments, n * 8 * P / 2);
  // Staging plus the NVMe tier's buffers: buffer_count tiles of (4 + 8) bytes per element, per rank.
  EXPECT_EQ(nvme.per_host.buffers, n * (4 * P + t.buffer_count * t.tile * 12));

  const Usage param_cpu = usage(m, c, {3, Offload::cpu, Offload::cpu}, t);
  EXPECT_EQ(param_cpu.per_gpu.weights16 + param_cpu.per_gpu.grads16, 0u);
  EXPECT_EQ(param_cpu.per_gpu.buffers, 4 * 2 * 100'000'000u);
  EXPECT_EQ(param_cpu.per_host.weights16, n * 2 * P);
  EXPECT_EQ(param_cpu.per_host.grads16, n * 2 * P);
  EXPECT_EQ(param_cpu.per_host.buffers, 0u);  // the partitions on the host are the staging
  const Usage param_nvme = usage(m, c, {3, Offload::nvme, Offload::nvme}, t);
  EXPECT_EQ(param_nvme.per_nvme_path.weights16, n * 2 * P / 2);
  EXPECT_EQ(param_nvme.per_nvme_path.grads16, 0u);  // FSDP2 puts the gradient shards in host RAM
  EXPECT_EQ(param_nvme.per_host.grads16, n * 2 * P);
  EXPECT_EQ(param_nvme.per_host.buffers, n * (t.buffer_count * t.tile * 12 + 4 * 2 * 100'000'000u));
}

TEST(Plan, LowBitMoments) {
  EXPECT_EQ(moment_bytes(4096, DType::f32), 8 * 4096u);
  EXPECT_EQ(moment_bytes(4096, DType::bf16), 4 * 4096u);
  // One byte per moment and element, and one fp32 scale per block of 2048 per moment: 2 blocks here.
  EXPECT_EQ(moment_bytes(4096, DType::i8), 2 * 4096u + 2 * 4 * 2);
  EXPECT_EQ(moment_bytes(4097, DType::i8), 2 * 4097u + 2 * 4 * 3);
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
  EXPECT_EQ(nvme.nvme_read_bytes, 12ull * 800'000'000);  // master and moments of the node's partitions
  EXPECT_DOUBLE_EQ(nvme.nvme_s, 2 * 9.6e9 / (2e9 * 2));  // read then written, over two paths
  EXPECT_DOUBLE_EQ(nvme.total_s, nvme.nvme_s + 4e8 / 25e9);  // NVMe is the slower of the pipelined pair
  EXPECT_EQ(estimate_step(m, c, {1, Offload::none, Offload::none}, {}, r).total_s, 0.0);
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
