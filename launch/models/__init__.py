"""Models shipped with the toolkit for the launcher, tests and benchmarks."""

from .gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block"]
