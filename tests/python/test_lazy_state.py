"""Parameters frozen when the optimizer is made (LoRA's base, layers unfrozen later) cost no state and no
gradient buffer until they want a gradient, as torch's optimizers make state at a parameter's first step
(issue 51, item 3; python/zoe/_lazy.py). Once unfrozen, one steps as torch.optim.AdamW steps it, and every
other parameter's state goes across the new engine bitwise: the whole run equals, bit for bit, zoe holding
the parameter from the start."""
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import zoe
from zoe.torch import OffloadOptimizer

from conftest import batches, make_mlp, max_diff, spawn_ranks

# fp32 zoe against fp32 torch: only the order of float operations in each element's update differs
# (test_optimizer.py's PARITY_TOL, measured 7.5e-8 after 50 steps; test_torch_contract.py uses it too).
PARITY_TOL = 1e-5
HYPER = dict(lr=3e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05)
STEPS, UNFREEZE_AT = 7, 3


def _mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _kw(cfg, tmp_path, name="swap"):
    kw = {k: v for k, v in cfg.items() if k not in ("where", "clip")}
    if kw.get("tier") == "nvme":
        kw["nvme_path"] = str(tmp_path / name)
    return kw


def _frozen_mlp():
    model = make_mlp()
    model[0].requires_grad_(False)
    return model


def _run(model, opt, cfg, steps=STEPS, unfreeze_at=UNFREEZE_AT, refreeze_at=None, first=0):
    """The trainer's loop; model[0] (frozen) is unfrozen at ``unfreeze_at``: before zero_grad() (``where`` =
    "zero_grad": zoe makes its state there) or after it, before backward (zoe makes it at step(), or in
    clip_grad_norm_ when the trainer clips through torch.nn.utils over model.parameters())."""
    micro = cfg.get("gradient_accumulation_steps", 1)
    data = batches((first + steps) * micro)[first * micro:]
    for t in range(steps):
        if t == unfreeze_at and cfg.get("where", "zero_grad") == "zero_grad":
            model[0].requires_grad_(True)
        if t == refreeze_at:
            model[0].requires_grad_(False)
        opt.zero_grad()
        if t == unfreeze_at and cfg.get("where") == "step":
            model[0].requires_grad_(True)
        for x, y in data[t * micro:(t + 1) * micro]:
            _mse(model, x, y).backward()
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()


def _states(opt, model) -> dict:
    """Every parameter's fp32 master and moments zoe holds, by position (none for one it holds nothing for)."""
    out = {}
    for i, p in enumerate(model.parameters()):
        try:
            out[i] = {k: v.clone() for k, v in opt.read_state(p).items()}
        except KeyError:
            pass
    return out


def _steps(opt) -> dict:
    """Each parameter's step, as torch's state_dict has it (parameters never stepped have no entry)."""
    return {i: int(s["step"]) for i, s in opt.torch_state_dict()["state"].items() if int(s["step"])}


def _torch_steps(opt, model) -> dict:
    return {i: int(opt.state[p]["step"]) for i, p in enumerate(model.parameters()) if p in opt.state}


def test_a_parameter_frozen_at_construction_holds_no_state_and_no_gradient_buffer(tmp_path):
    model = _frozen_mlp()
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = list(model[0].parameters())
    for tier in ("ram", "nvme"):
        kw = _kw(dict(tier=tier), tmp_path, f"swap-{tier}")
        opt = OffloadOptimizer(model.parameters(), **HYPER, **kw)
        alone = OffloadOptimizer(trainable, **HYPER, **_kw(dict(tier=tier), tmp_path, f"alone-{tier}"))
        stats, alone_stats = opt.stats(), alone.stats()
        print(f"tier {tier}: state elements {stats['state_elements']} (trainable alone "
              f"{alone_stats['state_elements']}), gradient buffers {stats['device_grad_bytes']} bytes "
              f"({alone_stats['device_grad_bytes']})")
        assert stats["state_elements"] == alone_stats["state_elements"] == sum(p.numel() for p in trainable)
        assert stats["device_grad_bytes"] == alone_stats["device_grad_bytes"] == 4 * sum(p.numel() for p in trainable)
        del alone
        _run(model, opt, {}, steps=2, unfreeze_at=None)
        for p in frozen:
            assert p not in opt.state and opt.state[p] == {} and p.grad is None  # torch's: nothing until a step
            with pytest.raises(KeyError, match="frozen since it was made"):
                opt.read_state(p)
        sd = opt.state_dict()
        assert sorted(sd["state"]) == [2, 3, 4, 5] and sd["zoe"]["lazy"] == [0, 1]
        assert sd["param_groups"][0]["params"] == list(range(6))  # numbered as torch numbers them
        del opt


