"""The blocks of a parameter offload (_param_offload.py): which parameters form each block and which blocks
each module's forward fetches (``plan``), and the records the offload keeps of a block in use: a module call
between its forward hooks (``Frame``), a fetched block's users (``Active``), and a saved tensor that lies in a
block, held by position (``SavedView``)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what a parameter tier holds


def block_selector(block_modules) -> Callable[[str, nn.Module], bool]:
    if block_modules is None:
        return lambda name, m: True
    if isinstance(block_modules, type) or (isinstance(block_modules, tuple)
                                           and all(isinstance(c, type) for c in block_modules)):
        return lambda name, m: isinstance(m, block_modules)
    if callable(block_modules):
        return block_modules
    raise TypeError("block_modules: a module class, a tuple of them, or a predicate (name, module) -> bool")


class SavedView(NamedTuple):
    """A saved tensor that lies in a block, by position rather than address."""
    block: int
    byte_offset: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    version: int  # the write-backs when saved (gathered()): weights written since make the graph stale


class Active:
    """A block fetched for the hooks: how many module calls and gradient accumulations use it now, and the
    storage its parameters' ``.data`` are views of."""

    __slots__ = ("count", "storage")

    def __init__(self, storage: torch.UntypedStorage):
        self.count = 1
        self.storage = storage


class Frame:
    """One module call between its forward hooks: the blocks its pre-hook took and whether it installed
    the saved-tensor hooks, so that the post-hook (also run when forward raises) undoes exactly that."""

    __slots__ = ("module", "blocks", "pushed")

    def __init__(self, module: nn.Module):
        self.module = module
        self.blocks: list[int] = []
        self.pushed = False


def storage_view(storage: torch.UntypedStorage, byte_offset: int, dtype: torch.dtype, size, stride) -> torch.Tensor:
    item = dtype.itemsize
    if byte_offset % item:
        raise RuntimeError(f"zoe parameter offload: offset {byte_offset} is not aligned to {dtype}")
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, byte_offset // item, size, stride)


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))



def plan(model: nn.Module, select: Callable[[str, nn.Module], bool]):
    """The blocks ``[(name, [params])]`` and, for each module whose forward fetches, the blocks of every
    parameter its forward reads directly: its own and its descendants' down to the next block module, tied
    ones included (a block module's "domain")."""
    blocks: list[tuple[str, list[nn.Parameter]]] = []
    owner: dict[nn.Parameter, int] = {}
    block_of_host: dict[nn.Module, int] = {}
    uses: dict[nn.Module, dict[nn.Parameter, None]] = {}

    # Not named_modules(): it lists a shared module once, under its first parent, and the domain of every
    # block module that calls it must include it.
    def visit(name: str, m: nn.Module, host: nn.Module, host_name: str) -> None:
        if m is model or select(name, m):
            host, host_name = m, name
        used = uses.setdefault(host, {})
        for p in m.parameters(recurse=False):
            if p.dtype not in DTYPES or p.numel() == 0:
                continue
            used[p] = None
            if p not in owner:
                if host not in block_of_host:
                    block_of_host[host] = len(blocks)
                    blocks.append((host_name or "(root)", []))
                owner[p] = block_of_host[host]
                blocks[owner[p]][1].append(p)
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, host, host_name)

    visit("", model, model, "")
    module_blocks = {host: sorted({owner[p] for p in used}) for host, used in uses.items()}
    return blocks, module_blocks
