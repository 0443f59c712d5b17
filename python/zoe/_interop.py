"""zoe's optimizer state in torch.optim's format, the interchange between zoe and torch and between zoe runs
of different data-parallel sizes.

A torch-format state_dict is ``{"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``
with full-size tensors per parameter (``torch.optim.AdamW`` loads it). zoe adds ``"zoe_masters"``: ``{i: fp32
master weights}``, which torch ignores and zoe loads (without them the masters are the model's weights, as
for a run that comes from torch). W ranks' zoe state_dicts are joined into one with ``consolidate``; any
number of ranks then load it, each taking its own partition. An fp16 run's loss scaler rides in each param
group as ``"zoe_loss_scale": [scale, clean_steps, hysteresis_left]`` (torch keeps unknown group keys).

DTensor (FSDP2) parameters have DTensor moments with the parameter's mesh and placements, as torch's
optimizers keep them: each rank holds its shards. That is the form ``torch.distributed.checkpoint`` saves
and reshards; under it the masters go into each parameter's state as ``"zoe_master"`` (it keeps only
``state`` and ``param_groups``).
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist

from . import _checks, _dtensor, _files, _rules, _scratch, _zoe
from ._flat import FlatState

try:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # a torch without torch.distributed: no DTensor parameters either
    compute_local_shape_and_global_offset = None

STATE_FORMAT = "zoe.torch.OffloadOptimizer/1"


def rank_file(folder: str, rank: int, world: int) -> str:
    """Where ``OffloadOptimizer.save_to(folder)`` puts a rank's state."""
    return os.path.join(folder, "zoe", f"rank{rank}-of-{world}.zoe")


