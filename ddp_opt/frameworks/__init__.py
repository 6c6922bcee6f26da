"""Routes into the training frameworks users run DDP inside (Lightning's Trainer, ...).

Each route is a module of its own that imports its framework at the top, so import it
by name (``from ddp_opt.frameworks.lightning import CompiledDDPStrategy``); this package
imports none of them, and ``import ddp_opt`` never imports a framework."""

__all__: list[str] = []
