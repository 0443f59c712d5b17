"""OffloadOptimizer(state_dtype="bf16" | "int8"): Adam moments kept in bf16 or 8-bit codes (tier ram, and tier
nvme stepping the same bits), the master weights in fp32. Each step is checked against float64 Adam started
from zoe's own stored state; state_dicts come back exactly; an unknown dtype is refused with a message."""
import pytest
import torch

import zoe
from zoe.torch import OffloadOptimizer

HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _is_bf16(t: torch.Tensor) -> bool:
    return torch.equal(t.to(torch.bfloat16).float(), t)


def _float64_step(before: dict, g: torch.Tensor, step: int):
    """AdamW in float64 from zoe's stored state: (exp_avg, exp_avg_sq, master) after the step."""
    b1, b2 = HYPER["betas"]
    m = before["exp_avg"].double() * b1 + (1 - b1) * g.double()
    v = before["exp_avg_sq"].double() * b2 + (1 - b2) * g.double() ** 2
    w = before["master"].double() * (1 - HYPER["lr"] * HYPER["weight_decay"])
    w -= HYPER["lr"] / (1 - b1 ** step) * m / (v.sqrt() / (1 - b2 ** step) ** 0.5 + HYPER["eps"])
    return m, v, w


def test_each_step_matches_float64_from_its_own_rounded_state():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.rand(5003) * 2 - 1)
    opt = OffloadOptimizer([p], state_dtype="bf16", **HYPER)
    for step in range(1, 11):
        before = opt.read_state(p)
        g = torch.randn(5003) * 1e-2
        p.grad = g.clone()  # a gradient of its own each step, as autograd gives
        opt.step()
        after = opt.read_state(p)
        # float64 Adam(W) from the stored state; zoe's fp32 arithmetic differs by rounding only.
        m, v, w = _float64_step(before, g, step)
        assert torch.allclose(after["master"].double(), w, rtol=1e-6, atol=1e-7), step
        # One bf16 ulp (2^-7 relative): float64 and fp32 may round to either neighbour.
        assert torch.allclose(after["exp_avg"].double(), m, rtol=2 ** -7, atol=1e-30), step
        assert torch.allclose(after["exp_avg_sq"].double(), v, rtol=2 ** -7, atol=1e-30), step
        assert _is_bf16(after["exp_avg"]) and _is_bf16(after["exp_avg_sq"])
        assert not _is_bf16(after["master"])
        assert torch.equal(p.detach(), after["master"])  # fp32 on the CPU: the master is the weight itself


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """Each element's 2048-block's largest |value| (zoe._zoe.MOMENT_BLOCK elements share a scale)."""
    block = zoe._zoe.MOMENT_BLOCK
    n = t.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=t.dtype)
    padded[:n] = t.abs()
    return padded.view(-1, block).amax(dim=1).repeat_interleave(block)[:n]


def test_int8_each_step_matches_float64_within_the_codes_bounds():
    # The codes' bounds (simd/kernels.h): m within half a step of its block's largest / 127, v within 2^-4
    # relative (or under 2^-31 of its block's largest); fp32 against float64 adds 1e-5 relative.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.rand(5003) * 2 - 1)  # two whole blocks and a short one
    opt = OffloadOptimizer([p], state_dtype="int8", **HYPER)
    for step in range(1, 11):
        before = opt.read_state(p)
        g = torch.randn(5003) * 1e-2 * torch.logspace(-3, 0, 5003)  # three decades within each block
        p.grad = g.clone()  # a gradient of its own each step, as autograd gives
        opt.step()
        after = opt.read_state(p)
        m, v, w = _float64_step(before, g, step)
        assert torch.allclose(after["master"].double(), w, rtol=1e-5, atol=1e-7), step
        m_bound = 0.5 / 127 * _blocks(after["exp_avg"]).double() * (1 + 1e-5) + 1e-5 * m.abs()
        assert bool(((after["exp_avg"].double() - m).abs() <= m_bound).all()), step
        v_bound = 2 ** -4 * v * (1 + 1e-5) + 2 ** -31 * _blocks(after["exp_avg_sq"]).double()
        assert bool(((after["exp_avg_sq"].double() - v).abs() <= v_bound).all()), step
        assert len(torch.unique(after["exp_avg"][:2048])) <= 255  # 8-bit: at most 255 values in a block
        assert bool((after["exp_avg_sq"][:2048] > 0).all())  # the small v keep a code beside the large


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_state_dict_round_trip_continues_exactly(schedule, state_dtype):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    twin = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
            for _ in range(2)]
    for t in twin:
        t.load_state_dict(model.state_dict())
    data = [(torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)) for _ in range(8)]

    def run(m, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x).float(), y.float()).backward()
            opt.step()

    whole = OffloadOptimizer(twin[0].parameters(), state_dtype=state_dtype, schedule=schedule, **HYPER)
    run(twin[0], whole, data)
    first = OffloadOptimizer(twin[1].parameters(), state_dtype=state_dtype, schedule=schedule, **HYPER)
    run(twin[1], first, data[:4])
    sd = first.state_dict()
    del first
    resumed = OffloadOptimizer(twin[1].parameters(), state_dtype=state_dtype, schedule=schedule, **HYPER)
    resumed.load_state_dict(sd)
    run(twin[1], resumed, data[4:])
    for a, b in zip(twin[0].parameters(), twin[1].parameters()):
        assert torch.equal(a, b)
        sa, sb = whole.read_state(a), resumed.read_state(b)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_low_bit_moments_on_the_nvme_tier_step_as_on_ram(tmp_path, state_dtype):
    torch.manual_seed(3)
    w = (torch.rand(5000) * 2 - 1).to(torch.bfloat16)
    ps = [torch.nn.Parameter(w.clone()) for _ in range(3)]
    opts = [OffloadOptimizer([ps[0]], state_dtype=state_dtype, **HYPER),
            OffloadOptimizer([ps[1]], state_dtype=state_dtype, tier="nvme", nvme_path=str(tmp_path), **HYPER),
            OffloadOptimizer([ps[2]], tier="nvme", nvme_path=str(tmp_path / "fp32"), **HYPER)]
    for _ in range(5):
        g = torch.randn(5000).to(torch.bfloat16) * 1e-2
        for p, opt in zip(ps, opts):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(ps[0], ps[1])
    assert not torch.equal(ps[1], ps[2])  # the low-bit moments are really in use
    a, b = opts[0].read_state(ps[0]), opts[1].read_state(ps[1])
    assert all(torch.equal(a[k], b[k]) for k in a)
    if state_dtype == "bf16":
        assert _is_bf16(b["exp_avg_sq"])
    # The swap files hold the compact form: 12 bytes per element of fp32 state, 8 with bf16, 6 and the
    # block scales with int8 (two slots per tile, each padded to the O_DIRECT block).
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.zoe-swap"))  # noqa: E731
    assert size(tmp_path) < size(tmp_path / "fp32") * (0.7 if state_dtype == "bf16" else 0.55)


def test_an_unknown_state_dtype_is_refused():
    p = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="unknown"):
        OffloadOptimizer([p], state_dtype="fp16")
    assert zoe.parse_config('{"zoe": {"state_dtype": "bf16"}}')["options"]["state_dtype"] == "bf16"
