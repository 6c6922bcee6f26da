"""Every private torch name the compiler core uses, in one place.

Each access below says what it relies on. Each is pinned by a test in
``tests/contracts/test_torch_contracts.py`` that fails if torch changes it, run on every
release in ``TESTED_TORCH`` (``tools/torch_matrix``). Other packages (``ddp_opt``,
``fsdp_opt``, ``launch``, ``benchmarks``) keep their own private accesses in their
own ``_torch_internals``-style module, and gate a feature on whether what it needs
exists (feature detection), never on the version number; ``warn_feature_off_once``
(``compiler.torch_release``) says which feature is off and why. A private name read when a
module is imported goes through ``at_import`` (Note [Private names read at import]).
"""

from __future__ import annotations

import re
import traceback
from typing import Any, Callable

import torch
from torch import fx

# What this torch release has: the releases the contract tests ran on, the feature-off warning and
# the names read at import (Note [Private names read at import]), kept in compiler.torch_release.
from .torch_release import (TESTED_TORCH, at_import, import_time_names, missing_at_import,  # noqa: F401
                            refuse_if_missing_at_import, torch_is_tested, torch_version, warn_feature_off_once,
                            warn_if_missing_at_import)


# --- compiling a module in place ----------------------------------------------------------


def compile_call_in_place(module: torch.nn.Module, compile_call: Any) -> Any:
    """Have ``module(...)`` run ``compile_call(call)``'s result from now on, where ``call`` runs what
    ``module(...)`` ran before (its hooks and its forward); the module object, its class, its
    ``forward`` and its state-dict keys are unchanged. Returns what ``compile_call`` made."""
    # Module._call_impl: the hooks and forward that Module.__call__ runs; Module._compiled_call_impl: what
    # __call__ (_wrapped_call_impl) runs instead when set, as Module.compile() sets it. Module.__getstate__
    # drops it, so a copy (copy.deepcopy) or a pickle of the module is the uncompiled module.
    module._compiled_call_impl = compile_call(module._call_impl)
    return module._compiled_call_impl


def compiled_call(module: torch.nn.Module) -> Any:
    """What :func:`compile_call_in_place` (or ``Module.compile``) set on ``module``, else None."""
    return module.__dict__.get("_compiled_call_impl")


# --- backends -----------------------------------------------------------------------


def backend_names() -> list[str]:
    # torch._dynamo.list_backends(exclude_tags=()): every registered name, debug ones included.
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def inductor_mode_names() -> list[str]:
    # torch._inductor.list_mode_options(): the modes torch.compile(mode=...) accepts.
    from torch._inductor import list_mode_options

    return sorted(list_mode_options().keys())


def named_backend(name: str, dynamic: bool | None) -> Callable:
    # torch._TorchCompileWrapper(backend, mode, options, dynamic): what torch.compile builds for a name.
    return torch._TorchCompileWrapper(name, None, None, dynamic)


def inductor_backend(mode: str | None, options: dict | None, dynamic: bool | None) -> Callable:
    # torch._TorchCompileInductorWrapper(mode, options, dynamic): validates options (RuntimeError) as torch.compile does.
    return torch._TorchCompileInductorWrapper(mode, options, dynamic)


# --- dynamo control flow and graph-break reasons -------------------------------------

# Exceptions dynamo raises to restart or skip tracing; a backend must let them through. Without
# one, such a signal is a compile failure: the partition or graph runs eagerly (compile_partitions warns).
CONTROL_FLOW = "Letting dynamo's restart and skip signals through a backend"
DYNAMO_CONTROL_FLOW = tuple(e for e in (at_import("torch._dynamo.exc.RestartAnalysis", CONTROL_FLOW),
                                        at_import("torch._dynamo.exc.SkipFrame", CONTROL_FLOW)) if e is not None)


def set_compile_reason(gm: fx.GraphModule, text: str, filename: str) -> None:
    # gm.compile_subgraph_reason (a GraphCompileReason): what dynamo's explain/logging shows as a break reason.
    from torch._dynamo.output_graph import GraphCompileReason

    gm.compile_subgraph_reason = GraphCompileReason(text, [traceback.FrameSummary(filename, 0, "split")])


def graph_break_frame(gm: fx.GraphModule) -> tuple[str, Any] | None:
    """(reason, user frame) when dynamo ended ``gm`` at a graph break, else None."""
    # dynamo sets gm.compile_subgraph_reason with .graph_break, .reason and .user_stack (FrameSummary list).
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and reason.graph_break and reason.user_stack:
        return reason.reason, reason.user_stack[-1]
    return None


# --- dynamo metadata on split graphs ------------------------------------------------------

