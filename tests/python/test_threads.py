"""zoe.torch.OffloadOptimizer called from several threads: its public calls are serialised, so two threads'
steps equal as many from one, and a state_dict() taken on another thread during training (a background
checkpoint) is one whole step. The gradients are the same at every step, so the order the threads' calls take
does not change the result; only an interleaving would. Both tiers."""
import threading

import pytest
import torch

from zoe.torch import OffloadOptimizer

TIERS = ["ram", "nvme"]


def _model(tier, tmp_path):
    torch.manual_seed(0)
    # Large enough that a step takes a while (several tiles of the engine and of the swap store).
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (400_000, 4096, 33)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    kw = dict(tier="nvme", nvme_path=str(tmp_path / "swap"), buffer_count=2, tile=1 << 14,
              keep_resident=False, durability="checkpoint") if tier == "nvme" else {}
    return params, OffloadOptimizer(params, lr=1e-2, **kw)


def _in_threads(*work):
    errors = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _moments(sd):
    return [(sd["state"][i]["exp_avg"].clone(), sd["state"][i]["exp_avg_sq"].clone()) for i in sorted(sd["state"])]


@pytest.mark.parametrize("tier", TIERS)
def test_steps_from_two_threads_equal_the_same_steps_from_one(tier, tmp_path):
    ref_params, ref = _model(tier, tmp_path / "one")
    for _ in range(10):
        ref.step()
    for run in range(2):
        params, opt = _model(tier, tmp_path / f"two{run}")

        def five():
            for _ in range(5):
                opt.step()

        _in_threads(five, five)
        assert opt.step_count == 10
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q)
            assert torch.equal(opt.read_state(p)["master"], ref.read_state(q)["master"])
            assert torch.equal(opt.read_state(p)["exp_avg_sq"], ref.read_state(q)["exp_avg_sq"])


@pytest.mark.parametrize("tier", TIERS)
def test_a_state_dict_taken_on_another_thread_is_one_whole_step(tier, tmp_path):
    steps = 6
    _, ref = _model(tier, tmp_path / "ref")
    after = [_moments(ref.state_dict())]  # after[k]: the moments after k steps
    for _ in range(steps):
        ref.step()
        after.append(_moments(ref.state_dict()))

    params, opt = _model(tier, tmp_path / "live")
    taken = []

    def train():
        for _ in range(steps):
            opt.step()

    def checkpoint():
        for _ in range(6):
            taken.append(opt.state_dict())

    _in_threads(train, checkpoint)
    assert len(taken) == 6
    for i, sd in enumerate(taken):
        k = int(sd["state"][0]["step"])
        assert 0 <= k <= steps
        assert all(int(s["step"]) == k for s in sd["state"].values()), "parameters of different steps in one state_dict"
        for (m, v), (m_ref, v_ref) in zip(_moments(sd), after[k]):
            assert torch.equal(m, m_ref) and torch.equal(v, v_ref), f"a state_dict labelled step {k} holds another state"
        # And it resumes: loaded into a fresh optimizer, it is that step's state.
        _, fresh = _model(tier, tmp_path / f"fresh{i}")
        fresh.load_state_dict(sd)
        assert fresh.step_count == k


@pytest.mark.parametrize("tier", TIERS)
def test_load_state_dict_beside_step_gives_one_or_the_other(tier, tmp_path):
    """A load on one thread while another steps: the load lands between two steps, so the result is the
    checkpoint's state stepped some whole number of times — never a store half old, half new."""
    params, opt = _model(tier, tmp_path / "live")
    for _ in range(2):
        opt.step()
    saved = opt.state_dict()

    def train():
        for _ in range(4):
            opt.step()

    _in_threads(train, lambda: opt.load_state_dict(saved))
    final = opt.state_dict()
    k = int(final["state"][0]["step"])
    assert 2 <= k <= 6
    # The same checkpoint stepped k - 2 times on one thread gives exactly this state.
    _, ref = _model(tier, tmp_path / "ref")
    ref.load_state_dict(saved)
    for _ in range(k - 2):
        ref.step()
    for (m, v), (m_ref, v_ref) in zip(_moments(final), _moments(ref.state_dict())):
        assert torch.equal(m, m_ref) and torch.equal(v, v_ref)
