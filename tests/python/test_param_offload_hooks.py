"""Parameter offload's module hooks (zoe/_param_offload.py) against FakeTier, a Python double of the
parameter tier with a small device pool: training, checkpointing, inference and tied weights reproduce the
plain model bit for bit, every fetch is released by the end of each iteration, and the pool never holds
more than its budget. A strict FakeTier evicts a block the moment it is released and poisons the memory,
so that anything still reading a released block turns the loss into NaN. Where the installed zoe has the
C++ tier (zoe._zoe.ParamTier), the training test runs against it too."""
import collections
import copy
import ctypes

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from zoe import _zoe
from zoe._param_offload import offload_parameters
from zoe.demo.data import ByteBatches
from zoe.demo.model import GPT, Block, GPTConfig

CONFIG = dict(vocab=256, seq=32, d_model=64, n_layer=12, n_head=4)
STEPS = 5
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


class FakeTier:
    """The interface of zoe._zoe.ParamTier in Python. The home is one uint8 tensor per block, the pool one
    uint8 tensor of budget bytes holding blocks first-fit, unused blocks evicted least recently used first.
    ``strict`` evicts a block as soon as its last use is released and fills the memory it held with 0xFF
    (NaN in every float dtype), and places blocks at the low and the high end of the free memory by turns,
    so that a block's address changes from one fetch to the next."""

    ALIGN = 64

    def __init__(self, entry_bytes, names, home, paths, budget, prefetch, strict=False):
        assert home in ("ram", "nvme") and len(names) == len(entry_bytes)
        self.names = list(names)
        self.offsets, self.sizes = [], []
        for entries in entry_bytes:
            offs, at = [], 0
            for n in entries:
                assert n > 0
                offs.append(at)
                at += -(-n // self.ALIGN) * self.ALIGN
            self.offsets.append(offs)
            self.sizes.append(at)
        self.entry_bytes = [list(e) for e in entry_bytes]
        self.home_tensors = [torch.zeros(n, dtype=torch.uint8) for n in self.sizes]
        self.budget = budget or sum(self.sizes)
        self.pool = torch.full((self.budget,), 0xFF, dtype=torch.uint8)
        self.prefetch_depth = prefetch
        self.strict = strict
        self.resident = collections.OrderedDict()  # block -> pool offset, least recently used first
        self.uses = [0] * len(self.sizes)
        self.order = None
        self.flip = False
        self.stale = set()
        self.closed = False
        self.counters = dict(fetches=0, hits=0, loads=0, evictions=0, loaded_bytes=0, read_bytes=0,
                             write_bytes=0, pool_peak_bytes=0)

    # -- the interface ---------------------------------------------------------------------------------

    def blocks(self):
        return len(self.sizes)

    def block_bytes(self, b):
        return self.sizes[b]

    def entry_offset(self, b, e):
        return self.offsets[b][e]

    def in_use(self, b):
        return self.uses[b]

    def set_order(self, order):
        assert self.order is None, "set_order is called once"
        assert sorted(order) == sorted(set(order)) and all(0 <= b < len(self.sizes) for b in order)
        self.order = list(order)

    def fetch(self, b, backward=False):
        self._check(b)
        self.counters["fetches"] += 1
        if b in self.resident:
            self.counters["hits"] += 1
            self.resident.move_to_end(b)
        else:
            self._load(b, protect={b})
        self.uses[b] += 1
        for nb in self._ahead(b, backward):
            self.prefetch(nb)
        return self.pool.data_ptr() + self.resident[b]

    def release(self, b):
        self._check(b)
        if self.uses[b] <= 0:
            raise RuntimeError(f"release of block {b} ({self.names[b]}), which is not in use")
        self.uses[b] -= 1
        if self.uses[b] == 0 and (self.strict or b in self.stale):
            self.stale.discard(b)
            self._evict(b)

    def prefetch(self, b):
        self._check(b)
        if b not in self.resident and not self.strict:
            try:
                self._load(b, protect={b})
            except MemoryError:
                pass  # no room: the fetch will load it

    def synchronize(self):
        pass

    def write(self, b, e, data, byte_offset=0):
        self._check(b)
        address, nbytes = data.data_ptr(), data.numel() * data.element_size()
        assert byte_offset + nbytes <= self.entry_bytes[b][e]
        at = self.home_tensors[b].data_ptr() + self.offsets[b][e] + byte_offset
        ctypes.memmove(at, address, nbytes)
        self.counters["write_bytes"] += nbytes
        if b in self.resident:  # the pool's copy is stale: dropped now, or at its last release if in use
            if self.uses[b]:
                self.stale.add(b)
            else:
                self._evict(b)

    def read(self, b, e, out, byte_offset=0):
        self._check(b)
        address, nbytes = out.data_ptr(), out.numel() * out.element_size()
        assert byte_offset + nbytes <= self.entry_bytes[b][e]
        ctypes.memmove(address, self.home_tensors[b].data_ptr() + self.offsets[b][e] + byte_offset, nbytes)
        self.counters["read_bytes"] += nbytes

    def stats(self):
        return dict(self.counters, budget_bytes=self.budget, fetch_wait_s=0.0)

    def resize(self, budget):
        """Test only: a new, empty pool."""
        assert not any(self.uses)
        self.budget = budget
        self.pool = torch.full((budget,), 0xFF, dtype=torch.uint8)
        self.resident.clear()

    def close(self):
        assert not any(self.uses), "close() with blocks in use"
        self.closed = True

    # -- the pool --------------------------------------------------------------------------------------

    def _check(self, b):
        assert not self.closed, "the tier is closed"
        assert 0 <= b < len(self.sizes), f"no block {b}"

    def _ahead(self, b, backward):
        if not self.order or b not in self.order or not self.prefetch_depth:
            return []
        i = self.order.index(b)
        if backward:
            return self.order[max(0, i - self.prefetch_depth):i][::-1]
        return self.order[i + 1:i + 1 + self.prefetch_depth]

    def _holes(self):
        taken = sorted((off, off + self.sizes[b]) for b, off in self.resident.items())
        at = 0
        for start, end in taken:
            if start > at:
                yield at, start
            at = max(at, end)
        if at < self.budget:
            yield at, self.budget

    def _place(self, n):
        fits = [(start, end) for start, end in self._holes() if end - start >= n]
        if not fits:
            return None
        if self.strict:  # lowest and highest place by turns: a block moves from one fetch to the next
            self.flip = not self.flip
            if self.flip:
                return fits[-1][1] - n
        return fits[0][0]

    def _load(self, b, protect):
        n = self.sizes[b]
        at = self._place(n)
        while at is None:
            victims = [v for v in self.resident if self.uses[v] == 0 and v not in protect]
            if not victims:
                raise MemoryError(f"pool of {self.budget} bytes has no room for block {b} ({self.names[b]}, "
                                  f"{n} bytes): blocks in use {[v for v in self.resident if self.uses[v]]}")
            self._evict(victims[0])
            at = self._place(n)
        self.pool[at:at + n] = self.home_tensors[b]
        self.resident[b] = at
        self.counters["loads"] += 1
        self.counters["loaded_bytes"] += n
        self.counters["pool_peak_bytes"] = max(self.counters["pool_peak_bytes"],
                                               sum(self.sizes[v] for v in self.resident))

    def _evict(self, b):
        at = self.resident.pop(b)
        self.pool[at:at + self.sizes[b]] = 0xFF
        self.counters["evictions"] += 1


def fake_tier(**kw):
    made = []

    def factory(entry_bytes, names, home, paths, budget, prefetch):
        made.append(FakeTier(entry_bytes, names, home, paths, budget, prefetch, **kw))
        return made[-1]
    return factory, made


def _weight_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _idle(off):
    return all(off.tier.in_use(b) == 0 for b in range(len(off.blocks))) and not off._active


def _no_saved_tensor_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class Checkpointed(nn.Module):
    """Runs a module under torch.utils.checkpoint."""

    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _gpt(seed=0, dtype=torch.float32, ckpt=None, **over):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**dict(CONFIG, **over))).to(dtype)
    if ckpt is not None:
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(blk, reentrant=ckpt)
    return model


