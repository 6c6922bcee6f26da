"""compile_ddp: the user-facing entry point. Compile a DDP-wrapped model so that
its graph is split where DDP's real buckets are."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from compiler import CompileCache, compile_blocks
from compiler.cache import open_cache
from compiler.ranks import gate_for_group, share_for_group

from ._torch_internals import is_compiled, no_builtin_ddp_splitter
from .planning.solver import LinkEstimate
from .compiled import CompiledDDP
from .compression.hooks import link_probe
from .config import DDPCompileConfig, keyword_signature
from .planning.cost import CostModel, DeviceRates, measure_link, measure_rates
from .compression.powersgd import link_probe as powersgd_probe, measure_hook_compute
from .strategies.rules import RULES
from .strategies.table import STRATEGIES, Setup, caps_from_ddp, ddp_backend, strategy_for
from .setup import prepare

log = logging.getLogger(__name__)

__all__ = ["CompiledDDP", "caps_from_ddp", "compile_ddp", "resolve_cost_model"]


def _cache_for(ddp_model: DistributedDataParallel, cache_dir: str | os.PathLike, settings: dict[str, Any],
               any_world_size: bool) -> CompileCache:
    """The compile cache entry of this model and config; loaded now (``compiler.cache.store.open_cache``:
    Inductor's local cache goes under ``cache_dir`` unless the user chose its directory). One
    entry for every world size (``any_world_size``), except where the strategy's backward graph holds
    the all-reduces of DDP's group (traced; Note [Compile cache])."""
    return open_cache(ddp_model.module, cache_dir, settings,
                      world_size=dist.get_world_size(ddp_model.process_group), any_world_size=any_world_size)


def keep_builtin_splitter_out(module: torch.nn.Module) -> None:
    """Switch PyTorch's own DDP splitter off for the duration of each call of ``module``
    (the DDP model, or a module compiled before DDP wraps it).

    Dynamo hands a graph captured under an active DDP module to PyTorch's splitter
    whenever ``torch._dynamo.config.optimize_ddp`` is on; it would split our
    partitions again with its own caps. The patch is entered before forward and
    left after it, also when forward raises, so no global flag stays flipped."""
    scopes: list[contextlib.ExitStack] = []

    def enter(module, args):
        stack = contextlib.ExitStack()
        stack.enter_context(no_builtin_ddp_splitter())
        scopes.append(stack)

    def leave(module, args, output):
        if scopes:
            scopes.pop().close()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def resolve_cost_model(ddp_model: DistributedDataParallel, config: DDPCompileConfig) -> CostModel | None:
    """The cost model ``compile_ddp(bucket_cap_mb=..., link=...)`` plans with; None for DDP's caps.

    Measures (all ranks together) what ``config.link`` does not give; see Note [Cost measurement].
    With ``reduce_dtype`` or ``compression`` the link is measured as the gradients travel,
    narrowed or compressed (Note [Reduced-precision all-reduce], Note [PowerSGD compression]).
    """
    link = config.link
    if not config.uses_cost_model:
        return None
    if isinstance(link, CostModel):
        return link
    group = ddp_model.process_group
    device = next((p.device for p in ddp_model.module.parameters()), torch.device("cpu"))
    if link is None and config.reduce_dtype is not None:
        link = link_probe(config.reduce_dtype, group)
    if link is None and config.compression is not None:
        link = powersgd_probe(config.compression, group)
    est = link if isinstance(link, LinkEstimate) else measure_link(link, group=group, device=device)
    rates: DeviceRates = measure_rates(device, group=group)
    if config.compression is not None and RULES[config.strategy].reducer:
        # the reducer's hook compresses each bucket on the cores backward runs on (Note [PowerSGD compression])
        return CostModel(est, rates, hook=measure_hook_compute(config.compression, device, group=group))
    return CostModel(est, rates)


def compile_ddp(ddp_model: DistributedDataParallel, *, config: DDPCompileConfig | None = None,
                **settings: Any) -> CompiledDDP:
    """Compile a DDP model, split at the bucket boundaries DDP really uses.

    Args:
        ddp_model: a ``DistributedDataParallel`` module.
        backend: dynamo backend name (``"inductor"``, ``"aot_eager"``, ...) or a
            callable ``(gm, example_inputs) -> callable``.
        mode, options: inductor mode and options, as for ``torch.compile``.
        dynamic: as for ``torch.compile``.
        fullgraph: as for ``torch.compile``; applies to the wrapped module's
            forward (the bucket splits are not graph breaks in dynamo's sense).
            The wrapped module's ``forward`` is compiled in place; compile
            before making copies of the module (``copy.deepcopy``), since a copy
            would share the compiled forward of the original.
        strategy: how the model is compiled, one of ``ddp_opt.config.STRATEGIES``:
            ``"split"`` (the default) splits the forward at the bucket boundaries
            and DDP's reducer all-reduces each bucket; ``"whole"`` compiles each
            captured graph whole (no overlap of gradient communication with
            backward; for comparison); ``"regional"`` compiles each repeated
            block once (below); ``"traced"`` compiles the forward whole and
            traces the all-reduces into one compiled backward graph, fused into
            buckets of DDP's caps or, with ``bucket_cap_mb="auto"``, of the
            cost-model plan (Note [Traced strategy]). Under ``"traced"`` run the
            backward as ``compiled.backward(loss)``; it falls back to ``"split"``
            with a warning where it cannot run (a comm hook already registered,
            ``find_unused_parameters=True``, a torch without compiled autograd).
        fallback: ``"warn"`` runs a partition that fails to compile eagerly,
            ``"raise"`` re-raises the backend's error.
        check_plans: fail on every rank, with the first differing bucket named,
            when ranks plan different buckets (which would deadlock in backward).
        align_buckets: after the first step, make DDP's runtime buckets equal
            the partitions (otherwise DDP's rebuild can make a bucket straddle
            two partitions and wait for the later one). Register comm hooks
            through the returned object's ``register_comm_hook``. With
            graph breaks, the partitions of every graph count (Note [Plans
            across graphs]); a warning says why when alignment is not reached.
        wrap_backend: applied to the backend dynamo calls (the splitter, or the
            plain backend with ``strategy="whole"``), e.g. ``Diagnoser().wrap`` to see
            every captured graph and its graph-break reason.
        bucket_cap_mb: None splits at DDP's own caps; ``"auto"`` chooses the
            buckets by the cost model (Note [Cost-model bucket plan]): the link
            and this device are measured here, once, on all ranks together (rank
            0's numbers broadcast), and with ``align_buckets`` DDP's runtime
            buckets follow the chosen partitions once realigned. The plan and its
            predicted timeline are logged and kept in ``compiled.prediction``.
        link: with ``"auto"``: None measures ``dist.all_reduce`` on DDP's group;
            a callable ``probe(tensor) -> Future/Work`` measures that path instead
            (e.g. a comm hook's, such as the benchmark's ``SimulatedLink.probe``);
            a ``LinkEstimate`` skips the link measurement; a ``CostModel`` skips
            all measuring. Given without ``"auto"``, the graph is split at DDP's
            caps as usual and the model only predicts that plan's timeline
            (``compiled.prediction``).
        cache_dir: a persistent compile cache (Note [Compile cache]): the entry
            for this model, config, world size, torch version and device is
            loaded now, and saved after the first step (or by
            ``save_compile_cache()``). A stale, foreign or corrupt entry is
            ignored with a warning. Loading a cache is loading code: the
            directory must be as trusted as the training code.
        blocks: with ``strategy="regional"`` (each repeated block compiled once and
            reused for every instance, DDP's buckets made of whole blocks, the
            rest of the model eager; Note [Regional compile]), which blocks:
            ``"auto"`` (the children of a ModuleList, ModuleDict or Sequential of
            one class, else repeated children of one class; Note [Finding
            blocks]), such a container's name, or module names.
        share: the first rank of DDP's group to reach a graph or partition
            compiles it and the others load its artifacts instead of compiling it
            again, and a rank leaves a graph's compile only when every rank that
            compiles it is done, so the first all-reduce after a compile cannot
            time out because one rank compiled longer (Note [Shared compile]).
            False: every rank compiles for itself, no barrier.
        share_timeout_s: the longest a rank waits for another rank's compile
            before it compiles for itself (with a warning).
        reduce_dtype: None all-reduces the gradients in their own dtype; ``torch.bfloat16``
            (or ``"bf16"``; ``torch.float16``, ``"fp16"``) all-reduces them in that dtype,
            averaged, and widens the result for the optimizer: half the bytes on the wire
            (Note [Reduced-precision all-reduce]). Under the reducer strategies it is a comm
            hook of its own, kept across realignment; under ``"traced"`` the cast is in the
            compiled backward. Not with a comm hook of the user's.
        compression: None, or ``"powersgd:R"`` (``"powersgd:R:START"``): rank-R PowerSGD
            with error feedback and warm start from step START (default 10), through
            PyTorch's ``powerSGD_hook``, kept across realignment
            (Note [PowerSGD compression]); under ``"traced"`` in the compiled backward
            (Note [Traced PowerSGD]). Not with ``reduce_dtype`` or a comm hook of the user's.
        step_gate: the ranks meet in the store before each synchronised step's
            first collective (after the forward; under ``"traced"`` inside the
            backward), so that a rank compiling alone (a shape only it saw, a cold
            cache) is waited for there, as long as it is alive, and never inside a
            collective, whose timeout a long compile would trip (Note [Step gate]).
            A few requests to the store per step. False: no gate.
        optimizer: None, or the optimizer of this model's parameters (``torch.optim.SGD``,
            ``AdamW``, ...): each bucket's parameters are updated by it inside backward, as soon
            as the bucket's gradients are reduced, and their gradients freed right after
            (Note [Optimizer in backward]). Its own groups, state and hyper-parameters are used, so
            LR schedulers act on it and its ``state_dict`` checkpoints as before; the loop's
            ``optimizer.step()`` and ``zero_grad()`` after backward find no gradients and change
            nothing. Under ``no_sync`` the update waits for the synchronising backward. Not with
            global-norm clipping or a GradScaler after backward (they need every gradient before any
            update), an optimizer whose step takes a closure (LBFGS), ``find_unused_parameters=True``
            or a comm hook of the user's.
        config: all of the above as one :class:`DDPCompileConfig` (validated when
            built), instead of the keyword arguments; not both.
        **more: passed on to ``torch.compile``.

    Returns:
        A :class:`CompiledDDP`; call it as you would call ``ddp_model``.

    Raises:
        SettingError (a ValueError): a setting that cannot work, before anything
            is measured or compiled.
    """
    if config is not None and settings:
        raise ValueError(
            f"compile_ddp(config=..., {', '.join(sorted(settings))}=...): a DDPCompileConfig carries every setting, "
            "so keywords given beside it would be silently dropped or silently win. Put them into the config "
            "(dataclasses.replace(config, backend='aot_eager')) or drop config=."
        )
    return _compile(ddp_model, config or DDPCompileConfig.from_keywords("compile_ddp", settings))


compile_ddp.__signature__ = keyword_signature(
    inspect.Parameter("ddp_model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=DistributedDataParallel))


def _compile(ddp_model: DistributedDataParallel, config: DDPCompileConfig) -> CompiledDDP:
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"compile_ddp expects a DistributedDataParallel module, got {type(ddp_model).__name__}. "
            "Wrap the model first: compile_ddp(DistributedDataParallel(model, ...)); for FSDP2's replicate "
            "(torchtitan's data parallelism) use fsdp_opt.apply(model, replicate=True, compile=...) on the "
            "unwrapped model; for a model without data parallelism use torch.compile directly."
        )
    inner = ddp_model.module
    if is_compiled(inner):
        raise RuntimeError(
            f"compile_ddp: the module inside this DDP ({type(ddp_model.module).__name__}) is already compiled "
            "(torch.compile(model), module.compile(), compile_for_ddp(model) or an earlier compile_ddp call). "
            "Compiling it again would nest two compilers. Call compile_ddp once, on a DDP model whose module is "
            "not compiled; or, to compile before wrapping in DDP (nanoGPT's order), replace torch.compile(model) "
            "with ddp_opt.compile_for_ddp(model) and drop compile_ddp."
        )
    strategy, why = strategy_for(ddp_model, config.strategy)
    entry = STRATEGIES[strategy]
    prepared = prepare("compile_ddp", ddp_model, config, strategy, stacklevel=3)  # the one setup (ddp_opt.setup)
    if why is not None:  # said once the setup took the module: a refusal comes first
        warnings.warn(f"compile_ddp(strategy={config.strategy!r}) runs the split strategy instead: {why}. To "
                      "silence this, pass strategy='split'.", stacklevel=3)
    own, in_backward, align = prepared.own, prepared.in_backward, prepared.align
    if in_backward is not None:
        entry.prepare_update(ddp_model, config)  # before DDP is converted, and before its first iteration
    cost_model = resolve_cost_model(ddp_model, config)
    caps = caps_from_ddp(ddp_model)
    cache = None
    if config.cache_dir is not None:
        cache = _cache_for(ddp_model, config.cache_dir, dict(config.cache_settings(), caps=repr(caps)),
                           any_world_size=entry.rules.reducer)
    group = dist.get_process_group_ranks(ddp_model.process_group)
    share = share_for_group(group, timeout_s=config.share_timeout_s, name="ddp") if config.share else None
    gate = gate_for_group(group, name="ddp") if config.step_gate else None
    # Keyed as a shared compile keys it (one cache entry for every world size), and before the step gate:
    # a backward compiled at the first backward would compile past it (Note [Step gate]).
    built = ddp_backend(Setup(ddp_model, config, inner, cost_model, gate), strategy, share,
                        backward_with_forward=(cache is not None or gate is not None) and entry.rules.reducer)
    more = dict(config.torch_compile_kwargs)
    if built.blocks is not None:  # regional: each block compiled, the rest of the forward eager
        compile_blocks(built.blocks, built.backend, dynamic=config.dynamic, fullgraph=config.fullgraph, **more)
    else:
        # Compile the wrapped module's forward in place, then let DDP call it (the
        # order torchtitan uses). torch.compile(ddp_model) would leave dynamo to find
        # frames below DDP's skipped forward, and it skips a torch.nn container's
        # forward (nn.Sequential) too, compiling nothing; nn.Module.compile() misses
        # it the same way. In place, state_dict keys stay DDP's.
        inner.forward = torch.compile(inner.forward, backend=built.backend, dynamic=config.dynamic,
                                      fullgraph=config.fullgraph, **more)
    keep_builtin_splitter_out(ddp_model)
    return CompiledDDP(ddp_model, built.splitter, align_buckets=align, strategy=strategy,
                       block_buckets=built.block_buckets, compile_cache=cache, share=share, traced=built.traced,
                       gate=gate, own_hook=own, in_backward=in_backward, control=prepared.control)

