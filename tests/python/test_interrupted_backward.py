"""An exception inside backward or step() leaves the optimizer as it was before the iteration, and the retry
torch's AdamW allows (zero_grad(), then the iteration again) gives the uninterrupted run's bits (issue 49).

Backward is interrupted after the last layers' gradients were reported to zoe — the overlap schedule has
stepped them speculatively (on tier ram, into its second state set), the delayed schedule has sent them the
previous step's weights — and before the first layer's. Every run reads the state at the same point before
iteration K + 1: reading it waits for the delayed schedule's background step, whose weights then go up at
once, so the runs compared must read it alike."""
import math

import pytest
import torch

import zoe
from conftest import batches, make_mlp
from zoe.torch import OffloadOptimizer

K = 4       # steps before the interrupted iteration (the delayed schedule's warm-up is 2 of them)
AFTER = 5   # steps after its retry
BF16 = torch.bfloat16  # tier nvme holds 16-bit parameters only; tier ram runs the same model


def make_opt(model, tier, schedule, folder, **options):
    nvme = dict(tier="nvme", nvme_path=str(folder)) if tier == "nvme" else {}
    return OffloadOptimizer(model.parameters(), lr=1e-2, schedule=schedule, delayed_warmup_steps=2, **nvme, **options)


class Interrupter:
    """Raises `kind` once, when armed, from a gradient hook in the middle of backward: a hook on the first
    layer's output (KeyboardInterrupt) or on the middle layer's weight (RuntimeError)."""

    def __init__(self, model, kind):
        self.kind, self.armed, self.raised = kind, False, 0
        if kind == "hook-error":
            model[2].weight.register_hook(self.hook)

    def hook(self, grad):
        if self.armed:
            self.armed = False
            self.raised += 1
            raise KeyboardInterrupt if self.kind == "keyboard-interrupt" else RuntimeError("a gradient hook failed")
        return grad

    def loss(self, model, x, y):
        h = model[1](model[0](x.to(BF16)))
        if self.kind == "keyboard-interrupt":
            h.register_hook(self.hook)
        return torch.nn.functional.mse_loss(model[4](model[3](model[2](h))).float(), y)

    def error(self):
        return KeyboardInterrupt if self.kind == "keyboard-interrupt" else RuntimeError


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def states(model, opt):
    return [dict(opt.read_state(p), step=opt.state[p]["step"]) for p in model.parameters()]


def assert_equal(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, dict):
            for k in x:
                assert torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])), f"{what}: parameter {i}, {k}"
        else:
            assert torch.equal(x, y), f"{what}: parameter {i}"


def train(tier, schedule, folder, kind=None, how="backward"):
    """K steps, iteration K + 1 (interrupted first where `kind` is given, then run again), AFTER steps.
    Returns what the run saw before iteration K + 1 (the weights, and the state after reading it), after the
    interruption (None without one), and at the end."""
    model = make_mlp(dtype=BF16)
    opt = make_opt(model, tier, schedule, folder)
    irq = Interrupter(model, kind or "keyboard-interrupt")
    data = batches(K + 1 + AFTER)
    for x, y in data[:K]:
        opt.zero_grad()
        irq.loss(model, x, y).backward()
        opt.step()
    opt.zero_grad()
    before = weights(model)
    interrupted = None
    x, y = data[K]
    if kind is not None:
        irq.armed = True
        with pytest.raises(irq.error()):
            if how == "closure":
                opt.step(lambda: irq.loss(model, x, y).backward())
            elif how == "opt.backward":
                opt.backward(irq.loss(model, x, y))
            else:
                irq.loss(model, x, y).backward()
        assert irq.raised == 1
        if how == "backward":
            opt.zero_grad()  # the retry torch allows; it puts the weights back
        interrupted = weights(model)
    before_state = states(model, opt)
    opt.zero_grad()
    irq.loss(model, x, y).backward()
    opt.step()
    for x, y in data[K + 1:]:
        opt.zero_grad()
        irq.loss(model, x, y).backward()
        opt.step()
    return dict(before=before, before_state=before_state, interrupted=interrupted,
                end=weights(model), end_state=states(model, opt), steps=opt.step_count)


_references: dict = {}


def reference(tier, schedule, tmp_path_factory):
    key = (tier, schedule)
    if key not in _references:
        _references[key] = train(tier, schedule, tmp_path_factory.mktemp(f"ref-{tier}-{schedule}"))
    return _references[key]


def check_against(ref, run):
    assert_equal(run["before"], ref["before"], "weights before iteration K + 1")
    assert_equal(run["interrupted"], ref["before"], "weights after the interruption and zero_grad()")
    assert_equal(run["before_state"], ref["before_state"], "state after the interruption")
    assert run["steps"] == ref["steps"] == K + 1 + AFTER
    assert_equal(run["end"], ref["end"], f"weights after the retry and {AFTER} steps")
    assert_equal(run["end_state"], ref["end_state"], f"state after the retry and {AFTER} steps")


