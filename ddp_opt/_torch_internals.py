"""Every private torch name ``ddp_opt`` uses, in one place.

Each access says what it relies on; ``tests/contracts/test_torch_contracts_ddp.py`` pins each one, so a torch
upgrade that changes one fails there first. Version gate: bucket realignment re-creates DDP's reducer
through DDP's private initialisation helpers. Where a release lacks one of them
(:func:`missing_for_realignment`, feature detection), :data:`REALIGN_SUPPORTED` is False: ``compile_ddp``
warns once, naming what is missing, and keeps DDP's own buckets instead of calling helpers that do not exist.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel import distributed as _ddp_module

# One definition each, in the core: the default group's store, the feature-off warning, and the functions
# dynamo records for autocast, grad-mode and inference-mode regions (Note [Private names read at import]).
from compiler._torch_internals import (AUTOCAST_ENTER, AUTOCAST_EXIT, INFERENCE_MODE_ENTER,  # noqa: F401
                                       INFERENCE_MODE_EXIT, INFERENCE_REGIONS, SET_GRAD_ENABLED, compile_call_in_place,
                                       compiled_call, default_store, warn_feature_off_once, warn_if_missing_at_import)

def missing_for_realignment() -> list[str]:
    """What bucket realignment (:func:`rebuild_reducer`) needs from DDP that this torch lacks;
    empty where it can run. Feature detection, not a version check."""
    init = getattr(DistributedDataParallel, "_ddp_init_helper", None)
    needed = {
        "per-bucket rebuild caps (DDP._bucket_config.per_bucket_bytes_caps, or DDP.bucket_bytes_cap_list read by "
        "DDP._ddp_init_helper)": _rebuild_caps_kind() is not None,
        "DDP._ddp_init_helper(parameters, expect_sparse_gradient, param_to_name_mapping, static_graph)":
            init is not None and list(inspect.signature(init).parameters)[1:5]
            == ["parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"],
        "DDP._build_params_for_reducer": hasattr(DistributedDataParallel, "_build_params_for_reducer"),
        "DDP._build_debug_param_to_name_mapping": hasattr(DistributedDataParallel,
                                                          "_build_debug_param_to_name_mapping"),
        "Reducer._remove_autograd_hooks": hasattr(dist.Reducer, "_remove_autograd_hooks"),
        "Reducer._check_reducer_finalized": hasattr(dist.Reducer, "_check_reducer_finalized"),
    }
    return [name for name, present in needed.items() if not present]


def _rebuild_caps_kind() -> str | None:
    """Where this torch's DDP reads the per-bucket caps its reducer is built and rebuilt with: ``"bucket_config"``
    (torch >= 2.12: ``DDP._bucket_config``, a ``_BucketCapacityConfig``), ``"cap_list"`` (torch 2.11:
    ``DDP.bucket_bytes_cap_list``, which 2.12 folded into ``_bucket_config``), or None."""
    config = getattr(_ddp_module, "_BucketCapacityConfig", None)
    if config is not None and dataclasses.is_dataclass(config) and \
            "per_bucket_bytes_caps" in {f.name for f in dataclasses.fields(config)}:
        return "bucket_config"
    init = getattr(DistributedDataParallel, "_ddp_init_helper", None)
    try:
        reads_list = init is not None and "self.bucket_bytes_cap_list" in inspect.getsource(init)
    except (OSError, TypeError):  # no source shipped: nothing to detect with
        reads_list = False
    return "cap_list" if reads_list else None


REALIGN_SUPPORTED = not missing_for_realignment()


def realign_unsupported_warning(entry: str = "compile_ddp") -> None:
    warn_feature_off_once(
        f"{entry}(align_buckets=True)", missing_for_realignment(),
        "DDP keeps its own buckets (they may straddle partitions; ddp_opt.measure_alignment tells). Pass "
        "align_buckets=False to silence this",
    )


# --- DDP's bucket configuration ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DDPBucketSettings:
    bucket_bytes_cap: int
    first_bucket_cap: int
    per_bucket_caps: tuple[int, ...]


def bucket_settings(ddp_model: DistributedDataParallel) -> DDPBucketSettings:
    """The caps DDP's reducer uses when it rebuilds its buckets after step 1."""
    config = getattr(ddp_model, "_bucket_config", None)
    if config is not None:
        # torch >= 2.13: DDP._bucket_config (bucket_bytes_cap, first_bucket_bytes_cap, per_bucket_bytes_caps).
        return DDPBucketSettings(int(config.bucket_bytes_cap), int(config.first_bucket_bytes_cap),
                                 tuple(int(c) for c in config.per_bucket_bytes_caps))
    # Older torch: DDP.bucket_bytes_cap_default: bucket_cap_mb unset, the first bucket capped at 1 MiB.
    cap = int(ddp_model.bucket_bytes_cap)
    uses_default = bool(getattr(ddp_model, "bucket_bytes_cap_default", False))
    first = min(default_first_bucket_bytes(), cap) if uses_default else cap
    per_bucket = tuple(int(c) for c in getattr(ddp_model, "bucket_bytes_cap_list", ()) or ())
    return DDPBucketSettings(cap, first, per_bucket)


