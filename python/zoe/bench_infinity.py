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


def plan(a, config_path: str) -> dict:
    """What zoe plan predicts for this run's model and placement (one node; the CPU as the device, or one GPU)."""
    cli = zoe_cli()
    if cli is None:
        return {"error": "no zoe CLI found (set ZOE_CLI, or build it: scripts/build)"}
    gpus = ["--gpus", "0"] if a.device == "cpu" else \
        ["--gpus", "1", "--gpu-mem", f"{torch.cuda.get_device_properties(0).total_memory >> 20}M"]
    cmd = [cli, "plan", "--model", config_path, *gpus, "--stage", "3", "--offload-optimizer", "nvme",
           "--offload-param", "nvme", "--state-dtype", a.state_dtype, "--prefetch", str(a.prefetch),
           "--micro-batch", str(a.batch), "--seq-len", str(a.seq), "--nvme", a.nvme_path, "--json"]
    if a.spill_grads:
        cmd.insert(-1, "--spill-grads")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:], "command": " ".join(cmd)}
    out = json.loads(r.stdout)
    out["command"] = " ".join(cmd)
    return out


def build(a, folder: str):
    """The model on the meta device, sharded by FSDP2 over one rank (gloo on the CPU, nccl on a GPU),
    initialised into the parameter tier group by group; then the optimizer. Returns (model, offload,
    optimizer, config, phases)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from zoe.torch import OffloadOptimizer, offload_parameters

    phases = {"start": rss()["rss"]}
    if a.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=f"file://{os.path.join(folder, 'pg')}",
                            rank=0, world_size=1)
    config = LlamaConfig(**llama_shape(a.params), torch_dtype="bfloat16")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    mesh = init_device_mesh(a.device, (1,))
    for layer in model.model.layers:  # as docs/param-offload.md shards a model: each layer, then the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t0 = time.perf_counter()
    offload = offload_parameters(model, "nvme", nvme_path=os.path.join(folder, "params"), prefetch=a.prefetch,
                                 init=model._init_weights)
    phases["init_s"] = time.perf_counter() - t0
    phases["after_init"] = rss()["rss"]
    opt = OffloadOptimizer(model.parameters(), lr=a.lr, tier="nvme", nvme_path=os.path.join(folder, "state"),
                           state_dtype=a.state_dtype, spill_grads=a.spill_grads)
    phases["after_optimizer"] = rss()["rss"]
    return model, offload, opt, config, phases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zoe.bench_infinity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("1B"), help="model size (250M, 1B, 4B) [1B]")
    ap.add_argument("--steps", type=int, default=4, help="training steps [4]")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step [1]")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence [32]")
    ap.add_argument("--prefetch", type=int, default=2, help="parameter groups read ahead [2]")
    ap.add_argument("--state-dtype", default="int8", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model computes [cpu]")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate [1e-3]")
    ap.add_argument("--nvme-path", default=None,
                    help="folder on the NVMe for the parameter tier and the swap store [a new folder under "
                         "./.nvme-scratch]; what it wrote there is removed at the end unless --keep (the folder too if it made it)")
    ap.add_argument("--keep", action="store_true", help="leave the files on disk")
    ap.add_argument("--spill-grads", action="store_true", help="gradient shards to NVMe as backward ends (spill_grads)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    a = ap.parse_args(argv)
    made = a.nvme_path is None or not os.path.exists(a.nvme_path)  # only a folder of its own goes whole
    if a.nvme_path is None:
        os.makedirs(".nvme-scratch", exist_ok=True)
        a.nvme_path = tempfile.mkdtemp(prefix="bench_infinity-", dir=".nvme-scratch")
    a.nvme_path = os.path.abspath(a.nvme_path)
    os.makedirs(a.nvme_path, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)

    def emit(kind: str, **fields):
        if a.json:
            print(json.dumps({"kind": kind, **fields}), flush=True)
        else:
            body = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
            print(f"{kind}: {body}", flush=True)

    try:
        model, offload, opt, config, phases = build(a, a.nvme_path)
        n = sum(p.numel() for p in model.parameters())
        emit("model", params=n, layers=config.num_hidden_layers, hidden=config.hidden_size,
             intermediate=config.intermediate_size, vocab=config.vocab_size)
        emit("setup", init_s=phases["init_s"], rss_start_gib=phases["start"] / GiB,
             rss_after_init_gib=phases["after_init"] / GiB, rss_after_optimizer_gib=phases["after_optimizer"] / GiB,
             disk_gib=disk_bytes(a.nvme_path) / GiB)
        config_path = os.path.join(a.nvme_path, "config.json")
        config.to_json_file(config_path)
        p = plan(a, config_path)
        host, disk = _plan_totals(p)
        emit("plan", host_gib=host / GiB if host else None, disk_gib=disk / GiB if disk else None,
             **({"error": p["error"]} if "error" in p else {}), command=p.get("command"))
        # One batch, stepped on again and again: the loss falling shows the model trains.
        ids = torch.randint(0, config.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).to(a.device)
        cuda = a.device == "cuda"
        now = (lambda: (torch.cuda.synchronize(), time.perf_counter())[1]) if cuda else time.perf_counter
        peaks = []
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
            peaks.append(m["peak"])
            if cuda:
                emit("gpu", step=step + 1, peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB)
            emit("step", step=step + 1, loss=loss.item(), forward_s=t1 - t0, backward_s=t2 - t1, step_s=t3 - t2,
                 peak_rss_gib=m["peak"] / GiB, rss_gib=m["rss"] / GiB,
                 peak_bytes_per_param=m["peak"] / n, disk_gib=disk_bytes(a.nvme_path) / GiB)
        _summary(emit, n, peaks, phases["start"], host, disk, disk_bytes(a.nvme_path))
        del opt, offload, model
    finally:
        if not a.keep:
            _remove(a.nvme_path, made)
    return 0


def _summary(emit, n: int, peaks: list, start: int, host, disk, used: int) -> None:
    """The run's peak RSS and disk beside the plan's (``host``, ``disk``: None where it failed) and the target."""
    peak = max(peaks) if peaks else 0
    # The plan leaves the process itself out (Python, torch: the RSS at start); its host reserve stands for it.
    growth = peak - start
    emit("summary", params=n, peak_rss_gib=peak / GiB, plan_host_gib=host / GiB if host else None,
         plan_host_vs_run=host / peak if host and peak else None, rss_start_gib=start / GiB,
         plan_host_vs_growth=host / growth if host and growth > 0 else None, disk_gib=used / GiB,
         plan_disk_gib=disk / GiB if disk else None, plan_disk_vs_run=disk / used if disk and used else None,
         target_rss_gib=(3 * GiB + 2.5 * n) / GiB)


def _remove(folder: str, made: bool) -> None:
    """What the benchmark wrote into ``folder``, and the folder itself if the benchmark made it: a folder the
    user named may hold other files."""
    if made:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in ("params", "state", "config.json", "pg"):
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
