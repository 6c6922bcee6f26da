"""One small test per private torch access (the ``_torch_internals`` module of each
package): if a torch upgrade changes what one relies on, it fails here, by name,
instead of somewhere deep in a training run. ``compiler``'s here; ``ddp_opt``'s and
``fsdp_opt``'s in ``tests/contracts/test_torch_contracts_ddp.py``."""

import copy
import inspect

import pytest
import torch
from torch import nn

import compiler._torch_internals as cti


pytestmark = pytest.mark.usefixtures("clean_dynamo")


def _captured(fn, *args):
    """The dynamo graphs (gm, example_inputs) of ``fn(*args)``, eager backend."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs, cti.tracing_context()))
        return gm.forward

    torch.compile(fn, backend=backend)(*args)
    return graphs


# --- compiler -------------------------------------------------------------------------


def test_a_call_compiled_in_place():
    # Module.__call__ runs _compiled_call_impl when set, in place of _call_impl (hooks and forward); copies drop it.
    model, seen = nn.Linear(2, 2), []
    model.register_forward_pre_hook(lambda module, args: seen.append("hook"))

    def compile_call(call_impl):
        return lambda *args: seen.append("compiled") or call_impl(*args)

    made = cti.compile_call_in_place(model, compile_call)
    assert cti.compiled_call(model) is made and "forward" not in vars(model)
    model(torch.randn(1, 2))
    assert seen == ["compiled", "hook"]
    assert cti.compiled_call(copy.deepcopy(model)) is None and cti.compiled_call(nn.Linear(2, 2)) is None


def test_backend_and_mode_registries():
    assert {"eager", "aot_eager", "inductor"} <= set(cti.backend_names())
    assert {"default", "reduce-overhead", "max-autotune"} <= set(cti.inductor_mode_names())
    assert callable(cti.named_backend("aot_eager", None))
    with pytest.raises(RuntimeError):
        cti.inductor_backend(None, {"no_such_inductor_option": 1}, None)


def test_dynamo_control_flow_exceptions_exist():
    assert all(issubclass(e, Exception) for e in cti.DYNAMO_CONTROL_FLOW)


def test_graph_break_reason_carries_the_user_frame():
    def with_print(x):
        y = x + 1
        print("break")
        return y * 2

    graphs = _captured(with_print, torch.randn(3))
    found = cti.graph_break_frame(graphs[0][0])
    assert found is not None, "the first graph ended at the print, so it carries a break reason"
    reason, frame = found
    assert reason and frame.filename == __file__ and "print" in (frame.line or "")


def test_tracing_context_handshake_of_pytorchs_splitter():
    # The attributes compile_partitions sets and reads, and AOTAutograd's reader of them.
    (gm, inputs, tracing), = _captured(lambda x: x.sin(), torch.randn(2))
    assert tracing is not None
    for name in ("fakify_first_call", "ddp_optimizer_ctx", "fw_metadata"):
        assert hasattr(tracing, name), name
    cti.start_partition_metadata(tracing)
    tracing.fw_metadata = "meta"
    cti.record_partition_metadata(tracing)
    assert tracing.ddp_optimizer_ctx.curr_bucket == 0 and tracing.ddp_optimizer_ctx.metadata_per_bucket == ["meta"]
    from torch._functorch._aot_autograd import runtime_wrappers

    source = inspect.getsource(runtime_wrappers)
    assert "ddp_optimizer_ctx" in source and "metadata_per_bucket" in source and "curr_bucket" in source


def test_dynamo_sources_on_placeholders():
    lin = nn.Linear(3, 2)
    (gm, _, _), = _captured(lin, torch.randn(1, 3))
    sources = cti.placeholder_sources(gm)
    assert any(s is not None for s in sources.values())
    assert hasattr(gm, "_param_name_to_source")


def test_fake_tensor_helpers():
    mode = cti.FakeTensorMode()
    fake = cti.to_fake(torch.randn(2, 3), mode)
    assert isinstance(fake, cti.FakeTensor) and cti.detect_fake_mode([fake]) is mode
    copy = cti.fake_copy(nn.Linear(3, 2), mode)
    assert isinstance(copy.weight, cti.FakeTensor)
    with cti.no_saved_tensor_hooks_while_tracing():
        pass


def test_aot_autograd_counters_and_cache_switches():
    before = cti.aot_counts()
    torch.compile(lambda x: x.cos() * 2, backend="aot_eager")(torch.randn(3, requires_grad=True))
    assert cti.aot_counts()[0] > before[0]
    assert isinstance(cti.aot_cache_enabled(), bool)
    with torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        assert cti.aot_cache_enabled()
        with torch._inductor.config.patch(force_disable_caches=True):  # as torch's own cache check reads it
            assert not cti.aot_cache_enabled()


def test_recompile_reason_text():
    def f(x):
        return x * 2

    compiled = torch.compile(f, backend="eager", dynamic=False)
    compiled(torch.randn(4, 8))
    compiled(torch.randn(4, 16))
    # The metrics are a bounded deque (full late in the suite): read the newest entry, not a position.
    reasons = [m.recompile_reason for m in cti.compilation_metrics()[-1:] if getattr(m, "recompile_reason", None)]
    assert reasons, "dynamo recorded no recompile reason"
    guard = cti.failed_guard(reasons[-1])
    assert not guard[:1].isdigit(), guard
    assert cti.size_guard(guard) == ("x", 1), guard
    assert cti.recompile_limit() >= 1


def test_a_feature_that_cannot_run_warns_once_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr("compiler.torch_release._features_off", set())
    with pytest.warns(RuntimeWarning, match=r"feature X is off on torch .*: it needs A._b, C._d, which this "
                                            r"release lacks, so it is skipped\. The toolkit's contract tests run "
                                            r"on torch 2.11, 2.12, 2.13, 2.14, 2.15"):
        cti.warn_feature_off_once("feature X", ["A._b", "C._d"], "it is skipped")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cti.warn_feature_off_once("feature X", ["A._b"], "it is skipped")  # once only


def test_compile_cache_internals():
    # The artifact payload format: one item per artifact type, merged by key; the C++ kernel caches.
    from torch.compiler._cache import CacheArtifactFactory, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    from torch._inductor.codecache import InductorCacheArtifact

    def payload(*keys):
        out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
        out.extend([(InductorCacheArtifact.type(),
                     [CacheArtifactFactory.create(InductorCacheArtifact.type(), k, k.encode()) for k in keys])])
        return out.to_bytes()

    merged, keys = cti.merge_artifact_payloads(payload("a", "b"), payload("b", "c"))
    assert keys == {(InductorCacheArtifact.type(), k) for k in "abc"}
    assert cti.merge_artifact_payloads(merged)[1] == keys
    assert isinstance(cti.cpp_kernel_keys(), set)
    assert isinstance(cti.inductor_default_cache_dir(), str)


def test_artifact_payload_reader_and_where_each_type_is_written(tmp_path, monkeypatch):
    # Note [Checked artifact keys]: the payload is read without torch's reader, so its layout is pinned
    # here against torch's own writer, and each type's target against torch's own path functions.
    import os

    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    items = [("inductor", ["fabc", "/abs"]), ("aot_autograd", ["adef"]), ("autotune", ["gh/ij.best_config"])]
    out.extend((kind, [CacheArtifactFactory.create(kind, k, b"x" * 3) for k in keys]) for kind, keys in items)
    out.extend([("inductor", [CacheArtifactFactory.create("inductor", "fzz", b"")])])  # a second save appends
    assert cti.artifact_format_known()
    assert cti.artifact_entries(out.to_bytes()) == [
        ("inductor", "fabc"), ("inductor", "/abs"), ("aot_autograd", "adef"), ("autotune", "gh/ij.best_config"),
        ("inductor", "fzz")]
    with pytest.raises(ValueError):
        cti.artifact_entries(out.to_bytes()[:-1])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert cti.artifact_target("inductor", "fabc") == os.path.join(tmp_path, "fxgraph", "ab", "fabc")
    assert cti.artifact_target("aot_autograd", "adef") == os.path.join(tmp_path, "aotautograd", "adef")
    assert cti.artifact_target("autotune", "gh/ij.best_config") == os.path.join(tmp_path, "gh", "ij.best_config")
    assert cti.artifact_target("pgo", "x") is None
    # What load_cache_artifacts does with an absolute key (why the keys are checked first): it writes
    # there, and may then unpickle the content (Inductor's Triton bundle; why a payload needs a MAC).
    import contextlib
    import pickle

    planted = tmp_path / "planted"
    with contextlib.suppress(pickle.UnpicklingError):
        torch.compiler.load_cache_artifacts(_one("inductor", str(planted)))
    assert planted.is_dir()


def _one(kind, key):
    from torch.compiler._cache import CacheArtifactFactory, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    out.extend([(kind, [CacheArtifactFactory.create(kind, key, b"content")])])
    return out.to_bytes()