@pytest.mark.parametrize("kind", ["hook-error", "keyboard-interrupt"])
@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_retry_after_an_exception_in_backward(tier, schedule, kind, tmp_path, tmp_path_factory):
    """Interrupted mid-backward, zero_grad() puts the weights and state back; the retry and 5 more steps
    equal the uninterrupted run bit for bit."""
    ref = reference(tier, schedule, tmp_path_factory)
    check_against(ref, train(tier, schedule, tmp_path, kind))


@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_exception_in_step_closure(tier, schedule, tmp_path, tmp_path_factory):
    """A closure whose backward raises inside step(): nothing is stepped, and the weights are back when
    step() raises."""
    ref = reference(tier, schedule, tmp_path_factory)
    check_against(ref, train(tier, schedule, tmp_path, "hook-error", how="closure"))


@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
def test_exception_through_opt_backward(schedule, tmp_path, tmp_path_factory):
    """Through opt.backward(), the weights are back as the exception leaves it, before any other call."""
    ref = reference("ram", schedule, tmp_path_factory)
    check_against(ref, train("ram", schedule, tmp_path, "keyboard-interrupt", how="opt.backward"))


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_refused_step_changes_nothing(tier, schedule, tmp_path, tmp_path_factory):
    """A NaN gradient makes step() raise (refuse_non_finite): weights and state as before, and the retry
    after zero_grad() equals the uninterrupted run. (The delayed schedule decides in the background and
    reports a refusal at the next step(), which is not this case.)"""
    ref = reference(tier, schedule, tmp_path_factory)
    model = make_mlp(dtype=BF16)
    opt = make_opt(model, tier, schedule, tmp_path)
    irq = Interrupter(model, "keyboard-interrupt")
    poison = {"on": False}
    model[4].bias.register_hook(lambda g: g * math.nan if poison["on"] else g)
    data = batches(K + 1 + AFTER)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        if i == K:
            assert_equal(weights(model), ref["before"], "weights before iteration K + 1")
            poison["on"] = True
            irq.loss(model, x, y).backward()
            with pytest.raises(zoe.InvalidArgumentError, match="NaN|Inf|finite"):
                opt.step()
            poison["on"] = False
            assert_equal(weights(model), ref["before"], "weights after the refused step")
            assert_equal(states(model, opt), ref["before_state"], "state after the refused step")
            opt.zero_grad()
        irq.loss(model, x, y).backward()
        opt.step()
    assert_equal(weights(model), ref["end"], "weights after the retry")
    assert_equal(states(model, opt), ref["end_state"], "state after the retry")


def test_backward_again_without_zero_grad_says_why(tmp_path):
    """Running backward again after an interrupted one, with no call to the optimizer between, is refused
    with a message that says what happened and what to call."""
    model = make_mlp(dtype=BF16)
    opt = make_opt(model, "ram", "overlap", tmp_path)
    irq = Interrupter(model, "keyboard-interrupt")
    data = batches(3)
    for x, y in data[:2]:
        opt.zero_grad()
        irq.loss(model, x, y).backward()
        opt.step()
    opt.zero_grad()
    x, y = data[2]
    irq.armed = True
    with pytest.raises(KeyboardInterrupt):
        irq.loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match="ended in an exception.*zero_grad"):
        irq.loss(model, x, y).backward()


@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
def test_retry_with_declared_micro_batches(schedule, tmp_path):
    """gradient_accumulation_steps=2, interrupted in the second micro-batch: zoe's fp32 sum of the first is
    dropped with the rest, and the iteration run again from its first micro-batch equals the uninterrupted
    run."""
    def run(interrupt):
        model = make_mlp(dtype=BF16)
        opt = make_opt(model, "ram", schedule, tmp_path, gradient_accumulation_steps=2)
        irq = Interrupter(model, "keyboard-interrupt")
        data = batches(2 * (K + 1 + AFTER))
        for i in range(K + 1 + AFTER):
            opt.zero_grad()
            if interrupt and i == K:
                before = weights(model)
                irq.loss(model, *data[2 * i]).backward()
                irq.armed = True
                with pytest.raises(KeyboardInterrupt):
                    irq.loss(model, *data[2 * i + 1]).backward()
                opt.zero_grad()
                assert_equal(weights(model), before, "weights after the interruption and zero_grad()")
            for x, y in data[2 * i:2 * i + 2]:
                irq.loss(model, x, y).backward()
            opt.step()
        return weights(model), states(model, opt)

    uninterrupted, interrupted = run(False), run(True)
    assert_equal(interrupted[0], uninterrupted[0], "weights at the end")
    assert_equal(interrupted[1], uninterrupted[1], "state at the end")
