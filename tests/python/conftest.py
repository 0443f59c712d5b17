"""Shared helpers for the Python suites. They run against the installed package (scripts/test installs it
into .venv first), with real PyTorch."""
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


@pytest.fixture(autouse=True)
def _two_threads():
    # The machines that run this have 2 cores; results must not depend on the count anyway.
    torch.set_num_threads(2)
    yield
