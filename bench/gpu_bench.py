"""zoe against torch.optim.AdamW(fused=True) on one GPU, side by side in one process (scripts/gpu-bench).

A GPT (bf16 weights, SDPA attention; about 300M parameters by default) trains with
- ``torch``: AdamW(fused=True), everything on the GPU — the baseline, run first and last;
- ``zoe_sync``, ``zoe_overlap``, ``zoe_delayed``: zoe's OffloadOptimizer, fp32 master and moments in pinned RAM;
- ``zoe_overlap_param_cpu``: the overlap schedule with the weights themselves in pinned RAM
  (offload_parameters, one block per transformer layer, prefetch 2).
No iteration synchronises: the loss is summed on the device and read once, after the timed steps.

One JSON line per configuration and batch size: ``tokens_per_s``, ``ratio_vs_torch`` (against the mean of the
two torch runs at that batch), ``device_idle_fraction`` (1 - forward+backward alone / iteration, the
forward+backward timed the same way with no optimizer), ``host_waits_per_step`` (times the trainer's thread
waited for zoe's devices per iteration; ``worker_waits_per_step`` zoe's own threads), ``copy_ratio`` (sync
only: the optimizer's D2H + H2D bytes over their time — the part of its step that is not Adam brings the
gradients down, ``d2h_gbps``, and the wait after it the weights up, ``h2d_gbps`` — against plain pinned copies
of the model's bytes in this process; the other schedules overlap their copies with other work, so their copy
time cannot be separated), ``peak_device_bytes`` (torch's peak allocation plus zoe's parameter pool).
The second batch size is chosen so that forward+backward takes at least 1.5x zoe's CPU step (measured at the
first). Then the largest model each configuration could train on this GPU and this host, by layers at this
width, from the device and host bytes measured per layer (computed, not run).

``--tile`` sets zoe's piece size (an A/B of the copies' granularity), ``--batches`` fixed batch sizes.

``--dry-run``: the same on the CPU with a tiny model (scripts/test runs it, so that this script cannot rot);
its figures mean nothing.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import sys
import time

import torch

from zoe.demo.model import GPT, Block, GPTConfig
from zoe.torch import OffloadOptimizer, offload_parameters

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ZOE_CONFIGS = {
    "zoe_sync": dict(schedule="sync"),
    "zoe_overlap": dict(schedule="overlap"),
    "zoe_delayed": dict(schedule="delayed"),
    "zoe_overlap_param_cpu": dict(schedule="overlap", offload="cpu"),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_waits(opt, offload) -> tuple[int, int]:
    if not isinstance(opt, OffloadOptimizer):
        return 0, 0
    s = opt.stats()
    trainer, worker = s["host_waits_trainer"], s["host_waits_worker"]
    if offload is not None:
        t = offload.stats()
        trainer += t.get("host_waits_trainer", 0)
        worker += t.get("host_waits_worker", 0)
    return trainer, worker


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        compute = None if self.device.type == "cuda" else torch.float32
        self.cfg = GPTConfig(seq=args.seq, d_model=args.d_model, n_layer=args.layers, n_head=args.heads,
                             compute_dtype=compute)
        torch.manual_seed(0)
        self.base = GPT(self.cfg).to(device=self.device, dtype=torch.bfloat16)
        self.n_params = self.base.num_params()
        # The pristine copy every configuration starts from stays on the device: not the configurations' own.
        self.base_bytes = sum(p.numel() * p.element_size() for p in self.base.parameters()) \
            if self.device.type == "cuda" else 0
        self.rows: list[dict] = []
        out = args.out or os.environ.get("OUT")
        self.out = open(os.path.join(out, "gpu_bench.jsonl"), "a") if out else None

    def emit(self, row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self.out is not None:
            self.out.write(line + "\n")
            self.out.flush()
        self.rows.append(row)

    def batch(self, b: int):
        g = torch.Generator(device=self.device).manual_seed(b)
        x = torch.randint(0, self.cfg.vocab, (b, self.cfg.seq), device=self.device, generator=g)
        return x, torch.roll(x, -1, dims=1)

    def forward_backward_s(self, b: int) -> float:
        """Forward+backward alone (no optimizer), per iteration: the device's share of an iteration."""
        model = copy.deepcopy(self.base)
        x, y = self.batch(b)
        for _ in range(2):
            model(x, y)[1].backward()
            model.zero_grad(set_to_none=True)
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(self.args.steps):
            model(x, y)[1].backward()
            model.zero_grad(set_to_none=True)
        _sync(self.device)
        s = (time.perf_counter() - t0) / self.args.steps
        del model
        self._free()
        return s

    def copy_ceiling_gbps(self) -> float:
        """Plain copies of the model's bf16 bytes between the device and pinned host memory, down then up,
        best of three: what zoe's copies are compared with."""
        n = self.n_params
        dev = torch.empty(n, dtype=torch.bfloat16, device=self.device)
        host = torch.empty(n, dtype=torch.bfloat16, pin_memory=self.device.type == "cuda")
        best_down = best_up = math.inf
        for _ in range(3):
            _sync(self.device)
            t = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            _sync(self.device)
            best_down = min(best_down, time.perf_counter() - t)
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            _sync(self.device)
            best_up = min(best_up, time.perf_counter() - t)
        del dev, host
        return 2 * 2 * n / (best_down + best_up) / 1e9

    def _free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, config: str, b: int, fb_s: float, ceiling: float) -> dict:
        args = self.args
        model = copy.deepcopy(self.base)
        offload = None
        row = {"config": config, "batch": b, "seq": self.cfg.seq, "model_params": self.n_params,
               "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"}
        try:
            if config == "torch":
                opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
            else:
                c = ZOE_CONFIGS[config]
                if c.get("offload"):
                    offload = offload_parameters(model, device=c["offload"], prefetch=2, block_modules=(Block,))
                tile = dict(tile=args.tile) if args.tile else {}
                opt = OffloadOptimizer(model.parameters(), schedule=c["schedule"], delayed_warmup_steps=2, **tile,
                                       **HYPER)
                row["tile"] = args.tile
            x, y = self.batch(b)

            def iteration() -> torch.Tensor:
                loss = model(x, y)[1]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach()

            for _ in range(args.warmup):
                iteration()
            _sync(self.device)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            waits0 = _host_waits(opt, offload)
            stats0 = opt.stats() if config != "torch" else None
            total = torch.zeros((), device=self.device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                total += iteration()
            loss_mean = float(total) / args.steps  # the one read of the device per run
            iter_s = (time.perf_counter() - t0) / args.steps
            waits1 = _host_waits(opt, offload)
            pool = offload.stats().get("budget_bytes", 0) if offload is not None else 0
            peak = (torch.cuda.max_memory_allocated(self.device) - self.base_bytes
                    if self.device.type == "cuda" else 0) + pool
            # Between iterations: weights, gradients kept, optimizer state on the device (no activations).
            resident = (torch.cuda.memory_allocated(self.device) - self.base_bytes
                        if self.device.type == "cuda" else 0) + pool
            row.update(tokens_per_s=b * self.cfg.seq / iter_s, iteration_s=iter_s, forward_backward_s=fb_s,
                       device_idle_fraction=max(0.0, 1 - fb_s / iter_s),
                       host_waits_per_step=(waits1[0] - waits0[0]) / args.steps,
                       worker_waits_per_step=(waits1[1] - waits0[1]) / args.steps,
                       peak_device_bytes=peak, resident_device_bytes=resident, loss_mean=loss_mean)
            if stats0 is not None:
                s1 = opt.stats()
                row["cpu_step_s"] = (s1["step_call_s"] - stats0["step_call_s"]) / args.steps
                row["cpu_adam_s"] = (s1["adam_s"] - stats0["adam_s"]) / args.steps
                row["copy_ceiling_gbps"] = ceiling
                row["copy_ratio"] = None
                if config == "zoe_sync":
                    # The timed step() also waits for the rest of backward (the host runs ahead): the copies
                    # are timed apart, in steps that start once the device is done. step() brings the
                    # gradients down and returns with the weights' copies enqueued: the wait after it is theirs.
                    probe0 = opt.stats()
                    h2d_s = 0.0
                    for _ in range(3):
                        model(x, y)[1].backward()
                        _sync(self.device)
                        opt.step()
                        t = time.perf_counter()
                        _sync(self.device)
                        h2d_s += time.perf_counter() - t
                        opt.zero_grad(set_to_none=True)
                    p1 = opt.stats()
                    d2h_s = (p1["step_call_s"] - probe0["step_call_s"]) - (p1["adam_s"] - probe0["adam_s"])
                    d2h = p1["d2h_bytes"] - probe0["d2h_bytes"]
                    h2d = p1["h2d_bytes"] - probe0["h2d_bytes"]
                    if d2h_s > 0 and h2d_s > 0 and d2h + h2d > 0:
                        row.update(copy_gbps=(d2h + h2d) / (d2h_s + h2d_s) / 1e9, d2h_gbps=d2h / d2h_s / 1e9,
                                   h2d_gbps=h2d / h2d_s / 1e9)
                        row["copy_ratio"] = row["copy_gbps"] / ceiling
        except Exception as e:  # one configuration's failure is a result, not the end of the run
            row["error"] = f"{type(e).__name__}: {e}"
        finally:
            opt = None
            gc.collect()  # the optimizer first: a parameter tier is not removed while one writes into it
            if offload is not None:
                try:
                    offload.remove()
                except Exception:
                    pass
            del model, offload
            self._free()
        return row

    def largest(self, at_batch: int) -> None:
        """Layers (at this width, at the first and smaller batch) each configuration fits: the device holds per layer its resident
        bytes (measured between iterations, per parameter) and its activations (peak - resident, per layer),
        the host zoe's fp32 master and moments (12 B per parameter) and staging (the bf16 weights and
        gradients, 4 B) — 16 B per parameter, or 18 B with the weights' home in pinned RAM."""
        if self.device.type != "cuda":
            return
        total_device = torch.cuda.get_device_properties(self.device).total_memory
        total_host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        per_layer_params = self.n_params / self.cfg.n_layer  # embeddings counted in: a slight overestimate
        done = set()
        for r in self.rows:
            if r.get("batch") != at_batch or "error" in r or "resident_device_bytes" not in r or r["config"] in done:
                continue
            config = r["config"]
            done.add(config)  # torch's first run stands for both
            dev_per_layer = r["peak_device_bytes"] / self.cfg.n_layer
            if config == "zoe_overlap_param_cpu":
                # The pool is fixed (prefetch 2 blocks); what grows with depth is the activations.
                dev_per_layer = (r["peak_device_bytes"] - r["resident_device_bytes"]) / self.cfg.n_layer
            layers_device = int(0.9 * total_device / dev_per_layer) if dev_per_layer > 0 else None
            host_per_param = 0 if config == "torch" else (18 if config.endswith("param_cpu") else 16)
            layers_host = int(0.8 * total_host / (host_per_param * per_layer_params)) if host_per_param else None
            layers = min(v for v in (layers_device, layers_host) if v is not None)
            self.emit({"largest_model": config, "batch": at_batch, "layers": layers,
                       "params": int(layers * per_layer_params), "limited_by": "device" if layers == layers_device else "host",
                       "device_bytes_per_layer": dev_per_layer, "host_bytes_per_param": host_per_param,
                       "confirmed": False})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU, a tiny model: the script's own check")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="the first batch size (sequences)")
    p.add_argument("--max-batch", type=int, default=64, help="the second batch size is at most this")
    p.add_argument("--steps", type=int, default=8, help="timed iterations per configuration")
    p.add_argument("--warmup", type=int, default=4, help="iterations before timing (more than zoe's delayed warm-up of 2)")
    p.add_argument("--tile", type=int, help="zoe's elements per piece (OffloadOptimizer tile; default its own)")
    p.add_argument("--batches", help="comma-separated batch sizes, instead of --batch and the one chosen after it")
    p.add_argument("--configs", default="torch,zoe_sync,zoe_overlap,zoe_delayed,zoe_overlap_param_cpu")
    p.add_argument("--out", help="folder for gpu_bench.jsonl (default $OUT; none: stdout only)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.d_model, args.layers, args.heads, args.seq = 64, 2, 4, 32
        args.batch, args.max_batch, args.steps, args.warmup = 2, 4, 2, 3
    elif not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here (use --dry-run on a machine without a GPU)", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c != "torch" and c not in ZOE_CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}: torch, {', '.join(ZOE_CONFIGS)}")
    bench = Bench(args)
    ceiling = bench.copy_ceiling_gbps()
    bench.emit({"bench": "gpu", "device": str(bench.device), "model_params": bench.n_params,
                "layers": args.layers, "d_model": args.d_model, "seq": args.seq, "copy_ceiling_gbps": ceiling,
                "torch": torch.__version__, "dry_run": args.dry_run})
    fixed = [int(x) for x in args.batches.split(",") if x] if args.batches else None
    batches = fixed or [args.batch]
    b = 0
    while b < len(batches):
        batch = batches[b]
        fb_s = bench.forward_backward_s(batch)
        order = (["torch"] if "torch" in configs else []) + [c for c in configs if c != "torch"] + \
                (["torch"] if "torch" in configs else [])
        rows = [bench.run(c, batch, fb_s, ceiling) for c in order]
        base = [r["tokens_per_s"] for r in rows if r["config"] == "torch" and "tokens_per_s" in r]
        for r in rows:
            if base and "tokens_per_s" in r:
                r["ratio_vs_torch"] = r["tokens_per_s"] / (sum(base) / len(base))
            bench.emit(r)
        if b == 0 and not fixed:
            steps = [r["cpu_step_s"] for r in rows if r["config"] == "zoe_sync" and "cpu_step_s" in r]
            if steps:
                per_seq = fb_s / batch
                need = math.ceil(1.5 * steps[0] / per_seq)
                second = min(args.max_batch, max(2 * batch, -(-need // 8) * 8))
                bench.emit({"second_batch": second, "cpu_step_s": steps[0], "forward_backward_s_per_seq": per_seq,
                            "needed_for_1.5x": need, "capped": need > args.max_batch})
                batches.append(second)
        b += 1
    bench.largest(batches[0])
    return 0 if all("error" not in r for r in bench.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
