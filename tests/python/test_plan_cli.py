"""zoe plan as users run it (build/zoe): the ZeRO paper's 7.5B example at each stage, the trillion-parameter
NVMe plan, a model config, and bad input refused in one line. The arithmetic itself is tests/plan/test_plan.cpp;
--adam-rate keeps these runs free of measurement."""
import json
import pathlib
import subprocess

import pytest

ZOE = pathlib.Path(__file__).resolve().parents[2] / "build" / "zoe"
pytestmark = pytest.mark.skipif(not ZOE.exists(), reason=f"{ZOE} is not built (run scripts/build)")


def plan(*args):
    r = subprocess.run([str(ZOE), "plan", *args], capture_output=True, text=True, timeout=120)
    return r


def plan_json(*args):
    r = plan(*args, "--json", "--adam-rate", "1B")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints one object, nothing else"
    return json.loads(lines[0])


@pytest.mark.parametrize("stage, gb", [(1, 31.4), (2, 16.6), (3, 1.9)])
def test_the_zero_papers_7_5b_on_64_gpus(stage, gb):
    # Rajbhandari et al., Figure 1: 7.5B parameters, N_d = 64, 16-bit weights and gradients, fp32 Adam state.
    p = plan_json("--params", "7.5B", "--gpus", "8", "--nodes", "8", "--gpu-mem", "80G", "--host-ram", "1T",
                  "--stage", str(stage))
    model_states = p["per_gpu_bytes"]["total"] - p["per_gpu_bytes"]["buffers"]
    assert round(model_states / 1e9, 1) == gb
    assert p["fits"] and p["requested"]


def test_a_trillion_parameters_fit_on_one_node_with_nvme(tmp_path):
    p = plan_json("--params", "1T", "--gpus", "16", "--gpu-mem", "32G", "--host-ram", "2.5T", "--nvme", str(tmp_path),
                  "--nvme-capacity", "30T")
    assert p["fits"]
    assert (p["stage"], p["offload_optimizer"], p["offload_param"]) == (3, "nvme", "nvme")
    nvme, host = p["per_nvme_bytes"], p["per_host_bytes"]
    # 14 bytes per parameter on the one path: 16-bit weights, fp32 master, two fp32 moments; the 16-bit
    # gradient shards are in host RAM, where FSDP2 (CPUOffloadPolicy) puts them.
    assert (nvme["weights16"], nvme["grads16"], nvme["master32"], nvme["moments"]) == (2e12, 0, 4e12, 8e12)
    assert host["grads16"] == 2e12
    assert p["step_s_estimate"] > 0
    # Stage 3 with parameters on NVMe is FSDP2's partitioning with zoe's tiers: zoe runs it.
    assert p["zoe_runs_it"] and p["zoe_gap"] == ""
    assert any("FSDP2" in note for note in p["config_notes"])
    assert p["config"]["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)
    # With 1.5 TB of host RAM the gradient shards do not fit.
    tight = plan_json("--params", "1T", "--gpus", "16", "--gpu-mem", "32G", "--host-ram", "1.5T", "--nvme",
                      str(tmp_path), "--nvme-capacity", "30T")
    assert not tight["fits"] and "host" in tight["why_not"].lower()
    # Without room on the path (its real free space), the same plan says what is missing.
    small = plan_json("--params", "1T", "--gpus", "16", "--gpu-mem", "32G", "--host-ram", "2.5T", "--nvme",
                      str(tmp_path), "--nvme-capacity", "1T")
    assert not small["fits"] and small["cheapest"] is None
    assert "NVMe: " + str(tmp_path) + " needs" in small["why_not"]


def test_a_model_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                                  "intermediate_size": 11008, "num_attention_heads": 32, "vocab_size": 32000,
                                  "hidden_act": "silu", "tie_word_embeddings": False}))
    p = plan_json("--model", str(config), "--gpus", "1", "--gpu-mem", "40G", "--host-ram", "256G",
                  "--micro-batch", "1", "--seq-len", "2048", "--activation-checkpointing")
    assert p["params"] == 6_738_415_616
    assert "32 layers" in p["model"] and not p["shape_assumed"]
    assert p["per_gpu_bytes"]["activations"] > 0
    # The cheapest fit keeps the 16-bit model (4Ψ = 25.1 GiB) and the activations on the 40 GiB GPU and the
    # state in host RAM: what zoe runs.
    assert (p["offload_optimizer"], p["offload_param"]) == ("cpu", "none")
    assert p["zoe_runs_it"] and p["config_notes"] == []
    text = plan("--model", str(config), "--gpus", "1", "--gpu-mem", "40G", "--host-ram", "256G", "--adam-rate", "1B")
    assert text.returncode == 0, text.stderr
    assert "weights16" in text.stdout and "zoe's config reader: loads it without notes" in text.stdout


@pytest.mark.parametrize("args, message", [
    (["--params", "7Q"], "--params: unknown suffix 'Q' in '7Q'"),
    (["--params", "7B", "--gpus", "0"], "--gpus 0 is out of range: give 1 to 1024"),
    (["--params", "7B", "--gpu-mem", "80X"], "--gpu-mem: unknown suffix 'X'"),
    (["--params", "7B", "--stage", "4"], "--stage: '4' is not 1, 2 or 3"),
    (["--params", "7B", "--offload-param", "cpu", "--stage", "2"], "needs --stage 3"),
    (["--params", "7B", "--state-dtype", "fp8"], "--state-dtype: 'fp8'"),
    (["--params", "7B", "--nvme", "/nonexistent/zoe-plan"], "/nonexistent/zoe-plan does not exist"),
    ([], "give the model as --params N"),
])
def test_bad_input_is_one_clear_line(args, message):
    r = plan(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_model_config_missing_fields(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64}))
    r = plan("--model", str(config))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"zoe plan: {config}: missing num_hidden_layers (or n_layer), vocab_size, "
                                "num_attention_heads (or n_head)")
