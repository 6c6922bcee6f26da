"""The dataset the config names (``data=...``): synthetic (``launch.data.source``), a
token file (``data=tokens``, ``launch.data.tokens``) or a user's ``_target_``."""

from __future__ import annotations

from ..config.schema import DataConfig
from .source import SyntheticTokens, TokenSource
from .tokens import TokenFile

__all__ = ["build_data"]


def build_data(cfg: DataConfig, *, seed: int, vocab_size: int) -> TokenSource:
    """The dataset the config names: synthetic, a token file (``data=tokens``,
    ``launch.data.tokens``), or ``_target_(**kwargs)``."""
    if cfg._target_:
        from hydra.utils import instantiate

        return instantiate({"_target_": cfg._target_, **cfg.kwargs})
    if cfg.name == "tokens":
        return TokenFile(cfg.path, seed=seed, dtype=cfg.dtype, val_fraction=cfg.val_fraction, vocab_size=vocab_size)
    return SyntheticTokens(seed, vocab_size, **cfg.kwargs)