CASES = [dict(tier=t, schedule=s, where=w) for t in ("ram", "nvme") for s in ("sync", "overlap")
         for w in ("zero_grad", "step")] + [
    dict(schedule="overlap", where="step", clip=0.05),  # made in clip_grad_norm_, which zoe answers
    dict(schedule="sync", where="zero_grad", gradient_accumulation_steps=2),
    dict(schedule="overlap", where="zero_grad", gradient_accumulation_steps=2, clip=0.05),
    dict(tier="nvme", schedule="overlap", where="zero_grad", state_dtype="int8"),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_parameter_unfrozen_later_steps_as_torch_adamw(cfg, tmp_path):
    ref, mine, held = make_mlp(), _frozen_mlp(), make_mlp()
    ref[0].requires_grad_(False)
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    mopt = OffloadOptimizer(mine.parameters(), **HYPER, **_kw(cfg, tmp_path))
    # zoe as it was: holding the frozen layer from construction, never stepped while it has no gradient.
    hopt = OffloadOptimizer(held.parameters(), **HYPER, **_kw(cfg, tmp_path, "held"))
    held[0].requires_grad_(False)
    frozen_elements = sum(p.numel() for p in mine[0].parameters())
    assert hopt.stats()["state_elements"] - mopt.stats()["state_elements"] == frozen_elements
    _run(ref, ropt, cfg, steps=UNFREEZE_AT, unfreeze_at=None)
    _run(mine, mopt, cfg, steps=UNFREEZE_AT, unfreeze_at=None)
    _run(held, hopt, cfg, steps=UNFREEZE_AT, unfreeze_at=None)
    before = _states(mopt, mine)
    assert sorted(before) == [2, 3, 4, 5]
    rest = dict(steps=STEPS - UNFREEZE_AT, unfreeze_at=0, first=UNFREEZE_AT)
    _run(ref, ropt, cfg, **rest)
    _run(mine, mopt, cfg, **rest)
    _run(held, hopt, cfg, **rest)
    mopt._engine.wait()
    hopt._engine.wait()
    diff = max_diff(ref, mine)
    print(f"{cfg}: max |w_zoe - w_torch| {diff:.2e} after {STEPS} steps, the unfrozen layer's {STEPS - UNFREEZE_AT}")
    if cfg.get("state_dtype", "fp32") == "fp32":  # int8 moments are not torch's: zoe's own run below
        assert diff < PARITY_TOL
    assert _steps(mopt) == _torch_steps(ropt, ref) == {0: 4, 1: 4, 2: 7, 3: 7, 4: 7, 5: 7}
    assert mopt.stats()["state_elements"] == hopt.stats()["state_elements"]
    # Bit for bit zoe's run holding the layer from the start: the new engine took every state as it was.
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), held.parameters()))
    mine_states, held_states = _states(mopt, mine), _states(hopt, held)
    for i in range(6):
        assert all(torch.equal(mine_states[i][k], held_states[i][k]) for k in held_states[i]), i