def _train(model, steps, off=None, seed=0):
    """Losses of `steps` AdamW steps; with an offload, checks after each that no block is in use."""
    data = ByteBatches(model.config.seq, 4, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    losses = []
    for _ in range(steps):
        x, y = data.next()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        if off is not None:
            assert _idle(off), {b: off.tier.in_use(b) for b in range(len(off.blocks))}
            assert _no_saved_tensor_hooks()
            with off.gathered():
                opt.step()
            assert _idle(off)
        else:
            opt.step()
        losses.append(loss.detach())
    return losses


def _assert_same_weights(reference, off):
    full = off.full_state_dict()
    ref = reference.state_dict()
    assert full.keys() == ref.keys()
    for k in ref:
        assert torch.equal(full[k], ref[k]), k


def _offload_gpt(model, strict=False, factor=8, **kw):
    factory, made = fake_tier(strict=strict)
    budget = int(_weight_bytes(model) / factor)
    off = offload_parameters(model, prefetch=2, budget_bytes=budget, tier_factory=factory,
                             block_modules=(Block,), **kw)
    assert made[0].budget == budget
    return off


# -- training ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True], ids=["lru", "strict"])
def test_gpt_training_matches_plain_model_bitwise(strict):
    reference = _gpt()
    model = copy.deepcopy(reference)
    off = _offload_gpt(model, strict=strict)
    assert len(off.blocks) == 1 + CONFIG["n_layer"]  # the root (embeddings, final norm), one per Block
    assert [n for n, _ in off.blocks][:3] == ["(root)", "blocks.0", "blocks.1"]
    want = _train(reference, STEPS)
    got = _train(model, STEPS, off)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), (want, got)
    _assert_same_weights(reference, off)
    s = off.stats()
    assert s["pool_peak_bytes"] <= s["budget_bytes"] == _weight_bytes(reference) // 8
    assert off.tier.order == list(range(len(off.blocks)))  # recorded once, in forward order
    if not strict:
        assert s["hits"] > 0 and s["evictions"] > 0


