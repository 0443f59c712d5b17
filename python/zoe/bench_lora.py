"""python -m zoe.bench_lora — PEFT LoRA on a frozen bf16 base: zoe's OffloadOptimizer against torch's AdamW.

A Llama-shaped model of about ``--params`` parameters (zoe.bench_infinity's shapes), bf16, on the device; PEFT
LoRA adapters (rank ``--rank`` on every linear layer) are all that trains. Each contender starts from the same
weights and adapters and trains the same batches:
- ``torch``: ``torch.optim.AdamW`` over the adapters (fused on a GPU) — the baseline, run first and last;
- ``zoe_sync``, ``zoe_overlap``, ``zoe_delayed``: ``zoe.torch.OffloadOptimizer`` with that schedule, the
  adapters' fp32 master and moments in host RAM.
One JSON line per contender: ``tokens_per_s`` (the median over the timed steps), ``ratio_vs_torch`` (against
the mean of the two torch runs), ``peak_device_gib`` (the device's peak allocation during the timed steps, on
a GPU, less the pristine copy's), ``trainable`` (the adapters' parameters) and ``loss_mean`` (the timed steps'
losses, summed on the device and read once). Reported, not asserted (BENCHMARKING.md).

    python -m zoe.bench_lora --params 1B --batch 8 --seq 1024 --device cuda

``--device cpu`` runs the same on the CPU (scripts/gpu-lora --dry-run, with ``--tiny``: a two-layer model);
its figures mean nothing there.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time

import torch

from zoe.bench_infinity import llama_model, llama_shape, parse_count

GiB = 1 << 30
CONTENDERS = ["torch", "zoe_sync", "zoe_overlap", "zoe_delayed", "torch"]
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def base_model(a):
    """The frozen base with its LoRA adapters, on the device: the pristine copy each contender starts from."""
    from peft import LoraConfig, get_peft_model

    shape = llama_shape(a.params)
    if a.tiny:
        shape.update(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    config, model = llama_model(shape, a.device, a.checkpointing, a.device)
    if a.checkpointing:
        model.enable_input_require_grads()  # a frozen embedding: checkpointed layers need an input with a gradient
    lora = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules="all-linear", lora_dropout=0.0)
    return config, get_peft_model(model, lora)


def optimizer(name: str, params):
    if name == "torch":
        return torch.optim.AdamW(params, fused=params[0].is_cuda, **HYPER)
    from zoe.torch import OffloadOptimizer

    schedule = name.removeprefix("zoe_")
    warm = {"delayed_warmup_steps": 2} if schedule == "delayed" else {}  # fewer than --warmup's steps
    return OffloadOptimizer(params, schedule=schedule, **warm, **HYPER)


def run(a, name: str, base, batches, base_bytes: int) -> dict:
    """One contender from the pristine copy (``base_bytes`` of device memory, not the contender's own):
    warm-up steps, then the timed ones."""
    model = copy.deepcopy(base)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(name, params)
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    loss_sum = torch.zeros((), device=a.device)
    times = []
    for step, ids in enumerate(batches):
        if step == a.warmup:
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= a.warmup:
            loss_sum += loss.detach().float()
            sync()
            times.append(time.perf_counter() - t0)
    sync()
    row = {"contender": name, "params": sum(p.numel() for p in model.parameters()),
           "trainable": sum(p.numel() for p in params), "batch": a.batch, "seq": a.seq,
           "tokens_per_s": a.batch * a.seq / sorted(times)[len(times) // 2],
           "loss_mean": (loss_sum / len(times)).item()}
    if cuda:
        row["peak_device_gib"] = (torch.cuda.max_memory_allocated() - base_bytes) / GiB
    del opt, model, params
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zoe.bench_lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("1B"), help="base model size [1B]")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank, on every linear layer [16]")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step [8]")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence [1024]")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per contender [8]")
    ap.add_argument("--warmup", type=int, default=4, help="steps before timing, more than delayed's 2 sync steps [4]")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each decoder layer")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"), help="where the model computes [cuda]")
    ap.add_argument("--tiny", action="store_true", help="a two-layer model of hidden size 64 (a dry run)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    config, base = base_model(a)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (a.batch, a.seq), generator=g).to(a.device)
               for _ in range(a.warmup + a.steps)]
    base_bytes = sum(t.numel() * t.element_size() for t in (*base.parameters(), *base.buffers()))
    rows = [run(a, name, base, batches, base_bytes if a.device == "cuda" else 0) for name in CONTENDERS]
    baseline = (rows[0]["tokens_per_s"] + rows[-1]["tokens_per_s"]) / 2
    for row in rows:
        row["ratio_vs_torch"] = row["tokens_per_s"] / baseline
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
