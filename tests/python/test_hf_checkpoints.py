"""A Hugging Face Trainer run on 2 gloo ranks (DistributedDataParallel, zoe partitioned across the ranks) saved
at step 4 and resumed equals the uninterrupted run at step 8 — with torch.optim.AdamW as the control in the
same test. Without zoe.hf.ZoeCheckpointCallback the run is refused on every rank at its first step, naming
the fix, instead of writing checkpoints that lack rank 1's partition. Accelerate's prepare() round trip carries no state."""
import gc
import os
import socket
import sys
import weakref

import pytest
import torch
import torch.multiprocessing as mp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
from test_hf import LR, Tokens, flat, tiny_llama  # noqa: E402

import transformers  # noqa: E402

# transformers before 5.18 resumes a CPU rank of a distributed run with torch.load(optimizer.pt,
# map_location="cpu:0"), which torch cannot restore; its own AdamW control fails the same way. Seen with
# 5.16 and 5.17 (on the GPU machine and here); 5.18 loads with map_location="cpu".
_INDEXED_CPU_RESUME_BUG = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 18)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, out_dir, job):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from transformers import Trainer, TrainingArguments

    from zoe.hf import ZoeCheckpointCallback
    from zoe.torch import OffloadOptimizer

    args = TrainingArguments(output_dir=os.path.join(out_dir, "run"), max_steps=8, per_device_train_batch_size=4,
                             learning_rate=LR, use_cpu=True, ddp_backend="gloo", save_strategy="steps", save_steps=4,
                             report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0, logging_steps=1)
    assert args.world_size == world  # the process group exists: zoe's optimizer partitions across it
    model = tiny_llama()
    if job["zoe"]:
        tier = {}
        if job.get("nvme"):  # the NVMe tier keeps 16-bit weights on the device
            model = model.to(torch.bfloat16)
            tier = dict(tier="nvme", nvme_path=os.path.join(out_dir, "swap"))
        opt = OffloadOptimizer(model.parameters(), lr=LR, reduce_grads=False, **tier)  # DDP averages the gradients
        callbacks = [ZoeCheckpointCallback(opt)] if job["callback"] else []
    else:
        opt, callbacks = torch.optim.AdamW(model.parameters(), lr=LR), []  # AdamW's default weight_decay, as zoe's
    calls = [0]  # the steps this process runs: a resumed run must run only the rest

    def counted(*a, _step=opt.step, **k):
        calls[0] += 1
        return _step(*a, **k)

    opt.step = counted
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None), callbacks=callbacks)
    result = {"error": None}
    try:
        trainer.train(resume_from_checkpoint=job["resume"])
    except RuntimeError as e:
        result["error"] = str(e)
    result["weights"] = flat(model)
    result["step"] = trainer.state.global_step
    result["steps_run"] = calls[0]
    # zoe's engine shuts down here, while everything else is alive: not at interpreter exit.
    gone = weakref.ref(opt)
    del trainer, opt, counted, callbacks
    gc.collect()
    result["optimizer_freed"] = gone() is None
    torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    open(os.path.join(out_dir, f"clean{rank}"), "w").close()


def _run(out, **job):
    out.mkdir(exist_ok=True)
    for attempt in range(3):
        try:
            mp.spawn(_rank_main, args=(2, _free_port(), str(out), job), nprocs=2, join=True)
            break
        except mp.ProcessRaisedException as e:
            # The free port may be taken by another process between our probe and rank 0's bind.
            if "address already in use" not in str(e).lower() or attempt == 2:
                raise
        except mp.ProcessExitedException as e:
            # After a rank shut zoe down, saved its result and destroyed its process group, the interpreter's
            # exit can still abort in torch's gloo teardown ("terminate called without an active exception";
            # seen with torch.optim.AdamW alone too). Anything earlier is a failure.
            if not all((out / f"clean{r}").exists() for r in range(2)):
                raise
            print(f"note: {e} after both ranks had finished cleanly")
            break
    results = [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(2)]
    assert all(r["optimizer_freed"] for r in results), "an optimizer outlived its trainer"
    return results


@pytest.mark.xfail(_INDEXED_CPU_RESUME_BUG, strict=True,
                   reason=f"transformers {transformers.__version__} cannot resume a CPU rank (map_location 'cpu:0')")
@pytest.mark.parametrize("optimizer", ["torch", "zoe", "zoe-nvme"])
def test_hf_trainer_two_ranks_resume_equals_the_uninterrupted_run(optimizer, tmp_path):
    zoe, nvme = optimizer.startswith("zoe"), optimizer == "zoe-nvme"
    whole = _run(tmp_path, zoe=zoe, callback=True, resume=None, nvme=nvme)  # saves checkpoint-4 and checkpoint-8
    checkpoint = tmp_path / "run" / "checkpoint-4"
    if zoe:
        assert sorted(os.listdir(checkpoint / "zoe")) == ["rank0-of-2.zoe", "rank1-of-2.zoe"]
        sd = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        carried = sum(t.numel() * t.element_size() for t in sd["zoe"].values() if isinstance(t, torch.Tensor))
        assert carried == 0, "optimizer.pt names the rank files, it does not carry the state"
    resumed = _run(tmp_path / "resumed", zoe=zoe, callback=True, resume=str(checkpoint), nvme=nvme)
    for w, r in zip(whole, resumed):
        assert w["error"] is None and r["error"] is None, (w["error"], r["error"])
        assert w["step"] == r["step"] == 8
        assert (w["steps_run"], r["steps_run"]) == (8, 4)
        diff = (w["weights"] - r["weights"]).abs().max().item()
        print(f"HF Trainer, 2 ranks, {optimizer}: resumed at step 4 against uninterrupted, step 8: max weight "
              f"difference {diff:.2e}")
        assert torch.equal(w["weights"], r["weights"])


