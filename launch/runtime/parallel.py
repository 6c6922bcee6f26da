"""Build the model the config names and wrap it for training: DDP + bucket-aware
compile, FSDP (through ``fsdp_opt``) or a plain, optionally compiled, module.

The wrapping order lives in :func:`apply_parallel`, in one place:
parallel wrapper first (DDP must see the real parameters to plan its buckets),
then compile (``compile_ddp`` reads DDP's bucket caps to split the graph there).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

import fsdp_opt
from compiler import SettingError
from compiler.cache import open_cache
from compiler.ranks import cpu_seconds
from ddp_opt import DDPCompileConfig, compile_ddp, measure_alignment
from ddp_opt.advice import Spelling
from ddp_opt.compression.hooks import own_hook, parse_reduce_dtype

from ..config.schema import (CompileConfig, ConfigError, DDPConfig, FSDPOptions, FSDPPrecision, JobConfig, ModelConfig,
                             ParallelMode)
from .dist import DistEnv

if TYPE_CHECKING:
    from ddp_opt import Alignment, Bucket, Timeline

log = logging.getLogger(__name__)

# How advice names a setting: as a launcher override, and the benchmark that compares caps.
OVERRIDE_SPELLING = Spelling(
    bucket_cap="ddp.bucket_cap_mb={}", bucket_cap_list="ddp.bucket_cap_mb_list={}", auto="ddp.bucket_cap_mb=auto",
    keep_aligned="Keep bucket realignment on (ddp.align_buckets=true)",
    regional="ddp.strategy=regional", cache_dir="compile.cache_dir=DIR",
    compare="python -m benchmarks.studies.ddp_compare --modes eager,nosplit,ours --caps {}", no_split="ddp.strategy=whole",
)

__all__ = ["CausalLM", "OVERRIDE_SPELLING", "Wrapped", "build_model", "apply_parallel", "ddp_bucket_kwargs",
           "ddp_compile_config", "fsdp_config", "in_backward_refusal"]

DDP_DEFAULT_CAP_MB = 25.0


class CausalLM(nn.Module):
    """Adapt a language model whose ``forward(idx)`` gives logits (a tensor, a tuple
    starting with them, or an object with ``.logits`` like transformers' outputs)
    to the job's ``forward(idx, targets) -> (logits, loss)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        out = self.model(idx)
        logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
        if logits is None:
            logits = out[0]
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_model(cfg: ModelConfig) -> nn.Module:
    """A fresh model with ``forward(idx, targets) -> (logits, loss)``; seed first."""
    if cfg._target_:
        from hydra.utils import instantiate

        return CausalLM(instantiate({"_target_": cfg._target_, **cfg.kwargs}))
    if cfg.name == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        hf_cfg = GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_embd=cfg.n_embd, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            use_cache=False, **cfg.kwargs,
        )
        return CausalLM(GPT2LMHeadModel(hf_cfg))
    from ..models import GPT, GPTConfig

    return GPT(GPTConfig(
        vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
        n_embd=cfg.n_embd, dropout=cfg.dropout, **cfg.kwargs,
    ))


