"""python -m zoe.bench — zoe's optimizer step against torch.optim.AdamW (foreach=True and fused=True) on the
same CPU parameters in the same run, gradient accumulation on the host against the same traffic in torch,
the PyTorch adapter's Python overhead on the demo model, and (--nvme-path) tier nvme's overlap on it.

Reported, not asserted (BENCHMARKING.md): medians of --reps timed steps after a warm-up, with min and max.
Every contender steps the same fp32 parameters with fp32 gradients; bytes counted per parameter are the 28 B
of fp32 Adam (read p, g, m, v; write p, m, v). zoe's OffloadOptimizer steps the CPU parameters in place, and by
default first refuses a NaN/Inf gradient (refuse_non_finite=True), which reads every gradient once more before
anything is written; it is listed with the refusal off too, beside the bare kernel (zoe.CpuAdam on the same
arrays), and the refusal's cost is put beside the rate at which the Adam pass itself reads memory."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import zoe
from zoe.torch import OffloadOptimizer


def _params(n_total: int, tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    size = n_total // tensors
    ps = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(size, generator=g) * 0.02)
        p.grad = torch.randn(size, generator=g) * 1e-3
        ps.append(p)
    return ps


def _time(fn, reps: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}


def bench_step(n: int, tensors: int, reps: int) -> list[dict]:
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    rows = []
    contenders = [("torch AdamW foreach=True", lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper))]
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        contenders.append(("torch AdamW fused=True", lambda ps: torch.optim.AdamW(ps, fused=True, **hyper)))
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"note: this torch has no fused AdamW on CPU ({e})", file=sys.stderr)
    contenders.append(("zoe OffloadOptimizer (sync, ram)", lambda ps: OffloadOptimizer(ps, **hyper)))
    contenders.append(("zoe, refuse_non_finite=False",
                       lambda ps: OffloadOptimizer(ps, refuse_non_finite=False, **hyper)))
    for name, make in contenders:
        ps = _params(n, tensors)
        opt = make(ps)
        rows.append({"name": name, **_time(opt.step, reps)})
        del opt, ps
    # The bare kernel on the same amount of data: what the step costs without the engine around it.
    ps = _params(n, tensors)
    adam = zoe.CpuAdam()
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    data = [p.detach() for p in ps]
    grads = [p.grad for p in ps]
    k = [0]

    def kernel():
        k[0] += 1
        adam.step(data, m, v, grads, step=k[0], lr=1e-3, weight_decay=0.01)

    rows.append({"name": f"zoe.CpuAdam kernel ({adam.kernel})", **_time(kernel, reps)})
    base = rows[0]["median_s"]
    fused = next((r["median_s"] for r in rows if "fused" in r["name"]), None)
    for r in rows:
        r["n"] = n
        r["gbps"] = 28 * n / r["median_s"] / 1e9
        r["speedup_vs_foreach"] = base / r["median_s"]
        if fused:
            r["speedup_vs_fused"] = fused / r["median_s"]
    # The refusal must see every gradient before the first write: one more read of 4 B per parameter, which
    # is set beside the rate at which the Adam pass reads (16 of its 28 B per parameter).
    on = next(r["median_s"] for r in rows if r["name"].startswith("zoe OffloadOptimizer"))
    off = next(r["median_s"] for r in rows if "refuse_non_finite=False" in r["name"])
    kernel_s = rows[-1]["median_s"]
    refusal = {"refusal_s": on - off, "refusal_read_gbps": 4 * n / (on - off) / 1e9 if on > off else None,
               "adam_read_gbps": 16 * n / kernel_s / 1e9}
    rows.append({"name": "refusal of NaN/Inf (the difference)", "n": n, **refusal})
    return rows


def bench_accumulate(n: int, tensors: int, reps: int) -> list[dict]:
    """Gradient accumulation on the host, per micro-batch that is not the last: zoe's report of every bf16
    gradient (added into the fp32 sum and zeroed in one pass, on the CPU in place) against the same traffic
    in torch (acc.add_(g); g.zero_()) and against a copy of the gradients alone (what bringing them down costs
    at memory speed). Bytes per parameter: read acc 4 + g 2, write acc 4 + g 2 = 12."""
    ps = [torch.nn.Parameter(p.detach().bfloat16()) for p in _params(n, tensors)]
    # Every timed micro-batch is one that is not the last (no step ever comes): more than the reps ever reach.
    opt = OffloadOptimizer(ps, lr=1e-3, gradient_accumulation_steps=1 << 30)
    slots = opt._slots
    for s in slots:  # the engine sums what lies in its gradient buffer; p.grad stays None until a backward
        s.grad_view.normal_(0, 1e-3)

    def zoe_micro_batch():
        for s in slots:
            opt._report(s, last=False)

    rows = [{"name": "zoe accumulate (fp32 sum, gradient zeroed)", **_time(zoe_micro_batch, reps)}]
    accs = [torch.zeros(p.numel(), dtype=torch.float32) for p in ps]
    grads = [s.grad_view.view(-1) for s in slots]

    def torch_add():
        for acc, g in zip(accs, grads):
            acc.add_(g)
            g.zero_()

    rows.append({"name": "torch acc.add_(g); g.zero_()", **_time(torch_add, reps)})
    outs = [torch.empty_like(g) for g in grads]

    def copy():
        for o, g in zip(outs, grads):
            o.copy_(g)

    copy_row = {"name": "copy of the bf16 gradients alone", **_time(copy, reps)}
    for r in rows:
        r["gbps"] = 12 * n / r["median_s"] / 1e9
        r["vs_copy"] = r["median_s"] / copy_row["median_s"]
    copy_row["gbps"] = 4 * n / copy_row["median_s"] / 1e9
    rows.append(copy_row)
    for r in rows:
        r["n"] = n
    return rows


def bench_adapter(steps: int) -> dict:
    """The adapter's own Python time per step (grad bookkeeping, hyper-parameter sync) against the whole
    optimizer step, on the demo's model with bf16 weights, tier ram."""
    from zoe.demo.data import ByteBatches
    from zoe.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(compute_dtype=torch.float32)).to(torch.bfloat16)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    data = ByteBatches(128, 8)
    step_wall = 0.0
    for i in range(steps + 3):
        if i == 3:  # warm-up done
            step_wall, base = 0.0, opt.stats()
        x, y = data.next()
        opt.zero_grad()
        model(x, y)[1].backward()
        t = time.perf_counter()
        opt.step()
        step_wall += time.perf_counter() - t
    s = opt.stats()
    adapter = s["adapter_s"] - base["adapter_s"]
    return {"model_params": model.num_params(), "steps": steps, "step_ms": 1e3 * step_wall / steps,
            "adapter_ms": 1e3 * adapter / steps, "adapter_fraction": adapter / step_wall,
            "engine_ms": 1e3 * (s["engine_s"] - base["engine_s"]) / steps}


