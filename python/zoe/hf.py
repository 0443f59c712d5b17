"""zoe's optimizer state in Hugging Face checkpoints. transformers' Trainer and Accelerate's save_state write
the optimizer's state_dict() from rank 0 only; a partitioned zoe optimizer holds a different partition on each
rank. These hooks make every rank save its own file into the checkpoint folder (``zoe/rank<r>-of-<W>.zoe``,
atomic and checksummed), and the state_dict the trainer writes then names that folder; on resume each rank
loads its own file.

    trainer = Trainer(..., optimizers=(opt, scheduler), callbacks=[zoe.hf.ZoeCheckpointCallback(opt)])
    trainer.train(resume_from_checkpoint=True)

    zoe.hf.register_accelerator_hooks(accelerator, opt)   # before accelerator.save_state / load_state
"""
from __future__ import annotations

import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR


class ZoeCheckpointCallback(TrainerCallback):
    """Saves each rank's zoe state into the checkpoint folder the Trainer is about to write."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def _save_if_due(self, args, state, control):
        if control.should_save:
            # The folder transformers' _save_checkpoint writes next (run_dir/checkpoint-<global step>).
            self.optimizer.save_to(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))
        return control

    def on_step_end(self, args, state, control, **kwargs):
        return self._save_if_due(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self._save_if_due(args, state, control)


def register_accelerator_hooks(accelerator, optimizer) -> None:
    """Every rank's zoe state saved into ``accelerator.save_state(dir)``'s folder and read back by
    ``load_state(dir)``."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: optimizer.save_to(output_dir))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: optimizer.load_from(input_dir))