# The functions dynamo records when a graph enters/leaves autocast or switches grad mode (an exit
# takes its enter node as argument). split_module's GLOBAL_STATE_NODES (a local there): the region
# nodes it re-enters in each partition it cuts through; with any in the graph it needs
# non-decreasing partitions. Without one, split_graph does not recognise those nodes (it warns).
REGIONS = "Keeping autocast and grad-mode regions whole when a graph is split"
AUTOCAST_ENTER = at_import("torch.amp._enter_autocast", REGIONS)
AUTOCAST_EXIT = at_import("torch.amp._exit_autocast", REGIONS)
SET_GRAD_ENABLED = at_import("torch._C._set_grad_enabled", REGIONS)
SPLIT_REENTERED_TARGETS = tuple(t for t in (AUTOCAST_ENTER, AUTOCAST_EXIT, SET_GRAD_ENABLED) if t is not None)
# The same for inference_mode, which split_module does not re-enter: a cut must not fall inside one.
INFERENCE_REGIONS = "Recognising inference_mode regions in a captured graph"
INFERENCE_MODE_ENTER = at_import("torch.autograd.grad_mode._enter_inference_mode", INFERENCE_REGIONS)
INFERENCE_MODE_EXIT = at_import("torch.autograd.grad_mode._exit_inference_mode", INFERENCE_REGIONS)


def placeholder_sources(gm: fx.GraphModule) -> dict[str, Any]:
    # node._dynamo_source: AOTAutograd reads it to tell parameters (static inputs) from activations.
    return {n.name: getattr(n, "_dynamo_source", None) for n in gm.graph.find_nodes(op="placeholder")}


def carry_sources(orig: fx.GraphModule, piece: fx.GraphModule, sources: dict[str, Any]) -> None:
    # gm._param_name_to_source and node._dynamo_source, as PyTorch's own splitter carries them.
    if hasattr(orig, "_param_name_to_source"):
        piece._param_name_to_source = orig._param_name_to_source
    for ph in piece.graph.find_nodes(op="placeholder"):
        ph._dynamo_source = sources.get(ph.name)


# --- fake tensors and the tracing context (Note [Lazy partition compile]) ------------------

# Fake tensors (re-exported) and dynamo's global event counters: the lazy partition compile cannot
# run without them (compile_partitions refuses).
LAZY_COMPILE = "Lazy partition compile (a split graph's partitions compiled one by one, Note [Lazy partition compile])"
FakeTensor = at_import("torch._subclasses.fake_tensor.FakeTensor", LAZY_COMPILE)
FakeTensorMode = at_import("torch._subclasses.fake_tensor.FakeTensorMode", LAZY_COMPILE)
_counters = at_import("torch._dynamo.utils.counters", LAZY_COMPILE)


def detect_fake_mode(inputs: list) -> FakeTensorMode | None:
    # torch._dynamo.utils.detect_fake_mode: the fake mode dynamo traced the inputs with.
    return torch._dynamo.utils.detect_fake_mode(inputs)