def bench_nvme_overlap(path: str, steps: int) -> list[dict]:
    """Tier nvme with the overlap schedule on the demo's model (bf16 weights, on the CPU, the store streamed,
    not resident): the time step() still takes after backward, with one param group and with torch's usual
    two (weights with decay; biases and norms without), which the adapter lays out one after the other while
    backward reports across them. The speculation goes through the tiles in the order the gradients came
    last iteration, so the two should match."""
    import shutil

    from zoe.demo.data import ByteBatches
    from zoe.demo.model import GPT, GPTConfig

    rows = []
    for name in ("one group", "two groups"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(seq=128, d_model=512, n_layer=8, n_head=8, compute_dtype=torch.float32)).to(torch.bfloat16)
        groups = [{"params": list(model.parameters())}]
        if name == "two groups":
            groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                      {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        folder = os.path.join(path, "zoe-bench-nvme-overlap")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        opt = OffloadOptimizer(groups, lr=1e-4, tier="nvme", nvme_path=folder, schedule="overlap",
                               keep_resident=False)
        data = ByteBatches(128, 8)
        after, whole = [], []
        for i in range(steps + 2):  # two warm-up steps: the first speculation knows no order yet
            x, y = data.next()
            t0 = time.perf_counter()
            model(x, y)[1].backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if i >= 2:
                after.append(t2 - t1)
                whole.append(t2 - t0)
        del opt
        shutil.rmtree(folder, ignore_errors=True)
        rows.append({"layout": name, "model_params": model.num_params(), "steps": steps,
                     "step_after_backward_ms": 1e3 * statistics.median(after),
                     "iteration_ms": 1e3 * statistics.median(whole)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoe.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=float, default=100e6, help="parameters (default 100M)")
    p.add_argument("--tensors", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--adapter-steps", type=int, default=20)
    p.add_argument("--nvme-path", default=None,
                   help="also tier nvme with the overlap schedule on the demo's model, its store in this folder")
    p.add_argument("--json", action="store_true", help="one JSON object per line on stdout, nothing else")
    a = p.parse_args(argv)
    # Zero of any of these times nothing, and every rate printed would be a division by zero.
    if a.tensors < 1:
        p.error(f"--tensors {a.tensors}: need at least 1")
    if int(a.n) < a.tensors:
        p.error(f"--n {a.n:g}: need at least one parameter per tensor (--tensors {a.tensors})")
    if a.reps < 1:
        p.error(f"--reps {a.reps}: need at least 1 timed repetition")
    if a.adapter_steps < 1:
        p.error(f"--adapter-steps {a.adapter_steps}: need at least 1 step")
    if a.nvme_path is not None and not (os.path.isdir(a.nvme_path) and os.access(a.nvme_path, os.W_OK | os.X_OK)):
        p.error(f"--nvme-path {a.nvme_path}: not a folder this process can write")
    rows = bench_step(int(a.n), a.tensors, a.reps)
    accumulate = bench_accumulate(int(a.n), a.tensors, a.reps)
    adapter = bench_adapter(a.adapter_steps)
    nvme = bench_nvme_overlap(a.nvme_path, a.adapter_steps) if a.nvme_path else []
    if a.json:
        for r in rows:
            print(json.dumps({"bench": "step_vs_torch", **r}))
        for r in accumulate:
            print(json.dumps({"bench": "accumulate", **r}))
        print(json.dumps({"bench": "adapter_overhead", **adapter}))
        for r in nvme:
            print(json.dumps({"bench": "nvme_overlap", **r}))
        return 0
    print(f"Adam step on {int(a.n) / 1e6:.0f}M fp32 CPU parameters in {a.tensors} tensors, {torch.get_num_threads()} "
          f"torch threads; median of {a.reps} (min-max); GB/s at 28 B/param")
    for r in rows:
        if "refusal_s" in r:
            rate = f"{r['refusal_read_gbps']:.1f} GB/s" if r["refusal_read_gbps"] else "(within noise)"
            print(f"  refusal of NaN/Inf: {1e3 * r['refusal_s']:+.1f} ms, one read of the gradients at {rate}; "
                  f"the Adam kernel reads at {r['adam_read_gbps']:.1f} GB/s")
            continue
        extra = f"  x{r['speedup_vs_fused']:.2f} vs fused" if "speedup_vs_fused" in r else ""
        print(f"  {r['name']:<36} {1e3 * r['median_s']:8.1f} ms ({1e3 * r['min_s']:.1f}-{1e3 * r['max_s']:.1f})"
              f"  {r['gbps']:6.1f} GB/s  x{r['speedup_vs_foreach']:.2f} vs foreach{extra}")
    print(f"Gradient accumulation, one micro-batch of {int(a.n) / 1e6:.0f}M bf16 gradients into fp32 sums "
          "(GB/s at 12 B/param; the copy at 4 B/param)")
    for r in accumulate:
        extra = f"  x{r['vs_copy']:.2f} the copy's time" if "vs_copy" in r else ""
        print(f"  {r['name']:<44} {1e3 * r['median_s']:8.1f} ms ({1e3 * r['min_s']:.1f}-{1e3 * r['max_s']:.1f})"
              f"  {r['gbps']:6.1f} GB/s{extra}")
    print(f"Adapter overhead on the demo model ({adapter['model_params'] / 1e6:.2f}M params, bf16, tier ram): "
          f"{adapter['adapter_ms']:.3f} ms of a {adapter['step_ms']:.2f} ms step "
          f"({100 * adapter['adapter_fraction']:.2f}%)")
    for r in nvme:
        print(f"Tier nvme, overlap, {r['layout']} ({r['model_params'] / 1e6:.1f}M params): step() after backward "
              f"{r['step_after_backward_ms']:.1f} ms of a {r['iteration_ms']:.1f} ms iteration (median of {r['steps']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
