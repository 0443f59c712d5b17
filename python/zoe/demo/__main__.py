"""python -m zoe.demo — trains a small GPT-style byte-level language model on Python's own documentation
with zoe's offloaded AdamW, on the embedded default: the GPU if there is one, else the CPU; bf16 weights
on the device, fp32 master weights and moments in zoe, on the NVMe tier (swap files under the working
directory) where this build has it, else in RAM. Prints a progress bar with tokens/s and where each step's
time goes, and writes loss.png (train and held-out loss, tokens/s; matplotlib) and summary.json."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import zoe
from zoe.demo import plot
from zoe.demo.data import ByteBatches, corpus_text
from zoe.demo.model import GPT, Block, GPTConfig
from zoe.torch import OffloadOptimizer, full_shape, offload_parameters


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m zoe.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--tier", choices=["auto", "ram", "nvme"], default="auto",
                   help="auto: nvme under --out/swap where this build has the tier, else ram")
    p.add_argument("--schedule", choices=["sync", "overlap", "delayed"], default="sync")
    p.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none",
                   help="keep the 16-bit weights in a parameter tier (pinned RAM, or NVMe under --out), fetched "
                        "per transformer block with prefetch 2 (zoe.torch.offload_parameters)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="the device weights")
    p.add_argument("--state", choices=["fp32", "bf16", "int8"], default="fp32",
                   help="how zoe keeps the Adam moments (bf16: half their bytes; int8: a quarter and "
                        "a scale per 2048)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--out", default="zoe-demo", help="folder for loss.png, summary.json and the swap files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--evals", type=int, default=10, help="held-out evaluations over the run (the last at the end)")
    p.add_argument("--write-corpus", metavar="FILE",
                   help="write the training text as the bytes the batches are drawn from, and exit (the C++ trainer's "
                        "--data: build/examples/cpp-gpt/zoe-train-gpt)")
    args = p.parse_args(argv)
    # Zero steps, batches or evaluations leave nothing to train, average or plot.
    for name in ("steps", "batch", "seq", "d_model", "layers", "heads", "warmup", "evals"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: need at least 1")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.lr <= 0 or not math.isfinite(args.lr):
        p.error(f"--lr {args.lr}: need a positive learning rate")
    return args


HELD_OUT_BATCHES = 4


def _resident_state_bytes(model, state: str) -> int:
    """Host bytes of zoe's state on tier ram: every parameter's fp32 master and its two moments (int8: a byte
    each and an fp32 scale per block of each moment)."""
    sizes = [math.prod(full_shape(p)) for p in model.parameters()]
    if state == "int8":
        block = zoe._zoe.MOMENT_BLOCK
        return sum(6 * n + 8 * -(-n // block) for n in sizes)
    return sum(n * (4 + 2 * (2 if state == "bf16" else 4)) for n in sizes)


def held_out_loss(model, batches, device) -> float:
    """Mean loss over the same held-out batches at every evaluation, so the curve shows the model change,
    not the sampling."""
    with torch.no_grad():
        return sum(model(x.to(device), y.to(device))[1].item() for x, y in batches) / len(batches)


def _swap_file_bytes(swap_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(swap_dir, f)) for f in os.listdir(swap_dir) if f.endswith(".zoe-swap"))


def make_optimizer(model, args, swap_dir):
    common = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, schedule=args.schedule,
                  max_grad_norm=1.0, state_dtype=args.state)
    # full_shape: an offloaded parameter's p.shape is its empty placeholder's.
    decay = [p for n, p in model.named_parameters() if len(full_shape(p)) >= 2]
    no_decay = [p for n, p in model.named_parameters() if len(full_shape(p)) < 2]
    groups = lambda: [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]  # noqa: E731
    if args.tier in ("auto", "nvme"):
        try:
            return OffloadOptimizer(groups(), tier="nvme", nvme_path=swap_dir, **common), "nvme", None
        except (zoe.UnsupportedError, zoe.InvalidArgumentError) as e:
            if args.tier == "nvme":
                raise
            note = f"tier nvme is not available here ({e}); using tier ram"
            return OffloadOptimizer(groups(), tier="ram", **common), "ram", note
    return OffloadOptimizer(groups(), tier="ram", **common), "ram", None


class Progress:
    """One status line, redrawn in place on a terminal, printed every 10% otherwise (logs, CI)."""

    def __init__(self, total: int):
        self.total, self.tty, self.last_pct = total, sys.stderr.isatty(), -1

    def update(self, step: int, text: str) -> None:
        width = 24
        done = int(width * step / self.total)
        line = f"[{'#' * done}{'.' * (width - done)}] {step}/{self.total} {text}"
        if self.tty:
            sys.stderr.write("\r" + line[:200] + "\x1b[K")
            sys.stderr.flush()
        else:
            pct = 10 * step // self.total
            if pct != self.last_pct or step == self.total:
                self.last_pct = pct
                print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def train(model, opt, sched, data, held, args, device):
    """The training loop: per-step losses and tokens/s, held-out losses at `args.evals` points, and where
    the time went. Evaluation time is kept out of the throughput."""
    tokens_per_step = args.batch * args.seq
    eval_at = {round(args.steps * k / args.evals) for k in range(1, args.evals + 1)} - {0}
    r = dict(losses=[], tokens_per_s=[], held_steps=[], held_losses=[], t_compute=0.0, t_step=0.0, t_eval=0.0,
             parts=dict(xfer=0.0, adam=0.0, io=0.0, adapter=0.0))
    parts, prev = r["parts"], opt.stats()
    bar = Progress(args.steps)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = (t.to(device) for t in data.next())
        tc = time.perf_counter()
        opt.zero_grad()
        _, loss = model(x, y)
        opt.backward(loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        opt.step()
        sched.step()
        t2 = time.perf_counter()
        r["t_compute"] += t1 - tc
        r["t_step"] += t2 - t1
        s = opt.stats()
        adam = s["adam_s"] - prev["adam_s"]
        io = s.get("nvme_read_s", 0.0) - prev.get("nvme_read_s", 0.0) + s.get("nvme_write_s", 0.0) - prev.get("nvme_write_s", 0.0)
        parts["adam"] += adam
        parts["xfer"] += max(0.0, s["step_call_s"] - prev["step_call_s"] - adam)
        parts["io"] += io
        parts["adapter"] += s["adapter_s"] - prev["adapter_s"]
        prev = s
        r["losses"].append(loss.item())
        r["tokens_per_s"].append(tokens_per_step / (time.perf_counter() - t0))
        if step in eval_at:
            t3 = time.perf_counter()
            r["held_steps"].append(step)
            r["held_losses"].append(held_out_loss(model, held, device))
            r["t_eval"] += time.perf_counter() - t3
        train_s = time.perf_counter() - start - r["t_eval"]
        ms = lambda v: 1e3 * v / step  # noqa: E731 - per-step milliseconds
        bar.update(step, f"loss {r['losses'][-1]:.3f} | {tokens_per_step * step / train_s:,.0f} tok/s | per step ms: "
                         f"compute {ms(r['t_compute']):.0f}, D2H+H2D {ms(parts['xfer']):.1f}, CPU Adam {ms(parts['adam']):.1f}, "
                         f"I/O {ms(parts['io']):.1f}, adapter {ms(parts['adapter']):.2f}")
    bar.close()
    r["wall"] = time.perf_counter() - start - r["t_eval"]
    return r


def _write_corpus(path: str) -> int:
    text, source = corpus_text()
    with open(path, "wb") as f:
        f.write(text.encode("utf-8"))
    print(f"{path}: {source}, {len(text.encode('utf-8'))} bytes")
    return 0


def _device(args) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def _offload(model, args):
    """The model's weights in a parameter tier (--offload-param), or None."""
    if args.offload_param == "none":
        return None
    params_dir = os.path.join(os.path.abspath(args.out), "params")
    os.makedirs(params_dir, exist_ok=True)
    return offload_parameters(model, device=args.offload_param, prefetch=2, block_modules=(Block,),
                              nvme_path=params_dir if args.offload_param == "nvme" else None)


