"""Command-line pieces the interleaved benchmarks share: the model and run flags,
and filling unset flags from the quick or full defaults."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_common_args", "fill_defaults"]


def add_common_args(p: argparse.ArgumentParser, *, layers: int, embd: int, embd_help: str, plot_help: str) -> None:
    """``--nproc --backend --batch --seq --vocab --layers --embd --heads --seed --json --plot``."""
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) to launch (default 2)")
    p.add_argument("--backend", default=None, help="dynamo backend for the compiled modes (default inductor)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="sequence length (block_size)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--embd", type=int, default=embd, help=embd_help)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here (a JSON list)")
    p.add_argument("--plot", default=None, help=f"{plot_help} (default: the --json path with .png)")


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any],
                  convert: Callable[[str, Any], Any] = lambda key, value: value) -> argparse.Namespace:
    """Set every flag the user left unset (None) from ``defaults``; derive ``--plot`` from ``--json``."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, convert(key, value))
    if args.plot is None and args.json:
        args.plot = str(Path(args.json).with_suffix(".png"))
    return args