def default_first_bucket_bytes() -> int:
    # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: DDP's first-bucket cap when bucket_cap_mb is unset (1 MiB).
    return int(dist._DEFAULT_FIRST_BUCKET_BYTES)


def registered_hook_name(ddp_model: DistributedDataParallel) -> str | None:
    """The name of a comm hook registered on ``ddp_model``'s reducer, if any."""
    # DDP._get_ddp_logging_data()["comm_hook"]: the registered hook's name, "" when none.
    return ddp_model._get_ddp_logging_data().get("comm_hook") or None


def reducer_finalized(ddp_model: DistributedDataParallel) -> bool:
    """True when the last backward's reduction is complete (safe to swap reducers)."""
    try:
        # Reducer._check_reducer_finalized(): raises RuntimeError while a reduction is pending.
        ddp_model.reducer._check_reducer_finalized()
    except RuntimeError:
        return False
    return True


def rebuild_reducer(ddp_model: DistributedDataParallel, rebuild_caps: tuple[int, ...] | None) -> None:
    """Re-create DDP's reducer, as DDP does when it is unpickled, with ``rebuild_caps``
    as the per-bucket caps of its next bucket rebuild (gradient-ready order); None keeps DDP's caps."""
    if rebuild_caps is not None and _rebuild_caps_kind() == "bucket_config":
        # DDP._bucket_config is a dataclass whose per_bucket_bytes_caps the reducer's rebuild reads.
        ddp_model._bucket_config = dataclasses.replace(ddp_model._bucket_config, per_bucket_bytes_caps=rebuild_caps)
    elif rebuild_caps is not None:
        # torch 2.11: DDP.bucket_bytes_cap_list (bytes), which _ddp_init_helper passes to the reducer as its
        # bucket limits and rebuild limits (bucket_cap_mb_list's storage before 2.12's _bucket_config).
        ddp_model.bucket_bytes_cap_list = list(rebuild_caps)
    # Reducer._remove_autograd_hooks(): detach the old reducer from the parameters' grad accumulators.
    ddp_model.reducer._remove_autograd_hooks()
    # DDP._build_params_for_reducer / _build_debug_param_to_name_mapping / _ddp_init_helper(params,
    # expect_sparse_gradient, param_to_name_mapping, static_graph): DDP's own reducer construction.
    params, expect_sparse = ddp_model._build_params_for_reducer()
    names = ddp_model._build_debug_param_to_name_mapping(params)
    ddp_model._ddp_init_helper(params, expect_sparse, names, ddp_model.static_graph)
    # _ddp_init_helper builds the reducer from DDP's attributes (gradient_as_bucket_view; torch >= 2.15 also
    # batched_grad_copy, lazy_bucket_allocation), but manual finalization (torch >= 2.15) lives only in the
    # reducer: as DDP.__setstate__ does, the public setter tells the new one (Reducer._set_manual_finalization_
    # required), else it finalizes by itself and the user's finalize_backward() raises.
    if getattr(ddp_model, "require_manual_backward_finalization", False):
        ddp_model.require_manual_backward_finalization = True
    if ddp_model.static_graph:
        # As DDP.__setstate__ does: Reducer/Logger._set_static_graph() mark the new reducer static (else it
        # never rebuilds). Its first iteration reduces every gradient at its end (Reducer._delay_all_reduce,
        # enqueued through DDPSink while DDP._static_graph_delay_allreduce_enqueued is False) and records
        # the order the next rebuild follows.
        ddp_model.reducer._set_static_graph()
        ddp_model.logger._set_static_graph()
        ddp_model._static_graph_delay_allreduce_enqueued = False
    # DDP._has_rebuilt_buckets: False makes the new reducer rebuild its buckets after its first iteration.
    ddp_model._has_rebuilt_buckets = False
    # DDP._comm_hooks: the (hook, state) pairs register_comm_hook appended; the new reducer has none of them.
    if hasattr(ddp_model, "_comm_hooks"):
        ddp_model._comm_hooks = []


def stop_finding_unused_parameters(ddp_model: DistributedDataParallel) -> None:
    """``find_unused_parameters`` off before DDP's first iteration (its forward reads the attribute, its reducer
    took the flag when built: re-created)."""
    ddp_model.find_unused_parameters = False
    rebuild_reducer(ddp_model, None)


def python_comm_hooks(ddp_model: DistributedDataParallel) -> list[tuple[Any, Any]] | None:
    """``(state, hook)`` of each Python comm hook registered on ``ddp_model``, in order; None
    where this torch does not keep them."""
    # DDP._comm_hooks: (hook, state) pairs appended by DDP.register_comm_hook (a built-in C++ hook is not listed).
    hooks = getattr(ddp_model, "_comm_hooks", None)
    return None if hooks is None else [(state, hook) for hook, state in hooks]