def test_the_new_engine_carries_every_other_state_bitwise(tmp_path):
    model = _frozen_mlp()
    opt = OffloadOptimizer(model.parameters(), **HYPER, state_dtype="bf16")
    _run(model, opt, {}, steps=3, unfreeze_at=None)
    before, steps = _states(opt, model), opt.step_count
    weights = [p.detach().clone() for p in model.parameters()]
    model[0].requires_grad_(True)
    opt.zero_grad()  # zoe makes the layer's state here
    after = _states(opt, model)
    assert sorted(after) == list(range(6)) and opt.step_count == steps
    for i in before:
        assert all(torch.equal(before[i][k], after[i][k]) for k in before[i]), i
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert torch.equal(after[0]["master"], model[0].weight.detach()) and not after[0]["exp_avg"].any()
    assert model[0].weight not in opt.state and opt.state[model[0].weight] == {}  # no state before its step


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_the_step_that_makes_the_state_neither_replaces_nor_writes_p_grad(schedule):
    model = _frozen_mlp()
    opt = OffloadOptimizer(model.parameters(), **HYPER, schedule=schedule)
    _run(model, opt, {}, steps=2, unfreeze_at=None)
    opt.zero_grad()
    model[0].requires_grad_(True)
    x, y = batches(3)[2]
    _mse(model, x, y).backward()
    grads = [(p.grad, p.grad._version, p.grad.clone()) for p in model.parameters()]
    opt.step()  # the new engine is made here
    assert opt.state[model[0].weight]["step"] == 1
    for p, (g, version, values) in zip(model.parameters(), grads):
        assert p.grad is g and g._version == version and torch.equal(g, values)


def test_refrozen_keeps_its_state_as_torch_does():
    ref, mine = make_mlp(), _frozen_mlp()
    ref[0].requires_grad_(False)
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    mopt = OffloadOptimizer(mine.parameters(), **HYPER)
    for model, opt in ((ref, ropt), (mine, mopt)):
        _run(model, opt, {}, steps=STEPS, unfreeze_at=2, refreeze_at=5)
    assert max_diff(ref, mine) < PARITY_TOL
    assert _steps(mopt) == _torch_steps(ropt, ref) == {0: 3, 1: 3, 2: 7, 3: 7, 4: 7, 5: 7}
    st = mopt.state[mine[0].weight]
    assert torch.allclose(st["exp_avg"], ropt.state[ref[0].weight]["exp_avg"], rtol=1e-4, atol=1e-9)


def test_unfreezing_after_micro_batches_zoe_summed_is_refused_and_the_iteration_runs_again():
    """Declared micro-batches are summed by zoe's engine, which a new engine would lose: unfrozen between
    zero_grad() and backward, the step refuses naming the parameter and gives the iteration up; after
    zero_grad() it runs again and steps as torch's."""
    ref, mine = make_mlp(), _frozen_mlp()
    ref[0].requires_grad_(False)
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    mopt = OffloadOptimizer(mine.parameters(), **HYPER, gradient_accumulation_steps=2)
    _run(ref, ropt, dict(gradient_accumulation_steps=2, where="step"), steps=4, unfreeze_at=2)
    cfg = dict(gradient_accumulation_steps=2)
    _run(mine, mopt, cfg, steps=2, unfreeze_at=None)
    weights = [p.detach().clone() for p in mine.parameters()]
    mopt.zero_grad()
    mine[0].requires_grad_(True)
    data = batches(8)
    for x, y in data[4:6]:
        _mse(mine, x, y).backward()
    with pytest.raises(RuntimeError, match=r"parameter 0 \(shape \(64, 32\)\), parameter 1 \(shape \(64,\)\): "
                       r"frozen when this optimizer was made.*opt.zero_grad\(\) after unfreezing"):
        mopt.step()
    assert all(torch.equal(w, p) for w, p in zip(weights, mine.parameters()))
    _run(mine, mopt, cfg, steps=2, unfreeze_at=None, first=2)  # zero_grad() first: the state is made there
    assert max_diff(ref, mine) < PARITY_TOL
    assert _steps(mopt) == _torch_steps(ropt, ref)


# ---- checkpoints ---------------------------------------------------------------------------------------------

