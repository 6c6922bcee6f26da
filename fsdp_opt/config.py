"""Typed configuration of the FSDP2 + compile transform: what to compile and how,
and how to shard. Frozen dataclasses, validated when built, so that a bad setting
fails before any process group, sharding or compile starts."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from compiler import CompileOptions, SettingError, check_blocks_setting, not_compiled

__all__ = ["FSDPCompileConfig", "FSDPConfig", "STRATEGIES"]

# How fsdp_opt.apply compiles a sharded model: each block before fully_shard (FSDP2's hooks stay
# eager around them), or the whole model with its all-gathers and reduce-scatters in the graph.
STRATEGIES = ("per_block", "traced")

# Why whole-model compile cannot be fullgraph under FSDP2; shared by the config
# check here and the runtime checks in apply.py.
WHOLE_MODEL_WHY = (
    "FSDP2's all-gather/reduce-scatter hooks are disabled for dynamo, so a compile of the whole "
    "model cannot capture them: without fullgraph the top frame silently runs eagerly, and with "
    "fullgraph=True it fails with 'Attempted to call function marked as skipped'"
)
COMPILED_AUTOGRAD_WHY = (
    "compiled autograd with FSDP2 was measured (torch 2.13, CPU + gloo) to give wrong losses and "
    "to drop the sharding without raising any error"
)


@dataclass(frozen=True)
class FSDPCompileConfig(CompileOptions):
    """How each block is compiled: ``compiler.CompileOptions`` (backend, mode, options,
    dynamic, fullgraph, cache_dir, share, share_timeout_s), and what only FSDP2 adds.

    ``cache_dir``: loaded before the first compile; save it after the first step with
    ``compiler.cache.store.save_on_local_rank0(plan.compile_cache)``. ``share``: over the
    mesh's ranks.

    Attributes:
        whole_model: compile the whole sharded model instead of each block.
            Allowed only with ``fullgraph=False``, and even then the FSDP hooks
            stay eager; per-block compile (the default) is what works.
        compiled_autograd: always refused with FSDP2 (see ``COMPILED_AUTOGRAD_WHY``);
            the field exists so that a request for it fails loudly.
    """

    OWNER = "FSDPCompileConfig"

    whole_model: bool = False
    compiled_autograd: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compiled_autograd:
            raise SettingError(
                "compiled_autograd",
                f"FSDPCompileConfig(compiled_autograd=True) was requested for an FSDP2 model: "
                f"{COMPILED_AUTOGRAD_WHY}. Leave compiled_autograd=False (the default); the "
                "per-block compiled forward already gets a compiled backward from AOTAutograd."
            )
        if self.whole_model and self.fullgraph:
            raise SettingError(
                "whole_model",
                "FSDPCompileConfig(whole_model=True, fullgraph=True) was requested for an FSDP2 model: "
                f"{WHOLE_MODEL_WHY}. Use per-block compile instead (whole_model=False, the default), "
                "which compiles each repeated block before fully_shard, one graph per block; "
                "set compile=None to turn compile off."
            )


@dataclass(frozen=True)
class FSDPConfig:
    """How a model is sharded and compiled by ``fsdp_opt.apply``.

    Attributes:
        strategy: ``"per_block"`` (the default): each block compiled, then sharded by
            FSDP2, whose hooks gather and reduce around the compiled blocks. ``"traced"``:
            parameters stored as FSDP2 stores them (``Shard(0)`` DTensors), the whole
            forward compiled in one graph with every all-gather and reduce-scatter inside
            it, bucketed and ordered from the measured link (``fsdp_opt.traced``).
        blocks: ``"auto"`` (the children of the ModuleLists, ModuleDicts and
            Sequentials whose children are all one class, else repeated children of
            one class), the name of one ModuleList, ModuleDict or Sequential
            (``"layers"``), or a sequence of module names (``("layers.0",
            "layers.1")``). See Note [Finding blocks] in ``compiler.graph.regional``.
        compile: ``None`` (no compile), a backend name or callable (per-block compile
            with defaults), or a :class:`FSDPCompileConfig`. Normalized to a
            ``FSDPCompileConfig`` or ``None``.
        reshard_after_forward: passed to ``fully_shard`` for every shard unit:
            ``True`` frees the gathered parameters after forward and all-gathers
            again in backward; ``False`` keeps them; an int reshards to that
            smaller world size. The root always keeps them (its parameters are
            the first needed in backward).
        mp_policy: FSDP2 mixed precision (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``).
        offload_policy: FSDP2 offload; on a machine without an accelerator use
            ``CPUOffloadPolicy(pin_memory=False)`` (pinning needs one). None for none.
        prefetch: how many shard units ahead to all-gather explicitly, in forward
            and in backward. 0 leaves FSDP2's implicit prefetching alone.
        shard_unit_mb: group consecutive blocks into one shard unit until the
            unit's all-gather holds at least this many MiB of parameters; None
            makes every block its own unit. See Note [Shard unit grouping].
            ``"auto"`` (the default): under ``per_block`` one unit per block (measured
            the fastest there, docs/fsdp.md); under ``traced`` the units planned from the
            measured link and block times (Note [Traced FSDP plan]).
        memory_budget_mb: ``traced`` only: the most gathered parameter bytes alive at
            once that the plan may use (more or bigger units in flight, units kept
            from forward to backward); None: what FSDP2 holds, the two largest block
            units and the root.
        checkpointing: wrap each block in activation checkpointing (recompute its
            activations in backward).
        replicate: FSDP2's replicate in place of ``fully_shard`` (what torchtitan runs for
            data parallelism instead of DDP): every parameter kept whole on every rank, each
            unit's gradients all-reduced as one bucket as soon as its backward is done, the
            blocks compiled as with sharding. ``reshard_after_forward`` does not apply.
    """

    strategy: str = "per_block"
    blocks: str | Sequence[str] = "auto"
    compile: FSDPCompileConfig | str | Callable | None = None
    # The sharding around the compiled blocks: the blocks are compiled before fully_shard, and
    # these change FSDP's hooks between them, not the block graphs (mp_policy changes their dtypes).
    reshard_after_forward: bool | int = not_compiled(True, why="FSDP's hooks around the compiled blocks")
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = not_compiled(None, why="where FSDP keeps the shards between uses")
    prefetch: int = not_compiled(1, why="FSDP's hooks around the compiled blocks")
    shard_unit_mb: float | str | None = "auto"
    checkpointing: bool = False
    replicate: bool = not_compiled(False, why="FSDP's hooks around the compiled blocks")
    memory_budget_mb: float | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise SettingError(
                "strategy",
                f"FSDPConfig.strategy={self.strategy!r} is not one of {list(STRATEGIES)}: 'per_block' compiles each "
                "block before FSDP2 shards it; 'traced' compiles the whole model with FSDP's collectives inside "
                "the graph. Use one of them (fsdp.strategy=per_block in the launcher)."
            )
        if isinstance(self.compile, (str, bytes)) or (self.compile is not None and callable(self.compile)):
            object.__setattr__(self, "compile", FSDPCompileConfig(backend=self.compile))
        elif self.compile is not None and not isinstance(self.compile, FSDPCompileConfig):
            raise TypeError(
                f"FSDPConfig.compile={self.compile!r}: expected None, a backend name such as "
                "'aot_eager' or 'inductor', a backend callable, or an FSDPCompileConfig. "
                "Set compile=None to turn compile off."
            )
        object.__setattr__(self, "blocks", check_blocks_setting(self.blocks, "FSDPConfig"))
        rafa = self.reshard_after_forward
        if not isinstance(rafa, bool) and (not isinstance(rafa, int) or rafa < 2):
            raise SettingError(
                "reshard_after_forward",
                f"FSDPConfig.reshard_after_forward={rafa!r}: expected True, False, or an int world size "
                "(> 1) to reshard to after forward, such as the number of ranks on one node."
            )
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise SettingError(
                "prefetch",
                f"FSDPConfig.prefetch={self.prefetch!r}: the prefetch depth is how many shard units "
                "ahead to all-gather, a non-negative int. Use 1 (the default) for one unit ahead, "
                "or 0 to leave FSDP2's implicit prefetching alone."
            )
        mb = self.shard_unit_mb
        if mb is not None and mb != "auto" and (isinstance(mb, (bool, str)) or not isinstance(mb, numbers.Real)
                                                or not mb > 0):
            raise SettingError(
                "shard_unit_mb",
                f"FSDPConfig.shard_unit_mb={mb!r}: the target all-gather size of a shard unit must be a "
                "positive number of MiB (e.g. 64), 'auto' (the default: the toolkit plans them), or None to "
                "make each block its own unit."
            )
        budget = self.memory_budget_mb
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
                                   or not budget > 0):
            raise SettingError(
                "memory_budget_mb",
                f"FSDPConfig.memory_budget_mb={budget!r}: the most gathered parameter MiB traced FSDP may hold at "
                "once must be a positive number, or None for what FSDP2 holds (two block units and the root)."
            )
        if budget is not None and self.strategy != "traced":
            raise SettingError(
                "memory_budget_mb",
                f"FSDPConfig(memory_budget_mb={budget!r}, strategy={self.strategy!r}): the budget bounds traced "
                "FSDP's plan; per_block leaves prefetching to FSDP2's hooks. Set strategy='traced', or drop "
                "memory_budget_mb."
            )
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                f"FSDPConfig.mp_policy={self.mp_policy!r}: expected a torch.distributed.fsdp."
                "MixedPrecisionPolicy, e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16), or None."
            )
        if self.offload_policy is not None and not isinstance(self.offload_policy, OffloadPolicy):
            raise TypeError(
                f"FSDPConfig.offload_policy={self.offload_policy!r}: expected a torch.distributed.fsdp."
                "OffloadPolicy such as CPUOffloadPolicy(), or None."
            )
