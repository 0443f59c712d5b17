"""The demo's model with bf16 weights on the device: zoe (fp32 master in the engine) against torch AdamW
keeping fp32 master weights itself; and the demo end to end."""
import json
import math
import os
import struct
import subprocess
import sys

import pytest
import torch

from zoe.demo.data import ByteBatches
from zoe.demo.model import GPT, GPTConfig
from zoe.torch import OffloadOptimizer

STEPS = 200
# The demo's architecture at a size that trains 200 steps in seconds on 2 cores.
CONFIG = dict(seq=64, d_model=96, n_layer=2, n_head=4, compute_dtype=torch.float32)
HYPER = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG)).to(torch.bfloat16)


def _losses(step_fn, model):
    data = ByteBatches(CONFIG["seq"], 8, seed=0)
    out = []
    for _ in range(STEPS):
        x, y = data.next()
        model.zero_grad(set_to_none=False)
        _, loss = model(x, y)
        loss.backward()
        step_fn()
        out.append(loss.item())
    return out


def test_bf16_weights_loss_at_step_200_within_1_percent_of_torch_fp32_master():
    zoe_model = _model()
    opt = OffloadOptimizer(zoe_model.parameters(), **HYPER)
    zoe_losses = _losses(opt.step, zoe_model)

    ref_model = _model()
    master = [p.detach().float().clone().requires_grad_() for p in ref_model.parameters()]
    ref_opt = torch.optim.AdamW(master, **HYPER)

    def ref_step():
        for m, p in zip(master, ref_model.parameters()):
            m.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(master, ref_model.parameters()):
                p.copy_(m)

    ref_losses = _losses(ref_step, ref_model)
    rel = abs(zoe_losses[-1] - ref_losses[-1]) / ref_losses[-1]
    print(f"loss at step {STEPS}: zoe {zoe_losses[-1]:.4f}, torch AdamW fp32 master {ref_losses[-1]:.4f}, "
          f"relative difference {100 * rel:.3f}% (step 1: {zoe_losses[0]:.4f})")
    assert zoe_losses[-1] < 0.7 * zoe_losses[0]  # it learned
    assert rel < 0.01


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "zoe.demo", "--steps", "6", "--batch", "4", "--seq", "32",
                        "--d-model", "64", "--layers", "1", "--heads", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens/s" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and len(summary["losses"]) == 6
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out / "loss.png") > 1000
    # A drawn figure (matplotlib, two panels with axes and legends), not a bare strip of pixels.
    png = (out / "loss.png").read_bytes()
    assert png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 600 and height >= 450, (width, height)
    assert os.path.getsize(out / "loss.png") > 20_000
    assert summary["plot_renderer"].startswith("matplotlib")
    assert summary["held_out_curve"]["steps"][-1] == 6 and len(summary["held_out_curve"]["losses"]) >= 2
    assert summary["held_out_loss"] == summary["held_out_curve"]["losses"][-1]
    assert all(math.isfinite(v) for v in summary["losses"] + summary["held_out_curve"]["losses"])


@pytest.mark.parametrize("module, args, message", [
    ("zoe.demo", ["--steps", "0"], "--steps 0: need at least 1"),
    ("zoe.demo", ["--warmup", "0"], "--warmup 0: need at least 1"),
    ("zoe.demo", ["--evals", "0"], "--evals 0: need at least 1"),
    ("zoe.demo", ["--d-model", "64", "--heads", "6"], "not a multiple of --heads"),
    ("zoe.bench", ["--n", "0"], "--n 0: need at least one parameter per tensor"),
    ("zoe.bench", ["--reps", "0"], "--reps 0"),
    ("zoe.bench", ["--tensors", "0"], "--tensors 0"),
])
def test_empty_inputs_are_refused_before_any_work(tmp_path, module, args, message):
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert os.listdir(tmp_path) == []
