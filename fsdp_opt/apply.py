"""``apply``: shard a model with FSDP2 (``fully_shard``) and compile it block by
block. One function holds the wrapping order; the plan it follows is made first
(``plan_fsdp``) and can be inspected without a process group."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from compiler import cache_settings, compile_blocks
from compiler.cache import open_cache
from compiler.graph import build_backend, keyword_signature, refuse_unknown_keywords
from compiler.ranks import share_for_group

from ._torch_internals import checkpoint_wrapper, compiled_autograd_active, replicate_with_fsdp
from .config import COMPILED_AUTOGRAD_WHY, FSDPCompileConfig, FSDPConfig
from .plan import FSDPPlan, plan_fsdp

log = logging.getLogger(__name__)

__all__ = ["apply", "check_no_compiled_autograd", "default_mesh"]


def apply(model: nn.Module, config: FSDPConfig | None = None, *, mesh: DeviceMesh | None = None,
          **settings: Any) -> FSDPPlan:
    """Shard ``model`` in place with FSDP2, compiling each block first.

    Give the settings either as one :class:`FSDPConfig` or as keywords, not both.
    The keywords are the fields of :class:`FSDPConfig`, by name and default
    (``inspect.signature(apply)`` lists them; Note [Keywords from a config]).

    Order, and why (the order torchtitan uses):

    1. Activation checkpointing wraps each block first, so that the module the
       parent calls is the wrapper: compile then captures the checkpoint (and
       AOTAutograd's partitioner plans the recompute), and fully_shard puts its
       hooks outside the recomputed region.
    2. Each block is compiled before sharding, in place (``Module.compile``).
       That is lazy: nothing is traced until the first forward, which runs
       after FSDP's pre-forward hook has all-gathered the parameters, so the
       graph sees plain unsharded tensors and no collectives; FSDP's hooks
       (dynamo-disabled) run eagerly around it. In place keeps the module
       identity: ``fully_shard`` then shards that same module, parameter
       names have no ``_orig_mod.``, and the blocks stay ``FSDPModule``s
       (prefetch, ``unshard``). The repeated block is traced once and its graph
       reused for the others.
    3. ``fully_shard`` per shard unit, bottom-up, then on the root (which takes
       every parameter left: embeddings, final norm, head).
    4. Explicit prefetch: each unit all-gathers the next ``prefetch`` units in
       forward and the previous ones in backward.

    Args:
        model: the unsharded model, on CPU or on this rank's device.
        config: every setting as one :class:`FSDPConfig`; None to take them from
            the keywords (all defaults when none is given).
        mesh: a 1-D device mesh of the data-parallel ranks (2-D for HSDP); None
            for all ranks of the default process group.
        **settings: the fields of :class:`FSDPConfig` (``blocks``, ``compile``,
            ``prefetch``, ...), each as a keyword.

    Returns:
        The plan that was applied (``print(plan.table())`` shows the units).

    Raises:
        ValueError: ``config`` together with keywords, blocks not found, an
            unknown backend, a model already sharded, or a compile setting that
            does not work with FSDP2 (see :class:`FSDPCompileConfig`).
        TypeError: a keyword that is no field of :class:`FSDPConfig`.
        RuntimeError: compiled autograd is enabled, or no process group.

    Example:
        >>> plan = fsdp_opt.apply(model, compile="aot_eager", shard_unit_mb=4)
        >>> plan = fsdp_opt.apply(model, FSDPConfig(compile="aot_eager", shard_unit_mb=4))
        >>> loss = model(x, y)[1]; loss.backward(); opt.step()
    """
    refuse_unknown_keywords("fsdp_opt.apply", settings, FSDPConfig)
    config = FSDPConfig(**settings) if config is None else _only_config(config, settings)
    check_no_compiled_autograd("fsdp_opt.apply")
    model_name = type(model).__name__  # before fully_shard renames the class (FSDP<name>)
    sharded = [name or "(root)" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(
            f"fsdp_opt.apply: {model_name} is already sharded by fully_shard (at {sharded[:3]}): a parameter "
            "can belong to one shard unit only. Apply once, to the unsharded model."
        )
    plan = plan_fsdp(model, config)  # fails on missing blocks before anything changes
    if config.strategy == "traced":
        return _apply_traced(model, config, mesh, plan, model_name)
    cc = config.compile
    backend = cc.resolve_backend() if cc else None
    mesh = mesh if mesh is not None else default_mesh(_device_type_of(model))
    _check_offload(config.offload_policy)
    if _rank() == 0:
        log.info("fsdp_opt: %d blocks in %d shard units, prefetch %d, compile %s\n%s",
                 len(plan.block_names), len(plan.units), config.prefetch,
                 _describe_compile(cc), plan.table())

    if cc is not None and cc.cache_dir is not None:  # before the first compile, and before fully_shard renames
        plan = dataclasses.replace(plan, compile_cache=open_cache(model, cc.cache_dir, _cache_settings(config),
                                                                  world_size=mesh.size()))
    share = share_for_group(dist.get_process_group_ranks(mesh.get_group()),
                            timeout_s=cc.share_timeout_s, name="fsdp") if cc is not None and cc.share else None
    if share is not None:  # Note [Shared compile]
        backend = build_backend(backend, share=share)  # Note [Backend wrapping order]
        plan = dataclasses.replace(plan, share=share)
    modules = dict(model.named_modules())
    found = {name: modules[name] for name in plan.block_names}
    if config.checkpointing:
        found = {name: _checkpoint_wrap(model, name, block) for name, block in found.items()}
    if cc is not None and not cc.whole_model:
        compile_blocks(list(found.items()), backend, fullgraph=cc.fullgraph, dynamic=cc.dynamic)

    shard_kwargs = dict(mesh=mesh, mp_policy=config.mp_policy or MixedPrecisionPolicy())
    if config.offload_policy is not None:
        shard_kwargs["offload_policy"] = config.offload_policy
    # replicate: nothing sharded, so nothing to reshard; each unit's gradients are all-reduced together.
    wrap = replicate_with_fsdp() if config.replicate else fully_shard
    unit_kwargs = {} if config.replicate else dict(reshard_after_forward=config.reshard_after_forward)
    units: list[nn.Module] = []
    for unit in plan.units:
        members = [found[name] for name in unit.blocks]
        wrap(members if len(members) > 1 else members[0], **unit_kwargs, **shard_kwargs)
        units.append(members[0])  # a grouped unit's modules share one FSDP state
    # The root keeps its parameters gathered after forward (None = FSDP2's choice
    # for a root): they are the first ones backward needs.
    wrap(model, **({} if config.replicate else dict(reshard_after_forward=None)), **shard_kwargs)
    _set_prefetch(model, units, config.prefetch)

    model.register_forward_pre_hook(functools.partial(_forward_guard, model_name), prepend=True)
    if cc is not None and cc.whole_model:
        log.warning("fsdp_opt: whole-model compile of an FSDP2 model: FSDP's hooks are dynamo-disabled, "
                    "so the top frame runs eagerly; per-block compile (whole_model=False) is the recipe.")
        model.compile(backend=backend, fullgraph=False, dynamic=cc.dynamic)
    return plan


def _apply_traced(model: nn.Module, config: FSDPConfig, mesh: DeviceMesh | None, plan: FSDPPlan,
                  model_name: str) -> FSDPPlan:
    """``strategy="traced"``: refusals first (one line each, the fix included), then the
    traced sharding and compile of ``fsdp_opt.traced``."""
    from .traced import apply_traced, traced_refusal

    why = traced_refusal(config, mesh)
    if why is not None:
        raise ValueError(f"fsdp_opt.apply: {why}")
    cc = config.compile
    mesh = mesh if mesh is not None else default_mesh(_device_type_of(model))
    if cc.cache_dir is not None:  # before the first compile, and before the parameters become DTensors
        plan = dataclasses.replace(plan, compile_cache=open_cache(model, cc.cache_dir, _cache_settings(config),
                                                                  world_size=mesh.size()))
    share = share_for_group(dist.get_process_group_ranks(mesh.get_group()), timeout_s=cc.share_timeout_s,
                            name="fsdp_traced") if cc.share else None
    modules = dict(model.named_modules())
    blocks = [(name, modules[name]) for name in plan.block_names]
    if config.checkpointing:
        blocks = [(name, _checkpoint_wrap(model, name, block)) for name, block in blocks]
    # Note [Backend wrapping order]: the shared compile around the traced backend, no transform of ours
    wrap = (lambda backend: build_backend(backend, share=share)) if share is not None else None
    traced = apply_traced(model, config, mesh, blocks, model_name, wrap_backend=wrap)
    if _rank() == 0:
        log.info("fsdp_opt: strategy traced, %d blocks, compile %s (the whole model, its collectives in the "
                 "graph)\n%s", len(blocks), config.compile.backend, traced.table())
    model.register_forward_pre_hook(functools.partial(_forward_guard, model_name), prepend=True)
    return dataclasses.replace(plan, traced=traced, share=share)


_PARAMETER = inspect.Parameter
apply.__signature__ = keyword_signature(FSDPConfig, leading=(
    _PARAMETER("model", _PARAMETER.POSITIONAL_OR_KEYWORD, annotation="nn.Module"),
    _PARAMETER("config", _PARAMETER.POSITIONAL_OR_KEYWORD, default=None, annotation="FSDPConfig | None"),
    _PARAMETER("mesh", _PARAMETER.KEYWORD_ONLY, default=None, annotation="DeviceMesh | None")))


def _only_config(config: FSDPConfig, keywords: dict) -> FSDPConfig:
    """``config``, after checking that no keyword beside it differs from its default."""
    if not isinstance(config, FSDPConfig):
        raise TypeError(
            f"fsdp_opt.apply(model, config={config!r}): config must be an FSDPConfig or None. Build one "
            "(fsdp_opt.FSDPConfig(compile='aot_eager')), or pass the settings as keywords "
            "(fsdp_opt.apply(model, compile='aot_eager'))."
        )
    defaults = {f.name: f.default for f in dataclasses.fields(FSDPConfig)}
    given = {k: v for k, v in keywords.items()
             if not (v is defaults[k] or (type(v) is type(defaults[k]) and v == defaults[k]))}
    if given:
        settings = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"fsdp_opt.apply(model, config, {settings}): an FSDPConfig carries every setting, so keywords given "
            "beside it would be silently dropped or silently win. Put them into the config "
            f"(fsdp_opt.apply(model, dataclasses.replace(config, {settings}))) or drop config and pass keywords only."
        )
    return config


def _cache_settings(config: FSDPConfig) -> dict:
    """What the compile cache key covers besides the model: every setting that changes the
    compiled graphs (Note [Settings in the cache key])."""
    return {"parallel": "fsdp", **cache_settings(config)}


def _device_type_of(model: nn.Module) -> str | None:
    param = next(model.parameters(), None)
    return param.device.type if param is not None and param.device.type != "meta" else None


def default_mesh(device_type: str | None = None) -> DeviceMesh:
    """A 1-D mesh over all ranks of the default process group.

    Args:
        device_type: where the model's parameters are (``fully_shard`` moves them to
            the mesh's device type): ``"cuda"`` also with gloo, when ranks share a
            GPU. None: CUDA with NCCL, the CPU otherwise.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fsdp_opt.apply needs a process group and none is initialized. Call "
            "torch.distributed.init_process_group(...) first (launch/ does it under torchrun), "
            "or pass mesh=init_device_mesh(...)."
        )
    if device_type is None:
        backend = str(dist.get_backend()).lower()
        device_type = "cuda" if torch.cuda.is_available() and "nccl" in backend else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def check_no_compiled_autograd(where: str) -> None:
    """Raise if compiled autograd is on: it breaks FSDP2 without an error.

    Args:
        where: what is being called, for the message.

    Raises:
        RuntimeError: ``torch._dynamo.config.compiled_autograd`` is set, or a
            compiled-autograd context is active.
    """
    if compiled_autograd_active():
        raise RuntimeError(
            f"{where}: compiled autograd is enabled (torch._dynamo.config.compiled_autograd or a "
            f"compiled_autograd._enable context) on an FSDP2 model: {COMPILED_AUTOGRAD_WHY}. Turn it "
            "off (torch._dynamo.config.compiled_autograd = False); per-block compile already compiles "
            "each block's backward through AOTAutograd."
        )


