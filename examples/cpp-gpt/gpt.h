// The zoe demo's GPT-style byte-level language model (python/zoe/demo/model.py) in libtorch C++: token and
// position embeddings, pre-norm blocks (causal self-attention, a GELU MLP), a tied output head. Built and
// initialised in the Python model's order, so that torch::manual_seed(s) gives the weights
// torch.manual_seed(s) gives there: the module constructors draw their default initialisations, then every
// Linear and Embedding weight is drawn again from N(0, 0.02) (biases zeroed) in module order, then the
// residual projections from N(0, 0.02 / sqrt(2 * layers)).
// The weights are stored in a 16-bit dtype and each is cast to fp32 where it is used: a CPU without 16-bit
// matrix instructions runs fp32 matmuls many times faster. Autograd casts each gradient back to its weight's
// dtype, which is what zoe takes.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>

namespace gpt {

struct Config {
  std::int64_t vocab = 256, seq = 128, d_model = 192, layers = 4, heads = 6;
};

inline torch::Tensor linear(const torch::Tensor& x, const torch::nn::Linear& m) {
  return torch::linear(x, m->weight.to(x.scalar_type()), m->bias.to(x.scalar_type()));
}

inline torch::Tensor norm(const torch::Tensor& x, const torch::nn::LayerNorm& m) {
  return torch::layer_norm(x, {x.size(-1)}, m->weight.to(x.scalar_type()), m->bias.to(x.scalar_type()), 1e-5);
}

struct BlockImpl : torch::nn::Module {
  std::int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};

  BlockImpl(std::int64_t d, std::int64_t h) : heads(h) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc = register_module("fc", torch::nn::Linear(d, 4 * d));
    out = register_module("out", torch::nn::Linear(4 * d, d));
  }

  torch::Tensor forward(torch::Tensor x) {
    const std::int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    auto qkv_out = linear(norm(x, ln1), qkv).split(d, 2);
    for (auto& z : qkv_out) z = z.view({b, t, heads, d / heads}).transpose(1, 2);
    torch::Tensor y = torch::scaled_dot_product_attention(qkv_out[0], qkv_out[1], qkv_out[2], {}, 0.0, true);
    x = x + linear(y.transpose(1, 2).reshape({b, t, d}), proj);
    return x + linear(torch::gelu(linear(norm(x, ln2), fc)), out);
  }
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  Config config;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln{nullptr};

  explicit GPTImpl(const Config& c) : config(c) {
    tok = register_module("tok", torch::nn::Embedding(c.vocab, c.d_model));
    pos = register_module("pos", torch::nn::Embedding(c.seq, c.d_model));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c.d_model, c.heads));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    torch::NoGradGuard no_grad;
    // nn.Module.apply order: children depth first, in registration order.
    tok->weight.normal_(0.0, 0.02);
    pos->weight.normal_(0.0, 0.02);
    for (const auto& m : *blocks) {
      auto* blk = m->as<BlockImpl>();
      for (torch::nn::Linear* l : {&blk->qkv, &blk->proj, &blk->fc, &blk->out}) {
        (*l)->weight.normal_(0.0, 0.02);
        (*l)->bias.zero_();
      }
    }
    for (const auto& m : *blocks) {
      auto* blk = m->as<BlockImpl>();
      for (torch::nn::Linear* l : {&blk->proj, &blk->out}) {
        (*l)->weight.normal_(0.0, 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers)));
      }
    }
  }

  // The mean cross-entropy of the next byte, in fp32.
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets) {
    const std::int64_t t = idx.size(1);
    const torch::Tensor tok_w = tok->weight.to(torch::kFloat32);
    torch::Tensor x = torch::embedding(tok_w, idx) + pos->weight.slice(0, 0, t).to(torch::kFloat32);
    for (const auto& m : *blocks) x = m->as<BlockImpl>()->forward(x);
    const torch::Tensor logits = torch::matmul(norm(x, ln), tok_w.t());
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }
};
TORCH_MODULE(GPT);

}  // namespace gpt
