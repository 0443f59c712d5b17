"""The model a zoe OffloadOptimizer steps, saved and loaded by the ecosystem's formats with their defaults:
safetensors' save_model/load_model, Accelerate's save_state/load_state (safe_serialization=True),
transformers' save_pretrained/from_pretrained, torch.save of one parameter. Each parameter keeps a storage of
its own (tied weights stay one tensor, as the model ties them), so none of them sees shared tensors and drops
one. A tiny Llama from a local config, on the CPU; nothing is downloaded."""
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import safetensors.torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from zoe.torch import OffloadOptimizer  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=64)


def tiny_llama(tied=False, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tied, **CONFIG))


def tokens(step):
    return torch.randint(0, CONFIG["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(step))


def train(model, opt, steps, first=0):
    for i in range(first, first + steps):
        x = tokens(i)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def storages(model):
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("schedule", ["sync", "overlap", "delayed"])
def test_every_parameter_keeps_a_storage_of_its_own(tied, schedule):
    model = tiny_llama(tied)
    params = list(model.parameters())
    ptrs = [p.data_ptr() for p in params]
    opt = OffloadOptimizer(model.parameters(), lr=1e-2, schedule=schedule, delayed_warmup_steps=1)
    train(model, opt, 3)
    assert len(storages(model)) == len(params)  # one storage per parameter, as the model made them
    assert [p.data_ptr() for p in params] == ptrs  # stepped in place, where the model had them
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("tied", [False, True])
def test_safetensors_save_model_and_load_model(tied, tmp_path):
    model = tiny_llama(tied)
    opt = OffloadOptimizer(model.parameters(), lr=1e-2, schedule="overlap")
    train(model, opt, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Removed shared tensor" would be a warning
        safetensors.torch.save_model(model, str(tmp_path / "model.safetensors"))
    fresh = tiny_llama(tied, seed=1)
    missing, unexpected = safetensors.torch.load_model(fresh, str(tmp_path / "model.safetensors"))
    assert not missing and not unexpected
    assert_same_weights(model, fresh)


def test_torch_save_of_one_parameter_holds_that_parameter_only(tmp_path):
    model = tiny_llama()
    opt = OffloadOptimizer(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    p = model.model.norm.weight
    torch.save(p, tmp_path / "p.pt")
    back = torch.load(tmp_path / "p.pt")
    assert torch.equal(back, p)
    assert back.untyped_storage().nbytes() == p.numel() * p.element_size()


def test_save_pretrained_and_from_pretrained(tmp_path):
    model = tiny_llama(tied=True)
    opt = OffloadOptimizer(model.parameters(), lr=1e-2, schedule="overlap")
    train(model, opt, 2)
    model.save_pretrained(tmp_path)  # safe_serialization=True: model.safetensors
    back = LlamaForCausalLM.from_pretrained(tmp_path)
    assert_same_weights(model, back)


@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_accelerate_save_state_and_load_state_with_its_defaults(schedule, tmp_path):
    """save_state at step 2, two more steps; a new model and optimizer load_state and take the same two
    steps: bit for bit the same weights and optimizer state."""
    def run(load_from=None):
        acc = Accelerator(cpu=True)
        model = tiny_llama(seed=0 if load_from is None else 5)
        opt = OffloadOptimizer(model.parameters(), lr=1e-2, schedule=schedule)
        model, opt = acc.prepare(model, opt)
        if load_from is None:
            train(model, opt, 2)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                acc.save_state(str(tmp_path / "ckpt"))  # safe_serialization=True, Accelerate's default
        else:
            acc.load_state(str(load_from))
        train(model, opt, 2, first=2)
        return model, opt.optimizer

    first, first_opt = run()
    second, second_opt = run(load_from=tmp_path / "ckpt")
    assert_same_weights(first, second)
    for p, q in zip(first.parameters(), second.parameters()):
        a, b = first_opt.read_state(p), second_opt.read_state(q)
        for k in a:
            assert torch.equal(a[k], b[k]), k
