"""python -m zoe.bench_infinity — ZeRO-Infinity on one machine: a Llama-shaped model of a given size, built
on the meta device, its weights in zoe's parameter tier on NVMe (FSDP2, one gloo rank, the CPU as the
device) and its optimizer state in zoe's swap store on NVMe, trained for a few steps. Per step it prints the
loss, the forward, backward and step seconds, the peak resident set of the step and the bytes on disk;
before the first step, the resident set after each phase of the set-up; and beside them what ``zoe plan``
predicts for the same model and placement.

Reported, not asserted (BENCHMARKING.md): the figures are what this machine did. The loss is printed to show
the model trains, not as a target. Peak RSS per step is the kernel's high-water mark (VmHWM), reset before
each step through /proc/self/clear_refs; disk is the blocks the NVMe folder's files occupy.

    python -m zoe.bench_infinity --params 1B --steps 4 --nvme-path /local_nvme/zoe-bench

With ``--device cuda`` the rank is one GPU (nccl) and each step also prints the GPU's peak allocation; the plan
is then asked for one GPU of that memory. Not yet run on a GPU (issue 55 measures it there).

``--param-tier cpu`` keeps the weights in pinned RAM instead, ``--state-tier ram`` the optimizer state;
``--checkpointing`` recomputes each decoder layer in backward (activation checkpointing). ``--params largest``
takes the largest model ``zoe plan`` fits on this machine, in the given tiers or, where neither is given, in
whichever of the four placements holds the most (``--size-only``: print that choice and stop). ``--torch``
trains the same model resident instead, with ``torch.optim.AdamW`` (fused on a GPU) and no zoe: the baseline;
with ``--params largest`` on a GPU it tries sizes downward from what the GPU's memory could hold until one
trains.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

GiB = 1 << 30


def parse_count(text: str) -> int:
    """'1B', '350M', '2.5B' -> a parameter count (decimal suffixes, as zoe plan reads them)."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    t = text.strip().upper()
    mult = scale.get(t[-1:], None)
    value = float(t[:-1] if mult else t) * (mult or 1)
    if value < 1e6:
        raise argparse.ArgumentTypeError(f"--params {text}: at least 1M parameters")
    return int(value)


def llama_shape(params: int, vocab: int = 32000) -> dict:
    """A Llama-shaped config of about ``params`` parameters: TinyLlama's proportions (intermediate 2.75x the
    hidden size, 4 key/value heads, untied embeddings) with the hidden size growing with the model, and as
    many layers as the count leaves after the embeddings."""
    hidden = 1024 if params < 400e6 else 2048 if params < 2.5e9 else 3072 if params < 6e9 else 4096
    head_dim = 64 if hidden <= 2048 else 128
    heads, kv_heads = hidden // head_dim, 4
    inter = round(2.75 * hidden / 256) * 256
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden - hidden) / per_layer))
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                tie_word_embeddings=False)


def rss() -> dict:
    """The resident set now and its high-water mark, in bytes (Linux /proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return {"rss": out.get("VmRSS", 0), "peak": out.get("VmHWM", 0)}


def reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def disk_bytes(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def zoe_cli() -> str | None:
    """The zoe CLI for the plan: $ZOE_CLI, zoe on PATH, or this checkout's build/zoe."""
    for c in (os.environ.get("ZOE_CLI"), shutil.which("zoe"), os.path.join(os.getcwd(), "build", "zoe")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def plan_command(a, config_path: str, param_tier: str, state_tier: str) -> list[str] | None:
    """zoe plan's command for this run's model (a config.json) and placement (one node; the CPU as the
    device, or one GPU); None where no zoe CLI is found."""
    cli = zoe_cli()
    if cli is None:
        return None
    gpus = ["--gpus", "0"] if a.device == "cpu" else \
        ["--gpus", "1", "--gpu-mem", f"{torch.cuda.get_device_properties(0).total_memory >> 20}M"]
    cmd = [cli, "plan", "--model", config_path, *gpus, "--stage", "3",
           "--offload-optimizer", "cpu" if state_tier == "ram" else "nvme", "--offload-param", param_tier,
           "--state-dtype", a.state_dtype, "--prefetch", str(a.prefetch), "--micro-batch", str(a.batch),
           "--seq-len", str(a.seq), "--nvme", a.nvme_path]
    if a.spill_grads:
        cmd.append("--spill-grads")
    if a.checkpointing:
        cmd.append("--activation-checkpointing")
    return cmd + ["--json"]


def plan(a, config_path: str) -> dict:
    """What zoe plan predicts for this run's model and placement."""
    cmd = plan_command(a, config_path, a.param_tier, a.state_tier)
    if cmd is None:
        return {"error": "no zoe CLI found (set ZOE_CLI, or build it: scripts/build)"}
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:], "command": " ".join(cmd)}
    out = json.loads(r.stdout)
    out["command"] = " ".join(cmd)
    return out


