"""``compile_prepared``: ``compile_ddp`` on the model ``accelerator.prepare`` returned,
with Accelerate's own words when what it returned is not a DDP module. The route is
one line: ``model = compile_prepared(accelerator.prepare(model), backend=...)``.

This module imports ``accelerate`` and is imported only by its users; ``ddp_opt`` and
``ddp_opt.frameworks`` never import it.

Note [Accelerate route]

Background
    Under ``torchrun`` (Accelerate's ``MULTI_CPU`` or ``MULTI_GPU``),
    ``accelerator.prepare(model)`` returns ``DistributedDataParallel(model)`` and keeps
    that same object in ``accelerator._models``, which ``save_state``/``load_state``
    walk. Accelerate's own compile recipe, ``Accelerator(dynamo_backend=...)``, wraps
    that DDP module in ``torch.compile``: dynamo then hands the graph to PyTorch's
    splitter, whose fixed cap ignores DDP's first-bucket cap and whose partitions DDP's
    bucket rebuild moves away from.

Algorithm
    ``compile_prepared`` is ``compile_ddp`` on the DDP module ``prepare`` returned: its
    wrapped module's ``forward`` is compiled in place, so the object Accelerate keeps
    is unchanged and checkpoints keep their keys. The ``CompiledDDP`` it returns
    answers ``isinstance(model, DistributedDataParallel)`` (Note [Looking like DDP]),
    so ``unwrap_model``, ``accumulate``/``no_sync``, ``trigger_sync_in_backward``,
    ``clip_grad_norm_`` and ``autocast`` treat it as the DDP module it calls. Before
    compiling it names, in Accelerate's terms, the cases ``compile_ddp`` cannot take:
    a module Accelerate already compiled (``dynamo_backend``) and a module Accelerate
    did not wrap in DDP (one process, FSDP, DeepSpeed). The handle prints its line of
    Note [In control, once] on rank 0, as ``accelerator.print`` would.

Notes
    - ``compile_ddp(accelerator.prepare(model))`` is what ``compile_prepared`` runs
      underneath, without those messages and the in-framework line. The docs spell the
      Accelerate route ``compile_prepared`` only (docs/ddp.md, Which entry point).
    - A comm hook given as ``DistributedDataParallelKwargs(comm_hook=...)`` is registered
      on DDP by ``prepare``; Accelerate's hooks are Python functions, which realignment
      reads back and registers again on the new reducer (``CommHooks.current``), as for
      any hook registered before compiling (Note [One setup for both entry points]).
      Beside ``reduce_dtype=``, ``compression=`` or ``optimizer=`` it is refused.
"""

from __future__ import annotations

import logging
from typing import Any

from accelerate.utils import is_compiled_module
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..api import compile_ddp
from ..compiled import CompiledDDP
from ..config import DDPCompileConfig

log = logging.getLogger(__name__)

__all__ = ["compile_prepared"]


def compile_prepared(model: nn.Module, *, config: DDPCompileConfig | None = None, **settings: Any) -> CompiledDDP:
    """``compile_ddp`` on the model ``accelerator.prepare`` returned (Note [Accelerate route]).

    Args:
        model: what ``accelerator.prepare(model)`` returned: a DDP module under torchrun.
        config: a :class:`ddp_opt.DDPCompileConfig`, instead of keyword settings; not both.
        **settings: ``compile_ddp``'s keywords (``backend``, ``mode``, ``bucket_cap_mb``, ...).

    Returns:
        The :class:`ddp_opt.CompiledDDP`; train with it as with the prepared model.

    Raises:
        TypeError: ``model`` is not a DDP module, or Accelerate already compiled it.
    """
    if is_compiled_module(model):
        raise TypeError(
            f"compile_prepared: accelerator.prepare returned a torch.compile'd "
            f"{type(model._orig_mod).__name__}, because the Accelerator was built with a dynamo_backend (or "
            "ACCELERATE_DYNAMO_BACKEND is set), and compiling it again would nest two compilers and leave the "
            "graph split by PyTorch's own splitter. Build the Accelerator without dynamo_backend (or "
            "dynamo_backend='no') and pass the backend here: compile_prepared(model, backend=...).")
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"compile_prepared: accelerator.prepare returned a {type(model).__name__}, not a DDP module: Accelerate "
            "wraps a model in DistributedDataParallel only when several processes run (torchrun --nproc-per-node N, "
            "or accelerate launch with num_processes > 1) without FSDP or DeepSpeed, and there are no DDP buckets "
            "to split at otherwise. Launch several processes, or, for one process, compile with torch.compile(model).")
    compiled = compile_ddp(model, config=config, **settings)
    compiled.control.in_framework("compile_prepared")  # Note [In control, once]
    log.info("compile_prepared: compiled the %s inside Accelerate's DDP module (strategy %s)",
             type(model.module).__name__, compiled.strategy)
    return compiled
