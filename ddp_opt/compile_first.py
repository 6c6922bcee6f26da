"""``compile_for_ddp``: compile a model before DDP wraps it (nanoGPT's order), with
the graph split where DDP's buckets are, as ``compile_ddp`` splits it.

Note [Compile before wrap]

Background
    Many scripts (nanoGPT's ``train.py`` among them) write ``model =
    torch.compile(model)`` and then ``model = DDP(model)``. PyTorch's own
    splitter supports that order: when dynamo compiles a frame while a DDP
    forward is running, it reads that DDP's cap and splits. ``compile_ddp``
    needs the DDP module up front, so that order would need four changed lines.

Algorithm
    ``compile_for_ddp(model)`` compiles ``model`` in place, as ``model.compile()`` would,
    with a backend that waits for its first graph to learn which DDP module it runs
    under (DDP's forward marks itself active, as PyTorch's splitter reads it too). For
    the first DDP module seen, it builds what ``compile_ddp`` builds: the splitter
    with that module's caps (first-bucket cap and ``bucket_cap_mb_list`` included),
    shared compile and the compile barrier over its group, and a
    :class:`CompiledDDP` whose before/after steps run as forward hooks on the DDP
    module, so bucket realignment happens at the same call as under ``compile_ddp``.
    A graph compiled with no DDP forward running (the model called outside DDP) is
    compiled whole, as ``torch.compile`` would. Each call of the model runs with
    PyTorch's splitter switched off, around the compiled call, before dynamo meets
    the frame (it decides on its splitter there).

Notes
    - In place, not a wrapper: the object returned is ``model``, with its class, its
      ``forward`` (and signature) and its state-dict keys (no ``_orig_mod.``). So
      frameworks treat it as the user's module: Lightning's checkpoints, Accelerate's
      ``unwrap_model`` and ``save_state``, the HF Trainer's column check (it reads
      ``forward``'s signature) all see what they see uncompiled; none of them unwraps
      or re-wraps it (they look for torch.compile's ``OptimizedModule``), so nothing
      drops the switch above. ``model.forward(x)`` called directly runs uncompiled,
      and a copy (``copy.deepcopy``) is uncompiled, as after ``model.compile()``.
    - The compiled frame is a function of ours, with a code object per model, that
      calls the module's own call (hooks and forward): dynamo does not start a frame
      inside ``torch.nn`` (``Module.compile`` on ``nn.Sequential`` compiles nothing on
      torch 2.13), and counts its recompile limit per code object.
    - Settings that need the DDP module before the first forward (the cost
      model's link measurement, the compile cache, regional compile, the traced
      strategy) are ``compile_ddp``'s only; they are refused here with that advice.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel

from compiler import SettingError
from compiler.ranks import gate_for_group, share_for_group

from ._torch_internals import (active_ddp_module, builtin_splitter_on, compile_call_in_place, compiled_call, is_compiled,
                               no_builtin_ddp_splitter)
from .setup import prepare
from .in_backward.reducer import grads_in_buckets
from .compiled import CompiledDDP
from .config import DDPCompileConfig
from .strategies.rules import RULES
from .strategies.table import Setup, ddp_backend

log = logging.getLogger(__name__)

__all__ = ["compile_for_ddp", "compiled_ddp_of"]

# compile_ddp settings that need the DDP module before the first forward.
_ONLY_COMPILE_DDP = ("bucket_cap_mb", "link", "cache_dir", "blocks")


def compile_for_ddp(model: nn.Module, *, config: DDPCompileConfig | None = None, **settings: Any) -> nn.Module:
    """``torch.compile(model)`` for a model that is wrapped in DDP afterwards: under DDP,
    each graph is split where DDP's buckets are, and DDP's buckets are realigned with the
    partitions, as ``compile_ddp`` does (Note [Compile before wrap]).

    Args:
        model: the model, not yet wrapped in DDP.
        config: a :class:`DDPCompileConfig`, instead of keyword settings; not both.
        **settings: ``compile_ddp``'s keywords (``backend``, ``mode``, ``options``, ``dynamic``,
            ``fullgraph``, ``fallback``, ``strategy`` (``"split"`` or ``"whole"``), ``check_plans``,
            ``align_buckets``, ``share``, ``share_timeout_s``, ``step_gate``, ``reduce_dtype``, ``compression``,
            ``wrap_backend``) and ``torch.compile``'s. The step gate (Note [Step gate]) starts at the second synchronised step.

    Returns:
        ``model`` itself, compiled in place: its class, ``forward`` and state-dict keys unchanged.
        Wrap it in DDP and train.

    Raises:
        SettingError: a setting only ``compile_ddp`` supports, or a bad value.
        TypeError: a DDP module, or a module ``torch.compile`` or ``Module.compile`` compiled already.
    """
    if isinstance(model, DistributedDataParallel):
        raise TypeError(
            "compile_for_ddp(model) compiles a model before DDP wraps it, and got a DistributedDataParallel "
            "module. For a model already wrapped, call ddp_opt.compile_ddp(ddp_model) instead.")
    if is_compiled(model) and _backend_of(model) is None:
        raise TypeError(
            f"compile_for_ddp(model): the {type(model).__name__} given is already compiled (torch.compile(model) or "
            "model.compile()), and compiling it again would nest two compilers. Pass the uncompiled model: "
            "compile_for_ddp(model) takes the place of torch.compile(model).")
    if config is not None and settings:
        raise ValueError(
            f"compile_for_ddp(config=..., {', '.join(sorted(settings))}=...): a DDPCompileConfig carries every "
            "setting, so keywords beside it would be silently dropped. Put them into the config or drop config=.")
    if config is None:
        config = DDPCompileConfig.from_keywords("compile_for_ddp", settings)
    default = DDPCompileConfig()
    refused = [name for name in _ONLY_COMPILE_DDP if getattr(config, name) != getattr(default, name)]
    if not RULES[config.strategy].compile_first:
        refused.insert(0, "strategy")
    if refused:
        raise SettingError(
            refused[0],
            f"compile_for_ddp({refused[0]}={getattr(config, refused[0])!r}): this setting needs the DDP module before the first forward "
            "(to measure the link, key the cache, or compile blocks or the backward), and a model compiled before "
            "DDP wraps it meets its DDP module only then. Wrap first and call "
            "compile_ddp(DistributedDataParallel(model), ...) to use it, or drop it here.")
    backend = _DeferredBackend(model, config)
    compile_call_in_place(model, functools.partial(_splitter_out_call, backend, config))
    return model


def _splitter_out_call(backend: _DeferredBackend, config: DDPCompileConfig, call_impl: Callable) -> Callable:
    """What the model's ``__call__`` runs once compiled in place (Note [Compile before wrap]):
    ``call_impl`` (the module's hooks and forward) compiled with ``backend``, called with
    PyTorch's DDP splitter switched off."""

    def call(*args: Any, **kwargs: Any) -> Any:  # the frame dynamo compiles: ours, so not skipped as torch.nn's
        return call_impl(*args, **kwargs)

    # A code object of its own: dynamo keeps compiled code, and counts recompiles against its limit, per code
    # object, so models sharing one would share that limit (the 9th model of another shape ran uncompiled).
    call.__code__ = call.__code__.replace()
    compiled = torch.compile(call, backend=backend, dynamic=config.dynamic, fullgraph=config.fullgraph,
                             **dict(config.torch_compile_kwargs))

    def run(*args: Any, **kwargs: Any) -> Any:
        ddp_model = active_ddp_module()
        if ddp_model is not None and backend.ddp_model is None:  # the first forward under DDP: the setup runs
            backend.attach(ddp_model)  # here, outside dynamo, so that a refusal reaches the user as raised
        with no_builtin_ddp_splitter():
            return compiled(*args, **kwargs)

    run.ddp_opt_backend = backend
    return run


def _backend_of(model: nn.Module) -> _DeferredBackend | None:
    backend = getattr(compiled_call(model), "ddp_opt_backend", None)
    return backend if isinstance(backend, _DeferredBackend) else None


def compiled_ddp_of(model: nn.Module) -> CompiledDDP | None:
    """What :func:`compile_for_ddp` built for the DDP module ``model`` runs under (its ``buckets``,
    ``aligned_caps``, ``realignment``, ``share``), once the first forward under DDP compiled;
    None before, or for a module ``compile_for_ddp`` did not compile."""
    backend = _backend_of(model)
    return backend.controller if backend is not None else None


class _DeferredBackend:
    """The dynamo backend of :func:`compile_for_ddp`: builds the DDP pieces at the first
    graph compiled under a DDP forward, then hands every graph to them."""

    def __init__(self, model: nn.Module, config: DDPCompileConfig) -> None:
        self.model, self.config = model, config
        self.plain = config.resolve_backend()
        self.ddp_model: DistributedDataParallel | None = None
        self.controller: CompiledDDP | None = None
        self._backend: Callable | None = None
        self._warned_builtin = False

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        ddp_model = active_ddp_module()
        if ddp_model is None:  # called outside DDP: compiled whole, as torch.compile would
            return self.plain(gm, example_inputs)
        if builtin_splitter_on() and not self._warned_builtin:
            self._warned_builtin = True
            warnings.warn(
                "compile_for_ddp: a graph captured under DDP reached this backend with PyTorch's own DDP splitter "
                "switched on (torch._dynamo.config.optimize_ddp), so PyTorch split it at its own bucket caps first "
                "and this graph is one of its pieces: the plan is PyTorch's, not ddp_opt's, and DDP's buckets are "
                "not realigned with it. Something ran the model's graphs with this backend outside the call "
                "compile_for_ddp set on the model, which switches PyTorch's splitter off. Call the model itself "
                "(model(x), as DDP does), or wrap in DDP first and call compile_ddp(ddp_model); under Lightning "
                "use ddp_opt.frameworks.lightning's strategy.", stacklevel=2)
        if self.ddp_model is None:
            self.attach(ddp_model)
        elif ddp_model is not self.ddp_model:
            raise RuntimeError(
                "compile_for_ddp: this compiled model runs under a second DistributedDataParallel module. Its "
                "splitter follows the first DDP's buckets and process group. Compile the model once per DDP "
                "module: compile_for_ddp(model) before each DDP(...).")
        return self._backend(gm, example_inputs)

    def attach(self, ddp_model: DistributedDataParallel) -> None:
        """Set up for ``ddp_model`` (Note [One setup for both entry points]) and build the backend."""
        config = self.config
        prepared = prepare("compile_for_ddp", ddp_model, config, config.strategy, stacklevel=3)
        own, in_backward = prepared.own, prepared.in_backward
        if in_backward is not None:  # DDP's reducer is in use: realignment's new reducer takes it
            grads_in_buckets(ddp_model, rebuild_now=False)
        self.ddp_model = ddp_model
        group = dist.get_process_group_ranks(ddp_model.process_group)
        share = share_for_group(group, timeout_s=config.share_timeout_s, name="ddp") if config.share else None
        gate = gate_for_group(group, name="ddp") if config.step_gate else None
        # The backward compiles before the step gate, as under compile_ddp.
        built = ddp_backend(Setup(ddp_model, config, self.model, gate=gate), config.strategy, share,
                            backward_with_forward=gate is not None)
        self._backend = built.backend
        # The first call is under way: CompiledDDP's hooks on the DDP module run from the second on,
        # where realignment happens.
        self.controller = CompiledDDP(ddp_model, built.splitter, align_buckets=prepared.align,
                                      strategy=config.strategy,
                                      share=share, gate=gate, own_hook=own, in_backward=in_backward,
                                      control=prepared.control)
        self.controller.gate_from_next()
        log.info("compile_for_ddp: splitting at the buckets of %s (%d ranks)", type(ddp_model).__name__,
                 dist.get_world_size(ddp_model.process_group))
