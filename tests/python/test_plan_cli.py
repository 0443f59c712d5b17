"""zoe plan as users run it (build/zoe, or the binary $ZOE_CLI names): the ZeRO paper's 7.5B example at each
stage, the trillion-parameter NVMe plan, a machine without a GPU, a model config, and bad input refused in one
line. The arithmetic itself is tests/plan/test_plan.cpp; --adam-rate keeps these runs free of measurement."""
import json
import os
import pathlib
import subprocess

import pytest

ZOE = pathlib.Path(os.environ.get("ZOE_CLI") or pathlib.Path(__file__).resolve().parents[2] / "build" / "zoe")
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


DGX2 = ("--params", "1T", "--gpus", "16", "--gpu-mem", "32G", "--host-ram", "1.5T")


def test_a_trillion_parameters_on_the_zero_infinity_papers_node(tmp_path):
    # The paper's DGX-2: 16 GPUs of 32 GB, 1.5 TB of RAM, NVMe. Optimizer state and weights on NVMe.
    nvme = ("--nvme", str(tmp_path), "--nvme-capacity", "30T", "--stage", "3", "--offload-optimizer", "nvme",
            "--offload-param", "nvme")
    p = plan_json(*DGX2, *nvme)
    host, disk, gpu = p["per_host_bytes"], p["per_nvme_bytes"], p["per_gpu_bytes"]
    # zoe's host RAM holds buffers, not a copy of the gradients or weights: the step streams through windows.
    assert host["grads16"] == 0 and host["staging"] == 0 and host["weights16"] == 0
    assert host["total"] == host["buffers"] < p["usable_host_bytes"] / 10
    assert host["step_windows"] > 0 and host["swap_buffers"] > 0 and host["param_bounces"] > 0
    # On disk, each byte twice: the swap store's two slots of 12 bytes per parameter, the tier's of 2.
    assert disk["swap_store"] >= 2 * 12e12 and disk["param_tier"] >= 2 * 2e12
    assert disk["total"] < 30 * 2**40
    # What does not fit is FSDP2's 16-bit gradient shards, kept until the step: 2 bytes per parameter / 16
    # on each GPU (116.4 GiB), or 1.82 TiB of host RAM with CPUOffloadPolicy. The report names it.
    assert gpu["grads16"] == 2 * 10**12 // 16
    assert not p["fits"] and "trainer's grads16 116.4 GiB" in p["why_not"]
    assert p["zoe_runs_it"] and p["zoe_gap"] == ""
    assert any("FSDP2" in note for note in p["config_notes"])
    assert p["config"]["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)
    policy = plan_json(*DGX2, *nvme, "--grads-on-host")
    assert policy["per_gpu_bytes"]["grads16"] == 0 and policy["per_host_bytes"]["grads16"] == 2 * 10**12
    assert not policy["fits"] and "host: needs" in policy["why_not"] and "1.82 TiB" in policy["why_not"]
    # Two such nodes, the gradient shards in host RAM: fits, and the step estimate counts every NVMe byte.
    two = plan_json(*DGX2, *nvme, "--grads-on-host", "--nodes", "2")
    assert two["fits"], two["why_not"]
    step = two["step"]
    assert step["param_read_bytes_per_node"] == 2 * step["param_write_bytes_per_node"] > 0
    assert step["nvme_read_bytes_per_node"] == step["swap_read_bytes_per_node"] + step["param_read_bytes_per_node"]
    assert step["pcie_bytes_per_gpu"] == 0  # gradients already on the host, weights to the tier
    # Without room on the path (its real free space), the same plan says what is missing.
    small = plan_json(*DGX2, "--grads-on-host", "--nodes", "2", "--nvme", str(tmp_path),
                      "--nvme-capacity", "1T")
    assert not small["fits"] and small["cheapest"] is None
    assert "NVMe: " + str(tmp_path) + " needs" in small["why_not"]


LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22, "intermediate_size": 5632,
            "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu",
            "tie_word_embeddings": False}


def test_a_machine_without_a_gpu(tmp_path):
    # Issue 51's machine: 24 GiB of RAM, ~66 GiB of disk, no GPU; FSDP2 world 1 on the CPU, weights and state
    # on NVMe, int8 moments. tests/plan/test_plan.cpp derives each figure.
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_1B))
    args = ("--model", str(config), "--gpus", "0", "--host-ram", "24G", "--nvme", str(tmp_path), "--nvme-capacity",
            "66G", "--state-dtype", "int8", "--stage", "3", "--offload-optimizer", "nvme", "--offload-param", "nvme",
            "--nvme-gbps", "2")
    p = plan_json(*args)
    assert p["cpu_device"] and p["params"] == 1_100_048_384
    assert p["fits"] and p["per_gpu_bytes"]["total"] == 0 and p["usable_gpu_bytes"] == 0
    host = p["per_host_bytes"]
    assert host["grads16"] == 2 * 1_100_048_384  # FSDP2's bf16 gradients, in host RAM
    assert host["total"] == 4_588_819_056
    assert p["per_nvme_bytes"]["total"] == 17_620_910_080
    assert p["step"]["pcie_s"] == 0 and p["step"]["pcie_bytes_per_gpu"] == 0
    assert p["step_s_estimate"] == pytest.approx(p["step"]["nvme_s"])
    text = plan(*args, "--adam-rate", "1B")
    assert text.returncode == 0, text.stderr
    assert "no GPU, the CPU as the device" in text.stdout and "per GPU" not in text.stdout
    assert "swap store (2 slots)" in text.stdout and "parameter tier (2 slots)" in text.stdout
    assert "no PCIe" in text.stdout
    assert "--gpus 0" in plan("--help").stdout
    refused = plan("--params", "1B", "--gpus", "0", "--gpu-mem", "80G")
    assert refused.returncode == 2 and "there is no GPU" in refused.stderr


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
    (["--params", "7B", "--gpus", "1025"], "--gpus 1025 is out of range: give 0 to 1024"),
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
