"""zoe's device work ordered on torch's stream.

On CUDA torch runs its kernels on its current stream. zoe's engine orders its own work with events on its
``compute`` stream: pointed at torch's current stream, those events and waits order zoe's copies against
torch's kernels on the GPU, and the host waits for nothing (the trainer's thread runs ahead of the GPU, as in
a plain PyTorch loop). On the CPU torch computes on the host, at once: before torch touches a buffer zoe is
still copying, the host itself must wait (``ordered`` is False)."""
from __future__ import annotations

from typing import Callable

import torch

from . import _zoe


class TorchStream:
    """The stream torch orders its work on for one device, followed by a zoe device before each call that
    enqueues work on its compute stream. ``current``: torch's current stream (None: torch's CUDA stream on a
    CUDA device, none on the CPU); tests give a host stand-in's HostStream in its place."""

    def __init__(self, zoe_device, device: torch.device, current: Callable[[], object] | None = None):
        if current is None and device.type == "cuda":
            def current() -> torch.cuda.Stream:
                return torch.cuda.current_stream(device)
        self._zoe_device = zoe_device
        self._current = current
        self._followed = None  # the stream followed, as compared: torch's handle, or the HostStream itself

    @property
    def ordered(self) -> bool:
        """torch's work is ordered on a stream zoe follows: the host waits for none of zoe's copies."""
        return self._current is not None

    def follow(self) -> None:
        """zoe's compute-stream work goes on torch's current stream (it may have changed: ``with
        torch.cuda.stream(s)``)."""
        if self._current is None:
            return
        stream = self._current()
        # torch makes a new Stream object for each current_stream(): its handle tells whether it changed.
        key = stream.cuda_stream if isinstance(stream, torch.cuda.Stream) else stream
        if key != self._followed:
            self._zoe_device.use_compute_stream(stream)
            self._followed = key


def host_wait_stats(device) -> dict:
    """A zoe device's host waits under the names stats() reports them by."""
    w = device.host_waits()
    return dict(host_waits_trainer=w["trainer_calls"], host_wait_trainer_s=w["trainer_s"],
                host_waits_worker=w["worker_calls"], host_wait_worker_s=w["worker_s"])


def devices_of(param_groups, cpu_device: Callable[[], object]) -> tuple:
    """The parameters' device, and the engine's device for it (``cpu_device()`` for the CPU)."""
    devices = {p.device for g in param_groups for p in g["params"]}
    if len(devices) > 1:
        raise ValueError(
            "zoe.torch.OffloadOptimizer: parameters are on several devices "
            f"({', '.join(sorted(str(d) for d in devices))}); one optimizer serves one device — "
            "move the model to one device first, or create one optimizer per device")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cuda":
        return device, _zoe.cuda_device(device.index or 0)
    if device.type == "cpu":
        return device, cpu_device()
    raise ValueError(f"zoe.torch.OffloadOptimizer: device {device} is not supported (cpu or cuda)")
