"""python -m zoe.bench_infinity runs end to end on a small model: every line it promises is there, the model
trains on its repeated batch, and the plan beside it comes from zoe plan. The figures are reported, not
asserted (BENCHMARKING.md); docs/performance.md has them at 1B and 4B."""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


CASES = {"fsdp2_grads": [], "spilled_grads": ["--spill-grads"],
         "ram_tiers_checkpointed": ["--param-tier", "cpu", "--state-tier", "ram", "--checkpointing"]}
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def bench(args, **kw):
    return subprocess.run([sys.executable, "-m", "zoe.bench_infinity", "--json"] + args, capture_output=True, text=True,
                          timeout=900, cwd=ROOT, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_bench_infinity_prints_every_phase_and_the_plan(tmp_path, case):
    # 20M asks for the smallest shape: one layer beside the 32000 x 1024 embedding and head (about 78M).
    r = bench(["--params", "20M", "--steps", "3", "--nvme-path", str(tmp_path / "nvme")] + CASES[case])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    kinds = [row["kind"] for row in rows]
    assert kinds == ["model", "setup", "plan", "step", "step", "step", "summary"], kinds
    on_disk = case != "ram_tiers_checkpointed"
    steps = [row for row in rows if row["kind"] == "step"]
    assert all(math.isfinite(s["loss"]) and s["peak_rss_gib"] > 0 and s["tokens_per_s"] > 0 for s in steps), steps
    # The folder holds a few small files either way (the config, the process group's rendezvous).
    assert all((s["disk_gib"] > 0.01) == on_disk for s in steps), steps
    assert steps[-1]["loss"] < steps[0]["loss"], "one batch stepped on three times: the loss must fall"
    plan = rows[2]
    assert "error" not in plan and plan["host_gib"] > 0 and (plan["disk_gib"] is not None) == on_disk, plan
    assert ("--spill-grads" in plan["command"]) == (case == "spilled_grads"), plan["command"]
    placement = "--offload-optimizer cpu --offload-param cpu" if not on_disk else \
        "--offload-optimizer nvme --offload-param nvme"
    assert placement in plan["command"], plan["command"]
    assert ("--activation-checkpointing" in plan["command"]) == (not on_disk), plan["command"]
    assert rows[0]["checkpointing"] == (not on_disk), rows[0]
    summary = rows[-1]
    assert summary["plan_host_vs_growth"] > summary["plan_host_vs_run"] > 0, summary
    assert summary["tokens_per_s"] in [s["tokens_per_s"] for s in steps[1:]], summary
    assert not os.path.exists(tmp_path / "nvme"), "the folder is removed without --keep"


def plan_fits(n: int, param_tier: str, state_tier: str, nvme: str) -> bool:
    """zoe plan itself, asked as the sizing asks it, for bench_infinity's shape of n parameters."""
    from zoe.bench_infinity import llama_shape

    config = os.path.join(nvme, "shape.json")
    with open(config, "w") as f:
        json.dump({"model_type": "llama", **llama_shape(n)}, f)
    cmd = [os.path.join(ROOT, "build", "zoe"), "plan", "--model", config, "--gpus", "0", "--stage", "3",
           "--offload-optimizer", "cpu" if state_tier == "ram" else "nvme", "--offload-param", param_tier,
           "--state-dtype", "int8", "--prefetch", "2", "--micro-batch", "1", "--seq-len", "32", "--nvme", nvme,
           "--adam-rate", "1B", "--nvme-gbps", "1", "--json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return out["fits"] and out["zoe_runs_it"]


def test_largest_is_the_most_any_placement_fits(tmp_path):
    """--params largest --size-only: the size zoe plan fits in the placement named, within the 2% the search
    stops at, and 5% more fits in none of the four."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    r = bench(["--params", "largest", "--size-only", "--nvme-path", str(nvme)])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["kind"] for row in rows] == ["size"], rows
    size = rows[0]
    n = size["params"]
    assert plan_fits(n, size["param_tier"], size["state_tier"], str(nvme)), size
    for param_tier, state_tier in [("cpu", "ram"), ("nvme", "ram"), ("cpu", "nvme"), ("nvme", "nvme")]:
        assert not plan_fits(int(n * 1.05), param_tier, state_tier, str(nvme)), (param_tier, state_tier, n)
    assert sorted(os.listdir(nvme)) == ["shape.json"], "the sizing leaves nothing behind"


def test_torch_baseline_trains_the_same_model_resident():
    r = bench(["--torch", "--params", "20M", "--steps", "2", "--seq", "16", "--checkpointing"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["kind"] for row in rows] == ["model", "step", "step", "summary"], rows
    assert rows[0]["baseline"] == "torch" and rows[0]["checkpointing"], rows[0]
    assert rows[2]["loss"] < rows[1]["loss"], rows
    assert "disk_gib" not in rows[-1] and rows[-1]["tokens_per_s"] > 0, rows[-1]


def test_torch_largest_tries_smaller_sizes_after_running_out_of_memory(monkeypatch):
    """--torch --params largest: a size that runs out of device memory is reported and the next one tried. The
    search itself needs a GPU; here the first size's model raises torch's OutOfMemoryError."""
    import argparse

    import torch

    from zoe import bench_infinity

    tried = []

    def model_or_oom(a, size):
        tried.append(size)
        if size == 10**12:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 TiB")
        return real(a, size)

    real = bench_infinity.torch_model
    monkeypatch.setattr(bench_infinity, "torch_model", model_or_oom)
    monkeypatch.setattr(bench_infinity, "torch_sizes", lambda a: [10**12, 20_000_000])
    rows = []
    a = argparse.Namespace(params="largest", device="cpu", checkpointing=False, torch=True, lr=1e-3, batch=1, seq=8,
                           steps=1)
    assert bench_infinity.run_torch(a, lambda kind, **f: rows.append({"kind": kind, **f})) == 0
    assert tried == [10**12, 20_000_000]
    assert [r["kind"] for r in rows] == ["oom", "model", "step", "summary"], rows
    assert rows[0]["params"] == 10**12 and "out of memory" in rows[0]["error"], rows[0]
