"""A small GPT-style byte-level language model: token and position embeddings, pre-norm transformer blocks
(causal self-attention and a GELU MLP), a tied output head.

The weights may be stored in a 16-bit dtype while the arithmetic runs in ``compute_dtype``: on a GPU both are
bf16, but a CPU without bf16 matrix instructions runs bf16 matmuls some 25x slower than fp32, so there the
demo keeps bf16 weights (what the optimizer exchanges) and computes in fp32. Each weight is cast where it is
used, and autograd casts its gradient back to the weight's dtype."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 256  # bytes: no tokenizer to ship
    seq: int = 128
    d_model: int = 192
    n_layer: int = 4
    n_head: int = 6
    compute_dtype: torch.dtype | None = None  # None: the weights' own dtype


def _linear(x: torch.Tensor, m: nn.Linear) -> torch.Tensor:
    return F.linear(x, m.weight.to(x.dtype), m.bias.to(x.dtype))


def _norm(x: torch.Tensor, m: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, m.normalized_shape, m.weight.to(x.dtype), m.bias.to(x.dtype), m.eps)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = _linear(_norm(x, self.ln1), self.qkv).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + _linear(y.transpose(1, 2).reshape(b, t, d), self.proj)
        return x + _linear(F.gelu(_linear(_norm(x, self.ln2), self.fc)), self.out)


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln = nn.LayerNorm(c.d_model)
        self.apply(self._init)
        # Residual projections scaled down with depth (GPT-2), so that deeper stacks start stable.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(p, 0.0, 0.02 / (2 * c.n_layer) ** 0.5)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        dt = self.config.compute_dtype or self.tok.weight.dtype
        tok = self.tok.weight.to(dt)
        x = F.embedding(idx, tok) + self.pos.weight[:t].to(dt)
        for blk in self.blocks:
            x = blk(x)
        logits = _norm(x, self.ln) @ tok.t()  # tied head: the embedding matrix reads out
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
