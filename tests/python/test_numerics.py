"""zoe's AdamW against torch's, teacher-forced: one recorded sequence of bf16 gradients from the demo model is
fed to zoe (fp32 master in the engine, bf16 weights written by its copy-out) and to torch AdamW over fp32
master weights kept by hand. Neither run's weights feed back into the gradients, so the two states stay a
few float roundings apart step after step instead of drifting apart chaotically as two trainings do; that
makes a tight, CPU-independent comparison possible at every step."""
import torch

from zoe.demo.data import ByteBatches
from zoe.demo.model import GPT, GPTConfig
from zoe.torch import OffloadOptimizer

from conftest import master_bound

STEPS = 50
CONFIG = dict(seq=64, d_model=96, n_layer=2, n_head=4, compute_dtype=torch.float32)
HYPER = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

def _record_gradients():
    """The demo model trained STEPS steps by torch AdamW on fp32 masters: its initial bf16 weights and every
    step's bf16 gradients."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG)).to(torch.bfloat16)
    initial = [p.detach().clone() for p in model.parameters()]
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, **HYPER)
    data = ByteBatches(CONFIG["seq"], 8, seed=0)
    grads = []
    for _ in range(STEPS):
        x, y = data.next()
        model.zero_grad(set_to_none=False)
        model(x, y)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)
    return initial, grads


class TorchReplay:
    def __init__(self, initial, **kind):
        self.master = [w.float().clone() for w in initial]
        self.opt = torch.optim.AdamW(self.master, **HYPER, **kind)

    def step(self, grads):
        for m, g in zip(self.master, grads):
            m.grad = g.float()
        self.opt.step()


class ZoeReplay:
    def __init__(self, initial):
        self.params = [torch.nn.Parameter(w.clone()) for w in initial]
        self.opt = OffloadOptimizer(self.params, **HYPER)

    def step(self, grads):
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        self.opt.step()

    @property
    def master(self):
        return [self.opt.read_state(p)["master"] for p in self.params]


def _check_bf16_weights(zoe_weights, zoe_master, torch_master, where):
    """zoe's bf16 weights are its master rounded to nearest even, bit for bit; where they differ from torch's
    (its master rounded), a bf16 rounding boundary lies between the two masters: the one between zoe's value
    and its neighbour towards torch's. Returns how many weights differ."""
    assert torch.equal(zoe_weights, zoe_master.bfloat16()), f"{where}: bf16 weights are not the master rounded"
    theirs = torch_master.bfloat16()
    differ = zoe_weights != theirs
    if not differ.any():
        return 0
    a, b = zoe_weights[differ], theirs[differ]
    boundary = (a.float() + torch.nextafter(a, b).float()) / 2  # exact: two neighbouring bf16 values fit a float
    lo = torch.minimum(zoe_master[differ], torch_master[differ])
    hi = torch.maximum(zoe_master[differ], torch_master[differ])
    assert ((lo <= boundary) & (boundary <= hi)).all(), f"{where}: bf16 weights differ without a rounding boundary"
    return int(differ.sum())


def test_teacher_forced_masters_and_bf16_weights_match_torch_adamw_every_step():
    initial, grads = _record_gradients()
    ours, foreach, fused = ZoeReplay(initial), TorchReplay(initial, foreach=True), TorchReplay(initial, fused=True)
    total = sum(w.numel() for w in initial)
    worst_ratio = 0.0
    for step, g in enumerate(grads, 1):
        for run in (ours, foreach, fused):
            run.step(g)
        max_diff = own_spread = 0.0
        bf16_differ = 0
        for i, (zm, tm, fm) in enumerate(zip(ours.master, foreach.master, fused.master)):
            tm = tm.detach()
            diff = (zm - tm).abs()
            bound = master_bound(step, zm, tm, HYPER["lr"])
            where = f"step {step}, parameter {i}"
            assert (diff <= bound).all(), f"{where}: masters {diff.max().item():.3e} apart, bound {bound.max().item():.3e}"
            worst_ratio = max(worst_ratio, (diff / bound).max().item())
            max_diff = max(max_diff, diff.max().item())
            own_spread = max(own_spread, (fm.detach() - tm).abs().max().item())
            bf16_differ += _check_bf16_weights(ours.params[i].detach(), zm, tm, where)
        if step in (1, 2, 5, 10, 20, 30, 40, 50):
            print(f"step {step:2d}: max |master_zoe - master_torch| {max_diff:.2e} (torch fused vs foreach "
                  f"{own_spread:.2e}); bf16 weights that differ: {bf16_differ} of {total}, all across a rounding "
                  "boundary")
    print(f"largest master difference as a fraction of its bound: {worst_ratio:.3f}")
