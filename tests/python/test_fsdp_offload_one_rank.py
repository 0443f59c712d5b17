"""FSDP2 parameter offload on one rank, on the CPU (gloo) and on a GPU (nccl). With one rank FSDP2 does not
all-gather but still asks zoe's extension for each shard and copies it, so everything between the tier and
FSDP runs: the fetch at each unshard, the view of the pool handed to FSDP and its release — on CUDA a pool in
device memory, filled by copies on the tier's stream and released in order after FSDP's copy (on the current
stream; with two GPUs or more FSDP copies on its copy-in stream, which the two-rank suite, test_fsdp_offload.py
with gloo on the CPU, cannot reach on CUDA). Offloaded shards (cpu and nvme homes, CPUOffloadPolicy) equal
resident ones bitwise after STEPS steps, and from the second step on every fetch finds its group loaded. The
CUDA cases skip without a GPU; scripts/gpu-python runs them where there is one."""
import collections
import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from conftest import spawn_ranks  # noqa: E402
from test_fsdp_offload import HYPER, PREFETCH, STEPS, _diff, _shards, _train  # noqa: E402

CONFIGS = {
    "ram_reshard": ("cpu", dict(reshard=True)),
    "nvme_keep": ("nvme", dict(reshard=False)),
    "nvme_cpu_offload_policy": ("nvme", dict(reshard=True, offload_policy=True)),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA GPU on this machine"))]


_Output = collections.namedtuple("_Output", "loss")


class _PlainLM(torch.nn.Module):
    """Where transformers is not installed (a GPU machine without a package registry may lack it): a causal LM
    of the Llama's sizes in plain torch, used as the suite uses it (``model.model.layers``, ``.loss``)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(67, 32)
        self.model = torch.nn.Module()
        nn = torch.nn
        self.model.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32)) for _ in range(3))
        self.head = torch.nn.Linear(32, 67, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.model.layers:
            x = x + layer(x)
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 67), labels[:, 1:].reshape(-1))
        return _Output(loss)  # a named tuple: FSDP2 finds the tensors it hooks backward on in it


def _llama(device, reshard=True, offload_policy=False):
    """The two-rank suite's tiny Llama (fully_shard per layer and at the root) on `device`, or _PlainLM."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("transformers is not installed: a plain-torch model instead of the tiny Llama")
        model = _PlainLM().to(device)
    else:
        cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = LlamaForCausalLM(cfg).to(device)
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=device == "cuda")) if offload_policy else {}
    mesh = init_device_mesh(device, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **kw)
    return model


def _rank_main(rank, init_file, out_dir, device):
    from zoe.torch import OffloadOptimizer, offload_parameters

    os.environ["HF_HUB_OFFLINE"] = "1"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=1)
    out = {}
    try:
        for name, (home, kw) in CONFIGS.items():
            resident = _llama(device, **kw)
            _train(resident, OffloadOptimizer(resident.parameters(), **HYPER), rank, device=device)
            model = _llama(device, **kw)
            off = offload_parameters(model, home, prefetch=PREFETCH,
                                     nvme_path=os.path.join(out_dir, name) if home == "nvme" else None)
            opt = OffloadOptimizer(model.parameters(), **HYPER)
            out[f"{name}_counters"] = _train(model, opt, rank, off, device=device)
            out[f"{name}_vs_resident"] = _diff(_shards(resident), _shards(model, off))
            del opt
            off.remove()
            # Given back where FSDP keeps them: on the device, or with CPUOffloadPolicy pinned on the CPU.
            for key, m in ((f"{name}_placement", model), (f"{name}_resident_placement", resident)):
                out[key] = [(str(p.to_local().device), p.to_local().is_pinned()) for p in m.parameters()]
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=DEVICES)
def one_rank(request, tmp_path_factory):
    main = functools.partial(_rank_main, device=request.param)
    return request.param, spawn_ranks(main, tmp_path_factory.mktemp(f"fsdp_offload_{request.param}"), 1)[0]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_rank_offloaded_shards_equal_resident_bitwise(one_rank, config):
    device, r = one_rank
    diff = r[f"{config}_vs_resident"]
    print(f"{device} {config}: {STEPS} steps, offloaded against resident shards: max difference {diff}")
    assert diff == 0.0


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_rank_prefetch_hits_from_the_second_step_on(one_rank, config):
    device, r = one_rank
    (f1, h1), (fn, hn) = r[f"{config}_counters"][0][:2], r[f"{config}_counters"][-1][:2]
    print(f"{device} {config}: fetches {fn - f1} and hits {hn - h1} over steps 2..{STEPS}")
    assert fn - f1 > 0 and hn - h1 == fn - f1


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_rank_remove_gives_the_shards_back_where_fsdp_keeps_them(one_rank, config):
    device, r = one_rank
    placement = sorted(set(r[f"{config}_placement"]))
    print(f"{device} {config}: shards after remove() on {placement}")
    assert r[f"{config}_placement"] == r[f"{config}_resident_placement"]