def _print_setup(args, device, compute, n_params, tier, note, data, offload) -> None:
    print(f"zoe demo: GPT {n_params / 1e6:.2f}M parameters ({args.layers} layers, d={args.d_model}), "
          f"{args.dtype} weights on {device}" + (" (fp32 arithmetic)" if compute else "") +
          f"; fp32 master + moments in zoe, tier {tier}, schedule {args.schedule}; "
          f"{torch.get_num_threads()} torch threads, zoe kernel {zoe.CpuAdam().kernel}")
    print(f"text: {data.source}, {len(data) / 1e3:.0f} kB; batch {args.batch} x {args.seq} tokens")
    if note:
        print(f"note: {note}")
    if offload is not None:
        st = offload.stats()
        print(f"parameters offloaded to {args.offload_param}: {len(offload.blocks)} blocks, device pool of "
              f"{st['budget_bytes'] / 2**20:.2f} MiB (prefetch 2)")


def _summary(args, r, model, n_params, device, tier, swap_dir, offload, opt, note, smooth, png, mpl_version) -> dict:
    losses, wall, parts, t_step = r["losses"], r["wall"], r["parts"], r["t_step"]
    stats = opt.stats()
    tokens_per_step = args.batch * args.seq
    return {
        "model_params": n_params, "device": str(device), "offload_param": args.offload_param,
        "state_dtype": args.state,
        # fp32 master + two moments, per parameter, as zoe holds them in RAM (tier ram)
        "resident_state_bytes": _resident_state_bytes(model, args.state) if tier == "ram" else 0,
        # tier nvme: the swap files, which hold each tile twice (a step writes the slot it did not read)
        "swap_file_bytes": _swap_file_bytes(swap_dir) if tier == "nvme" else 0,
        "param_tier": offload.stats() if offload is not None else None, "weights_dtype": args.dtype, "tier": tier,
        "schedule": args.schedule, "steps": args.steps, "batch": args.batch, "seq": args.seq,
        "tokens_per_s": tokens_per_step * args.steps / wall, "tokens_per_s_per_step": r["tokens_per_s"],
        "wall_s": wall, "eval_s": r["t_eval"],
        "first_loss": losses[0], "final_loss": smooth[-1], "held_out_loss": r["held_losses"][-1],
        "held_out_curve": {"steps": r["held_steps"], "losses": r["held_losses"], "batches": HELD_OUT_BATCHES},
        "loss_range": [min(losses), max(losses)], "loss_unit": "nats per byte (cross-entropy)",
        "per_step_ms": {"device_compute": 1e3 * r["t_compute"] / args.steps, "optimizer_step": 1e3 * t_step / args.steps,
                        "d2h_h2d_and_waits": 1e3 * parts["xfer"] / args.steps, "cpu_adam": 1e3 * parts["adam"] / args.steps,
                        "nvme_io_in_flight": 1e3 * parts["io"] / args.steps, "adapter_python": 1e3 * parts["adapter"] / args.steps},
        "adapter_fraction_of_step": parts["adapter"] / t_step if t_step else 0.0,
        "engine": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
        "losses": losses, "plot": png, "plot_renderer": f"matplotlib {mpl_version}", "note": note,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_corpus:
        return _write_corpus(args.write_corpus)
    try:
        mpl_version = plot.require_matplotlib()
    except ImportError as e:
        print(f"zoe demo: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    device = _device(args)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # A CPU without bf16/fp16 matrix instructions runs 16-bit matmuls many times slower than fp32: there the
    # weights stay 16-bit (what the optimizer exchanges) and the arithmetic runs in fp32.
    compute = None if device.type == "cuda" else torch.float32
    cfg = GPTConfig(seq=args.seq, d_model=args.d_model, n_layer=args.layers, n_head=args.heads, compute_dtype=compute)
    model = GPT(cfg).to(device=device, dtype=dtype)
    n_params = model.num_params()  # counted before any offload leaves placeholders in the parameters
    data = ByteBatches(args.seq, args.batch, seed=args.seed)
    # Held-out batches drawn once, from a generator of their own: the training batches are the same with or
    # without evaluation, and every evaluation sees the same text.
    held_data = ByteBatches(args.seq, args.batch, seed=args.seed + 1)
    held = [held_data.next(held_out=True) for _ in range(HELD_OUT_BATCHES)]
    os.makedirs(args.out, exist_ok=True)
    swap_dir = os.path.join(os.path.abspath(args.out), "swap")
    offload = _offload(model, args)
    opt, tier, note = make_optimizer(model, args, swap_dir)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    _print_setup(args, device, compute, n_params, tier, note, data, offload)

    r = train(model, opt, sched, data, held, args, device)
    losses = r["losses"]
    window = max(1, args.steps // 20)
    smooth = plot.trailing_mean(losses, window)
    params_m = n_params / 1e6
    png = os.path.join(args.out, "loss.png")
    plot.draw(png, plot.Curves(list(range(1, args.steps + 1)), losses, smooth, window, r["held_steps"],
                               r["held_losses"], HELD_OUT_BATCHES, r["tokens_per_s"]),
              title=f"zoe demo: GPT {params_m:.2f}M params on Python's docs, tier {tier}, schedule {args.schedule}"
                    + (f"\nweights offloaded to {args.offload_param}, fetched per block (prefetch 2)" if offload else ""),
              subtitle=f"{args.layers} layers, d={args.d_model}, {args.dtype} weights on {device}, fp32 master + Adam "
                       f"moments in zoe; batch {args.batch} x {args.seq} bytes, lr {args.lr:g}")
    summary = _summary(args, r, model, n_params, device, tier, swap_dir, offload, opt, note, smooth, png, mpl_version)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if offload is not None:
        del opt, sched  # the optimizer writes into the parameter tier: it goes first
        offload.remove()  # the trained weights back in the model; the tier (and its NVMe file) freed
    print(f"done: {args.steps} steps in {r['wall']:.1f} s, {summary['tokens_per_s']:,.0f} tokens/s; loss "
          f"{losses[0]:.3f} -> {smooth[-1]:.3f} (held-out {summary['held_out_loss']:.3f}); optimizer step "
          f"{summary['per_step_ms']['optimizer_step']:.1f} ms of which adapter Python "
          f"{100 * summary['adapter_fraction_of_step']:.1f}%")
    print(f"wrote {png} and {os.path.join(args.out, 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