def test_gpt_bf16_weights_fp32_compute():
    reference = _gpt(dtype=torch.bfloat16, compute_dtype=torch.float32)
    model = copy.deepcopy(reference)
    off = _offload_gpt(model, strict=True)
    want = _train(reference, 3)
    got = _train(model, 3, off)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    _assert_same_weights(reference, off)


@pytest.mark.skipif(not hasattr(_zoe, "ParamTier"), reason="this build of zoe has no ParamTier")
def test_gpt_training_with_the_cpp_tier():
    reference = _gpt()
    model = copy.deepcopy(reference)
    off = offload_parameters(model, prefetch=2, budget_bytes=_weight_bytes(model) // 4, block_modules=(Block,))
    want = _train(reference, 3)
    got = _train(model, 3, off)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), (want, got)
    _assert_same_weights(reference, off)
    s = off.stats()
    assert s["pool_peak_bytes"] <= s["budget_bytes"]
    off.remove()


def test_gradient_accumulation_over_micro_batches():
    reference = _gpt(n_layer=3)
    model = copy.deepcopy(reference)
    off = _offload_gpt(model, strict=True, factor=2)
    data = ByteBatches(CONFIG["seq"], 2, seed=3)
    batches = [data.next() for _ in range(3)]
    for m in (reference, model):
        for x, y in batches:
            m(x, y)[1].backward()
    assert _idle(off)
    for (n, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), n
        assert q.numel() == 0 and q.grad.shape == p.shape  # the placeholder, with the full gradient


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("strict", [False, True], ids=["lru", "strict"])
def test_activation_checkpointing(reentrant, strict):
    reference = _gpt(ckpt=reentrant)
    model = copy.deepcopy(reference)
    off = _offload_gpt(model, strict=strict)
    want = _train(reference, 3)
    got = _train(model, 3, off)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), (want, got)
    _assert_same_weights(reference, off)
    assert off.stats()["pool_peak_bytes"] <= off.stats()["budget_bytes"]


def test_autograd_grad_releases_every_fetch():
    reference = _gpt(n_layer=2)
    model = copy.deepcopy(reference)
    off = _offload_gpt(model, strict=True, factor=1.6)  # room for the root's block and one more
    x, y = ByteBatches(CONFIG["seq"], 2, seed=5).next()
    tok_ref, tok = reference.tok.weight, model.tok.weight
    (want,) = torch.autograd.grad(reference(x, y)[1], [tok_ref])
    (got,) = torch.autograd.grad(model(x, y)[1], [tok])
    assert torch.equal(want, got) and tok.grad is None
    assert _idle(off)