@dataclass
class Wrapped:
    """What training needs from a wrapped model.

    Attributes:
        forward: what the loop calls (compiled, or the module itself).
        module: the module whose state is checkpointed (DDP/FSDP/plain, never the
            compiled wrapper, whose state-dict keys carry an ``_orig_mod.`` prefix).
        compiled_ddp: the ``CompiledDDP`` when compiled with DDP, for the bucket table.
        compile_cache: with ``compile.cache_dir`` and parallel=fsdp or none, the loaded
            ``compiler.CompileCache`` (DDP's is the ``CompiledDDP``'s); saved after the first step.
    """

    forward: Callable[..., Any]
    module: nn.Module
    compiled_ddp: Any = None
    compile_cache: Any = None
    share: Any = None  # the compiler.ranks.share.CompileShare of the compile, when there is one
    cpu_at_compile: float = field(default_factory=cpu_seconds)  # once wrapped: compiles happen in the first step

    def __post_init__(self) -> None:
        if self.share is None and self.compiled_ddp is not None:
            self.share = self.compiled_ddp.share

    def buckets(self) -> list[Bucket]:
        """DDP's buckets = the graph partitions, in forward order (empty without compile_ddp)."""
        return list(self.compiled_ddp.buckets) if self.compiled_ddp is not None else []

    def partition_records(self) -> list:
        """The DDP splitter's ``PartitionRecord`` per partition (empty without one)."""
        opt = getattr(self.compiled_ddp, "splitter", None)
        return list(opt.records) if opt is not None else []

    def alignment(self) -> Alignment | None:
        """DDP's runtime buckets against the partitions (None without compile_ddp)."""
        if self.compiled_ddp is None or self.compiled_ddp.strategy == "traced":  # no DDP reducer buckets in use
            return None
        return measure_alignment(self.compiled_ddp.ddp_model, self.compiled_ddp.buckets)

    def in_backward_updates(self) -> int | None:
        """With ``ddp.optimizer_in_backward``: the bucket updates run inside backward on this rank
        so far (Note [Optimizer in backward]); None otherwise."""
        stepper = getattr(self.compiled_ddp, "in_backward", None)
        return stepper.updates if stepper is not None else None

    def prediction(self) -> Timeline | None:
        """The cost model's predicted timeline (``ddp.bucket_cap_mb=auto``), else None."""
        return self.compiled_ddp.prediction if self.compiled_ddp is not None else None

    def traced_buckets(self) -> list[int] | None:
        """Under ``ddp.strategy=traced``: the fused all-reduces' bytes of the last compiled
        synchronising backward, gradient-ready order; None otherwise."""
        traced = getattr(self.compiled_ddp, "traced", None)
        return (traced.fused[-1] if traced.fused else []) if traced is not None else None

    def backward_context(self) -> contextlib.AbstractContextManager:
        """What every ``loss.backward()`` runs in: under ``ddp.strategy=traced`` compiled autograd
        with the planned all-reduce fusion (Note [Traced strategy]); nothing otherwise."""
        return self.compiled_ddp.backward_context() if self.compiled_ddp is not None else contextlib.nullcontext()


def ddp_bucket_kwargs(cfg: DDPConfig) -> dict[str, Any]:
    """DDP constructor caps for the ``ddp`` config.

    DDP has no first-bucket argument; ``first_bucket_cap_mb`` becomes
    ``bucket_cap_mb_list=[first, cap]``: DDP fills its buckets in gradient-ready
    order against that list, the last entry repeating for every later bucket.
    """
    if cfg.bucket_cap_mb_list is not None:
        return {"bucket_cap_mb_list": list(cfg.bucket_cap_mb_list)}
    if cfg.first_bucket_cap_mb is not None:
        cap = cfg.bucket_cap_mb if cfg.bucket_cap_mb is not None else DDP_DEFAULT_CAP_MB
        return {"bucket_cap_mb_list": [cfg.first_bucket_cap_mb, cap]}
    if cfg.bucket_cap_mb == "auto":  # compile_ddp chooses the buckets; DDP's caps only serve step 1
        return {"bucket_cap_mb": None}
    return {"bucket_cap_mb": cfg.bucket_cap_mb}


def ddp_compile_config(cfg: JobConfig, wrap_backend: Callable[[Callable], Callable] | None = None,
                       optimizer: torch.optim.Optimizer | None = None) -> DDPCompileConfig:
    """The ``ddp_opt.DDPCompileConfig`` for the job's ``compile`` and ``ddp`` sections: the one
    place where the launcher hands its settings to ``ddp_opt``, which parses them (``bucket_cap_mb``
    beyond ``auto`` goes to DDP's constructor, ``ddp_bucket_kwargs``).

    Building it validates every compile setting (``compiler.SettingError`` names the
    field); ``launch.checks.validate`` builds it before any process group starts, and
    ``apply_parallel`` uses what it parsed, compiled or not. ``optimizer``: the job's optimizer,
    updating each bucket inside backward (``ddp.optimizer_in_backward``); None: after backward."""
    c = cfg.compile
    return DDPCompileConfig(
        **vars(c.compile_options()), fallback=c.fallback, blocks=c.blocks,
        bucket_cap_mb="auto" if cfg.ddp.bucket_cap_mb == "auto" else None, wrap_backend=wrap_backend,
        align_buckets=cfg.ddp.align_buckets, step_gate=cfg.ddp.step_gate,
        strategy=cfg.ddp.strategy if cfg.parallel.name == ParallelMode.DDP else "split", spelling=OVERRIDE_SPELLING,
        reduce_dtype=cfg.ddp.reduce_dtype if cfg.parallel.name == ParallelMode.DDP else None,
        compression=cfg.ddp.compression if cfg.parallel.name == ParallelMode.DDP else None,
        optimizer=optimizer,
    )


def in_backward_refusal(e: SettingError, strategy: str) -> ConfigError:
    """``ddp_opt``'s refusal of the optimizer in backward (``ddp.optimizer_in_backward``), from its
    config before any process group (``launch.checks.validate``) or from ``compile_ddp`` once it
    sees the model, told as a setting of this job."""
    return ConfigError(f"ddp.optimizer_in_backward=true with ddp.strategy={strategy} is refused by compile_ddp: {e} "
                       "In this job: set ddp.optimizer_in_backward=false to step the optimizer after backward.")


