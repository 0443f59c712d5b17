"""zoe — the ZeRO Offload Engine.

fp32 master weights and Adam moments live off the accelerator (pinned RAM, or NVMe) and the Adam step runs
on the CPU. ``zoe.torch.OffloadOptimizer`` is the PyTorch front; ``zoe.CpuAdam`` is the kernel on numpy
arrays or CPU tensors; ``python -m zoe.demo`` trains a small language model with it.
"""
from ._zoe import (  # noqa: F401
    CorruptError,
    CpuAdam,
    Device,
    Engine,
    EngineOptions,
    InvalidArgumentError,
    OutOfMemoryError,
    UnsupportedError,
    ZoeError,
    cuda_device,
    host_device,
    cpu_device,
    load_config,
    parse_config,
    supported_isas,
)

__version__ = "0.1.0"
__all__ = [
    "CpuAdam", "Device", "Engine", "EngineOptions", "ZoeError", "UnsupportedError", "InvalidArgumentError",
    "CorruptError", "OutOfMemoryError", "host_device", "cpu_device", "cuda_device", "load_config", "parse_config",
    "supported_isas",
]
