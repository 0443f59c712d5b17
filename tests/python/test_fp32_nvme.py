"""fp32 parameters on tier nvme: an fp32 model on the CPU, and fp32 adapters beside a bf16 base (PEFT's LoRA).
The swap store keeps their fp32 masters and each step copies them to the model: the weights and the
state_dict() equal tier ram's bit for bit, in every schedule."""
import pytest
import torch

import zoe
from zoe.torch import OffloadOptimizer

from conftest import batches, make_mlp, train

HYPER = dict(lr=3e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05)
SCHEDULES = [dict(schedule="sync"), dict(schedule="overlap"), dict(schedule="delayed", delayed_warmup_steps=2)]


def _equal_state_dicts(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(b["state"][i][k])), (i, k)


def _nvme(params, tmp_path, **kw):
    try:
        return OffloadOptimizer(params, tier="nvme", nvme_path=str(tmp_path / "swap"), **kw)
    except zoe.UnsupportedError:
        pytest.skip("this build has no NVMe tier")


@pytest.mark.parametrize("cfg", SCHEDULES, ids=lambda c: c["schedule"])
@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_an_fp32_model_on_nvme_equals_ram_bitwise(cfg, state_dtype, tmp_path):
    data = batches(6)
    ram, disk = make_mlp(), make_mlp()
    ropt = OffloadOptimizer(ram.parameters(), state_dtype=state_dtype, **cfg, **HYPER)
    dopt = _nvme(disk.parameters(), tmp_path, state_dtype=state_dtype, **cfg, **HYPER)
    train(ram, ropt, data)
    train(disk, dopt, data)
    for p, q in zip(ram.parameters(), disk.parameters()):
        a, b = ropt.read_state(p), dopt.read_state(q)  # waits for a step in flight (delayed)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for p, q in zip(ram.parameters(), disk.parameters()):
        assert p.dtype == q.dtype == torch.float32
        assert torch.equal(p, q)
        if cfg["schedule"] != "delayed":  # delayed: the last step's weights go up in the next backward
            assert torch.equal(dopt.read_state(q)["master"].view_as(q), q.detach())  # the weights are the master
    _equal_state_dicts(ropt.state_dict(), dopt.state_dict())
    assert dopt.stats()["nvme_write_bytes"] > 0


class Adapted(torch.nn.Module):
    """A bf16 base (frozen or not) with an fp32 low-rank adapter beside it, as PEFT's LoRA leaves them."""

    def __init__(self, seed: int = 0, train_base: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.base = torch.nn.Linear(32, 8).to(torch.bfloat16)
        self.base.requires_grad_(train_base)
        self.down = torch.nn.Linear(32, 4, bias=False)
        self.up = torch.nn.Linear(4, 8, bias=False)
        torch.nn.init.normal_(self.up.weight, std=0.1)

    def forward(self, x):
        return self.base(x.to(torch.bfloat16)).float() + self.up(self.down(x.float()))


@pytest.mark.parametrize("cfg", SCHEDULES[:2], ids=lambda c: c["schedule"])
@pytest.mark.parametrize("train_base", [False, True])
def test_fp32_adapters_on_a_bf16_base_on_nvme_equal_ram_bitwise(cfg, train_base, tmp_path):
    data = batches(5)
    ram, disk = Adapted(train_base=train_base), Adapted(train_base=train_base)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    ropt = OffloadOptimizer(trainable(ram), **cfg, **HYPER)
    dopt = _nvme(trainable(disk), tmp_path, **cfg, **HYPER)
    train(ram, ropt, data)
    train(disk, dopt, data)
    for p, q in zip(ram.parameters(), disk.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(disk.up.weight, Adapted().up.weight)  # the adapters were stepped
    _equal_state_dicts(ropt.state_dict(), dopt.state_dict())


def test_an_fp32_model_on_nvme_resumes_from_its_state_dict_bitwise(tmp_path):
    """state_dict() of tier nvme loads into tier nvme and tier ram; either continues as the uninterrupted run."""
    data = batches(8)
    whole = make_mlp()
    train(whole, OffloadOptimizer(whole.parameters(), **HYPER), data)
    first = make_mlp()
    opt = _nvme(first.parameters(), tmp_path / "first", **HYPER)
    train(first, opt, data[:4])
    sd = opt.state_dict()
    for tier in ("nvme", "ram"):
        model = make_mlp()
        model.load_state_dict(first.state_dict())
        again = (_nvme(model.parameters(), tmp_path / "again", schedule="overlap", **HYPER) if tier == "nvme"
                 else OffloadOptimizer(model.parameters(), schedule="overlap", **HYPER))
        again.load_state_dict(sd)
        train(model, again, data[4:])
        for p, q in zip(whole.parameters(), model.parameters()):
            assert torch.equal(p, q), tier