def _saved(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _resumed(sd, frozen: bool, steps: int, first: int, unfreeze_at=None, list_of=False):
    """A new model and optimizer from the checkpoint ``sd`` (the layer frozen at construction or not), trained
    on. The model's weights come from the checkpoint as a trainer loads them: a layer zoe held no state for
    has no master in the optimizer's."""
    model = make_mlp(seed=5)
    model.load_state_dict(sd["model"])
    sd = sd["opt"]
    model[0].requires_grad_(not frozen)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    model[0].requires_grad_(False)  # held or not, frozen until unfreeze_at
    opt.load_state_dict([sd] if list_of else sd)
    _run(model, opt, {}, steps=steps, unfreeze_at=unfreeze_at, first=first)
    return model, opt


@pytest.mark.parametrize("list_of", [False, True], ids=["state_dict", "list"])
def test_a_state_dict_saved_with_parameters_without_state_resumes_bitwise(list_of):
    whole = _frozen_mlp()
    wopt = OffloadOptimizer(whole.parameters(), **HYPER)
    _run(whole, wopt, {}, steps=3, unfreeze_at=None)
    sd = _saved({"model": whole.state_dict(), "opt": wopt.state_dict()})
    _run(whole, wopt, {}, steps=4, unfreeze_at=1, first=3)
    # Frozen at construction in the new optimizer too: the same engine layout, zoe's own checkpoint.
    model, opt = _resumed(sd, frozen=True, steps=4, first=3, unfreeze_at=1, list_of=list_of)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), model.parameters()))
    assert _steps(opt) == _steps(wopt) == {0: 3, 1: 3, 2: 7, 3: 7, 4: 7, 5: 7}
    # Trainable at construction there: it holds the layer the checkpoint has no state for (through torch's
    # format, with the fp32 masters), and steps it from its first gradient.
    model, opt = _resumed(sd, frozen=False, steps=4, first=3, unfreeze_at=1, list_of=list_of)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), model.parameters()))
    assert _steps(opt) == _steps(wopt)


def test_a_state_dict_with_state_for_a_parameter_frozen_here_gives_it_its_state():
    whole = make_mlp()
    wopt = OffloadOptimizer(whole.parameters(), **HYPER)
    _run(whole, wopt, {}, steps=3, unfreeze_at=None)
    sd = _saved({"model": whole.state_dict(), "opt": wopt.state_dict()})
    _run(whole, wopt, {}, steps=2, unfreeze_at=None, first=3)
    model, opt = _resumed(sd, frozen=True, steps=2, first=3, unfreeze_at=0)
    assert opt.state[model[0].weight]["step"] == 5
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), model.parameters()))


def test_torch_adamws_state_dict_gives_a_parameter_frozen_here_its_state():
    ref = make_mlp()
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    _run(ref, ropt, {}, steps=3, unfreeze_at=None)
    mine = _frozen_mlp()
    mine.load_state_dict(ref.state_dict())
    mopt = OffloadOptimizer(mine.parameters(), **HYPER)
    mopt.load_state_dict(_saved(ropt.state_dict()))  # the model's weights are the torch run's too
    assert torch.equal(mopt.state[mine[0].weight]["exp_avg"], ropt.state[ref[0].weight]["exp_avg"])
    for model, opt in ((ref, ropt), (mine, mopt)):
        _run(model, opt, {}, steps=3, unfreeze_at=0, first=3)
    assert max_diff(ref, mine) < PARITY_TOL
    assert _steps(mopt) == _torch_steps(ropt, ref)


# ---- zoe's partition and FSDP2 refuse, naming the parameter -------------------------------------------------

