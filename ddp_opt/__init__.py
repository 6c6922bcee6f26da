"""DDP optimizer: plan gradient buckets from a captured graph, split the graph at
the bucket boundaries DDP really uses, compile each partition.

The names below are the public surface (at most 20). The building blocks behind them
are imported from their modules: ``ddp_opt.autoplan`` (``simulate``, ``solve``,
``UnitCost``), ``ddp_opt.cost`` (``measure_link``, ``measure_rates``),
``ddp_opt.graph_plan`` (``plan_auto``), ``ddp_opt.calibrate``, ``ddp_opt.alignment``
(``alignment_fraction``, ``runtime_buckets``), ``ddp_opt.agreement``
(``check_plan_agreement``, ``plan_summary``), ``ddp_opt.plan`` (``partition_map``) and
``ddp_opt.advice`` (the spellings of settings in messages)."""

from .advice import ddp_advice
from .agreement import PlanMismatchError
from .alignment import Alignment, measure_alignment
from .api import CompiledDDP, caps_from_ddp, compile_ddp
from .autoplan import LinkEstimate, Timeline
from .calibrate import Calibration
from .compile_first import compile_for_ddp, compiled_ddp_of
from .config import DDPCompileConfig
from .cost import CostModel, DeviceRates
from .optimizer import DDPOptimizer
from .plan import Bucket, BucketCaps, format_buckets, plan_buckets
from .powersgd import PowerSGD

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
    "Calibration",
    # alignment with DDP's runtime buckets, rank agreement, advice
    "Alignment",
    "measure_alignment",
    "PlanMismatchError",
    "ddp_advice",
    # compression (compile_ddp(compression=...))
    "PowerSGD",
]
