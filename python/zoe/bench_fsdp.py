"""python -m zoe.bench_fsdp — FSDP2 training steps with each rank's shards in zoe's parameter tier
(offload_parameters on a fully_shard model) against the same FSDP2 model resident and with FSDP2's own
CPUOffloadPolicy, all stepped by zoe's OffloadOptimizer, on gloo ranks of this machine (or one GPU per rank).

Reported, not asserted (BENCHMARKING.md): per contender the median iteration time (forward, backward, step)
after a warm-up, its ratio to the resident run, and for the tier the fetches per step, the share of them found
loaded (``hit_fraction``), the time the ranks waited for NVMe reads that were not prefetched in time
(``fetch_wait_fraction`` of the iteration: the device idle the tier causes) and the NVMe read rate while reads
were in flight. The tier's fetch bandwidth against raw O_DIRECT reads of its files is ``zoe bench step
--offload-param nvme`` (the same ParamTier, one per rank here)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONTENDERS = ("resident", "cpu_offload_policy", "tier_cpu", "tier_nvme")


def _model(a, contender: str, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    with device:
        model = torch.nn.Sequential(*[torch.nn.Linear(a.hidden, a.hidden, bias=False) for _ in range(a.layers)])
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kw = {"mesh": mesh}
    if contender == "cpu_offload_policy":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in model:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _run(a, contender: str, prefetch: int, device: torch.device, folder: str) -> dict:
    from zoe.torch import OffloadOptimizer, offload_parameters

    model = _model(a, contender, device)
    off = None
    if contender.startswith("tier_"):
        home = contender[len("tier_"):]
        off = offload_parameters(model, home, nvme_path=folder if home == "nvme" else None, prefetch=prefetch)
    opt = OffloadOptimizer(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, a.hidden, device=device, generator=torch.Generator(device).manual_seed(dist.get_rank()))
    times, base = [], None
    for i in range(a.warmup + a.steps):
        if i == a.warmup and off is not None:
            base = off.stats()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    row = {"contender": contender, "iteration_ms": 1e3 * statistics.median(times[a.warmup:]),
           "iteration_ms_min": 1e3 * min(times[a.warmup:]), "iteration_ms_max": 1e3 * max(times[a.warmup:])}
    if off is not None:
        s = off.stats()
        fetches = s["fetches"] - base["fetches"]
        busy = s.get("read_busy_s", 0) - base.get("read_busy_s", 0)
        read = s.get("read_bytes", 0) - base.get("read_bytes", 0)
        wait = s["fetch_wait_s"] - base["fetch_wait_s"]
        row.update(prefetch=prefetch, fetches_per_step=fetches / a.steps,
                   hit_fraction=(s["hits"] - base["hits"]) / fetches if fetches else 0.0,
                   fetch_wait_fraction=wait / sum(times[a.warmup:]), pool_peak_bytes=s["pool_peak_bytes"],
                   budget_bytes=s["budget_bytes"], nvme_read_gbps=read / busy / 1e9 if busy > 0 else None)
        del opt
        off.remove()
    return row


def _rank_main(rank: int, a, init_file: str, folder: str, out_file: str) -> None:
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=a.world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    rows = []
    try:
        for contender in CONTENDERS:
            for prefetch in (a.prefetch if contender.startswith("tier_") else [a.prefetch[0]]):
                rows.append(_run(a, contender, prefetch, device, folder))
                dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoe.bench_fsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (gloo on the CPU; one GPU each with --device cuda)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048, help="each layer a hidden x hidden fp32 linear")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prefetch", type=lambda s: [int(v) for v in s.split(",")], default=[2, 0],
                   help="the tier's prefetch depths, comma-separated (default 2,0)")
    p.add_argument("--path", default=None, help="folder for the NVMe home (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true", help="one JSON object per line on stdout, nothing else")
    a = p.parse_args(argv)
    for name in ("world", "layers", "hidden", "batch", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} {getattr(a, name)}: need at least 1")
    if a.warmup < 1:
        p.error(f"--warmup {a.warmup}: need at least 1 (the first step records the fetch order)")
    if any(v < 0 for v in a.prefetch):
        p.error(f"--prefetch {a.prefetch}: depths are 0 or more")
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        p.error(f"--device cuda --world {a.world}: {torch.cuda.device_count()} GPUs here")
    with tempfile.TemporaryDirectory(dir=a.path) as folder:
        out_file = os.path.join(folder, "rows.json")
        mp.spawn(_rank_main, args=(a, os.path.join(folder, "init"), folder, out_file), nprocs=a.world, join=True)
        with open(out_file) as f:
            rows = json.load(f)
    resident = rows[0]["iteration_ms"]
    shard_mb = a.layers * a.hidden * a.hidden * 4 / a.world / 2**20
    for r in rows:
        r.update(bench="fsdp_offload", device=a.device, world=a.world, layers=a.layers, hidden=a.hidden,
                 vs_resident=r["iteration_ms"] / resident)
        if a.json:
            print(json.dumps(r))
    if a.json:
        return 0
    print(f"FSDP2 on {a.world} {a.device} ranks, {a.layers} layers of {a.hidden}x{a.hidden} fp32 ({shard_mb:.0f} MiB "
          f"of weights per rank), batch {a.batch}; median of {a.steps} iterations (min-max), zoe's optimizer")
    for r in rows:
        tier = ""
        if "prefetch" in r:
            rate = f", NVMe reads {r['nvme_read_gbps']:.2f} GB/s" if r["nvme_read_gbps"] else ""
            tier = (f"  prefetch {r['prefetch']}: {r['fetches_per_step']:.0f} fetches/step, "
                    f"{100 * r['hit_fraction']:.0f}% loaded, waited {100 * r['fetch_wait_fraction']:.1f}%{rate}")
        print(f"  {r['contender']:<20} {r['iteration_ms']:8.1f} ms ({r['iteration_ms_min']:.1f}-"
              f"{r['iteration_ms_max']:.1f})  x{r['vs_resident']:.2f}{tier}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