def fsdp_config(f: FSDPOptions, c: CompileConfig) -> fsdp_opt.FSDPConfig:
    """The ``fsdp_opt.FSDPConfig`` for the job's ``fsdp`` and ``compile`` sections.

    ``compile.backend=eager`` means no compile; otherwise each block is compiled
    (``compile.fullgraph`` as given: the launcher's default is False, so a graph
    break inside a block falls back instead of failing the job)."""
    compile_cfg = None
    if c.backend != "eager":
        compile_cfg = fsdp_opt.FSDPCompileConfig(**vars(c.compile_options()))
    mp = None
    reduce_dtype = parse_reduce_dtype(f.reduce_dtype)  # None: fp32
    if f.mixed_precision == FSDPPrecision.BF16 or reduce_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if f.mixed_precision == FSDPPrecision.BF16 else None,
                                  reduce_dtype=reduce_dtype or torch.float32)
    same = {g.name for g in fields(fsdp_opt.FSDPConfig)} & {g.name for g in fields(f)}  # by name, no list
    return fsdp_opt.FSDPConfig(compile=compile_cfg, mp_policy=mp, **{name: getattr(f, name) for name in same})


def _shard_with_fsdp(model: nn.Module, cfg: JobConfig) -> fsdp_opt.FSDPPlan:
    """FSDP2 in place, each repeated block compiled before sharding (fsdp_opt's
    recipe; fsdp_opt logs the shard-unit table on rank 0)."""
    plan = fsdp_opt.apply(model, fsdp_config(cfg.fsdp, cfg.compile))
    log.debug("fsdp plan:\n%s", plan.table())
    return plan


def apply_parallel(model: nn.Module, cfg: JobConfig, env: DistEnv,
                   wrap_backend: Callable[[Callable], Callable] | None = None,
                   optimizer: torch.optim.Optimizer | None = None) -> Wrapped:
    """Wrap ``model`` (already on ``env.device``) as ``cfg.parallel`` says, then compile it.

    ``compile.backend=eager`` means no ``torch.compile`` at all. ``wrap_backend``
    wraps the backend dynamo calls (the diagnoser's hook; DDP and none only).
    ``optimizer``: with ``ddp.optimizer_in_backward``, the job's optimizer over ``model``'s
    parameters (DDP keeps them as they are), which ``compile_ddp`` runs inside backward.
    """
    c = cfg.compile
    compile_it = c.backend != "eager"
    if cfg.parallel.name == ParallelMode.DDP:
        config = ddp_compile_config(cfg, wrap_backend, optimizer)
        ddp = DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            static_graph=cfg.ddp.static_graph,
            **ddp_bucket_kwargs(cfg.ddp),
        )
        if not compile_it:
            assert optimizer is None, "the optimizer in backward is compile_ddp's (refused with compile.backend=eager)"
            own = own_hook(ddp.process_group, config.reduce_dtype, config.compression)
            if own is not None:  # the comm hook compile_ddp would register
                ddp.register_comm_hook(own.state, own.bucket)
            return Wrapped(ddp, ddp)
        try:
            compiled = compile_ddp(ddp, config=config)
        except SettingError as e:  # compile_ddp's own refusal of the optimizer, seeing the model
            if e.setting != "optimizer":
                raise
            raise in_backward_refusal(e, cfg.ddp.strategy) from None
        compiled.auto_save_cache = False  # saved by the training loop after its first step
        compiled.control.entry = "launch.train"  # its line at INFO, shown on rank 0 (Note [In control, once])
        return Wrapped(compiled, ddp, compiled)
    if cfg.parallel.name == ParallelMode.FSDP:
        plan = _shard_with_fsdp(model, cfg)  # shards (and compiles the blocks of) the model in place
        return Wrapped(model, model, compile_cache=plan.compile_cache, share=plan.share)
    if not compile_it:
        return Wrapped(model, model)
    options = c.compile_options()
    cache = None
    if c.cache_dir is not None:  # loaded before the first compile
        cache = open_cache(model, c.cache_dir, dict(options.cache_settings(), parallel="none"),
                           world_size=env.world_size)
    backend = options.resolve_backend()
    if wrap_backend is not None:
        backend = wrap_backend(backend)
    return Wrapped(torch.compile(model, backend=backend, dynamic=c.dynamic, fullgraph=c.fullgraph), model,
                   compile_cache=cache)
