"""Nothing lost under shared paths, kills and damage: a swap folder serves one live optimizer (a second one,
in this process or another, is refused naming the holder; a dead holder's store is taken over), a killed
save leaves nothing the next start does not remove, and a swap store that fails its checksums is replaced in
place by loading a good checkpoint."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zoe
from zoe import _scratch
from zoe.torch import OffloadOptimizer

ZOE_CLI = os.path.join(os.path.dirname(__file__), "..", "..", "build", "zoe")


def _params(n=300_000, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(77, dtype=torch.bfloat16))]


def _nvme(folder, **kw):
    return dict(tier="nvme", nvme_path=str(folder), buffer_count=2, tile=1 << 14, keep_resident=False, **kw)


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)


def _holder(folder):
    """A child process holding an optimizer on `folder`; returns it once the store is made."""
    code = textwrap.dedent(f"""
        import sys, torch
        from zoe.torch import OffloadOptimizer
        p = [torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))]
        opt = OffloadOptimizer(p, tier="nvme", nvme_path={str(folder)!r})
        print("ready", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_second_optimizer_on_a_live_swap_folder_is_refused_and_the_first_goes_on(tmp_path):
    params = _params()
    first = OffloadOptimizer(params, lr=1e-2, **_nvme(tmp_path))
    _grads(params, 1)
    first.step()
    with pytest.raises(zoe.ZoeError) as e:
        OffloadOptimizer(_params(seed=1), lr=1e-2, **_nvme(tmp_path))
    for part in (str(tmp_path), f"pid {os.getpid()}", "this process", "nvme_path"):
        assert part in str(e.value)
    # The first store is untouched: it steps on, to the state an undisturbed run reaches.
    first.step()
    ref_params = _params()
    ref = OffloadOptimizer(ref_params, lr=1e-2, **_nvme(tmp_path / "ref"))
    _grads(ref_params, 1)
    ref.step()
    ref.step()
    for p, q in zip(params, ref_params):
        assert torch.equal(first.read_state(p)["master"], ref.read_state(q)["master"])
    del first
    import gc
    gc.collect()
    OffloadOptimizer(_params(seed=2), lr=1e-2, **_nvme(tmp_path))  # let go: the folder is free again


def test_a_swap_folder_held_by_another_process_is_refused_then_taken_over_once_it_is_killed(tmp_path):
    child = _holder(tmp_path)
    try:
        with pytest.raises(zoe.ZoeError) as e:
            OffloadOptimizer(_params(), **_nvme(tmp_path))
        assert f"pid {child.pid}" in str(e.value) and str(tmp_path) in str(e.value)
        assert "this process" not in str(e.value)
        # zoe probe calls it in use, by that pid, and offers no command to remove it.
        probe = subprocess.run([ZOE_CLI, "probe", str(tmp_path), "--json", "--bytes", "1M"], capture_output=True,
                               text=True)
        text = probe.stdout
        json.loads(text.splitlines()[0])
        assert f"pid {child.pid}" in text and '"in_use"' in text, text
        assert "remove_command" not in text and "rm " not in text, text
    finally:
        child.kill()
        child.wait()
    # The holder died without a word (kill -9): its store is taken over.
    params = _params()
    opt = OffloadOptimizer(params, **_nvme(tmp_path))
    _grads(params, 1)
    opt.step()
    assert opt.step_count == 1


def test_nvme_path_that_is_a_file_is_refused_naming_it(tmp_path):
    f = tmp_path / "not-a-folder"
    f.write_text("")
    with pytest.raises(zoe.InvalidArgumentError, match="not-a-folder.*is not a folder"):
        OffloadOptimizer(_params(), **_nvme(f))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder: the permission cannot be tested")
def test_a_read_only_swap_folder_is_named_as_such(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(zoe.ZoeError, match="not writable"):
            OffloadOptimizer(_params(), **_nvme(tmp_path))
    finally:
        tmp_path.chmod(0o755)


def test_a_killed_save_leaves_nothing_that_the_next_start_does_not_remove(tmp_path):
    """kill -9 during state_dict(), at several moments: whatever the kill left in zoe's scratch folder, the
    next optimizer's start removes all of it (and nothing of a live process)."""
    code = textwrap.dedent("""
        import torch
        from zoe.torch import OffloadOptimizer
        p = [torch.nn.Parameter(torch.zeros(20_000_000))]
        opt = OffloadOptimizer(p)
        print("ready", flush=True)
        while True:
            opt.state_dict()
    """)
    base = _scratch._base()
    pids = []
    for delay in (0.05, 0.2, 0.4):
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        pids.append(child.pid)

    def theirs():
        return [n for n in (os.listdir(base) if os.path.isdir(base) else []) if any(f".{pid}." in n for pid in pids)]

    with _scratch.scratch_file() as mine:  # a live writer's folder is never taken
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(8))])
        assert theirs() == []
        assert os.path.isdir(os.path.dirname(mine))


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_a_swap_store_that_fails_its_checksums_is_replaced_in_place_by_a_good_checkpoint(tmp_path, state_dtype):
    params = _params()
    opt = OffloadOptimizer(params, lr=1e-2, state_dtype=state_dtype, **_nvme(tmp_path / "swap"))
    _grads(params, 1)
    opt.step()
    good = opt.state_dict()
    opt.save_to(tmp_path / "ckpt")
    by_file = opt.state_dict()  # after save_to: refers to the file written (zoe.hf's checkpoints)
    swap = tmp_path / "swap" / "zoe-optimizer.zoe-swap"
    # The same optimizer takes the checkpoint (inline, or by its file), and goes on exactly as a new one
    # loaded from it does.
    for sd in (good, by_file):
        data = bytearray(swap.read_bytes())
        for i in range(0, len(data), 4096):
            data[i] ^= 0xFF
        swap.write_bytes(data)
        _grads(params, 2)
        with pytest.raises(zoe.CorruptError, match="fails its checksum"):
            opt.step()
        opt.load_from(tmp_path / "ckpt")
        opt.load_state_dict(sd)
        opt.step()
        ref_params = _params(seed=5)
        ref = OffloadOptimizer(ref_params, lr=1e-2, state_dtype=state_dtype, **_nvme(tmp_path / "ref"))
        ref.load_state_dict(good)
        _grads(ref_params, 2)
        ref.step()
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q)
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.read_state(p)[key], ref.read_state(q)[key]), key
        del ref
        import gc
        gc.collect()
