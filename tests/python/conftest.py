"""Shared helpers for the Python suites. They run against the installed package (scripts/test installs it
into .venv first), with real PyTorch."""
import math

import pytest
import torch


def make_mlp(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                            torch.nn.Linear(64, 8))
    return m.to(dtype)


def batches(n: int, seed: int = 1, batch: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 32, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(n)]


def train(model, opt, data, scale_loss: bool = False):
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        (opt.scale_loss(loss) if scale_loss else loss).backward()
        opt.step()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


# Per element and step, the two masters may drift apart by at most
#   MASTER_ULPS_PER_STEP ulps of the master (each step rounds it twice: the decay product and the update)
#   + lr * UPDATE_REL_ERR (the update m_hat / (sqrt(v_hat) + eps), at most ~1 in size, computed in another
#     operation order: fused multiply-adds and a reciprocal multiply in zoe, separate roundings in torch;
#     a few float ulps, 2^-23 each, relative).
# Teacher-forced, the drift can only add up, so the bound grows linearly with the step. Measured on an
# AVX-512 Xeon under each of scalar, avx2 and avx512 (the demo model, test_numerics.py): 7.5e-9 after step 1, from step 5 on 1.2e-7 (one ulp of
# the layer-norm weights near 1); at most 0.44 of the bound.
MASTER_ULPS_PER_STEP = 2
UPDATE_REL_ERR = 2.0 ** -20


def master_bound(step: int, a: torch.Tensor, b: torch.Tensor, lr: float) -> torch.Tensor:
    """How far apart two fp32 AdamW masters fed the same gradients may be after `step` steps, per element."""
    x = torch.maximum(a.abs(), b.abs())
    ulp = torch.nextafter(x, torch.full_like(x, math.inf)) - x
    return step * (MASTER_ULPS_PER_STEP * ulp + lr * UPDATE_REL_ERR)


def spawn_ranks(main, folder, world: int) -> list[dict]:
    """Runs ``main(rank, init_file, folder)`` on ``world`` processes (each saves what it recorded to
    ``folder/rank<r>.pt``, which the multi-rank suites' tests then read); returns those records by rank."""
    import torch.multiprocessing as mp

    mp.spawn(main, args=(str(folder / "init"), str(folder)), nprocs=world, join=True)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


def worst(ranks: list[dict], key: str):
    """The largest of what every rank recorded under ``key``."""
    return max(r[key] for r in ranks)


@pytest.fixture(autouse=True)
def _two_threads():
    # The machines that run this have 2 cores; results must not depend on the count anyway.
    torch.set_num_threads(2)
    yield
