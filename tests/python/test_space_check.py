"""Room before allocation from Python (issue 51, item 4): an optimizer or a parameter tier that needs more RAM
or disk than is free (the figures set by the test-only hook ``_zoe.set_free_space_for_tests``) is refused
with an exception giving both numbers and a ``zoe plan`` command; nothing is created — no optimizer, no file,
the model left as it was."""
import os

import pytest
import torch

import zoe
from zoe import _zoe
from zoe.torch import OffloadOptimizer, offload_parameters


@pytest.fixture(autouse=True)
def machine_figures_after():
    yield
    _zoe.set_free_space_for_tests()  # the machine's own figures again


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 16)).to(torch.bfloat16)


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_optimizer_refused_for_ram():
    model = _model()
    _zoe.set_free_space_for_tests(ram=50000)
    with pytest.raises(zoe.OutOfMemoryError) as e:
        OffloadOptimizer(model.parameters(), lr=1e-3, state_dtype="bf16")
    assert isinstance(e.value, MemoryError)
    m = str(e.value)
    assert f"the optimizer ({_params(model)} parameters, tier ram" in m
    assert "of host RAM (fp32 master weights " in m
    assert "and 48.8 KiB (50000 bytes) are free (set by a test)" in m
    assert m.endswith(f"zoe plan --params {_params(model)} --offload-optimizer cpu --state-dtype bf16")
    _zoe.set_free_space_for_tests()
    OffloadOptimizer(model.parameters(), lr=1e-3)  # the model is as it was


def test_optimizer_refused_for_disk(tmp_path):
    model = _model()
    _zoe.set_free_space_for_tests(disk=4096)
    with pytest.raises(zoe.ZoeError) as e:
        OffloadOptimizer(model.parameters(), lr=1e-3, tier="nvme", nvme_path=str(tmp_path))
    m = str(e.value)
    assert f"of disk for its files under {tmp_path}, and 4.0 KiB (4096 bytes) are free on that filesystem" in m
    assert "refused before creating any file" in m
    assert f"--offload-optimizer nvme --state-dtype fp32 --nvme '{tmp_path}'" in m
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_parameter_tier_refused_leaves_the_model_as_it_was(tmp_path, home):
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = dict(nvme_path=str(tmp_path)) if home == "nvme" else {}
    _zoe.set_free_space_for_tests(ram=1000) if home == "cpu" else _zoe.set_free_space_for_tests(disk=1000)
    with pytest.raises(zoe.OutOfMemoryError if home == "cpu" else zoe.ZoeError) as e:
        offload_parameters(model, device=home, **kw)
    m = str(e.value)
    assert "the parameter tier (2 blocks, " in m
    assert ("of host RAM" if home == "cpu" else "of disk for its files under") in m
    assert f"zoe plan --params {_params(model)} --stage 3 --offload-param {home} --prefetch 2" in m
    assert os.listdir(tmp_path) == []
    for n, p in model.named_parameters():
        assert not hasattr(p, "_zoe_param_offload")
        assert torch.equal(p.detach(), before[n]), n
    model(torch.randn(2, 256, dtype=torch.bfloat16))  # no hooks left behind
    _zoe.set_free_space_for_tests()
    offload_parameters(model, device=home, **kw).remove()  # and it can be offloaded now


def test_figures_that_allow_it_are_not_refused():
    model = _model()
    _zoe.set_free_space_for_tests(ram=10**12, disk=0)  # no NVMe path: the disk is not asked about
    opt = OffloadOptimizer(model.parameters(), lr=1e-3)
    del opt


def test_fsdp2_rank_folder_goes_with_a_refusal(tmp_path):
    """A ShardOffload makes <nvme_path>/rank<r> for its files: refused, it leaves no folder behind."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        path = tmp_path / "params"
        path.mkdir()
        _zoe.set_free_space_for_tests(disk=0)
        with pytest.raises(zoe.ZoeError, match="of disk for its files under"):
            offload_parameters(model, device="nvme", nvme_path=str(path))
        assert os.listdir(path) == []
        _zoe.set_free_space_for_tests()
        offload = offload_parameters(model, device="nvme", nvme_path=str(path))
        assert os.listdir(path) == ["rank0"]
        offload.close()
        assert os.listdir(path) == []
    finally:
        dist.destroy_process_group()