def test_retain_graph_second_backward():
    reference = _gpt(n_layer=2)
    model = copy.deepcopy(reference)
    off = _offload_gpt(model, strict=True, factor=1.6)  # room for the root's block and one more
    x, y = ByteBatches(CONFIG["seq"], 2, seed=6).next()
    for m in (reference, model):
        loss = m(x, y)[1]
        loss.backward(retain_graph=True)
        loss.backward()
    assert _idle(off)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_outer_saved_tensor_hooks_take_precedence():
    """Under the trainer's own saved-tensor hooks the offload does not install its own. These copy what is
    saved (as save_on_cpu does for a CUDA model), so they hold no pool memory either; hooks that keep the
    tensor itself (save_on_cpu for a CPU model) keep its block in use until backward."""
    reference = _gpt(n_layer=2)
    model = copy.deepcopy(reference)
    off = _offload_gpt(model, strict=True, factor=1.6)
    x, y = ByteBatches(CONFIG["seq"], 2, seed=7).next()
    for m in (reference, model):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t):
            loss = m(x, y)[1]
        loss.backward()
    assert _idle(off)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


# -- inference -----------------------------------------------------------------------------------------


def test_eval_inference_no_grad():
    reference = _gpt()
    model = copy.deepcopy(reference)
    off = _offload_gpt(model, strict=True)
    reference.eval()
    model.eval()
    x, _ = ByteBatches(CONFIG["seq"], 3, seed=2).next()
    with torch.no_grad():
        want = reference(x)
        got = model(x)
        assert _idle(off)  # nothing saved: every block went back after its forward
        assert torch.equal(want, got)
    with torch.inference_mode():
        assert torch.equal(model(x), want)
    assert _idle(off)


def test_outputs_viewing_weights_keep_their_block():
    """A forward may return a view of its weights: the block stays fetched while the view lives."""

    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 4))

        def forward(self, i):
            return self.weight[i]

    torch.manual_seed(0)
    model = nn.Sequential(Emb())
    want = model[0].weight.detach().clone()
    factory, made = fake_tier(strict=True)
    off = offload_parameters(model, tier_factory=factory)
    with torch.no_grad():
        row = model(torch.tensor(3))
    assert off.tier.in_use(0) == 1 and torch.equal(row, want[3])
    del row
    assert _idle(off)


# -- structure -----------------------------------------------------------------------------------------


