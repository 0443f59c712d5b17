"""Time and peak memory of saving and loading a large zoe optimizer state the ways trainers do:

  inline   state_dict() + torch.save, then torch.load + load_state_dict() (what a one-process trainer does)
  files    save_to(folder) / load_from(folder) + load_state_dict() (zoe.hf's callback and hooks, every rank)

    .venv/bin/python bench/checkpoint_rss.py --params 500M --tier ram --out /path/with/room

Peak RSS per phase: the kernel's high-water mark is reset before the phase (/proc/self/clear_refs, 5) and
read after it (VmHWM), reported as the rise over the RSS the phase started from. bf16 parameters in tensors
of 64M elements on the CPU; zoe keeps 12 bytes per parameter (fp32 master, m, v)."""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from zoe.torch import OffloadOptimizer

GiB = 1 << 30


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class Phase:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.rss0 = _status("VmRSS")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self.t0
        peak = _status("VmHWM")
        print(f"{self.name:40s} {seconds:7.1f} s   peak RSS +{(peak - self.rss0) / GiB:5.2f} GiB "
              f"({self.rss0 / GiB:.1f} -> {peak / GiB:.1f} GiB)", flush=True)


def count(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="500M")
    p.add_argument("--tier", choices=["ram", "nvme"], default="ram")
    p.add_argument("--out", default=tempfile.gettempdir(), help="where the checkpoint files (and swap) go")
    p.add_argument("--mmap", action="store_true", help="torch.load(..., mmap=True): the blob stays file-backed")
    args = p.parse_args()
    n, chunk = count(args.params), 64 << 20
    sizes = [min(chunk, n - i) for i in range(0, n, chunk)]
    work = tempfile.mkdtemp(prefix="zoe-ckpt-rss-", dir=args.out)
    try:
        params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in sizes]
        tier = dict(tier="nvme", nvme_path=os.path.join(work, "swap")) if args.tier == "nvme" else {}
        if tier:
            os.makedirs(tier["nvme_path"])
        opt = OffloadOptimizer(params, lr=1e-4, **tier)
        for q in params:
            q.grad = torch.randn_like(q)  # zoe, as torch, leaves a parameter whose gradient is None
        opt.step()
        print(f"{n / 1e6:.0f}M bf16 parameters, tier {args.tier}, zoe state {12 * n / GiB:.1f} GiB; files in {work}")
        path = os.path.join(work, "optimizer.pt")
        with Phase("inline: state_dict + torch.save"):
            torch.save(opt.state_dict(), path)
        with Phase("inline: torch.load" + (" (mmap)" if args.mmap else "") + " + load_state_dict"):
            opt.load_state_dict(torch.load(path, weights_only=False, mmap=args.mmap))
        os.remove(path)
        folder = os.path.join(work, "checkpoint")
        with Phase("files: save_to (+ its state_dict)"):
            opt.save_to(folder)
            sd = opt.state_dict()
        with Phase("files: load_from + load_state_dict"):
            opt.load_from(folder)
            opt.load_state_dict(sd)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
