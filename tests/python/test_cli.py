"""The zoe command line (build/zoe, made by scripts/build) run as users run it: empty or zero inputs are refused
with a message naming the option, never measured into a NaN."""
import json
import math
import os
import pathlib
import subprocess

import pytest

ZOE = pathlib.Path(__file__).resolve().parents[2] / "build" / "zoe"
pytestmark = pytest.mark.skipif(not ZOE.exists(), reason=f"{ZOE} is not built (run scripts/build)")


def zoe(*args, timeout=120):
    return subprocess.run([str(ZOE), *args], capture_output=True, text=True, timeout=timeout)


def has_aio() -> bool:
    return "probe" in zoe("--help").stdout


@pytest.mark.parametrize("args, option", [
    (["bench", "adam", "--n", "0"], "--n 0"),
    (["bench", "adam", "--n", "0", "--json"], "--n 0"),
    (["bench", "adam", "--n", "1K", "--reps", "0"], "--reps 0"),
    (["bench", "adam", "--n", "1K", "--isa", ""], "--isa is empty"),
    (["bench", "adam", "--n", "1K", "--grad", ""], "--grad is empty"),
    (["bench", "adam", "--n", "1K", "--out", ""], "--out is empty"),
    (["bench", "adam", "--n", "1K", "--tensors", "0"], "--tensors 0"),
    (["bench", "adam", "--n", "1K", "--tile", "0"], "--tile 0"),
    (["bench", "accumulate", "--n", "0"], "--n 0"),
    (["bench", "accumulate", "--n", "0", "--json"], "--n 0"),
    (["bench", "accumulate", "--n", "1K", "--reps", "0"], "--reps 0"),
    (["bench", "accumulate", "--n", "1K", "--isa", ""], "--isa is empty"),
    (["bench", "accumulate", "--n", "1K", "--grad", ""], "--grad is empty"),
    (["bench", "accumulate", "--n", "1K", "--mode", ""], "--mode is empty"),
    (["bench", "accumulate", "--n", "1K", "--tile", "0"], "--tile 0"),
    (["bench", "step", "--n", "0"], "--n 0"),
    (["bench", "step", "--n", "1K", "--buckets", "0"], "--buckets 0"),
    (["bench", "step", "--n", "4", "--buckets", "5"], "--buckets 5 is more than --n 4"),
    (["bench", "step", "--n", "1K", "--iters", "0"], "--iters 0"),
])
def test_empty_input_is_refused_with_its_option_named(args, option):
    r = zoe(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert option in r.stderr
    assert r.stdout == ""  # no table or JSON line with a NaN in it


@pytest.mark.parametrize("extra, option", [
    (["--n", "0"], "--n 0"),
    (["--n", "1K", "--reps", "0"], "--reps 0"),
    (["--n", "1K", "--buffers", "0"], "--buffers 0"),
    (["--n", "1K", "--queue-depth", "0"], "--queue-depth 0"),
    (["--n", "1K", "--block-size", "0"], "--block-size 0"),
    (["--n", "1K", "--chunk", "0"], "--chunk 0"),
])
def test_bench_nvme_empty_input_is_refused(tmp_path, extra, option):
    if not has_aio():
        pytest.skip("this build has no NVMe tier (libaio)")
    r = zoe("bench", "nvme", "--path", str(tmp_path), "--tile", "48K", *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    assert option in r.stderr
    assert r.stdout == ""
    assert os.listdir(tmp_path) == []  # refused before any swap file was made


def test_bench_adam_smallest_input_gives_finite_numbers():
    r = zoe("bench", "adam", "--n", "1", "--reps", "1", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    for key in ("median_s", "params_per_s", "gbps", "ceiling_gbps", "ratio"):
        assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (key, row)


def test_bench_step_reports_each_copy_direction_and_the_host_waits_per_step():
    # The host stand-in: copies on its stream threads, as a GPU's. sync waits once per step on the trainer's
    # thread (for the gradients); the weights' copies are waited for when the next step rewrites them.
    r = zoe("bench", "step", "--device", "host", "--schedule", "sync", "--n", "256K", "--buckets", "4",
            "--iters", "3", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    for key in ("d2h_gbps", "d2h_ratio", "h2d_gbps", "h2d_ratio", "copy_gbps", "copy_ratio", "d2h_ceiling_gbps",
                "h2d_ceiling_gbps"):
        assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert row["host_waits_per_step"] <= 1, row


def test_bench_accumulate_smallest_input_gives_finite_numbers_for_every_mode():
    r = zoe("bench", "accumulate", "--n", "1", "--reps", "1", "--grad", "f32,bf16",
            "--mode", "add,add_zero,first,first_zero", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(row["grad"], row["mode"]) for row in rows] == [
        (g, m) for g in ("f32", "bf16") for m in ("add", "add_zero", "first", "first_zero")]
    for row in rows:
        assert row["bench"] == "accumulate"
        for key in ("median_s", "params_per_s", "gbps", "ceiling_gbps", "ratio"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (key, row)


def test_probe_reports_a_killed_runs_swap_store_with_the_command_that_removes_it(tmp_path):
    """A run killed with SIGKILL leaves its swap store; zoe probe reports it in use while the run lives and
    abandoned after, with an rm command that frees the folder; the path stays usable (exit status 0)."""
    if not has_aio():
        pytest.skip("this build has no NVMe tier (libaio)")
    import signal
    import time

    run = subprocess.Popen([str(ZOE), "bench", "nvme", "--path", str(tmp_path), "--n", "4K", "--tile", "48K",
                            "--reps", "1000000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        manifest = tmp_path / "zoe-bench-nvme.zoe-swap.json"
        deadline = time.monotonic() + 60
        while not manifest.exists() and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.01)
        assert manifest.exists(), "the benchmark did not create its store"
        live = json.loads(zoe("probe", str(tmp_path), "--bytes", "1M", "--json").stdout)
        assert [s["state"] for s in live["swap_stores"]] == ["in_use"]
        assert f"pid {run.pid}" in live["swap_stores"][0]["who"]
        assert "remove_command" not in live["swap_stores"][0]
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    r = zoe("probe", str(tmp_path), "--bytes", "1M")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"left by pid {run.pid}" in r.stdout and "which is not running" in r.stdout
    assert "usable with a warning: 1 swap store(s) of runs that are not running" in r.stdout
    line = json.loads(zoe("probe", str(tmp_path), "--bytes", "1M", "--json").stdout)
    (store,) = line["swap_stores"]
    assert store["state"] == "abandoned" and store["bytes"] > 2 * 12 * 4096
    assert subprocess.run(store["remove_command"], shell=True).returncode == 0
    assert os.listdir(tmp_path) == []
    assert zoe("probe", str(tmp_path), "--bytes", "1M", "--json").stdout.count('"swap_stores": []') == 1


@pytest.mark.parametrize("args, message", [
    (["--offload-param", "gpu"], "'gpu' is unknown"),
    (["--offload-param", "nvme"], "needs --path"),
    (["--offload-param", "cpu", "--layers", "1"], "--layers 1"),
    (["--offload-param", "cpu", "--prefetch", ""], "--prefetch is empty"),
    (["--offload-param", "cpu", "--compute-ratio", "0"], "--compute-ratio 0"),
    (["--offload-param", "cpu", "--device", "tpu"], "--device tpu is not host, cpu or cuda"),
])
def test_bench_step_offload_param_refuses_bad_input(args, message):
    r = zoe("bench", "step", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_bench_step_offload_param_reports_each_prefetch_depth(home, tmp_path):
    if home == "nvme" and not has_aio():
        pytest.skip("zoe was built without the libaio NVMe tier")
    extra = ["--path", str(tmp_path)] if home == "nvme" else []
    r = zoe("bench", "step", "--offload-param", home, *extra, "--layers", "4", "--layer-bytes", "256K",
            "--prefetch", "0,2", "--iters", "1", "--host-waits", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    runs = [x for x in lines if x["bench"] == "param_offload"]
    assert [x["prefetch"] for x in runs] == [0, 2]
    for x in runs:
        assert 0 <= x["device_idle_fraction"] <= 1
        assert x["pool_peak_bytes"] <= x["budget_bytes"]
        assert x["compute_ms"] > 0 and x["iteration_ms"] > 0
    fetch = [x for x in lines if x["bench"] == "param_fetch"]
    assert len(fetch) == 1 and fetch[0]["device"] == "host" and fetch[0]["home"] == home
    assert fetch[0]["fetch_gbps"] > 0 and fetch[0]["copy_ceiling_gbps"] > 0
    if home == "nvme":
        assert fetch[0]["raw_read_gbps"] > 0 and fetch[0]["fetch_ratio"] > 0
        assert list(tmp_path.iterdir()) == []  # the scratch parameter file is removed