class Tied(nn.Module):
    """An embedding and a head that share one weight, a module called twice, and a bias-free block."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        x = self.mid(F.gelu(self.mid(x)))  # twice: the block is in use twice over
        return self.head(self.norm(x))


def test_tied_weights_and_a_module_called_twice():
    torch.manual_seed(0)
    reference = Tied()
    model = copy.deepcopy(reference)
    factory, made = fake_tier(strict=True)
    off = offload_parameters(model, tier_factory=factory, budget_bytes=0)
    names = [n for n, _ in off.blocks]
    assert names == ["emb", "mid", "norm"]  # head owns nothing: its weight is emb's
    assert off._module_blocks[model.head] == [0]
    assert off.param_location(model.head.weight) == (0, 0) == off.param_location(model.emb.weight)
    assert model.mid.bias._zoe_param_offload == (off, 1, 1)
    g = torch.Generator().manual_seed(1)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(4):
        idx = torch.randint(0, 32, (4, 8), generator=g)
        tgt = torch.randint(0, 32, (4, 8), generator=g)
        losses = []
        for m, o in ((reference, opt_ref), (model, opt)):
            o.zero_grad()
            loss = F.cross_entropy(m(idx).flatten(0, 1), tgt.flatten())
            loss.backward()
            losses.append(loss.detach())
            if m is model:
                assert _idle(off)
                with off.gathered():
                    o.step()
            else:
                o.step()
        assert torch.equal(*losses)
    _assert_same_weights(reference, off)
    assert model.head.weight is model.emb.weight


def test_default_blocks_follow_module_registration_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2), nn.ReLU()), nn.Linear(2, 1))
    model.register_parameter("scale", nn.Parameter(torch.ones(1)))
    model.register_buffer("steps", torch.zeros(()))
    factory, _ = fake_tier()
    off = offload_parameters(model, tier_factory=factory)
    assert [(n, len(ps)) for n, ps in off.blocks] == [("(root)", 1), ("0", 2), ("1.0", 2), ("2", 2)]
    assert off.tier.entry_bytes == [[4], [64, 16], [32, 8], [8, 4]]
    assert all(p.numel() == 0 for p in model.parameters())


def test_remove_restores_the_model():
    torch.manual_seed(0)
    reference = Tied()
    model = copy.deepcopy(reference)
    factory, made = fake_tier(strict=True)
    off = offload_parameters(model, tier_factory=factory)
    idx = torch.arange(8).view(1, 8)
    model(idx).sum().backward()
    off.remove()
    assert made[0].closed and off.tier is None
    for (n, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(p, q) and not hasattr(q, "_zoe_param_offload"), n
    assert not model._forward_pre_hooks and not model.emb._forward_hooks
    assert torch.equal(model(idx), reference(idx))


def test_state_dict_through_materialize_and_load_through_gathered():
    torch.manual_seed(0)
    reference = Tied()
    model = copy.deepcopy(reference)
    factory, _ = fake_tier()
    off = offload_parameters(model, tier_factory=factory)
    with off.materialize():
        sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in reference.state_dict().items())
    assert model.emb.weight.numel() == 0  # the placeholder again, sd keeps its copy
    new = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in sd.items()}
    new["head.weight"] = new["emb.weight"]
    with off.gathered():
        model.load_state_dict(new)
    full = off.full_state_dict()
    assert all(torch.equal(full[k], new[k]) for k in new)


def test_weights_written_between_forward_and_backward_are_refused():
    torch.manual_seed(0)
    model = Tied()
    factory, _ = fake_tier()
    off = offload_parameters(model, tier_factory=factory)
    loss = model(torch.arange(8).view(1, 8)).sum()
    with off.gathered():
        pass
    with pytest.raises(RuntimeError, match="written after the forward"):
        loss.backward()


# -- failures ------------------------------------------------------------------------------------------


def test_fetch_failure_names_the_block_and_leaves_nothing_behind():
    reference = _gpt(n_layer=2)
    model = copy.deepcopy(reference)
    # Room for the root's block but not for it and a transformer block together.
    factory, made = fake_tier()
    root_bytes = sum(p.numel() * 4 for p in (model.tok.weight, model.pos.weight, model.ln.weight, model.ln.bias))
    off = offload_parameters(model, tier_factory=factory, budget_bytes=root_bytes + 1024, block_modules=(Block,))
    x, y = ByteBatches(CONFIG["seq"], 2, seed=4).next()
    with pytest.raises(RuntimeError, match=r"fetching block 1 \('blocks.0'.*no room"):
        model(x, y)
    assert _idle(off) and _no_saved_tensor_hooks() and not off._frames()
    assert all(p.numel() == 0 for p in model.parameters())
    # The same offload works once the pool is large enough.
    made[0].resize(_weight_bytes(reference))
    assert made[0].order is None  # the failed forward's order was not handed on
    assert torch.equal(model(x, y)[1], reference(x, y)[1])
    assert _idle(off) and made[0].order == [0, 1, 2]


def test_a_forward_reading_uncalled_submodules_weights_is_explained():
    """The demo GPT reads its layers' weights without calling the layers: with one block per module those
    blocks are never fetched, and the failure says what to do."""
    model = _gpt(n_layer=2)
    factory, _ = fake_tier()
    off = offload_parameters(model, tier_factory=factory)
    with pytest.raises(RuntimeError) as info:
        model(*ByteBatches(CONFIG["seq"], 2, seed=8).next())
    if hasattr(info.value, "add_note"):  # Python 3.11
        assert "block_modules" in "".join(info.value.__notes__)
    assert _idle(off) and _no_saved_tensor_hooks()


def test_interrupted_forward_is_undone_by_the_next():
    torch.manual_seed(0)
    model = Tied()
    factory, _ = fake_tier()
    off = offload_parameters(model, tier_factory=factory)

    def interrupt(m, args):
        raise KeyboardInterrupt  # not an Exception: the always-called post-hooks do not run

    h = model.head.register_forward_pre_hook(interrupt)  # after the offload's: head's block is fetched
    with pytest.raises(KeyboardInterrupt):
        model(torch.arange(8).view(1, 8))
    h.remove()
    assert off._active and off._frames() and not _no_saved_tensor_hooks()
    model(torch.arange(8).view(1, 8))
    assert _idle(off) and not off._frames() and _no_saved_tensor_hooks()


def test_bad_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'cpu' or 'nvme'"):
        offload_parameters(model, device="gpu")
    with pytest.raises(ValueError, match="nvme_path"):
        offload_parameters(model, device="nvme")
    factory, _ = fake_tier()
    offload_parameters(model, tier_factory=factory)
    with pytest.raises(RuntimeError, match="offloaded already"):
        offload_parameters(model, tier_factory=factory)
