"""DDP optimizer: plan gradient buckets from a captured graph, split the graph at
the bucket boundaries DDP really uses, compile each partition."""

from .advice import API_SPELLING, DIRECT_SPELLING, Spelling, ddp_advice
from .alignment import Alignment, alignment_fraction, measure_alignment, runtime_buckets
from .agreement import PlanMismatchError, check_plan_agreement, plan_summary
from .api import CompiledDDP, caps_from_ddp, compile_ddp
from .compile_first import compile_for_ddp, compiled_ddp_of
from .config import DDPCompileConfig
from .autoplan import LinkEstimate, Timeline, UnitCost, simulate, solve
from .calibrate import Calibration, calibrate, calibrated_model
from .cost import CostModel, DeviceRates, measure_link, measure_rates
from .graph_plan import plan_auto
from .optimizer import DDPOptimizer
from .plan import Bucket, BucketCaps, format_buckets, partition_map, plan_buckets

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
    "partition_map",
    "format_buckets",
    # cost-model plan (bucket_cap_mb="auto")
    "CostModel",
    "DeviceRates",
    "LinkEstimate",
    "Timeline",
    "UnitCost",
    "measure_link",
    "measure_rates",
    "plan_auto",
    "simulate",
    "solve",
    "Calibration",
    "calibrate",
    "calibrated_model",
    # alignment with DDP's runtime buckets
    "Alignment",
    "alignment_fraction",
    "measure_alignment",
    "runtime_buckets",
    # rank agreement
    "PlanMismatchError",
    "check_plan_agreement",
    "plan_summary",
    # advice in the spelling of the entry point
    "API_SPELLING",
    "DIRECT_SPELLING",
    "Spelling",
    "ddp_advice",
]