def _sharded_mlp(case):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_mlp()
    model[0].requires_grad_(False)
    if case == "fsdp2":
        mesh = init_device_mesh("cpu", (2,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _dcp_round_trip(model, opt, folder) -> bool:
    """FSDP2's checkpoint through torch.distributed.checkpoint, into a new model and optimizer with the layer
    frozen again: the state of the others comes back bitwise, and the frozen layer has none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    again = _sharded_mlp("fsdp2")
    opt2 = OffloadOptimizer(again.named_parameters(), **HYPER)
    model_sd, optim_sd = get_state_dict(again, opt2)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    set_state_dict(again, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    same = all(torch.equal(opt.read_state(p)[k], opt2.read_state(q)[k]) for p, q in
               zip(list(model.parameters())[2:], list(again.parameters())[2:]) for k in ("master", "exp_avg"))
    return same and opt2.stats()["state_elements"] == opt.stats()["state_elements"]


def _refusals_main(rank, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    out = {}
    try:
        for case in ("partition", "fsdp2"):
            model = _sharded_mlp(case)
            opt = OffloadOptimizer(model.named_parameters(), **HYPER)
            x, y = batches(1)[0]
            _mse(model, x, y).backward()
            opt.step()  # the frozen layer costs nothing and is not stepped
            out[f"{case}_elements"] = opt.stats()["state_elements"]
            if case == "fsdp2":
                out["dcp"] = _dcp_round_trip(model, opt, os.path.join(out_dir, "dcp"))
            model[0].requires_grad_(True)
            try:
                opt.zero_grad()
                out[case] = None
            except zoe.UnsupportedError as e:
                out[case] = str(e)
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def test_partitioned_and_fsdp2_optimizers_refuse_a_parameter_unfrozen_after_construction(tmp_path):
    ranks = spawn_ranks(_refusals_main, tmp_path, 2)
    trainable = sum(p.numel() for p in make_mlp()[2:].parameters())
    for r in ranks:
        assert r["partition_elements"] == -(-trainable // 2)  # each rank holds its half of the trainable ones
        assert r["fsdp2_elements"] == trainable // 2 and r["dcp"]  # its shards of them
        for case in ("partition", "fsdp2"):
            assert r[case] is not None and "parameter 0 '0.weight' (shape (64, 32)), parameter 1 '0.bias' (shape " \
                "(64,)): frozen (requires_grad=False) when this optimizer was made" in r[case], r[case]
            assert "Unfreeze before creating the optimizer" in r[case]


# ---- PEFT LoRA given model.parameters() (issue 51: 0.7 GB for 131k trainable elements before) ---------------

_LORA = textwrap.dedent("""
    import json, os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from zoe.torch import OffloadOptimizer

    def rss():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

    torch.manual_seed(0)
    # ~58M parameters: 32000 x 512 embeddings and head, 8 layers of 512 (the size the issue measured).
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0))
    params = list(model.parameters())
    given = params if sys.argv[1] == "all" else [p for p in params if p.requires_grad]
    before = rss()
    opt = OffloadOptimizer(given, lr=1e-4)
    after = rss()
    x = torch.randint(0, 32000, (1, 16))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    stepped = rss()
    s = opt.stats()
    print(json.dumps(dict(params=sum(p.numel() for p in params),
                          trainable=sum(p.numel() for p in params if p.requires_grad),
                          state_elements=s["state_elements"], grad_bytes=s["device_grad_bytes"],
                          rss_delta=after["VmRSS"] - before["VmRSS"], hwm_delta=after["VmHWM"] - before["VmHWM"],
                          step_rss_delta=stepped["VmRSS"] - before["VmRSS"])))
""")


def test_peft_lora_given_every_parameter_costs_what_its_trainable_ones_cost():
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    got = {}
    for given in ("all", "trainable"):
        done = subprocess.run([sys.executable, "-c", _LORA, given], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        got[given] = json.loads(done.stdout.strip().splitlines()[-1])
    every, alone = got["all"], got["trainable"]
    print(f"PEFT LoRA r=8 on a {every['params'] / 1e6:.1f}M-parameter Llama, {every['trainable']} trainable:")
    for name, g in got.items():
        print(f"  given {name:9s}: state {g['state_elements']} elements, {12 * g['state_elements']} bytes of fp32 "
              f"state + {g['grad_bytes']} of gradient buffers; creating the optimizer: RSS "
              f"+{g['rss_delta'] / 2**20:.1f} MiB (peak +{g['hwm_delta'] / 2**20:.1f} MiB), after one step "
              f"+{g['step_rss_delta'] / 2**20:.1f} MiB")
    assert 50e6 < every["params"] < 65e6 and every["trainable"] == 131072
    cost = {k: 12 * g["state_elements"] + g["grad_bytes"] for k, g in got.items()}  # what zoe allocated
    assert cost["all"] <= 1.2 * cost["trainable"]
    assert every["state_elements"] == alone["state_elements"] == every["trainable"]