PLACEMENTS = [("cpu", "ram"), ("nvme", "ram"), ("cpu", "nvme"), ("nvme", "nvme")]  # (param tier, state tier)


def largest(a, folder: str) -> tuple[int, str, str]:
    """The largest Llama-shaped model (by llama_shape) zoe plan fits on this machine and zoe runs, within 2%,
    in the tiers given or in whichever placement holds the most: (parameters, param tier, state tier). The
    rates are given (--adam-rate, --nvme-gbps) so that no call measures: they change the step's estimate,
    not what fits."""
    if a.param_tier_given or a.state_tier_given:
        placements = [(a.param_tier, a.state_tier)]
    else:
        placements = PLACEMENTS
    config_path = os.path.join(folder, "sizing.json")

    def fits(n: int, param_tier: str, state_tier: str) -> bool:
        with open(config_path, "w") as f:
            json.dump({"model_type": "llama", **llama_shape(n)}, f)
        cmd = plan_command(a, config_path, param_tier, state_tier)
        if cmd is None:
            raise SystemExit("--params largest needs the zoe CLI (set ZOE_CLI, or build it: scripts/build)")
        cmd[-1:-1] = ["--adam-rate", "1B", "--nvme-gbps", "1"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"zoe plan failed while sizing: {' '.join(cmd)}\n{r.stderr.strip()}")
        out = json.loads(r.stdout)
        return bool(out.get("fits")) and bool(out.get("zoe_runs_it"))

    best = (0, "", "")
    for param_tier, state_tier in placements:
        lo = int(100e6)
        if not fits(lo, param_tier, state_tier):
            continue
        hi = lo * 2
        while fits(hi, param_tier, state_tier):
            lo, hi = hi, hi * 2
        while hi - lo > lo // 50:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, param_tier, state_tier) else (lo, mid)
        best = max(best, (lo, param_tier, state_tier))
    if best[0] == 0:
        raise SystemExit("--params largest: not even 100M parameters fit this machine in "
                         + ", ".join(f"params {p} / state {t}" for p, t in placements))
    return best


def build(a, folder: str):
    """The model on the meta device, sharded by FSDP2 over one rank (gloo on the CPU, nccl on a GPU),
    initialised into the parameter tier group by group; then the optimizer. Returns (model, offload,
    optimizer, config, phases)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zoe.torch import OffloadOptimizer, offload_parameters

    phases = {"start": rss()["rss"]}
    if a.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=f"file://{os.path.join(folder, 'pg')}",
                            rank=0, world_size=1)
    config, model = llama_model(llama_shape(a.params), a.device, a.checkpointing, "meta")
    mesh = init_device_mesh(a.device, (1,))
    for layer in model.model.layers:  # as docs/param-offload.md shards a model: each layer, then the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t0 = time.perf_counter()
    offload = offload_parameters(model, a.param_tier, prefetch=a.prefetch, init=model._init_weights,
                                 nvme_path=os.path.join(folder, "params") if a.param_tier == "nvme" else None)
    phases["init_s"] = time.perf_counter() - t0
    phases["after_init"] = rss()["rss"]
    opt = OffloadOptimizer(model.parameters(), lr=a.lr, tier=a.state_tier, state_dtype=a.state_dtype,
                           nvme_path=os.path.join(folder, "state") if a.state_tier == "nvme" else None,
                           spill_grads=a.spill_grads)
    phases["after_optimizer"] = rss()["rss"]
    return model, offload, opt, config, phases


def llama_model(shape: dict, device: str, checkpointing: bool, made_on: str):
    """A bf16 LlamaForCausalLM of ``shape`` (llama_shape's fields) made on ``made_on`` (meta, or the device
    itself), with the attention that suits ``device`` (eager on the CPU, SDPA on a GPU) and, where
    ``checkpointing``, each decoder layer's forward run again in backward (non-reentrant: FSDP2's and zoe's
    hooks run again): (config, model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, torch_dtype="bfloat16")
    config._attn_implementation = "eager" if device == "cpu" else "sdpa"
    torch.manual_seed(0)
    with torch.device(made_on):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers' name from 5.2x; the older one warns there
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return config, model


def torch_model(a, params: int):
    """The baseline: the same model resident on the device, initialised there, and torch's AdamW over it
    (fused on a GPU): (config, model, optimizer)."""
    config, model = llama_model(llama_shape(params), a.device, a.checkpointing, "meta")
    model.to_empty(device=a.device)
    with torch.no_grad():
        model.apply(model._init_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=a.device == "cuda")
    return config, model, opt


