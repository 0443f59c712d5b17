// Bounded fuzzing (tests/fuzz.h) of zoe plan's model reader (model_from_config, what `zoe plan --model`
// runs): a Hugging Face config.json with every key the reader looks at, mutated. Each case must give an
// error naming the file, or a model whose sizes the plan's arithmetic can take — never a crash or an
// exception from the JSON library (the CLI would abort on it: issue 32).
#include <gtest/gtest.h>

#include <string>

#include "zoe/plan.h"
#include "base/utf8.h"
#include "tests/fuzz.h"

namespace zoe::plan {
namespace {

using fuzz::Case;
using fuzz::Rng;
using fuzz::Verdict;

// Every key model_from_config reads, including the optional ones whose type it must check.
constexpr const char* kValidModel = R"({
  "model_type": "mixtral", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 704,
  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 32000,
  "hidden_act": "silu", "activation_function": "gelu_new", "attention_bias": false,
  "tie_word_embeddings": false, "n_positions": null, "num_local_experts": 8,
  "torch_dtype": "bfloat16", "rope_theta": 1000000.0, "architectures": ["MixtralForCausalLM"]
})";

// What an accepted model promises the rest of the plan; empty when it holds.
std::string model_violation(const Model& m) {
  if (m.params == 0) return "0 parameters";
  if (m.largest_tensor == 0 || m.largest_tensor > m.params) return "largest tensor 0 or above the parameter count";
  if (m.layers == 0 || m.hidden == 0 || m.heads == 0) return "a zero shape";
  if (m.description.find("model.json") == std::string::npos) return "a description that does not name the file";
  return "";
}

TEST(FuzzPlan, ModelConfig) {
  Result<Model> valid = model_from_config(kValidModel, "model.json");
  ASSERT_TRUE(valid.ok()) << valid.status().to_string();
  ASSERT_EQ(model_violation(valid.value()), "");
  const fuzz::Tally t = fuzz::run(
      "plan_model", fuzz::default_budget(),
      [](Rng& rng) {
        Case c;
        c.input = fuzz::mutate_json(kValidModel, rng, &c.mutation);
        return c;
      },
      [](const Case& c) {
        Result<Model> r = model_from_config(c.input, "model.json");
        if (!r.ok()) {
          EXPECT_NE(r.status().message().find("model.json"), std::string::npos)
              << c.mutation << ": an error that does not name the file: " << r.status().message();
          EXPECT_TRUE(utf8_valid(r.status().message())) << c.mutation << ": a message that is not UTF-8";
          return Verdict::refused;
        }
        EXPECT_EQ(model_violation(r.value()), "") << c.mutation << ":\n" << c.input;
        // The arithmetic the CLI runs next, on the largest cluster shape it allows.
        Cluster cluster;
        cluster.gpu_mem = 80ull << 30;
        cluster.host_ram = 1ull << 40;
        Training training;
        training.micro_batch = 1;
        training.seq_len = 4096;
        for (const Placement& p : candidates()) (void)check(usage(r.value(), cluster, p, training), cluster);
        return Verdict::accepted;
      });
  fuzz::expect_both_outcomes(t);
}

}  // namespace
}  // namespace zoe::plan
