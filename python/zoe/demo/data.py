"""Training text that needs no download: the topic pages of Python's own documentation, which every CPython
ships as ``pydoc_data.topics`` (about a megabyte of English prose and code), with the docstrings of a few
standard modules as a fallback where a distribution strips pydoc_data."""
from __future__ import annotations

import torch


def corpus_text() -> tuple[str, str]:
    """The text and a name for where it came from."""
    try:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics (Python's documentation)"
    except ImportError:
        import collections, json, os, re, this  # noqa: E401, F401 - their docstrings are the text

        parts = [m.__doc__ or "" for m in (collections, json, os, re)]
        for mod in (collections, json, os, re):
            parts += [getattr(mod, n).__doc__ or "" for n in dir(mod) if not n.startswith("_")]
        return "\n\n".join(p for p in parts if p), "docstrings of the standard library"


class ByteBatches:
    """Random windows of the corpus as byte tokens: (input, next-byte target) batches, reproducible from a
    seed, with the last 5% held out for evaluation."""

    def __init__(self, seq: int, batch: int, seed: int = 0):
        text, self.source = corpus_text()
        data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        split = int(len(data) * 0.95)
        self.train, self.held_out = data[:split], data[split:]
        self.seq, self.batch = seq, batch
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.train)

    def next(self, held_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.held_out if held_out else self.train
        start = torch.randint(0, len(data) - self.seq - 1, (self.batch,), generator=self.gen)
        idx = start[:, None] + torch.arange(self.seq + 1)
        window = data[idx]
        return window[:, :-1], window[:, 1:]

