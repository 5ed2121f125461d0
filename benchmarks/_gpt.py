"""The benchmark GPT model; it lives in the package (``lazyckpt.cli._gpt``) so that ``lazyckpt bench`` has it."""

from lazyckpt.cli._gpt import *  # noqa: F403
from lazyckpt.cli._gpt import __all__  # noqa: F401
