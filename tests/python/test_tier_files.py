"""The parameter tier's NVMe files end with the tier, however it ends (issue 51, item 6): a normal exit, an
uncaught exception, ``del`` of the model and handle (collected), ``offload.close()`` — with an optimizer still
holding the tier too — and none of them reads the weights back (the tier's read counters, the process's RSS);
``keep_files=True`` keeps them. The optimizer's own swap files (tier nvme) are kept, as docs/nvme.md says."""
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zoe
from zoe import _zoe
from zoe.torch import OffloadOptimizer, offload_parameters

# The child: a bf16 model whose weights (WEIGHT_MIB) go to an NVMe tier under sys.argv[1], one forward and
# backward and one step of zoe's optimizer (tier ram: its state is not the point), then how it ends
# (sys.argv[2]). It prints the files under the path and how far its RSS rose above where it was while that
# end ran (the peak, VmHWM, reset just before it).
CHILD = textwrap.dedent("""
    import gc, os, sys
    import torch
    from zoe.torch import OffloadOptimizer, offload_parameters

    path, how, keep = sys.argv[1], sys.argv[2], sys.argv[3] == "keep"

    def status_mib(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) / 1024

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(torch.bfloat16)  # 16 MiB
    offload = offload_parameters(model, device="nvme", nvme_path=path, keep_files=keep)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3) if "opt" in how else None
    model(torch.randn(4, 1024, dtype=torch.bfloat16)).float().square().mean().backward()
    if opt is not None:
        opt.step()
    print("files", sorted(os.listdir(path)), flush=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from the RSS now
    before = status_mib("VmRSS")
    if how.startswith("close"):
        if opt is not None:
            del opt
        offload.close()
        print("after", sorted(os.listdir(path)), flush=True)
    elif how.startswith("del"):
        del model, offload, opt
        gc.collect()
        print("after", sorted(os.listdir(path)), flush=True)
    elif how == "remove":
        del opt
        offload.remove()
    print("rss_growth_mib", status_mib("VmHWM") - before, flush=True)  # the most it held above `before`
    if how.startswith("raise"):
        raise RuntimeError("the trainer failed")
""")


def run_child(path, how: str, keep: bool = False) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), how, "keep" if keep else "no"],
                       capture_output=True, text=True, timeout=300)
    out = {"rc": r.returncode, "stderr": r.stderr}
    for line in r.stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = eval(value)  # lists of names and a float, printed by the child above
    return out


@pytest.mark.parametrize("how", ["exit", "exit_opt", "raise", "raise_opt", "del", "del_opt", "close", "close_opt"])
def test_files_go_however_the_tier_ends(tmp_path, how):
    r = run_child(tmp_path, how)
    assert r["rc"] == (1 if how.startswith("raise") else 0), r["stderr"]
    if how.startswith("raise"):
        assert "the trainer failed" in r["stderr"]
    assert r["files"] == ["zoe-params.zoe-params", "zoe-params.zoe-params.lock"]
    if "after" in r:  # del and close: gone at once, not only at the exit
        assert r["after"] == []
    assert os.listdir(tmp_path) == []
    # Not one weight was brought back into memory to end the tier (remove() does that: 16 MiB).
    assert r["rss_growth_mib"] < 4, r


def test_remove_reads_the_weights_back(tmp_path):
    """The control of the RSS measurement above: remove() gives the model its weights, which shows."""
    r = run_child(tmp_path, "remove")
    assert r["rc"] == 0, r["stderr"]
    assert r["rss_growth_mib"] > 8, r  # 16 MiB of weights read back (some into memory freed before)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("how", ["exit", "raise", "del", "close"])
def test_keep_files_keeps_them(tmp_path, how):
    r = run_child(tmp_path, how, keep=True)
    assert r["rc"] == (1 if how == "raise" else 0), r["stderr"]
    assert os.listdir(tmp_path) == ["zoe-params.zoe-params"]  # the owner lock goes when the tier does
    assert os.path.getsize(tmp_path / "zoe-params.zoe-params") >= 2 * 16 * 2**20