def to_fake(value: torch.Tensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    # torch._dynamo.utils.to_fake_tensor: a fake copy of a real tensor in that mode.
    return torch._dynamo.utils.to_fake_tensor(value, fake_mode)


def fake_copy(module: torch.nn.Module, fake_mode: FakeTensorMode) -> torch.nn.Module:
    # torch._dynamo.utils.deepcopy_to_fake_tensor: a deep copy whose tensors are fake.
    return torch._dynamo.utils.deepcopy_to_fake_tensor(module, fake_mode)


def no_saved_tensor_hooks_while_tracing() -> Any:
    # torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing: as PyTorch's splitter compiles partitions.
    return torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing()


def tracing_context() -> Any:
    # torch._guards.TracingContext.try_get(): dynamo's context for the graph being compiled, or None.
    return torch._guards.TracingContext.try_get()


def profiler_enabled() -> bool:
    # torch.autograd._profiler_enabled(): whether a torch.profiler session is recording (a partition then runs
    # under a record_function range named for it).
    return torch.autograd._profiler_enabled()


class PartitionMetadata:
    """Per-partition AOTAutograd forward metadata, read back by the lazy backward
    compile: AOTAutograd's runtime wrappers read ``tracing.ddp_optimizer_ctx``
    (``curr_bucket``, ``metadata_per_bucket``), the handshake PyTorch's own
    splitter uses."""

    def __init__(self) -> None:
        self.curr_bucket = -1
        self.metadata_per_bucket: list[Any] = []


def start_partition_metadata(tracing: Any) -> None:
    # TracingContext.ddp_optimizer_ctx: where AOTAutograd looks for per-partition forward metadata.
    tracing.ddp_optimizer_ctx = PartitionMetadata()


def record_partition_metadata(tracing: Any) -> None:
    # TracingContext.fw_metadata: the forward metadata AOTAutograd just produced for the compiled partition.
    meta = tracing.ddp_optimizer_ctx
    meta.curr_bucket += 1
    meta.metadata_per_bucket.append(tracing.fw_metadata)


def set_fakify_first_call(tracing: Any, on: bool) -> None:
    # TracingContext.fakify_first_call: AOTAutograd returns fake outputs with the backend's strides on the first call.
    tracing.fakify_first_call = on


def aot_counts() -> tuple[int, int]:
    """(graphs through AOTAutograd, AOTAutograd cache hits) so far in this process."""
    # counters["aot_autograd"]["total"] / ["autograd_cache_hit"]: bumped by AOTAutograd per compile / cache hit.
    aot = _counters["aot_autograd"]
    return aot["total"], aot["autograd_cache_hit"]


def aot_cache_enabled() -> bool:
    """Whether AOTAutograd's local cache would serve a partition compiled without
    ``fakify_first_call`` (its own checks: FX graph cache and autograd cache on, and caches not
    force-disabled, as ``should_use_local_autograd_cache`` reads them)."""
    # torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache and
    # torch._inductor.config.force_disable_caches (an alias of torch.compiler.config's).
    from torch._functorch import config as functorch_config

    inductor = torch._inductor.config
    return bool(inductor.fx_graph_cache and functorch_config.enable_autograd_cache
                and not inductor.force_disable_caches)


# --- compilation metrics and guard text (Note [Diagnosis]) ---------------------------------


def compilation_metrics() -> list[Any]:
    # torch._dynamo.utils.get_compilation_metrics(): a bounded deque of per-frame records
    # with co_name, co_filename, co_firstlineno and recompile_reason.
    return list(torch._dynamo.utils.get_compilation_metrics())


def recompile_limit() -> int:
    # torch._dynamo.config.recompile_limit: compiles per frame before dynamo falls back to eager.
    return int(torch._dynamo.config.recompile_limit)


# A recompile reason reads "<frame>/<n>: <guard>"; a shape guard reads
# "tensor 'name' size mismatch at index i. expected ..., actual ...".
_REASON_PREFIX = re.compile(r"^\d+/\d+: ")
SIZE_GUARD = re.compile(r"tensor '([^']+)' size mismatch at index (\d+)")


def failed_guard(recompile_reason: str) -> str:
    """The guard text of a recompile reason, without dynamo's frame/count prefix."""
    return recompile_reason.split(": ", 1)[-1] if _REASON_PREFIX.match(recompile_reason) else recompile_reason


def size_guard(guard: str) -> tuple[str, int] | None:
    """(input name, axis) when ``guard`` is a failed shape guard, else None."""
    m = SIZE_GUARD.search(guard)
    return (m.group(1), int(m.group(2))) if m else None


# --- Inductor's on-disk kernels (Note [Damaged cache artifacts]) ----------------------------


def inductor_cache_dir() -> str:
    # torch._inductor.runtime.cache_dir_utils.cache_dir(): TORCHINDUCTOR_CACHE_DIR, else Inductor's default.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_default_cache_dir() -> str:
    # torch._inductor.runtime.cache_dir_utils.default_cache_dir(): where Inductor caches when not told.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def cpp_kernel_keys() -> set[str]:
    # torch._inductor.codecache.CppCodeCache and its subclasses (CppPythonBindingsCodeCache,
    # CppWrapperCodeCache): a class-level ``cache`` dict keyed by the hash that names the kernel's
    # files, <cache dir>/<key[1:3]>/<key>.*; every kernel this process built or loaded is a key there.
    from torch._inductor import codecache

    keys: set[str] = set()
    for name in ("CppCodeCache", "CppPythonBindingsCodeCache", "CppWrapperCodeCache"):
        keys.update(k for k in getattr(getattr(codecache, name, None), "cache", {}) if isinstance(k, str))
    return keys


def merge_artifact_payloads(*payloads: bytes) -> tuple[bytes, set[tuple[str, str]]]:
    """One ``save_cache_artifacts`` payload holding every artifact of ``payloads`` once (by type and
    key, the later payload's content winning), and those (type, key) pairs. Raises if one is not
    torch's format."""
    # torch.compiler._cache: a payload is AppendingByteSerializer bytes of (artifact type, [CacheArtifact])
    # items (_serialize_single_cache / _deserialize_single_cache). save_cache_artifacts() appends one
    # item per type at every call, and CacheArtifactManager.deserialize keeps only the last item of a
    # type (dict(...)), so a payload is rebuilt here with one item per type.
    from torch.compiler._cache import (CacheArtifactManager, _deserialize_single_cache,
                                       _serialize_single_cache)
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    merged: dict[str, dict[str, Any]] = {}
    for payload in payloads:
        for kind, artifacts in AppendingByteSerializer.to_list(payload, deserialize_fn=_deserialize_single_cache):
            for artifact in artifacts:
                merged.setdefault(kind, {})[artifact.key] = artifact
    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    out.extend((kind, list(by_key.values())) for kind, by_key in merged.items())
    return out.to_bytes(), {(kind, key) for kind, by_key in merged.items() for key in by_key}


def artifact_format_known() -> bool:
    """Whether ``save_cache_artifacts`` payloads are in the format :func:`artifact_entries` reads."""
    # torch.utils._appending_byte_serializer._ENCODING_VERSION: the payload's format version (1 since it
    # exists); torch.compiler._cache._serialize_single_cache: how one item of artifacts is written.
    try:
        from torch.compiler import _cache
        from torch.utils import _appending_byte_serializer as serializer
    except ImportError:
        return False
    return getattr(serializer, "_ENCODING_VERSION", None) == 1 and hasattr(_cache, "_serialize_single_cache")


def artifact_entries(payload: bytes) -> list[tuple[str, str]]:
    """The (artifact type, key) of every artifact in a ``save_cache_artifacts`` payload, read without
    creating or unpickling anything. Raises ValueError when the bytes are not in that format."""
    # torch.utils._appending_byte_serializer: 4 bytes of CRC32 over the rest, a uint64 format version,
    # then items; torch.compiler._cache._serialize_single_cache writes an item as str(type), uint64
    # count, then str(key) and bytes(content) per artifact. A uint64 is 8 bytes big-endian; bytes are a
    # uint64 length and the bytes; a str is the bytes of its utf-8 text in base64. torch's own reader
    # does not check lengths (a short payload can make it loop); this one does.
    import base64
    import binascii
    import zlib

    data = memoryview(payload)
    if len(data) < 12 or zlib.crc32(data[4:]).to_bytes(4, "big") != bytes(data[:4]):
        raise ValueError("not a torch compile-artifact payload (too short, or its CRC does not match)")
    pos = 4

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise ValueError(f"truncated at byte {pos} (wants {n} more of {len(data)})")
        pos += n
        return bytes(data[pos - n:pos])

    def uint64() -> int:
        return int.from_bytes(take(8), "big")

    def text() -> str:
        try:
            return base64.b64decode(take(uint64()), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as e:
            raise ValueError(f"a name that is not base64 text ({e})") from None

    if (version := uint64()) != 1:
        raise ValueError(f"format version {version}, not 1")
    entries = []
    while pos < len(data):
        kind, count = text(), uint64()
        for _ in range(count):
            entries.append((kind, text()))
            take(uint64())  # the artifact's content
    return entries


def artifact_target(kind: str, key: str) -> str | None:
    """Where ``load_cache_artifacts`` writes an artifact of type ``kind`` (a folder or a file, in the
    current Inductor cache directory); None for a type the toolkit does not produce."""
    # InductorCacheArtifact.populate_cache: FxGraphCache._write_to_local_cache -> a file in
    # FxGraphCache._get_tmp_dir_for_key(key) (<dir>/fxgraph/<key[1:3]>/<key>); AOTAutogradCacheArtifact:
    # a file in AOTAutogradCache._get_tmp_dir_for_key(key) (<dir>/aotautograd/<key>);
    # AutotuneCacheArtifact (Triton kernels' best configs, on GPU): the file <cache_dir()>/<key>.
    if kind == "inductor":
        from torch._inductor.codecache import FxGraphCache

        return FxGraphCache._get_tmp_dir_for_key(key)
    if kind == "aot_autograd":
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

        return AOTAutogradCache._get_tmp_dir_for_key(key)
    if kind == "autotune":
        import os

        return os.path.join(inductor_cache_dir(), key)
    return None


# --- shared compile (Note [Shared compile]) ---------------------------------------------------


def compile_backward_with_forward() -> Any:
    # torch._functorch.config.force_non_lazy_backward_lowering: AOTAutograd compiles the
    # backward graph right after the forward (and saves its cache entry then), not at the
    # first backward pass.
    from torch._functorch import config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def default_store() -> Any:
    # torch.distributed.distributed_c10d._get_default_store(): the default group's rendezvous store.
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
