"""The end-to-end demo: ``python -m zoe.demo`` trains a small GPT-style language model with
``zoe.torch.OffloadOptimizer``. See ``zoe.demo.__main__`` for the options."""
from .data import ByteBatches, corpus_text  # noqa: F401
from .model import GPT, GPTConfig  # noqa: F401
