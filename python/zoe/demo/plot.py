"""The demo's loss.png, drawn with matplotlib (Agg backend: no display needed): the training loss per step
(faint) and smoothed, the held-out loss at each evaluation, and the throughput below it on the same steps."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Curves:
    steps: list[int]            # 1-based training steps
    train_loss: list[float]     # one per step: mean cross-entropy of its batch, nats per byte
    train_smooth: list[float]   # trailing mean of `window` steps
    window: int
    held_steps: list[int]       # steps after which the held-out batches were evaluated
    held_loss: list[float]
    held_batches: int
    tokens_per_s: list[float]   # one per step: its tokens over its wall time (forward, backward, step)


def require_matplotlib() -> str:
    """The matplotlib version, or an ImportError saying how to get it (checked before training starts)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("python -m zoe.demo draws loss.png with matplotlib, which is not installed: "
                          "pip install matplotlib (scripts/setup installs it into .venv)") from e
    return matplotlib.__version__


def trailing_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def draw(path: str, c: Curves, title: str, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, (ax, tp) = plt.subplots(2, 1, figsize=(8, 6.2), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    ax.plot(c.steps, c.train_loss, color="tab:blue", alpha=0.25, lw=0.8, label="train loss, each step")
    ax.plot(c.steps, c.train_smooth, color="tab:blue", lw=2, label=f"train loss, mean of last {c.window} steps")
    ax.plot(c.held_steps, c.held_loss, "o-", color="tab:red", lw=1.5, ms=4,
            label=f"held-out loss ({c.held_batches} fixed batches of unseen text)")
    # A model that knows nothing predicts each of 256 byte values equally: ln 256 nats per byte.
    ax.axhline(math.log(256), color="gray", ls=":", lw=1, label="uniform guess over 256 bytes (5.55)")
    ax.set_ylabel("cross-entropy loss (nats per byte)")
    ax.set_title(subtitle, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    top = max(max(c.train_loss), math.log(256))
    ax.set_ylim(max(0.0, min(c.train_loss + c.held_loss) - 0.2), top + 0.3)

    tp.plot(c.steps, c.tokens_per_s, color="tab:green", alpha=0.25, lw=0.8, label="each step")
    tp.plot(c.steps, trailing_mean(c.tokens_per_s, c.window), color="tab:green", lw=2,
            label=f"mean of last {c.window} steps")
    tp.set_ylabel("throughput\n(tokens/s)")
    tp.set_xlabel("training step")
    tp.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    tp.set_ylim(bottom=0)
    tp.grid(alpha=0.3)
    tp.legend(loc="lower right", fontsize=8)
    tp.xaxis.set_major_locator(MaxNLocator(integer=True))
    tp.set_xlim(min(c.steps), max(c.steps) if len(c.steps) > 1 else min(c.steps) + 1)

    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
