"""scripts/gpu-lora --dry-run and scripts/gpu-largest --dry-run: the GPU session's LoRA and largest-model
scripts on the CPU, so that they cannot rot between the rare runs on a GPU. Figures are not checked (they mean
nothing on the CPU); the rows are, and what must hold anywhere: zoe's sync and overlap train the adapters to
torch AdamW's numbers (fp32 adapters, the same batches: equal losses to the bit)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def test_lora_dry_run_reports_every_contender(tmp_path):
    r = subprocess.run([os.path.join(ROOT, "scripts", "gpu-lora"), "--dry-run", str(tmp_path)], capture_output=True,
                       text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "lora.jsonl").read_text().splitlines()]
    assert [row["contender"] for row in rows] == ["torch", "zoe_sync", "zoe_overlap", "zoe_delayed", "torch"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["ratio_vs_torch"] > 0 and 0 < row["trainable"] < row["params"], row
    loss = {row["contender"]: row["loss_mean"] for row in rows}
    assert loss["torch"] == loss["zoe_sync"] == loss["zoe_overlap"], loss


def test_largest_dry_run_sizes_and_trains_both(tmp_path):
    r = subprocess.run([os.path.join(ROOT, "scripts", "gpu-largest"), "--dry-run", str(tmp_path)], capture_output=True,
                       text=True, env=dict(ENV, LARGEST_NVME=str(tmp_path / "nvme")), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    zoe = [json.loads(line) for line in (tmp_path / "largest_zoe.jsonl").read_text().splitlines()]
    assert [row["kind"] for row in zoe] == ["size", "model", "setup", "plan", "step", "step", "summary"], zoe
    assert zoe[0]["params"] > 0 and zoe[1]["checkpointing"], zoe[:2]
    baseline = [json.loads(line) for line in (tmp_path / "largest_torch.jsonl").read_text().splitlines()]
    assert [row["kind"] for row in baseline] == ["model", "step", "step", "summary"], baseline