def parse_size(text: str):
    """--params: a count, or "largest"."""
    return "largest" if text.strip().lower() == "largest" else parse_count(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zoe.bench_infinity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_size, default=parse_count("1B"),
                    help="model size (250M, 1B, 4B), or largest: the largest zoe plan fits here [1B]")
    ap.add_argument("--steps", type=int, default=4, help="training steps [4]")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step [1]")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence [32]")
    ap.add_argument("--prefetch", type=int, default=2, help="parameter groups read ahead [2]")
    ap.add_argument("--state-dtype", default="int8", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--param-tier", choices=("nvme", "cpu"), help="the weights: nvme (files) or cpu (pinned RAM) [nvme]")
    ap.add_argument("--state-tier", choices=("nvme", "ram"), help="the optimizer state: nvme (swap store) or ram [nvme]")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each decoder layer")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model computes [cpu]")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate [1e-3]")
    ap.add_argument("--nvme-path", default=None,
                    help="folder on the NVMe for the parameter tier and the swap store [a new folder under "
                         "./.nvme-scratch]; what it wrote there is removed at the end unless --keep (the folder too if it made it)")
    ap.add_argument("--keep", action="store_true", help="leave the files on disk")
    ap.add_argument("--spill-grads", action="store_true", help="gradient shards to NVMe as backward ends (spill_grads)")
    ap.add_argument("--size-only", action="store_true", help="with --params largest: print the size chosen and stop")
    ap.add_argument("--torch", action="store_true",
                    help="the baseline: the model resident, torch.optim.AdamW (fused on a GPU), no zoe")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    a = ap.parse_args(argv)
    a.param_tier_given, a.state_tier_given = a.param_tier is not None, a.state_tier is not None
    a.param_tier, a.state_tier = a.param_tier or "nvme", a.state_tier or "nvme"
    if a.torch and (a.param_tier_given or a.state_tier_given or a.spill_grads or a.size_only):
        ap.error("--torch trains the model resident: --param-tier, --state-tier, --spill-grads and --size-only are zoe's")
    if a.torch and a.params == "largest" and a.device != "cuda":
        ap.error("--torch --params largest tries sizes until one fits the GPU: it needs --device cuda")
    if a.size_only and a.params != "largest":
        ap.error("--size-only goes with --params largest")
    if a.spill_grads and a.state_tier == "ram":
        ap.error("--spill-grads spills beside the swap store: it needs --state-tier nvme")

    def emit(kind: str, **fields):
        if a.json:
            print(json.dumps({"kind": kind, **fields}), flush=True)
        else:
            body = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
            print(f"{kind}: {body}", flush=True)

    torch.set_num_threads(os.cpu_count() or 1)
    if a.device == "cuda":
        torch.cuda.set_device(0)
    if a.torch:
        return run_torch(a, emit)
    made = a.nvme_path is None or not os.path.exists(a.nvme_path)  # only a folder of its own goes whole
    if a.nvme_path is None:
        os.makedirs(".nvme-scratch", exist_ok=True)
        a.nvme_path = tempfile.mkdtemp(prefix="bench_infinity-", dir=".nvme-scratch")
    a.nvme_path = os.path.abspath(a.nvme_path)
    os.makedirs(a.nvme_path, exist_ok=True)
    try:
        if a.params == "largest":
            a.params, a.param_tier, a.state_tier = largest(a, a.nvme_path)
            emit("size", params=a.params, param_tier=a.param_tier, state_tier=a.state_tier, **llama_shape(a.params))
            if a.size_only:
                return 0
        model, offload, opt, config, phases = build(a, a.nvme_path)
        n = sum(p.numel() for p in model.parameters())
        emit("model", params=n, layers=config.num_hidden_layers, hidden=config.hidden_size,
             intermediate=config.intermediate_size, vocab=config.vocab_size, param_tier=a.param_tier,
             state_tier=a.state_tier, checkpointing=a.checkpointing)
        emit("setup", init_s=phases["init_s"], rss_start_gib=phases["start"] / GiB,
             rss_after_init_gib=phases["after_init"] / GiB, rss_after_optimizer_gib=phases["after_optimizer"] / GiB,
             disk_gib=disk_bytes(a.nvme_path) / GiB)
        config_path = os.path.join(a.nvme_path, "config.json")
        config.to_json_file(config_path)
        p = plan(a, config_path)
        host, disk = _plan_totals(p)
        emit("plan", host_gib=host / GiB if host else None, disk_gib=disk / GiB if disk else None,
             **({"error": p["error"]} if "error" in p else {}), command=p.get("command"))
        run = train(a, emit, model, opt, config, n)
        _summary(emit, n, run, phases["start"], host, disk, disk_bytes(a.nvme_path))
        del opt, offload, model
    finally:
        if not a.keep:
            _remove(a.nvme_path, made)
    return 0