def saved_keys(param_groups, sd: dict) -> list:
    """The key of each of the optimizer's parameters in sd["state"], in param-group order: torch numbers them,
    torch.distributed.checkpoint names them (FQNs); as torch's load_state_dict, matched by position."""
    groups = sd["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError(f"this state_dict has {len(groups)} param groups, the optimizer {len(param_groups)}")
    for gi, (saved, mine) in enumerate(zip(groups, param_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(f"param group {gi} of this state_dict has {len(saved['params'])} parameters, the "
                             f"optimizer's {len(mine['params'])}: it is for a different model")
    return [k for g in groups for k in g["params"]]


def _as_local(t: torch.Tensor, s, what: str) -> torch.Tensor:
    """A state tensor of the parameter's global shape (plain, or a DTensor of any placement) as this
    optimizer's flat fp32 piece of it: the local shard for a DTensor parameter, else the whole."""
    p = s.param
    if tuple(t.shape) != tuple(s.shape):
        raise ValueError(f"parameter {s.index}: {what} has shape {tuple(t.shape)}, the parameter {tuple(s.shape)}: "
                         "this state_dict is for a different model")
    if not _dtensor.is_dtensor(p):
        t = t.full_tensor() if _dtensor.is_dtensor(t) else t
    elif _dtensor.is_dtensor(t):
        if t.device_mesh != p.device_mesh:
            raise ValueError(f"parameter {s.index}: {what} is a DTensor on another device mesh than the parameter; "
                             "load it through torch.distributed.checkpoint, which reshards")
        if tuple(t.placements) != tuple(p.placements):
            t = t.redistribute(p.device_mesh, p.placements)
        t = t.to_local()
    else:  # a whole tensor (a one-process or consolidated state): this rank's shard of it
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        t = t[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    return t.detach().to("cpu", torch.float32).reshape(-1)


def read_torch_state(flat: FlatState, param_groups, sd: dict):
    """A torch-format state checked against the optimizer's parameters (its FlatState and param groups) and
    brought to fp32 tensors per parameter, this optimizer's elements of each (a DTensor parameter's local
    shard): ({index: (master, exp_avg, exp_avg_sq)}, step) — the rule's state arrays (``flat.states``) after the
    master. Nothing changes here; a bad state raises."""
    rule = flat.rule
    state = sd.get("state", {})
    masters = sd.get("zoe_masters", {})
    keys = saved_keys(param_groups, sd)
    steps = {}  # torch keeps a step per parameter; one without state has not been stepped
    full = {}
    for s in flat.slots:
        key = keys[s.index]
        st = state.get(key, state.get(str(key)))
        if st is None:
            # Never stepped: the rule's starting state (Adagrad's sum starts at initial_accumulator_value).
            group = {**param_groups[s.group], **sd["param_groups"][s.group]}  # the saved group's value first
            arrays = [torch.full((s.numel,), rule.fresh_state(k, group), dtype=torch.float32) for k in rule.states]
        else:
            for k in (*rule.states, "step"):
                if k not in st:
                    raise ValueError(f"parameter {s.index}: its state has no '{k}' ({rule.state_hint()})")
            arrays = [_as_local(st[k], s, k) for k in rule.states]
            steps[s.index] = int(float(st["step"]))
        master = masters.get(s.index, masters.get(str(s.index)))
        if master is None and st is not None:
            master = st.get("zoe_master")
        if master is None and s.tier is not None:
            offload, block, entry = s.tier  # an offloaded parameter's weights are in its tier, not in p
            master = offload._read(block, entry, torch.device("cpu"))
        elif master is None:
            master = s.param.detach()
        full[s.index] = (_as_local(master, s, "its master"), *arrays)
    signed = [k + 1 for k, name in enumerate(rule.states) if name in rule.non_negative]  # their places in full[i]
    for i, arrays in full.items():
        if not bool(torch.isfinite(arrays[0]).all()) or not all(bool((arrays[k] >= 0).all()) for k in signed):
            why = f" or its {' or '.join(rule.non_negative)} has negative values" if signed else ""
            raise ValueError(f"parameter {i}: its master weights are not finite{why}")
        if steps.get(i, 0) < 0:
            raise ValueError(f"parameter {i}: its step {steps[i]} is negative")
    return full, steps


def read_loss_scale(flat: FlatState, sd: dict):
    """The loss scaler's state a torch-format state_dict carries (None: none, or this optimizer does not scale)."""
    ls = next((g["zoe_loss_scale"] for g in sd["param_groups"] if "zoe_loss_scale" in g), None)
    if ls is None or not flat.loss_scaling:
        return None
    try:
        scale, clean, left = (float(ls[0]), int(ls[1]), int(ls[2]))
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"this state_dict's zoe_loss_scale {ls!r} is not [scale, clean_steps, hysteresis_left]") from e
    if not (math.isfinite(scale) and scale > 0 and clean >= 0 and left >= 0):
        raise ValueError(f"this state_dict's zoe_loss_scale {ls!r} is invalid (need a finite scale > 0, counts >= 0)")
    return scale, clean, left


def write_torch_state(flat: FlatState, full: dict, steps: dict) -> None:
    """The state read_torch_state made, into this rank's pieces; the weights then agree on every rank. The
    optimizer's step count is the largest parameter's; each parameter keeps its own."""
    engine = flat.engine
    engine.set_step_count(max(steps.values(), default=0))
    for s, begin, n in flat.pieces():
        flat.write_arrays(s.engine_ids[0], [t[begin:begin + n].contiguous() for t in full[s.index]])
        for i in s.engine_ids:
            engine.set_param_step_count(i, steps.get(s.index, 0))
    if flat.world > 1:
        flat.gather_weights()


def torch_state(flat: FlatState, param_groups, masters_in_state: bool = False) -> dict:
    """fp32 tensors per parameter: moments and step, and the masters as ``zoe_masters`` (``masters_in_state``:
    as each parameter's ``zoe_master``). Whole tensors, gathered over zoe's partition; DTensors of the
    parameter's placements for DTensor (FSDP2) parameters, each rank its shards."""
    flat.engine.wait()
    step = int(flat.engine.step_count)
    if flat.dtensor is not None:
        weights = _dtensor_state(flat)
    else:
        weights = _gathered_state(flat)
    state, masters = {}, {}
    own = {s.index: flat.engine.param_step_count(s.engine_ids[0]) for s in flat.slots if s.engine_ids}
    for index, (p, *arrays) in weights.items():
        state[index] = {"step": torch.tensor(float(own.get(index, step))), **dict(zip(flat.states, arrays))}
        if masters_in_state:
            state[index]["zoe_master"] = p
        else:
            masters[index] = p
    sd = {"state": state, "param_groups": _param_groups(flat, param_groups)}
    if not masters_in_state:
        sd["zoe_masters"] = masters
    return sd


def _gathered_state(flat: FlatState) -> dict:
    """{index: (master, exp_avg, exp_avg_sq)} (the rule's state arrays after the master), whole, every rank's
    partition gathered."""
    count = 1 + len(flat.states)
    shards = {b.dtype: torch.zeros(count, b.shard_numel, dtype=torch.float32) for b in flat.buckets}
    owner = {id(s): b for b in flat.buckets for s in b.slots}
    windowed = {}
    for s, begin, n in flat.pieces():
        b = owner[id(s)]
        at = s.offset + begin - flat.rank * b.shard_numel
        bufs = [torch.empty(n, dtype=torch.float32) for _ in range(count)]
        flat.read_arrays(s.engine_ids[0], bufs)
        if s.windowed:
            windowed[s.index] = tuple(t.view(s.shape) for t in bufs)
            continue
        for k in range(count):
            shards[b.dtype][k, at:at + n] = bufs[k]
    out = {}
    for b in flat.buckets:
        mine = shards[b.dtype]
        if flat.world > 1:
            everyone = [torch.empty_like(mine) for _ in range(flat.world)]
            dist.all_gather(everyone, mine, group=flat.dp.collectives.group)
            whole = torch.cat(everyone, dim=1)
        else:
            whole = mine
        for s in b.slots:
            out[s.index] = windowed[s.index] if s.windowed else \
                tuple(whole[k, s.offset:s.offset + s.numel].clone().view(s.shape) for k in range(count))
    return out


def _dtensor_state(flat: FlatState) -> dict:
    """{index: (master, exp_avg, exp_avg_sq)} as DTensors over this rank's shards (host memory: nothing of
    the offloaded state goes to the accelerator)."""
    out = {}
    for s in flat.slots:
        p = s.param
        local = [torch.zeros(s.numel, dtype=torch.float32) for _ in range(1 + len(flat.states))]
        if s.engine_ids:
            flat.read_arrays(s.engine_ids[0], local)
        out[s.index] = tuple(
            _dtensor.DTensor.from_local(t.view(p._local_tensor.shape), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride()) for t in local)
    return out


def _param_groups(flat: FlatState, param_groups) -> list[dict]:
    """torch.optim.AdamW's param_groups (the rule's torch keys, _rules.TorchRule.torch_group): zoe's
    hyper-parameters, torch's flags at their defaults, and an fp16 run's loss scaler."""
    scaler = list(flat.engine.loss_scale_state) if flat.loss_scaling else None
    out, index = [], 0
    for g in param_groups:
        d = flat.rule.torch_group(g)
        if scaler is not None:
            d["zoe_loss_scale"] = scaler
        d["params"] = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        out.append(d)
    return out


def consolidate(state_dicts) -> dict:
    """W ranks' zoe state_dicts (each rank's ``opt.state_dict()``) joined into one torch-format state_dict
    with ``zoe_masters``, loadable on any number of ranks."""
    sds = list(state_dicts)
    if not sds:
        raise ValueError("consolidate: no state_dicts given")
    metas, states, rules = [], {}, []
    for k, sd in enumerate(sds):
        meta = sd.get("zoe") if isinstance(sd, dict) else None
        if meta is None or meta.get("format") != STATE_FORMAT:
            raise ValueError(f"state_dict {k} was not written by zoe.torch.OffloadOptimizer.state_dict()")
        if meta.get("pieces", []) is None:
            raise ValueError(f"state_dict {k} holds FSDP2 shards: torch.distributed.checkpoint saves and reshards "
                             "those (get_state_dict / set_state_dict)")
        rule = _rules.rule_of_meta(meta)
        if rule is None:
            raise ValueError(f"state_dict {k} names the optimizer {meta.get('optimizer')!r}, which zoe does not run")
        rules.append(rule)
        if rule is not rules[0]:
            raise ValueError(f"state_dict {k} was saved by an optimizer running {rule.title}, state_dict 0 by one "
                             f"running {rules[0].title}: they are not of one run")
        if "pieces" not in meta:
            raise ValueError(f"state_dict {k} predates partition records (no 'pieces'); it loads only on the ranks "
                             "that wrote it")
        metas.append(meta)
        states[id(meta)] = sd.get("state")
    world = metas[0]["world_size"]
    if any(m["world_size"] != world for m in metas):
        raise ValueError(f"the state_dicts come from runs of different sizes: {sorted({m['world_size'] for m in metas})} ranks")
    ranks = [m["rank"] for m in metas]
    missing = sorted(set(range(world)) - set(ranks))
    duplicated = sorted({r for r in ranks if ranks.count(r) > 1})
    if missing or duplicated:
        raise ValueError(f"a run of {world} ranks needs each rank's state_dict once: "
                         + (f"missing rank(s) {missing}" if missing else "")
                         + ("; " if missing and duplicated else "")
                         + (f"rank(s) {duplicated} given twice" if duplicated else ""))
    layout = metas[0]["layout"]
    if any(m["layout"] != layout for m in metas):
        raise ValueError("the state_dicts are of different models (their parameter layouts differ)")
    joined = _join(metas, states)
    keys = rules[0].states  # the state arrays the checkpoints hold, by torch's keys
    # The engine's parameters are this optimizer's slots, in its order: each file's pieces of them, matched
    # with the pieces its state_dict names by torch index, say which parameter each one is.
    index_of = {}
    for meta, engine_pieces in zip(metas, joined["pieces"]):
        named = [k for k in meta["pieces"] if k[2] > 0]
        held = [k for k in engine_pieces if k[2] > 0]
        fits = len(named) == len(held)
        for (index, begin, n), (e, engine_begin, engine_n) in zip(named, held):
            fits = fits and (begin, n) == (engine_begin, engine_n) and index_of.setdefault(e, index) == index
        if not fits:
            raise ValueError(f"rank {meta['rank']}'s state_dict: its zoe checkpoint holds other pieces than its "
                             "state_dict names")
    state, masters = {}, {}
    for e, index in index_of.items():
        shape = layout[index][0]
        numel = _checks.shape_numel(f"parameter {index} of the state_dicts' layout", shape)
        if joined["params"][e][2] != numel:
            raise ValueError(f"parameter {index}: zoe's checkpoints hold {joined['params'][e][2]} elements, the "
                             f"layout's shape {list(shape)} {numel}")
        state[index] = {"step": torch.tensor(float(joined["step"])),
                        **{key: torch.from_numpy(joined[key][e]).view(shape) for key in keys}}
        masters[index] = torch.from_numpy(joined["master"][e]).view(shape)
    lazy = set(metas[0].get("lazy", ()))  # no state: frozen when the optimizer was made (_lazy.py)
    for index, (shape, _, trainable, *rest) in enumerate(layout):
        if trainable and _checks.shape_numel(f"parameter {index} of the state_dicts' layout", shape) > 0 \
                and index not in state and index not in lazy:
            raise ValueError(f"parameter {index}: no rank's partition holds it")
    groups = [dict(g) for g in sds[0]["param_groups"]]
    # An fp16 model's run scaled its loss (zoe's default for fp16); the scaler of any other is at rest.
    fp16 = any(entry[1] == str(torch.float16) for entry in layout)
    for g in groups:
        g.pop("zoe_loss_scale", None)
        if fp16:
            g["zoe_loss_scale"] = list(joined["loss_scale"])
    return {"state": state, "param_groups": groups, "zoe_masters": masters}


@contextlib.contextmanager
def blob_file(meta: dict, state: dict | None):
    """A state_dict's engine checkpoint as a temporary file, for the engine's readers: ``meta["checkpoint"]``
    (uint8), with the moments put back from torch's ``state`` where ``meta["moments"]`` cut them out
    (StateDictMethods._save_engine_into). The file's checksums then tell whether they are the ones saved."""
    blob = meta["checkpoint"].cpu().numpy()
    with _scratch.scratch_file() as path:
        with open(path, "wb") as f:
            at = 0
            for offset, n, key in meta.get("moments") or []:
                gap = offset - f.tell()
                f.write(memoryview(blob[at:at + gap]))  # no copy of the blob
                at += gap
                for index, begin, count in meta["pieces"]:
                    st = (state or {}).get(index, (state or {}).get(str(index), {}))
                    if key not in st:
                        raise ValueError(f"this state_dict's 'state' has no {key} for parameter {index}: zoe's "
                                         "checkpoint in it needs the moments it was saved with")
                    t = st[key].detach().reshape(-1)[begin:begin + count]
                    f.write(memoryview(t.to("cpu", torch.float32).contiguous().numpy()))
                if f.tell() != offset + n:
                    raise ValueError(f"this state_dict's {key} tensors hold {f.tell() - offset} bytes, zoe's "
                                     f"checkpoint in it {n}: it is for a different model")
            f.write(memoryview(blob[at:]))
        yield path


def _join(metas: list, states: dict) -> dict:
    """The ranks' engine checkpoints joined by the engine's PartitionedCheckpoint (what zoe export reads), with
    an error naming the rank, not the temporary file."""
    with contextlib.ExitStack() as files:
        paths = [files.enter_context(blob_file(meta, states[id(meta)])) for meta in metas]
        try:
            return _zoe.join_checkpoints(paths)
        except _zoe.ZoeError as e:
            message = str(e)
            for meta, path in zip(metas, paths):
                message = message.replace(path, f"rank {meta['rank']}'s zoe checkpoint")
            raise type(e)(message) from e


def _state_keys(source, sd: dict) -> tuple[str, ...]:
    """The state arrays' keys of an optimizer (its rule's), or of a torch-format state_dict (the rule whose keys
    its first parameter's state holds; Adam's when none)."""
    rule = getattr(getattr(source, "_flat", None), "rule", None)
    if rule is None:
        rule = next((r for r in map(_rules.rule_of_state, sd["state"].values()) if r is not None), _rules.ADAM)
    return rule.states


def export_fp32(source, out_dir, names=None, moments: bool = False) -> list[str]:
    """Writes the fp32 master weights by parameter name as ``model.safetensors`` in ``out_dir`` (``moments``:
    ``exp_avg.safetensors`` and ``exp_avg_sq.safetensors`` too). ``source``: an OffloadOptimizer, the list of
    every rank's ``state_dict()``, or a torch-format state_dict with ``zoe_masters``. ``names``: the
    parameters' names in optimizer order (a list, or an ``nn.Module`` whose ``named_parameters()`` the
    optimizer was built from); by default the param groups' ``param_names`` (an optimizer built from
    ``model.named_parameters()``). Returns the files written."""
    from safetensors.torch import save_file

    if isinstance(source, torch.optim.Optimizer) and hasattr(source, "torch_state_dict"):  # an OffloadOptimizer
        sd = source.torch_state_dict()
        groups = source.param_groups
    elif isinstance(source, (list, tuple)):
        sd = consolidate(source)
        groups = sd["param_groups"]
    else:
        sd = source
        groups = sd["param_groups"]
    if "zoe_masters" not in sd:
        raise ValueError("this state_dict has no zoe_masters: export reads the fp32 masters zoe keeps")
    if isinstance(names, torch.nn.Module):
        names = [n for n, _ in names.named_parameters()]
    if names is None:
        names = [n for g in groups for n in g.get("param_names", [])]
        if not names:
            raise ValueError("no parameter names: build the optimizer from model.named_parameters(), or pass names=")
    names = list(names)
    count = sum(len(g["params"]) for g in groups)
    if len(names) != count:
        raise ValueError(f"{len(names)} names for {count} parameters")
    os.makedirs(out_dir, exist_ok=True)
    files = []
    kinds = [("model.safetensors", lambda i: sd["zoe_masters"].get(i))]
    if moments:
        # The rule's state arrays by torch's keys (Adam: exp_avg, exp_avg_sq; Lion: exp_avg; Adagrad: sum).
        kinds += [(f"{key}.safetensors", lambda i, key=key: sd["state"].get(i, {}).get(key))
                  for key in _state_keys(source, sd)]
    for filename, get in kinds:
        tensors = {}
        for i, name in enumerate(names):
            t = get(i)
            if t is not None:
                tensors[name] = t.detach().to("cpu", torch.float32).contiguous()
        path = os.path.join(out_dir, filename)
        with _files.atomic_path(path) as own:  # never written through a link another user planted
            save_file(tensors, own, metadata={"format": "pt", "written_by": "zoe"})
        files.append(path)
    return files
