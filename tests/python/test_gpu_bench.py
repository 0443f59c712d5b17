"""scripts/gpu-bench --dry-run: the GPU benchmark's own script on the CPU with a tiny model, so that it
cannot rot between the rare runs on a GPU. Its figures are not checked (they mean nothing on the CPU); its
rows are, and the one thing that must hold anywhere: sync, overlap and overlap with the weights offloaded
train the same numbers, so their mean losses are equal to the bit."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ["torch", "zoe_sync", "zoe_overlap", "zoe_delayed", "zoe_overlap_param_cpu"]
FIELDS = ["tokens_per_s", "ratio_vs_torch", "device_idle_fraction", "host_waits_per_step", "peak_device_bytes"]


def test_dry_run_reports_every_configuration_at_two_batches(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run([os.path.join(ROOT, "scripts", "gpu-bench"), "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu_bench.jsonl").read_text().splitlines()]
    assert rows == [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    runs = [row for row in rows if "config" in row]
    batches = sorted({row["batch"] for row in runs})
    assert len(batches) == 2, batches
    for b in batches:
        at = [row for row in runs if row["batch"] == b]
        assert [row["config"] for row in at] == CONFIGS + ["torch"]  # the baseline first and last
        for row in at:
            assert "error" not in row, row
            missing = [f for f in FIELDS if f not in row]
            assert not missing, (row["config"], missing)
        loss = {row["config"]: row["loss_mean"] for row in at}
        assert loss["zoe_sync"] == loss["zoe_overlap"] == loss["zoe_overlap_param_cpu"], loss
    assert any(row.get("second_batch") == batches[1] for row in rows)
