"""zoe.torch.offload_parameters on a CUDA GPU, with zoe's OffloadOptimizer and C++ parameter tier: a 12-layer
GPT whose 16-bit weights are 8x the device pool trains bit-identically to the same model with its weights
resident on the same GPU, for the cpu and nvme homes; so do micro-batches, activation checkpointing and
no-grad inference. Skipped, naming why, on a machine without a GPU (CI); test_param_offload.py covers the same
on the host stand-in there.

Bit-identity needs the same kernels on both sides: deterministic algorithms, and attention through the math
kernel (the fused attention backward kernels may accumulate in a varying order)."""
import copy
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from zoe.demo.data import ByteBatches
from zoe.demo.model import GPT, Block, GPTConfig
from zoe.torch import OffloadOptimizer, offload_parameters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

CONFIG = dict(seq=64, d_model=256, n_layer=12, n_head=4, compute_dtype=torch.float32)
STEPS = 20


@pytest.fixture(autouse=True)
def _deterministic():
    # cuBLAS reads this when torch creates its handle; use_deterministic_algorithms refuses to run without it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    with sdpa_kernel(SDPBackend.MATH):
        yield
    torch.use_deterministic_algorithms(False)


class Checkpointed(torch.nn.Module):
    """Runs a block under torch.utils.checkpoint: its recomputation in backward calls the block again."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _gpt(ckpt=False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG)).to(device="cuda", dtype=torch.bfloat16)
    if ckpt:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(block)
    return model


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _train(model, schedule, steps=STEPS, micro=1):
    opt = OffloadOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01, schedule=schedule, delayed_warmup_steps=3,
                           gradient_accumulation_steps=micro if micro > 1 else None)
    data = ByteBatches(model.config.seq, 4, seed=0)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro):
            x, y = data.next()
            _, loss = model(x.cuda(), y.cuda())
            (loss / micro).backward()
            losses.append(loss.detach().clone())
        opt.step()
    return opt, losses


def _offload(model, home, tmp_path, prefetch=2):
    nvme = {}
    if home == "nvme":
        (tmp_path / "params").mkdir()
        nvme = dict(nvme_path=str(tmp_path / "params"))
    budget = _weight_bytes(model) // 8
    off = offload_parameters(model, device=home, prefetch=prefetch, budget_bytes=budget, block_modules=(Block,), **nvme)
    assert all(p.numel() == 0 and p.device.type == "cuda" for p in model.parameters())
    return off, budget


def _assert_same_training(reference, model, off, ref_opt, opt, want, got):
    assert [float(x) for x in got] == [float(x) for x in want]
    full = off.full_state_dict()
    for name, w in reference.state_dict().items():
        assert torch.equal(full[name].cpu(), w.cpu()), name
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        a, b = opt.read_state(p), ref_opt.read_state(p_ref)
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_gpt_trains_bitwise_as_resident_on_the_gpu(home, schedule, tmp_path):
    reference = _gpt()
    model = copy.deepcopy(reference)
    off, budget = _offload(model, home, tmp_path)
    ref_opt, want = _train(reference, schedule)
    opt, got = _train(model, schedule)
    _assert_same_training(reference, model, off, ref_opt, opt, want, got)
    s = off.stats()
    assert s["budget_bytes"] <= budget and s["pool_peak_bytes"] <= s["budget_bytes"]
    # The offloaded parameters' gradients left the GPU as each backward ended: it holds one window, as large
    # as the largest parameter, where the resident run holds a gradient for every weight.
    largest = max(p.numel() * p.element_size() for p in reference.parameters())
    assert opt.stats()["device_grad_bytes"] == largest
    assert ref_opt.stats()["device_grad_bytes"] == _weight_bytes(reference)
    assert opt.step_count == STEPS


def test_micro_batches_sum_on_the_host_bitwise(tmp_path):
    reference = _gpt()
    model = copy.deepcopy(reference)
    off, _ = _offload(model, "cpu", tmp_path)
    ref_opt, want = _train(reference, "overlap", steps=6, micro=3)
    opt, got = _train(model, "overlap", steps=6, micro=3)
    _assert_same_training(reference, model, off, ref_opt, opt, want, got)


def test_activation_checkpointing_fetches_again_bitwise(tmp_path):
    reference = _gpt(ckpt=True)
    model = _gpt(ckpt=True)
    off, _ = _offload(model, "nvme", tmp_path)
    loads_before = off.stats()["loads"]
    ref_opt, want = _train(reference, "sync", steps=4)
    opt, got = _train(model, "sync", steps=4)
    _assert_same_training(reference, model, off, ref_opt, opt, want, got)
    # Each layer is fetched for the forward, again for its recomputation and (the pool holding 1/8 of the
    # weights) again for its backward.
    assert off.stats()["loads"] - loads_before >= 4 * 2 * CONFIG["n_layer"]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_eval_inference_equals_resident(prefetch, tmp_path):
    reference = _gpt().eval()
    model = copy.deepcopy(reference)
    off, _ = _offload(model, "nvme", tmp_path, prefetch=prefetch)
    x, y = ByteBatches(CONFIG["seq"], 4, seed=9).next()
    with torch.no_grad():
        for _ in range(2):
            want, got = reference(x.cuda(), y.cuda()), model(x.cuda(), y.cuda())
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(off.tier.in_use(b) == 0 for b in range(len(off.blocks)))
