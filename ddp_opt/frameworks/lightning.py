"""``CompiledDDPStrategy``: Lightning's ``DDPStrategy`` that compiles the DDP module it
builds with ``compile_ddp``, so a ``Trainer`` user's route is one line:
``Trainer(strategy=CompiledDDPStrategy(backend=..., bucket_cap_mb=...))`` instead of
``strategy="ddp"``.

This module imports ``lightning.pytorch`` and is imported only by its users;
``ddp_opt`` and ``ddp_opt.frameworks`` never import it.

Note [Lightning strategy]

Background
    Lightning's own recipe, ``trainer.fit(torch.compile(model))``, unwraps the compiled
    module and re-applies only the dynamo context, dropping the forward hooks that keep
    PyTorch's splitter out: its splitter then cuts at its own cap, DDP's buckets are never
    realigned, and small caps trip its assertions. ``compile_ddp`` needs the DDP module,
    and in Lightning only the strategy builds it.

Algorithm
    - Construction: ``DDPCompileConfig`` fields, ``bucket_cap_mb="auto"`` and
      ``torch.compile`` keywords go to ``compile_ddp``, the rest to ``DDPStrategy``; the
      config is checked here, so a bad setting fails before any process starts.
    - ``configure_ddp``: wrap in DDP as ``DDPStrategy._setup_model`` does, then
      ``compile_ddp``, which compiles the LightningModule's ``forward`` in place.
      ``strategy.model`` stays the DDP module, so ``no_sync``, precision, clipping and
      checkpoints work as under ``DDPStrategy``; the handle is ``strategy.compiled``.
    - Comm hooks are registered through the handle, on every device, so realignment
      keeps them. ``backward`` runs in ``compiled.backward_context()``.
    - The handle prints its line of Note [In control, once] on rank 0: Lightning's default
      verbosity shows no INFO record of ours.
    - A ``training_step`` that never calls ``self(...)`` would train uncompiled: the first
      step checks the compiled forward ran, and warns if not. ``teardown`` restores the
      user's module.

Notes
    Lightning internals used, pinned by ``tests/ddp_opt/test_framework_lightning.py``:
    ``DDPStrategy._setup_model`` (called) and ``LightningModule._compiler_ctx`` (a module
    given already compiled is refused: two nested compilers; so is one compiled in place,
    by ``compile_for_ddp`` or ``module.compile()``).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import warnings
from dataclasses import fields
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from .._torch_internals import is_compiled
from ..api import compile_ddp
from ..compiled import CompiledDDP
from ..config import DDPCompileConfig

log = logging.getLogger(__name__)

__all__ = ["CompiledDDPStrategy"]

# compile_ddp's settings (bucket_cap_mb only when "auto": a number is DDP's cap) and torch.compile's keywords.
_COMPILE_KEYWORDS = (frozenset(f.name for f in fields(DDPCompileConfig)) - {"spelling", "bucket_cap_mb"}
                     | (frozenset(inspect.signature(torch.compile).parameters) - {"model"}))
# What DDPStrategy passes on to DistributedDataParallel (the module and devices are the strategy's).
_DDP_KEYWORDS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self", "module", "device_ids", "output_device", "process_group", "device_mesh"}


class CompiledDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose DDP module is compiled by ``compile_ddp`` (Note [Lightning strategy]).

    Args:
        config: a :class:`DDPCompileConfig`, instead of compile keywords; not both.
        ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper: as for ``DDPStrategy``; the hook is
            registered on every device, kept across realignment.
        **kwargs: ``compile_ddp``'s settings (``backend``, ``strategy``, ``align_buckets``,
            ``cache_dir``, ``bucket_cap_mb="auto"``, ...), ``torch.compile``'s keywords, and
            ``DDPStrategy``'s and DDP's own (``bucket_cap_mb=4``, ``static_graph``, ``timeout``, ...).

    Attributes:
        compile_config: the compile settings, checked when the strategy is built.
        compiled: the :class:`CompiledDDP` handle of the running fit (``buckets``,
            ``realignment``, ``share``); None before the first fit's setup.

    Raises:
        SettingError (a ValueError), TypeError: a compile setting that cannot work, or an
            unknown keyword; when the strategy is built.
    """

    def __init__(self, *, config: DDPCompileConfig | None = None, ddp_comm_state: object | None = None,
                 ddp_comm_hook: Callable | None = None, ddp_comm_wrapper: Callable | None = None,
                 **kwargs: Any) -> None:
        settings = {name: kwargs.pop(name) for name in list(kwargs) if name in _COMPILE_KEYWORDS}
        if kwargs.get("bucket_cap_mb") == "auto":
            settings["bucket_cap_mb"] = kwargs.pop("bucket_cap_mb")
        _check_strategy_keywords(kwargs)
        if config is not None and settings:
            raise ValueError(
                f"CompiledDDPStrategy(config=..., {', '.join(sorted(settings))}=...): a DDPCompileConfig carries "
                "every compile setting, so keywords beside it would be silently dropped or silently win. Put them "
                "into the config (dataclasses.replace(config, backend='aot_eager')) or drop config=.")
        self.compile_config = config or DDPCompileConfig.from_keywords("CompiledDDPStrategy", settings)
        if self.compile_config.optimizer is not None:
            raise ValueError(
                "CompiledDDPStrategy(optimizer=...): the optimizer in backward does not fit Lightning's loop, which "
                "runs backward inside optimizer.step(closure) and after it clips (gradient_clip_val) and unscales "
                "(fp16) the gradients, which would find none: the clipping would silently not happen. Drop "
                "optimizer= (Lightning steps the optimizer after backward), or call compile_ddp(ddp, "
                "optimizer=opt) in a loop of your own.")
        _check_comm_hook(self.compile_config, ddp_comm_hook)
        super().__init__(ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook,
                         ddp_comm_wrapper=ddp_comm_wrapper, **kwargs)
        self._comm = (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)
        self.compiled: CompiledDDP | None = None
        self._forward: Callable | None = None  # the compiled forward set on the LightningModule
        self._forward_hook: torch.utils.hooks.RemovableHandle | None = None
        self._forward_ran = False
        self._first_step_checked = False

    def configure_ddp(self) -> None:
        """Wrap the LightningModule in DDP as ``DDPStrategy`` does, then compile it with ``compile_ddp``."""
        module = self.model
        assert isinstance(module, pl.LightningModule)
        _refuse_compiled(module)
        self.model = self._setup_model(module)
        self.compiled = compile_ddp(self.model, config=self.compile_config)
        self.compiled.control.in_framework("CompiledDDPStrategy")  # Note [In control, once]
        state, hook, wrapper = self._comm
        if hook is not None:
            self.compiled.register_comm_hook(state, wrapper(hook) if wrapper is not None else hook)
        self._forward = module.__dict__.get("forward")  # None under strategy="regional": the blocks are compiled
        self._forward_ran, self._first_step_checked = False, False
        if self._forward is not None:
            self._forward_hook = module.register_forward_pre_hook(self._saw_call)
        log.info("CompiledDDPStrategy: %s compiled with strategy=%r, backend=%r", type(module).__name__,
                 self.compiled.strategy, self.compile_config.backend)

    def backward(self, closure_loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Lightning's backward (precision plugin included) in ``compiled.backward_context()``."""
        context = self.compiled.backward_context() if self.compiled is not None else contextlib.nullcontext()
        with context:
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if not self._first_step_checked and self._forward is not None:
            self._first_step_checked = True
            self._forward_hook.remove()
            if not self._forward_ran:
                name = type(self.lightning_module).__name__
                warnings.warn(
                    f"CompiledDDPStrategy: {name}.training_step did not call {name}.forward (self(batch)), which is "
                    "what the strategy compiles, so the step ran uncompiled. Compute the model's output in forward "
                    "and call self(...) in training_step, or use strategy='ddp' to train uncompiled.", stacklevel=2)
        return out

    def teardown(self) -> None:
        module = self.lightning_module
        if self._forward_hook is not None:
            self._forward_hook.remove()
        if module is not None and self._forward is not None and module.__dict__.get("forward") is self._forward:
            del module.forward  # the class's forward again: the module is the user's own after fit
        self._forward = None
        super().teardown()

    def _saw_call(self, module: torch.nn.Module, args: Any) -> None:
        # Lightning's forward redirection calls the module once with its forward patched to training_step;
        # the compiled forward is in place when training_step calls self(...).
        if torch.is_grad_enabled() and module.__dict__.get("forward") is self._forward:
            self._forward_ran = True


def _refuse_compiled(module: pl.LightningModule) -> None:
    # from_compiled marks Lightning's recipe with _compiler_ctx; compile_for_ddp and module.compile() compile in place.
    if getattr(module, "_compiler_ctx", None) is not None or is_compiled(module):
        raise RuntimeError(
            f"CompiledDDPStrategy: the {type(module).__name__} given to trainer.fit is already compiled "
            "(torch.compile(model) or compile_for_ddp(model)), and the strategy compiles it itself once DDP wraps "
            "it; compiling twice would nest two compilers. Pass the uncompiled module (drop torch.compile), or "
            "use strategy='ddp' to keep your own compile.")


def _check_comm_hook(config: DDPCompileConfig, hook: Callable | None) -> None:
    if hook is None:
        return
    if config.strategy == "traced":
        raise ValueError(
            "CompiledDDPStrategy(strategy='traced', ddp_comm_hook=...): the traced strategy all-reduces the "
            "gradients inside the compiled backward graph, where a DDP bucket hook cannot run. Drop ddp_comm_hook, "
            "or use strategy='split' (the default) to keep it.")
    owner = "reduce_dtype" if config.reduce_dtype is not None else "compression"
    if getattr(config, owner) is not None:
        raise ValueError(
            f"CompiledDDPStrategy({owner}=..., ddp_comm_hook=...): {owner} all-reduces the gradients through a comm "
            f"hook of its own, and DDP calls one hook. Drop ddp_comm_hook, or pass {owner}=None to reduce through "
            "your hook.")


def _check_strategy_keywords(kwargs: dict[str, Any]) -> None:
    """Every keyword left for ``DDPStrategy`` must be its own or DDP's (it passes the rest to DDP)."""
    own = set(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}
    for name in kwargs:
        if name in own or name in _DDP_KEYWORDS:
            continue
        known = sorted(own | _DDP_KEYWORDS | _COMPILE_KEYWORDS | {"bucket_cap_mb", "config"})
        near = difflib.get_close_matches(name, known, n=1)
        raise TypeError(
            f"CompiledDDPStrategy() got an unexpected keyword argument {name!r}: it is neither a compile_ddp setting "
            "(the fields of ddp_opt.DDPCompileConfig), nor one of torch.compile's, DDPStrategy's or "
            "DistributedDataParallel's keywords, so nothing would take it. "
            + (f"Did you mean {near[0]}=?" if near else "Check its spelling, or drop it."))
