"""Fine-tuning as users run it, with the real libraries: PEFT LoRA under transformers' Trainer (a frozen base
whose parameters get no gradient, and the Trainer's clip_grad_norm_ over every parameter), and PyTorch
Lightning's BaseFinetuning, which unfreezes layers with add_param_group. Each beside torch.optim.AdamW in the
same loop; tiny models from configs, on the CPU, nothing downloaded."""
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from zoe.torch import OffloadOptimizer  # noqa: E402

from conftest import make_mlp  # noqa: E402
# test_hf.py's tiny Llama config, token data and bound (measured there at 1.2e-7 after 12 steps: the order of
# float operations in each element's update, and zoe's norm summed in double where torch's is fp32).
from test_hf import CONFIG, LR, TORCH_TOL, Tokens  # noqa: E402


def lora_llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    # init_lora_weights=False: B starts random too, so that every adapter has a gradient from step 1.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                        init_lora_weights=False)
    return get_peft_model(model, config)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def lora_under_trainer(make_opt, accumulation, max_grad_norm, tmp_path):
    model = lora_llama()
    opt = make_opt(trainable(model))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accumulation, max_grad_norm=max_grad_norm, learning_rate=LR,
                             use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    told = [str(w.message) for w in seen if "zoe" in str(w.message)]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return model, opt, told, norms


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.02])  # the Trainer's default; one that clips every step
def test_peft_lora_under_the_trainer(schedule, accumulation, max_grad_norm, tmp_path):
    """The frozen base's parameters get no gradient and the Trainer clips over all of them: zoe answers the
    clipping, the adapters' steps are AdamW's, nothing is taken again (the overlap stays), and with declared
    micro-batches zoe's fp32 sum is what is stepped (no warning that it was dropped)."""
    ref, _, _, ref_norms = lora_under_trainer(lambda ps: torch.optim.AdamW(ps, lr=LR), accumulation, max_grad_norm,
                                              tmp_path / "torch")
    declared = accumulation if accumulation > 1 else None
    mine, opt, told, norms = lora_under_trainer(
        lambda ps: OffloadOptimizer(ps, lr=LR, schedule=schedule, gradient_accumulation_steps=declared),
        accumulation, max_grad_norm, tmp_path / schedule)
    diff = max((a - b).abs().max().item() for a, b in zip(trainable(ref), trainable(mine)))
    clipped = sum(n > max_grad_norm for n in ref_norms)
    print(f"PEFT LoRA under the Trainer, {schedule}, gradient_accumulation_steps={accumulation}, max_grad_norm="
          f"{max_grad_norm}: max adapter "
          f"difference to torch AdamW {diff:.2e}; steps clipped {clipped}; redone {opt.stats()['redone']}; "
          f"zoe warnings {told}")
    assert not told
    assert diff < TORCH_TOL
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    # A step is taken again only when the clip changed its gradients (the overlap assumed it would not).
    assert opt.stats()["redone"] <= (clipped if schedule == "overlap" else 0)
    base = [p for p in mine.parameters() if not p.requires_grad]
    ref_base = [p for p in ref.parameters() if not p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(base, ref_base))  # the frozen base did not move


# ---- Lightning's BaseFinetuning -----------------------------------------------------------------------------

def lightning_unfreeze(make_opt, tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BaseFinetuning

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            mlp = make_mlp()
            layers = list(mlp.children())
            self.body, self.head = torch.nn.Sequential(*layers[:-1]), layers[-1]

        def forward(self, x):
            return self.head(self.body(x))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return make_opt(trainable(self))

    class UnfreezeAtEpoch1(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.body)

        def finetune_function(self, pl_module, current_epoch, optimizer):
            if current_epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.body, optimizer, lr=LR / 10, initial_denom_lr=1.0)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g))
    module = Module()
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[UnfreezeAtEpoch1()],
                         default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    return module, trainer.optimizers[0]


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_lightning_base_finetuning_unfreezes_with_add_param_group(schedule, tmp_path):
    ref, ref_opt = lightning_unfreeze(lambda ps: torch.optim.AdamW(ps, lr=LR), tmp_path / "torch")
    mine, opt = lightning_unfreeze(lambda ps: OffloadOptimizer(ps, lr=LR, schedule=schedule), tmp_path / schedule)
    assert len(opt.param_groups) == len(ref_opt.param_groups) == 2
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), mine.parameters()))
    print(f"Lightning BaseFinetuning, {schedule}: max weight difference to torch AdamW {diff:.2e}")
    assert diff < TORCH_TOL
    # The body was stepped after its unfreezing only: 2 epochs of 4 batches; the head all 12.
    steps = sorted(int(s["step"]) for s in opt.torch_state_dict()["state"].values())
    assert steps == sorted(int(s["step"]) for s in ref_opt.state_dict()["state"].values())