def train(a, emit, model, opt, config, n: int) -> dict:
    """--steps steps on one batch, stepped on again and again (the loss falling shows the model trains), each
    reported; returns the peaks and speeds of them all."""
    ids = torch.randint(0, config.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).to(a.device)
    cuda = a.device == "cuda"
    now = (lambda: (torch.cuda.synchronize(), time.perf_counter())[1]) if cuda else time.perf_counter
    run = {"peaks": [], "device_peaks": [], "tokens_per_s": []}
    for step in range(a.steps):
        reset_peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = now()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = now()
        loss.backward()
        t2 = now()
        opt.step()
        opt.zero_grad()
        t3 = now()
        m = rss()
        run["peaks"].append(m["peak"])
        run["tokens_per_s"].append(a.batch * a.seq / (t3 - t0))
        if cuda:
            run["device_peaks"].append(torch.cuda.max_memory_allocated())
            emit("gpu", step=step + 1, peak_allocated_gib=run["device_peaks"][-1] / GiB)
        disk = {} if a.torch else {"disk_gib": disk_bytes(a.nvme_path) / GiB}
        emit("step", step=step + 1, loss=loss.item(), forward_s=t1 - t0, backward_s=t2 - t1, step_s=t3 - t2,
             tokens_per_s=run["tokens_per_s"][-1], peak_rss_gib=m["peak"] / GiB, rss_gib=m["rss"] / GiB,
             peak_bytes_per_param=m["peak"] / n, **disk)
    return run


def torch_sizes(a) -> list[int]:
    """--torch --params largest: sizes to try, largest first. A bf16 model under torch's AdamW holds 8 bytes per
    parameter on the GPU (weights, gradients, exp_avg, exp_avg_sq, all bf16); the first try is 95% of what the
    GPU's memory holds at that, each next 90% of the one before."""
    first = 0.95 * torch.cuda.get_device_properties(0).total_memory / 8
    return [int(first * 0.9 ** k) for k in range(8)]


def run_torch(a, emit) -> int:
    """The baseline at --params, or the largest that trains (--params largest: sizes downward until one runs
    its steps without running out of GPU memory). 3 where none did."""
    for size in ([a.params] if a.params != "largest" else torch_sizes(a)):
        oom = None
        try:
            start = rss()["rss"]
            config, model, opt = torch_model(a, size)
            n = sum(p.numel() for p in model.parameters())
            emit("model", params=n, layers=config.num_hidden_layers, hidden=config.hidden_size,
                 intermediate=config.intermediate_size, vocab=config.vocab_size, baseline="torch",
                 checkpointing=a.checkpointing)
            run = train(a, emit, model, opt, config, n)
            _summary(emit, n, run, start, None, None, None)
            return 0
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        # Out of the handler, so that its traceback no longer holds the model's tensors.
        config = model = opt = None
        torch.cuda.empty_cache()
        emit("oom", params=size, error=oom)
    return 3


def _summary(emit, n: int, run: dict, start: int, host, disk, used: int | None) -> None:
    """The run's peak RSS and disk beside the plan's (``host``, ``disk``: None where it failed or where there is
    none, the torch baseline), its speed (the median tokens/s of the steps after the first) and the target."""
    peak = max(run["peaks"]) if run["peaks"] else 0
    speeds = sorted(run["tokens_per_s"][1:] or run["tokens_per_s"])
    # The plan leaves the process itself out (Python, torch: the RSS at start); its host reserve stands for it.
    growth = peak - start
    device = {"peak_device_gib": max(run["device_peaks"]) / GiB} if run["device_peaks"] else {}
    files = {} if used is None else {"disk_gib": used / GiB, "plan_disk_gib": disk / GiB if disk else None,
                                     "plan_disk_vs_run": disk / used if disk and used else None}
    emit("summary", params=n, tokens_per_s=speeds[len(speeds) // 2] if speeds else None, **device,
         peak_rss_gib=peak / GiB, plan_host_gib=host / GiB if host else None,
         plan_host_vs_run=host / peak if host and peak else None, rss_start_gib=start / GiB,
         plan_host_vs_growth=host / growth if host and growth > 0 else None, **files,
         target_rss_gib=(3 * GiB + 2.5 * n) / GiB)


def _remove(folder: str, made: bool) -> None:
    """What the benchmark wrote into ``folder``, and the folder itself if the benchmark made it: a folder the
    user named may hold other files."""
    if made:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in ("params", "state", "config.json", "sizing.json", "pg"):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)


def _plan_totals(p: dict) -> tuple[int | None, int | None]:
    """Host RAM and disk (every NVMe path) from zoe plan's JSON, for the placement it sized."""
    try:
        paths = max(1, len(p.get("nvme_paths") or [1]))
        return int(p["per_host_bytes"]["total"]), int(p["per_nvme_bytes"]["total"]) * paths
    except (KeyError, TypeError, ValueError):
        return None, None


if __name__ == "__main__":
    sys.exit(main())
