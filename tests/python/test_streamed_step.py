"""Tier nvme's sync step streams through windows (docs/architecture.md, "Host memory that does not grow with
the model"): on a device with memory of its own it copies each window's gradients down during step(), after
anything the trainer did to them since backward. torch's clip_grad_norm_ scales p.grad in place, so zoe must
treat those gradients as read in place — clipped once, not once by torch and again by the engine. The host
stand-in (memory of its own, as a GPU's) against tier ram, whose staging copy is taken at the norm."""
import torch

import zoe
import zoe.torch


def _train(tier, clip, path, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    where = dict(nvme_path=str(path)) if tier == "nvme" else {}
    opt = zoe.torch.OffloadOptimizer(model.parameters(), lr=1e-2, tier=tier, schedule="sync", **where)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
        opt.zero_grad()
        (model(x).float().pow(2).mean() * 100).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    state = opt.state_dict()["state"]
    moments = [state[k][name] for k in sorted(state) for name in ("exp_avg", "exp_avg_sq")]
    return moments, [p.detach().clone() for p in model.parameters()]


def test_clipping_on_a_device_with_its_own_memory_clips_once(tmp_path, monkeypatch):
    monkeypatch.setattr(zoe.torch, "_cpu_device", zoe.host_device)
    # Unclipped, both tiers read the same bf16 gradients: the same bits.
    ram, nvme = _train("ram", None, None), _train("nvme", None, tmp_path / "unclipped")
    for a, b in zip(ram[0] + ram[1], nvme[0] + nvme[1]):
        assert torch.equal(a, b)
    # Clipped by 0.01 (it bites at every step, coefficient ~5e-4): tier ram clips its fp32 copy of the
    # gradients in the step; the streamed step reads what torch's clip wrote into the bf16 gradients, rounded
    # to bf16 (a relative 2^-8 per element). So the moments agree to that rounding — the norm of each within
    # 1% — where clipping twice would make them smaller by the coefficient itself.
    ram, nvme = _train("ram", 0.01, None), _train("nvme", 0.01, tmp_path / "clipped")
    for a, b in zip(ram[0], nvme[0]):
        assert abs((b.norm() / a.norm()).item() - 1) < 0.01