def _check_offload(policy: OffloadPolicy | None) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and not torch.accelerator.is_available():
        raise ValueError(
            "offload_policy=CPUOffloadPolicy(pin_memory=True) on a machine without an accelerator: "
            "FSDP2 pins the offloaded shards in page-locked memory, which needs one, and fails with "
            "'Cannot access accelerator device'. Use CPUOffloadPolicy(pin_memory=False), or "
            "offload_policy=None to keep the shards where they are."
        )


def _forward_guard(model_name: str, module: nn.Module, args: tuple) -> None:
    # Compiled autograd can be switched on after apply(); catch it at the next step.
    check_no_compiled_autograd(f"forward of the FSDP2 model {model_name}")


def _set_prefetch(root: nn.Module, units: list[nn.Module], depth: int) -> None:
    """Unit i all-gathers units i+1..i+depth in forward and i-1..i-depth (nearest
    first) in backward; the root prefetches the first units in forward and the
    last ones at the start of backward."""
    if depth == 0 or not units:
        return
    for i, unit in enumerate(units):
        assert isinstance(unit, FSDPModule)
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])
        if i > 0:
            unit.set_modules_to_backward_prefetch(units[max(0, i - depth):i][::-1])
    root.set_modules_to_forward_prefetch(units[:depth])
    root.set_modules_to_backward_prefetch(units[::-1][:depth])


def _checkpoint_wrap(model: nn.Module, name: str, block: nn.Module) -> nn.Module:
    """Replace ``block`` (at ``name`` in ``model``) by its checkpoint wrapper.

    The wrapper's state_dict hooks drop its ``_checkpoint_wrapped_module.`` prefix,
    so checkpoints keep the unwrapped parameter names."""
    parent_name, _, child_name = name.rpartition(".")
    wrapped = checkpoint_wrapper(block)
    setattr(model.get_submodule(parent_name) if parent_name else model, child_name, wrapped)
    return wrapped


def _describe_compile(cc: FSDPCompileConfig | None) -> str:
    if cc is None:
        return "off"
    name = cc.backend if isinstance(cc.backend, str) else getattr(cc.backend, "__name__", "callable")
    return f"{name} ({'whole model' if cc.whole_model else 'per block'}, fullgraph={cc.fullgraph})"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