FSDP_CHILD = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from zoe.torch import OffloadOptimizer, offload_parameters

    path, how = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{path}/init", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    offload = offload_parameters(model, device="nvme", nvme_path=os.path.join(path, "params"))
    opt = OffloadOptimizer(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    print("files", sorted(os.listdir(os.path.join(path, "params", "rank0"))), flush=True)
    if how == "close":
        del opt
        offload.close()
        print("after", sorted(os.listdir(os.path.join(path, "params"))), flush=True)
    if how == "raise":
        raise RuntimeError("the trainer failed")
""")


@pytest.mark.parametrize("how", ["exit", "raise", "close"])
def test_fsdp2_files_and_rank_folder_go(tmp_path, how):
    """FSDP2: each rank's files under <nvme_path>/rank<r>, and the folder made for them, go at the exit (an
    uncaught exception's too) and at close(); the optimizer holds the tier until the end."""
    (tmp_path / "params").mkdir()
    r = subprocess.run([sys.executable, "-c", FSDP_CHILD, str(tmp_path), how], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == (1 if how == "raise" else 0), r.stderr
    assert "files ['zoe-params.zoe-params', 'zoe-params.zoe-params.lock']" in r.stdout
    if how == "close":
        assert "after []" in r.stdout
    assert os.listdir(tmp_path / "params") == []


class CountingTier:
    """A real tier behind a double that counts what is read from it (``tier_factory``)."""

    def __init__(self, *args):
        self.real = _zoe.ParamTier(_zoe.cpu_device(), *args)
        self.reads = 0

    def read(self, *args):
        self.reads += 1
        return self.real.read(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _offloaded(tmp_path, counting: bool = True):
    """A small model offloaded to NVMe after one forward and backward; with ``counting``, its tier a
    CountingTier (which zoe's optimizer cannot take: it needs the binding's own tier)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    tiers = []

    def factory(*args):
        tiers.append(CountingTier(*args))
        return tiers[-1]

    offload = offload_parameters(model, device="nvme", nvme_path=str(tmp_path),
                                 tier_factory=factory if counting else None)
    model(torch.randn(2, 64, dtype=torch.bfloat16)).sum().backward()
    return model, offload, tiers[0] if counting else offload.tier


def test_close_reads_nothing_and_the_model_says_so(tmp_path):
    model, offload, tier = _offloaded(tmp_path)
    read_bytes, fetches = tier.real.stats()["read_bytes"], tier.real.stats()["fetches"]
    offload.close()
    assert os.listdir(tmp_path) == []
    assert tier.reads == 0
    with pytest.raises(zoe.ZoeError, match="closed"):
        tier.real.stats()  # freed
    assert read_bytes > 0 and fetches > 0
    with pytest.raises(RuntimeError, match="was closed .*remove\\(\\) is what gives them back"):
        model(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="was closed"):
        offload.weights(model[0].weight)
    with pytest.raises(RuntimeError, match="was closed"):
        offload.full_state_dict()
    with pytest.raises(RuntimeError, match="was closed"):
        offload.remove()
    offload.close()  # a second close does nothing


def test_close_is_refused_while_an_optimizer_writes_into_the_tier(tmp_path):
    model, offload, _ = _offloaded(tmp_path, counting=False)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="close\\(\\) while an OffloadOptimizer still writes"):
        offload.close()
    assert len(os.listdir(tmp_path)) == 2
    del opt
    gc.collect()
    offload.close()
    assert os.listdir(tmp_path) == []


def test_close_is_refused_inside_gathered(tmp_path):
    model, offload, _ = _offloaded(tmp_path)
    with offload.gathered():
        with pytest.raises(RuntimeError, match="close\\(\\) while blocks are in use"):
            offload.close()
    assert len(os.listdir(tmp_path)) == 2
    model(torch.randn(2, 64, dtype=torch.bfloat16))  # the offload works on
    offload.close()
    assert os.listdir(tmp_path) == []


def test_collected_with_its_model_reads_nothing(tmp_path):
    model, offload, tier = _offloaded(tmp_path)
    read_bytes = tier.real.stats()["read_bytes"]
    del model, offload
    gc.collect()
    assert os.listdir(tmp_path) == []
    assert tier.reads == 0
    assert tier.real.stats()["read_bytes"] == read_bytes  # still alive here (the test holds it), files unlinked


def test_handle_dropped_while_the_model_lives_keeps_the_tier(tmp_path):
    """The model still needs its weights: only the model's end (with the handle's) ends the tier."""
    model, offload, tier = _offloaded(tmp_path)
    del offload
    gc.collect()
    assert len(os.listdir(tmp_path)) == 2
    model(torch.randn(2, 64, dtype=torch.bfloat16)).sum().backward()


def test_the_optimizers_swap_files_are_kept(tmp_path):
    """docs/nvme.md: the swap files are the optimizer's durable state (zoe probe lists a store left behind and
    the next optimizer replaces it); the parameter tier's are scratch."""
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, tier="nvme", nvme_path=str(tmp_path))
    model(torch.randn(2, 64, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    del opt
    gc.collect()
    assert any(n.endswith(".zoe-swap") for n in os.listdir(tmp_path))