def has_rebuilt_buckets(ddp_model: DistributedDataParallel) -> bool:
    """True once DDP's reducer has rebuilt its buckets (from the recorded gradient order)."""
    # DDP._has_rebuilt_buckets: set True by DDP's forward when Reducer._rebuild_buckets() rebuilt them.
    return bool(getattr(ddp_model, "_has_rebuilt_buckets", False))


def runtime_buckets(ddp_model: DistributedDataParallel) -> list[list[tuple[int, int]]]:
    """DDP's current buckets as ``[(id(param), bytes), ...]`` each, in reduction order."""
    # Reducer._get_zeros_like_grad_buckets(): one GradBucket per runtime bucket, with .parameters().
    return [
        [(id(p), p.numel() * p.element_size()) for p in bucket.parameters()]
        for bucket in ddp_model.reducer._get_zeros_like_grad_buckets()
    ]


def is_compiled(module: torch.nn.Module) -> bool:
    """True when ``module`` (or its forward) was already given to torch.compile."""
    # Module._compiled_call_impl: set by Module.compile(); _torchdynamo_orig_callable: on torch.compile's wrapper.
    return (getattr(module, "_compiled_call_impl", None) is not None
            or hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable"))


# torch._dynamo.config.optimize_ddp: dynamo hands graphs captured under DDP to PyTorch's splitter when True
# or "ddp_optimizer" (convert_frame reads get_optimize_ddp_mode() as the frame compiles).
def no_builtin_ddp_splitter() -> Any:
    return torch._dynamo.config.patch(optimize_ddp=False)


def builtin_splitter_on() -> bool:
    return torch._dynamo.config.optimize_ddp is True or torch._dynamo.config.optimize_ddp == "ddp_optimizer"


def graph_slot() -> int | None:
    """Which graph of the model dynamo is compiling: the id of its frame (None outside a compile); a graph break
    resumes in a new frame, a recompile keeps it, and after ``torch.compiler.reset()`` it can get a new one."""
    # torch._guards.CompileContext.current_compile_id(): a CompileId(frame_id, frame_compile_id, ...)
    # while dynamo compiles a frame, None otherwise.
    compile_id = torch._guards.CompileContext.current_compile_id()
    return None if compile_id is None else compile_id.frame_id


def trace_artifact(name: str, encoding: str, payload_fn: Any) -> None:
    # torch._logging.trace_structured("artifact", ...): a named artifact in TORCH_TRACE for tlparse.
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload_fn)


# --- what dynamo's graphs carry ------------------------------------------------------------

def is_ddp_ignored(param: torch.nn.Parameter) -> bool:
    # Parameter._ddp_ignored: set by DDP._set_params_and_buffers_to_ignore_for_model on real parameters.
    return bool(getattr(param, "_ddp_ignored", False))


def is_view(value: torch.Tensor) -> bool:
    # Tensor._is_view(): whether the (fake) tensor aliases another's storage.
    return value._is_view()


def size_hint(size: Any) -> int:
    # symbolic_shapes.optimization_hint (torch 2.13; size_hint in torch 2.11, where hint_int warns that
    # it is deprecated): a (symbolic) size's example value, read without adding a guard.
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint
    return hint(size)


def node_example(node: fx.Node) -> Any:
    # node.meta["example_value"] (dynamo) or node.meta["val"] (AOT/export): the node's fake value.
    return node.meta.get("example_value", node.meta.get("val"))


# Dynamo's source names: L['self']._modules['0']._parameters['weight'].
_SOURCE_PARTS = re.compile(r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]|\.([A-Za-z_]\w*)")


def source_to_param_name(source_name: str) -> str:
    """``L['self']._modules['0']._parameters['weight']`` -> ``0.weight``
    (``__self__`` of a compiled bound ``forward`` is dropped too)."""
    root = source_name.find("]")
    tail = source_name[root + 1:] if source_name.startswith(("L[", "G[")) else source_name
    parts = [a or b for a, b in _SOURCE_PARTS.findall(tail) if (a or b) != "__self__"]
    return ".".join(parts) if parts else source_name


def placeholder_parameter(node: fx.Node) -> tuple[str, torch.nn.Parameter] | None:
    """(name, the real parameter) a dynamo placeholder stands for, or None."""
    # node.meta["grapharg"] (a GraphArg): .example is the real tensor, .source.name its dynamo source;
    # the fake example_value has lost attributes such as _ddp_ignored and has another id().
    grapharg = node.meta.get("grapharg")
    real = getattr(grapharg, "example", None) if grapharg is not None else None
    if isinstance(real, torch.nn.Parameter):
        source = getattr(grapharg, "source", None)
        return (source_to_param_name(source.name) if source else str(node.target)), real
    value = node.meta.get("example_value")
    if isinstance(value, torch.nn.Parameter):
        return str(node.target), value
    return None


def active_ddp_module() -> DistributedDataParallel | None:
    """The DDP module whose forward is running now (dynamo compiles a frame below it), else None."""
    # DDP._get_active_ddp_module(): set by DDP's forward (_inside_ddp_forward) for dynamo's DDPOptimizer, as here.
    return DistributedDataParallel._get_active_ddp_module()
