"""DDP optimizer: plan gradient buckets from a captured graph, split the graph at
the bucket boundaries DDP really uses, compile each partition.

Packages by role: ``ddp_opt.planning`` (bucket plans and the cost model),
``ddp_opt.strategies`` (how a compiled model is cut at its buckets),
``ddp_opt.alignment`` (rank agreement and alignment with DDP's runtime buckets),
``ddp_opt.compression`` (reduced-precision and PowerSGD hooks); the entry points
(``api``, ``compile_first``, ``compiled``) and their handle parts sit above them.

The names below are the public surface (at most 20). The building blocks behind them
are imported from their modules: ``ddp_opt.planning.solver`` (``simulate``, ``solve``,
``UnitCost``, ``HookCompute``), ``ddp_opt.planning.cost`` (``measure_link``, ``measure_rates``),
``ddp_opt.planning.auto`` (``plan_auto``), ``ddp_opt.planning.calibrate`` (``Calibration``),
``ddp_opt.alignment.measure`` (``alignment_fraction``, ``runtime_buckets``),
``ddp_opt.alignment.agreement`` (``check_plan_agreement``, ``plan_summary``),
``ddp_opt.planning.buckets`` (``partition_map``) and ``ddp_opt.advice`` (the spellings
of settings in messages)."""

from .advice import ddp_advice
from .alignment.agreement import PlanMismatchError
from .alignment.measure import Alignment, measure_alignment
from .api import CompiledDDP, caps_from_ddp, compile_ddp
from .compile_first import compile_for_ddp, compiled_ddp_of
from .compression.powersgd import PowerSGD
from .config import DDPCompileConfig
from .planning.buckets import Bucket, BucketCaps, format_buckets, plan_buckets
from .planning.cost import CostModel, DeviceRates
from .planning.solver import LinkEstimate, Timeline
from .strategies.split import DDPOptimizer

__all__ = [
    # entry points
    "compile_ddp",
    "compile_for_ddp",
    "compiled_ddp_of",
    "DDPCompileConfig",
    "CompiledDDP",
    "DDPOptimizer",
    # planning
    "Bucket",
    "BucketCaps",
    "caps_from_ddp",
    "plan_buckets",
    "format_buckets",
    # cost-model plan (bucket_cap_mb="auto")
    "CostModel",
    "DeviceRates",
    "LinkEstimate",
    "Timeline",
    # alignment with DDP's runtime buckets, rank agreement, advice
    "Alignment",
    "measure_alignment",
    "PlanMismatchError",
    "ddp_advice",
    # compression (compile_ddp(compression=...))
    "PowerSGD",
]
