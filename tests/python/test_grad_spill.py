"""spill_grads (tier nvme, FSDP2): each shard's gradient goes to a file as its backward ends and p.grad is None
after it; the step reads them back (src/offload/grad_spill.h). On one rank (gloo, the CPU) a spilled run must
give the unspilled run's bits — clipped by max_grad_norm, by torch.nn.utils.clip_grad_norm_ (which zoe answers,
the gradients being gone from p.grad), and with FSDP2's own micro-batches (gradient sync on the last) — and
the misuses are refused by name."""
import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import spawn_ranks  # noqa: E402
from test_fsdp_offload import HYPER, _ids, _shards  # noqa: E402
from test_fsdp_offload_one_rank import _llama  # noqa: E402

STEPS = 3


def _model(unused=False):
    """The tiny Llama, sharded; ``unused``: with a parameter no backward reaches (a head left unused)."""
    if not unused:
        return _llama("cpu")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    model.unused = torch.nn.Linear(32, 8)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def _run(out_dir, name, spill, clip=None, torch_clip=None, micro=1, unused=False):
    """STEPS steps of the tiny Llama under FSDP2 with tier nvme; what the test compares. ``unused``: a model
    with a parameter that gets no gradient, and zero_grad(set_to_none=False), which steps it with zeros."""
    model = _model(unused)
    opt = zoe.torch.OffloadOptimizer(model.parameters(), **HYPER, tier="nvme", spill_grads=spill,
                                     nvme_path=os.path.join(out_dir, name), max_grad_norm=clip)
    grads_after_backward = []
    if unused:  # as torch: every parameter has a gradient from here on, zero where backward gives none
        opt.zero_grad(set_to_none=False)
    for step in range(STEPS):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            ids = _ids(0, step, m)
            (model(input_ids=ids, labels=ids).loss / micro).backward()
        grads_after_backward.append(sum(p.grad is not None for p in model.parameters()))
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        opt.step()
        opt.zero_grad(set_to_none=not unused)
    stats = opt.stats()
    result = dict(shards=_shards(model), grads_after_backward=grads_after_backward, d2h=stats["d2h_bytes"],
                  spill_file=os.path.exists(os.path.join(out_dir, name, "zoe-optimizer.grads")))
    del opt
    result["spill_file_after"] = os.path.exists(os.path.join(out_dir, name, "zoe-optimizer.grads"))
    return result


def _clip_errors(out_dir):
    """Clipping zoe cannot answer over spilled gradients: another norm, part of the parameters."""
    model = _llama("cpu")
    opt = zoe.torch.OffloadOptimizer(model.parameters(), **HYPER, tier="nvme", spill_grads=True,
                                     nvme_path=os.path.join(out_dir, "clip_errors"))
    ids = _ids(0, 0, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    errors = []
    for call in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf")),
                 lambda: torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            errors.append(f"{type(e).__name__}: {e}")
        else:
            errors.append("")
    opt.zero_grad()
    return errors


def _twice(out_dir):
    """A second backward with gradient sync before step(): the spill does not sum micro-batches."""
    model = _llama("cpu")
    opt = zoe.torch.OffloadOptimizer(model.parameters(), **HYPER, tier="nvme", spill_grads=True,
                                     nvme_path=os.path.join(out_dir, "twice"))
    ids = _ids(0, 0, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        error = f"{type(e).__name__}: {e}"
    else:
        error = ""
    opt.zero_grad()  # gives the iteration up: the next one runs
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return error


def _rank_main(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    out = {}
    try:
        out["plain"] = _run(out_dir, "plain", False)
        out["spilled"] = _run(out_dir, "spilled", True)
        out["plain_clipped"] = _run(out_dir, "plain_clipped", False, clip=0.05)
        out["spilled_clipped"] = _run(out_dir, "spilled_clipped", True, clip=0.05)
        out["spilled_torch_clip"] = _run(out_dir, "spilled_torch_clip", True, torch_clip=0.05)
        out["plain_micro"] = _run(out_dir, "plain_micro", False, micro=2)
        out["spilled_micro"] = _run(out_dir, "spilled_micro", True, micro=2)
        out["plain_unused"] = _run(out_dir, "plain_unused", False, unused=True)
        out["spilled_unused"] = _run(out_dir, "spilled_unused", True, unused=True)
        out["twice"] = _twice(out_dir)
        out["clip_errors"] = _clip_errors(out_dir)
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return spawn_ranks(functools.partial(_rank_main), tmp_path_factory.mktemp("grad_spill"), 1)[0]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["shards"], b["shards"]))


@pytest.mark.parametrize("pair", [("plain", "spilled"), ("plain_clipped", "spilled_clipped"),
                                  ("spilled_clipped", "spilled_torch_clip"), ("plain_micro", "spilled_micro"),
                                  ("plain_unused", "spilled_unused")])
def test_spilled_steps_equal_unspilled_bitwise(one_rank, pair):
    a, b = (one_rank[k] for k in pair)
    assert _equal(a, b), f"{pair[0]} and {pair[1]} differ"


def test_the_clipping_compared_bites(one_rank):
    assert not _equal(one_rank["plain"], one_rank["plain_clipped"])


def test_spilled_gradients_leave_p_grad_and_the_file_goes_with_the_optimizer(one_rank):
    r = one_rank["spilled"]
    assert r["grads_after_backward"] == [0] * STEPS  # every p.grad None after backward
    assert one_rank["plain"]["grads_after_backward"][0] > 0
    assert r["d2h"] == 0  # the CPU is the device: written from where FSDP2 put them
    assert r["spill_file"] and not r["spill_file_after"]


def test_a_second_backward_before_step_is_refused(one_rank):
    error = one_rank["twice"]
    assert "reported twice" in error and "spill" in error, error


def test_clipping_zoe_cannot_answer_is_refused(one_rank):
    inf_norm, subset = one_rank["clip_errors"]
    assert "norm_type=inf" in inf_norm and "spilled gradients" in inf_norm, inf_norm
    assert "spilled gradients (spill_grads) must be given this optimizer's parameters" in subset, subset


def test_spill_grads_needs_tier_nvme_and_fsdp2(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="spill_grads=True needs tier='nvme'"):
        zoe.torch.OffloadOptimizer(model.parameters(), spill_grads=True)
    with pytest.raises(zoe.UnsupportedError, match="spill_grads is for FSDP2-sharded models"):
        zoe.torch.OffloadOptimizer(model.parameters(), tier="nvme", nvme_path=str(tmp_path), spill_grads=True)
    with pytest.raises(ValueError, match="spill_grads = 'yes' is invalid"):
        zoe.torch.OffloadOptimizer(model.parameters(), tier="nvme", nvme_path=str(tmp_path), spill_grads="yes")
