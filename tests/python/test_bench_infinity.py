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


@pytest.mark.parametrize("spill", [False, True], ids=["fsdp2_grads", "spilled_grads"])
def test_bench_infinity_prints_every_phase_and_the_plan(tmp_path, spill):
    # 20M asks for the smallest shape: one layer beside the 32000 x 1024 embedding and head (about 78M).
    r = subprocess.run([sys.executable, "-m", "zoe.bench_infinity", "--params", "20M", "--steps", "3", "--json",
                        "--nvme-path", str(tmp_path / "nvme")] + (["--spill-grads"] if spill else []),
                       capture_output=True, text=True, timeout=900,
                       cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    kinds = [row["kind"] for row in rows]
    assert kinds == ["model", "setup", "plan", "step", "step", "step", "summary"], kinds
    steps = [row for row in rows if row["kind"] == "step"]
    assert all(math.isfinite(s["loss"]) and s["peak_rss_gib"] > 0 and s["disk_gib"] > 0 for s in steps), steps
    assert steps[-1]["loss"] < steps[0]["loss"], "one batch stepped on three times: the loss must fall"
    plan = rows[2]
    assert "error" not in plan and plan["host_gib"] > 0 and plan["disk_gib"] > 0, plan
    assert ("--spill-grads" in plan["command"]) == spill, plan["command"]
    summary = rows[-1]
    assert summary["plan_host_vs_growth"] > summary["plan_host_vs_run"] > 0, summary
    assert not os.path.exists(tmp_path / "nvme"), "the folder is removed without --keep"