def test_hf_trainer_without_the_callback_fails_on_every_rank_at_the_first_step(tmp_path):
    # Refused where every rank can stop together: at the first save only rank 0 would (and rank 1, left in
    # DDP's all-reduce with a dead peer, may then abort in gloo, as it does with torch.optim.AdamW too).
    ranks = _run(tmp_path, zoe=True, callback=False, resume=None)
    for r in ranks:
        assert "ZoeCheckpointCallback" in r["error"]
        assert r["steps_run"] == 1 and r["step"] == 0, "refused before the first step changed anything"
    assert not (tmp_path / "run" / "checkpoint-4").exists()


def test_accelerate_prepare_carries_no_state(tmp_path):
    from accelerate import Accelerator

    from zoe.torch import OffloadOptimizer

    model = tiny_llama()
    opt = OffloadOptimizer(model.parameters(), lr=LR)
    seen = []
    original = type(opt).load_state_dict

    def spy(self, sd):
        seen.append(sum(t.numel() * t.element_size() for t in sd["zoe"].values() if isinstance(t, torch.Tensor)))
        return original(self, sd)

    type(opt).load_state_dict = spy
    try:
        accelerator = Accelerator(cpu=True)
        model, prepared = accelerator.prepare(model, opt)
    finally:
        type(opt).load_state_dict = original
    params = sum(p.numel() for p in model.parameters())
    print(f"Accelerate prepare(): the state_dict round trip carried {seen} bytes of tensors for {params} parameters")
    assert seen and max(seen) < params  # less than one byte per parameter (none)


def _accelerate_steps(accelerator, model, opt, batches):
    for batch in batches:
        loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()


def test_accelerate_save_state_load_state_resume_exactly(tmp_path):
    from accelerate import Accelerator

    from zoe.hf import register_accelerator_hooks
    from zoe.torch import OffloadOptimizer

    data = Tokens()
    batches = [{k: v.unsqueeze(0) for k, v in data[i].items()} for i in range(6)]

    def setup():
        accelerator = Accelerator(cpu=True)
        model = tiny_llama()
        opt = OffloadOptimizer(model.parameters(), lr=LR)
        register_accelerator_hooks(accelerator, opt)
        model, prepared = accelerator.prepare(model, opt)
        return accelerator, model, prepared, opt

    accelerator, model, prepared, opt = setup()
    _accelerate_steps(accelerator, model, prepared, batches[:3])
    accelerator.save_state(str(tmp_path / "state"))  # Accelerate's default: the model as safetensors
    assert os.path.isfile(tmp_path / "state" / "zoe" / "rank0-of-1.zoe")
    _accelerate_steps(accelerator, model, prepared, batches[3:])
    whole = flat(model)

    accelerator, model, prepared, opt = setup()
    _accelerate_steps(accelerator, model, prepared, batches[:1])  # state that the load must replace
    accelerator.load_state(str(tmp_path / "state"))
    assert opt.step_count == 3
    _accelerate_steps(accelerator, model, prepared, batches[3:])
    assert torch.equal(flat(model), whole)


def _one_process_trainer(out, schedule, tier, resume, callback):
    from transformers import Trainer, TrainingArguments

    from zoe.hf import ZoeCheckpointCallback
    from zoe.torch import OffloadOptimizer

    model = tiny_llama()
    extra = {}
    if tier == "nvme":
        model = model.to(torch.bfloat16)
        extra = dict(tier="nvme", nvme_path=str(out / "swap"))
    opt = OffloadOptimizer(model.parameters(), lr=LR, schedule=schedule, **extra)
    args = TrainingArguments(output_dir=str(out / "run"), max_steps=8, per_device_train_batch_size=4,
                             learning_rate=LR, use_cpu=True, save_strategy="steps", save_steps=4, report_to=[],
                             seed=0, disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None),
                      callbacks=[ZoeCheckpointCallback(opt)] if callback else [])
    trainer.train(resume_from_checkpoint=resume)
    return flat(model)


@pytest.mark.parametrize("tier", ["ram", "nvme"])
@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_hf_trainer_one_process_resume_every_schedule_and_tier(schedule, tier, tmp_path):
    # One rank: the Trainer's own optimizer.pt carries the state (no callback needed); with the callback, the
    # rank file beside it does. Both resume exactly.
    whole = _one_process_trainer(tmp_path, schedule, tier, None, callback=False)
    resumed = _one_process_trainer(tmp_path / "resumed", schedule, tier, str(tmp_path / "run" / "checkpoint-4"),
                                   callback=False)
    assert torch.equal(whole, resumed)
    with_files = _one_process_trainer(tmp_path / "files", schedule, tier, None, callback=True)
    resumed = _one_process_trainer(tmp_path / "files2", schedule, tier, str(tmp_path / "files" / "run" / "checkpoint-4"),
                                   callback=True)
    assert torch.equal(with_files, resumed) and torch.equal(with_files, whole)
