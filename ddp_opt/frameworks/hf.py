"""``compile_trainer``: the HF Trainer route. A ``TrainerCallback`` that compiles the DDP
module the Trainer builds with ``compile_ddp`` and keeps DDP's buckets aligned with the
partitions under the Trainer's defaults. The route is one line after the Trainer is made:
``compile_trainer(trainer, backend=...)``.

This module imports ``transformers`` and is imported only by its users; ``ddp_opt`` and
``ddp_opt.frameworks`` never import it.

Note [HF Trainer route]

Background
    The Trainer wraps the model in DDP inside ``train()``; from ``on_train_begin`` on,
    ``trainer.model_wrapped`` is that DDP module. Its own recipe,
    ``TrainingArguments(torch_compile=True)``, hands the graph to PyTorch's splitter; an
    ``OptimizedModule`` given to ``Trainer(...)`` breaks its column check and saves
    ``_orig_mod.`` keys that ``from_pretrained`` ignores. And its default
    ``ddp_find_unused_parameters=None`` builds DDP with ``find_unused_parameters=True``
    for most models, and such a DDP never rebuilds, so its buckets cannot be realigned.

Algorithm
    1. ``compile_trainer`` checks the arguments (not with ``torch_compile=True``) and adds
       a :class:`DDPCompileCallback` that knows the Trainer.
    2. ``on_train_begin``: when the Trainer chose ``find_unused_parameters=True`` by its
       default and no comm hook is registered, turn it off (re-creating the reducer; one
       INFO line on every rank; the line of Note [In control, once], printed on rank 0, names
       the change), then ``compile_ddp(trainer.model_wrapped)``, which compiles the user's
       ``forward`` in place, so ``save_model`` + ``from_pretrained`` round-trip.
    3. ``on_pre_optimizer_step``, while the flag is off by our choice: a reduction left
       unfinished (a parameter without gradient) stops the step before the optimizer
       applies unreduced gradients, naming the setting that keeps DDP's search.

Notes
    - Turning the flag off beats realigning under it: that would need one more private
      interface, and with no unused parameter the flag only costs a graph walk per step.
    - ``ddp_find_unused_parameters=True`` given by the user is kept, with one line that
      buckets cannot be realigned. Without a DDP module the callback warns and does nothing.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback

from .._torch_internals import reducer_finalized, registered_hook_name, stop_finding_unused_parameters
from ..api import compile_ddp
from ..compiled import CompiledDDP
from ..config import DDPCompileConfig
from ..alignment.realign import never_rebuilds

log = logging.getLogger(__name__)

__all__ = ["DDPCompileCallback", "compile_trainer"]

# What the route changed, as the line of Note [In control, once] says it.
TURNED_OFF = ("find_unused_parameters=False for DDP (the Trainer's default, True, keeps DDP from rebuilding its "
              "buckets; TrainingArguments(ddp_find_unused_parameters=True) keeps it on)")


class DDPCompileCallback(TrainerCallback):
    """Compiles ``trainer.model_wrapped`` with ``compile_ddp`` when training begins
    (Note [HF Trainer route]); made and added by :func:`compile_trainer`.

    Attributes:
        compiled: the :class:`ddp_opt.CompiledDDP` once training began (its ``buckets``,
            ``realignment``, ``register_comm_hook``), else None.
        stopped_finding_unused: True when this callback turned DDP's
            ``find_unused_parameters`` off.
    """

    def __init__(self, trainer: Trainer, config: DDPCompileConfig) -> None:
        self.trainer = trainer
        self.config = config
        self.compiled: CompiledDDP | None = None
        self.stopped_finding_unused = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = self.trainer.model_wrapped
        if self.compiled is not None and self.compiled.ddp_model is ddp:
            return  # train() again, on the DDP module compiled the first time
        if not isinstance(ddp, DistributedDataParallel):
            warnings.warn(
                f"compile_trainer: the Trainer's model_wrapped is a {type(ddp).__name__}, not a DDP module (one "
                "process, or FSDP/DeepSpeed), so there are no DDP buckets to split at and the model trains "
                "uncompiled. Launch several processes with torchrun to train under DDP, or, for one process, use "
                "TrainingArguments(torch_compile=True) instead of compile_trainer.", stacklevel=2)
            return
        if (args.ddp_find_unused_parameters is None and never_rebuilds(ddp) and self.config.align_buckets
                and registered_hook_name(ddp) is None):
            stop_finding_unused_parameters(ddp)
            self.stopped_finding_unused = True
            log.info("compile_trainer: turned DDP's find_unused_parameters off (the Trainer turns it on by default, "
                     "and such a DDP never rebuilds its buckets, so they could not follow the partitions); a step "
                     "in which a parameter gets no gradient stops with an error. "
                     "TrainingArguments(ddp_find_unused_parameters=True) keeps it on.")
        self.compiled = compile_ddp(ddp, config=self.config)
        self.compiled.control.in_framework("compile_trainer", [TURNED_OFF] if self.stopped_finding_unused else [])

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.stopped_finding_unused or self.compiled is None:
            return
        ddp = self.compiled.ddp_model
        if not reducer_finalized(ddp):
            missing = [n for n, p in ddp.module.named_parameters() if p.requires_grad and p.grad is None]
            listed = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise RuntimeError(
                f"compile_trainer: at step {state.global_step + 1} DDP did not receive a gradient for every "
                f"parameter ({listed or 'unnamed'}), and compile_trainer had turned DDP's find_unused_parameters "
                "off (the Trainer's default turns it on), so this step's gradients were not all all-reduced. Pass "
                "TrainingArguments(ddp_find_unused_parameters=True) to keep DDP's search for unused parameters "
                "(DDP's buckets then stay unaligned with the partitions).")


def compile_trainer(trainer: Trainer, *, config: DDPCompileConfig | None = None,
                    **settings: Any) -> DDPCompileCallback:
    """Compile the DDP module ``trainer`` builds with ``compile_ddp`` when training begins
    (Note [HF Trainer route]).

    Args:
        trainer: the ``transformers.Trainer``, made and not yet training.
        config: a :class:`ddp_opt.DDPCompileConfig`, instead of keyword settings; not both.
        **settings: ``compile_ddp``'s keywords (``backend``, ``mode``, ``bucket_cap_mb``, ...);
            DDP's own cap is ``TrainingArguments(ddp_bucket_cap_mb=...)``.

    Returns:
        The callback, added to the trainer; ``callback.compiled`` once training began.

    Raises:
        ValueError: ``torch_compile=True`` in the arguments, both ``config`` and keywords, or
            ``optimizer=`` (the optimizer in backward; the Trainer clips after backward).
        SettingError: a bad setting, before training starts.
    """
    if trainer.args.torch_compile:
        raise ValueError(
            "compile_trainer: TrainingArguments(torch_compile=True) makes the Trainer compile the model itself, "
            "with PyTorch's own DDP splitter, and compiling it again would nest two compilers. Pass "
            "torch_compile=False (and the backend to compile_trainer(trainer, backend=...)), or drop compile_trainer.")
    if config is not None and settings:
        raise ValueError(
            f"compile_trainer(config=..., {', '.join(sorted(settings))}=...): a DDPCompileConfig carries every "
            "setting, so keywords given beside it would be silently dropped. Put them into the config or drop config=.")
    config = config or DDPCompileConfig.from_keywords("compile_ddp", settings)
    if config.optimizer is not None:
        raise ValueError(
            "compile_trainer(optimizer=...): the optimizer in backward does not fit the Trainer's loop, which clips "
            "the gradients after backward (TrainingArguments.max_grad_norm, 1.0 by default) and unscales fp16 ones "
            "before its own optimizer.step(), and would find none: the clipping would silently not happen. Drop "
            "optimizer= (the Trainer steps the optimizer after backward), or call compile_ddp(ddp, optimizer=opt) "
            "in a loop of your own.")
    callback = DDPCompileCallback(trainer, config)
    trainer.add_callback(callback)
    return callback
