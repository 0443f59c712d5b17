"""zoe.CpuAdam on numpy arrays and CPU tensors: torch's AdamW numerics, 16-bit gradients and weight copies,
errors as Python exceptions."""
import numpy as np
import pytest
import torch

import zoe

# Weights that cancel to near zero keep the absolute error of their larger past values; moments are compared
# relative to their own size.
TOL = dict(rtol=1e-5, atol=1e-6)


def _torch_adamw(p, grads, **h):
    p = torch.nn.Parameter(torch.tensor(p))
    opt = torch.optim.AdamW([p], **h)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    return p.detach().numpy(), opt.state[p]["exp_avg"].numpy(), opt.state[p]["exp_avg_sq"].numpy()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_numpy_matches_torch_adamw(n):
    rng = np.random.default_rng(n)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(10)]
    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    adam = zoe.CpuAdam()
    for k, g in enumerate(grads, 1):
        adam.step([p], [m], [v], [g], step=k, lr=1e-2, weight_decay=0.1)
    rp, rm, rv = _torch_adamw(p0, grads, lr=1e-2, weight_decay=0.1)
    np.testing.assert_allclose(p, rp, **TOL)
    np.testing.assert_allclose(m, rm, **TOL)
    np.testing.assert_allclose(v, rv, **TOL)


@pytest.mark.parametrize("adamw", [True, False])
def test_maximize_matches_torch_and_is_descent_on_minus_g(adamw):
    """maximize=True: torch's ascent (the gradient negated before Adam's L2 term), bit for bit the plain step
    on -g."""
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(1001).astype(np.float32)
    grads = [rng.standard_normal(1001).astype(np.float32) for _ in range(6)]
    up, down = [p0.copy(), np.zeros_like(p0), np.zeros_like(p0)], [p0.copy(), np.zeros_like(p0), np.zeros_like(p0)]
    adam = zoe.CpuAdam()
    for k, g in enumerate(grads, 1):
        adam.step([up[0]], [up[1]], [up[2]], [g], step=k, lr=1e-2, weight_decay=0.1, adamw=adamw, maximize=True)
        adam.step([down[0]], [down[1]], [down[2]], [-g], step=k, lr=1e-2, weight_decay=0.1, adamw=adamw)
    for a, b in zip(up, down):
        assert np.array_equal(a, b)
    p = torch.nn.Parameter(torch.tensor(p0))
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([p], lr=1e-2, weight_decay=0.1, maximize=True)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(up[0], p.detach().numpy(), **TOL)
    np.testing.assert_allclose(up[1], opt.state[p]["exp_avg"].numpy(), **TOL)
    np.testing.assert_allclose(up[2], opt.state[p]["exp_avg_sq"].numpy(), **TOL)


def test_bf16_grads_and_copy_out_on_tensors():
    n = 100
    p = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    zoe.CpuAdam().step([p], [m], [v], [g], [out], step=1, lr=1e-2)
    assert torch.equal(out, p.bfloat16())  # the copy is the updated master, rounded to nearest even


def test_grad_scale_and_check_finite():
    p = np.ones(4, np.float32)
    m, v = np.zeros(4, np.float32), np.zeros(4, np.float32)
    g = np.array([1, 2, np.inf, 4], np.float32)
    adam = zoe.CpuAdam()
    with pytest.raises(zoe.ZoeError, match="non-finite"):
        adam.step([p], [m], [v], [g], step=1, check_finite=True)
    assert (p == 1).all() and (m == 0).all()  # refused: nothing changed


def test_errors():
    adam = zoe.CpuAdam()
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="same size"):
        adam.step([a], [a.copy()], [a.copy()], [np.zeros(3, np.float32)], step=1)
    with pytest.raises(zoe.InvalidArgumentError, match="step"):
        adam.step([a], [a.copy()], [a.copy()], [a.copy()], step=0)
    with pytest.raises(ValueError, match="dtype"):
        adam.step([a], [a.copy()], [a.copy()], [np.zeros(4, np.float64)], step=1)
    with pytest.raises(zoe.ZoeError, match="ISA"):
        zoe.CpuAdam(isa="sse9")


def test_explicit_isa_wins_over_zoe_isa_and_both_are_checked(monkeypatch):
    monkeypatch.setenv("ZOE_ISA", "scalar")
    assert zoe.CpuAdam().isa == "scalar"  # the environment sets what "auto" picks
    for isa in zoe.supported_isas():
        assert zoe.CpuAdam(isa=isa).isa == isa  # a name given in code wins
    with pytest.raises(zoe.ZoeError, match="requested ISA=sse9"):
        zoe.CpuAdam(isa="sse9")
    monkeypatch.setenv("ZOE_ISA", "sse9")
    with pytest.raises(zoe.ZoeError, match="ZOE_ISA=sse9"):
        zoe.CpuAdam(isa="scalar")


def test_arrays_it_writes_are_taken_as_they_are():
    """A strided or float64 array would reach the kernel as a converted copy, stepped and dropped, the
    caller's array unchanged: refused. A strided gradient is only read, and is taken by value."""
    adam = zoe.CpuAdam()
    z = lambda: torch.zeros(4, 4)  # noqa: E731
    g = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    for params, exp_avgs in (([z().t()], [z()]), ([z().double()], [z()]), ([z()], [z().t()])):
        with pytest.raises(TypeError):
            adam.step(params, exp_avgs, [z()], [g], step=1)
    with pytest.raises(TypeError):
        adam.step([z()], [z()], [z()], [g], [z().to(torch.bfloat16).t()], step=1)
    strided, contiguous = z(), z()
    adam.step([strided], [z()], [z()], [g.t()], step=1, lr=0.1)
    adam.step([contiguous], [z()], [z()], [g.t().contiguous()], step=1, lr=0.1)
    assert torch.equal(strided, contiguous) and not torch.equal(strided, z())


def test_engine_state_arrays_it_fills_are_taken_as_they_are():
    from zoe.torch import OffloadOptimizer

    p = torch.nn.Parameter(torch.zeros(16))
    opt = OffloadOptimizer([p], lr=0.1)
    p.grad = torch.ones(16)
    opt.step()
    engine = opt._flat.engine
    engine.wait()
    for out in (torch.zeros(32)[::2], torch.zeros(16, dtype=torch.float64)):
        with pytest.raises(TypeError):
            engine.read_state(0, out, None, None)
    master = torch.zeros(16)
    engine.read_state(0, master, None, None)
    assert torch.equal(master, p.detach())
