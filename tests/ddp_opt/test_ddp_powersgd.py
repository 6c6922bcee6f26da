"""compile_ddp(compression="powersgd:R:START"): PyTorch's PowerSGD hook through DDP's reducer under
the split strategy, kept across realignment, step by step against eager DDP with the same hook, seed
and start (Note [PowerSGD compression]); and the settings it refuses.

The eager reference runs PyTorch's hook through ``sequenced_powersgd_hook`` too: registered as it is,
on gloo with several buckets, its ranks issue collectives in different orders and abort (the Note)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.link.peer_hooks import bucket_bf16_hook
from compiler import SettingError
from ddp_opt import DDPCompileConfig, compile_ddp
from ddp_opt._torch_internals import python_comm_hooks, registered_hook_name
from ddp_opt.compression import hooks as compression
from ddp_opt.compression.hooks import own_hook
from ddp_opt.compression.powersgd import (PowerSGD, SequencedState, parse_compression, powersgd_hook,
                                         sequenced_powersgd_hook)

# Each Linear's weight (1.4 MB) fills a bucket at a cap of 1 MiB, so DDP's buckets, eager and realigned
# alike, hold one matrix each, in the same order: PowerSGD's result for a bucket depends on the matrices
# in it and on the buckets' order (its random first Q is drawn per bucket), not on the order of the
# gradients inside one.
WIDTH, LAYERS, CAP_MB, RANK, START, STEPS = 600, 3, 1.0, 2, 3, 7


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 4))


def _train(rank: int, model: torch.nn.Module, call) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    losses, grads = [], []
    for _ in range(STEPS):
        loss = call(torch.randn(8, WIDTH, generator=data)).square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads}


def _parity_rank(rank: int, world_size: int) -> dict:
    reference = DDP(_model(), bucket_cap_mb=CAP_MB)
    state = SequencedState(reference.process_group, matrix_approximation_rank=RANK, start_powerSGD_iter=START,
                           use_error_feedback=True, warm_start=True, random_seed=0)
    reference.register_comm_hook(state, sequenced_powersgd_hook)
    fp32 = DDP(_model(), bucket_cap_mb=CAP_MB)
    # DDP all-reduces its used-parameter map right after the last bucket's hook: in order only if
    # that hook waits for the others.
    unused = DDP(_model(), bucket_cap_mb=CAP_MB, find_unused_parameters=True)
    unused.register_comm_hook(parse_compression(f"powersgd:{RANK}:{START}").state(unused.process_group),
                              sequenced_powersgd_hook)
    changed = []
    compression.forget_buckets = lambda state: changed.append(dict(state.error_dict))  # realignment's calls
    ddp = DDP(_model(), bucket_cap_mb=CAP_MB)
    compiled = compile_ddp(ddp, backend="aot_eager", compression=f"powersgd:{RANK}:{START}")
    ours = _train(rank, ddp.module, compiled)
    own = compiled.own_hook.state
    return {"ours": ours, "reference": _train(rank, reference.module, reference),
            "unused": _train(rank, unused.module, unused), "layout_changes": len(changed),
            "fp32": _train(rank, fp32.module, fp32), "aligned": compiled.aligned_caps,
            "partitions": len([b for b in compiled.buckets if b.size]), "hook": registered_hook_name(ddp),
            "compressed": (own.total_numel_before_compression, own.total_numel_after_compression),
            "buckets": sorted(own.error_dict)}


def test_powersgd_under_the_split_strategy_matches_eager_ddp_with_pytorchs_hook(run_ranks):
    results = run_ranks(_parity_rank, timeout=600)
    for r in results:
        # Realigned after step 1 and the hook registered again on the new reducer, one bucket per layer.
        assert r["aligned"] is not None and r["partitions"] >= LAYERS, r["aligned"]
        assert r["hook"] == "powersgd_hook"
        before, after = r["compressed"]
        assert 0 < after < before / 10, r["compressed"]  # rank 2 of 600 x 600: what crossed was ~1/150
        assert r["buckets"] == list(range(len(r["buckets"]))) and len(r["buckets"]) >= LAYERS
        # Told twice that the layout changed (the reducer re-created, its realigned buckets built).
        assert r["layout_changes"] == 2, r["layout_changes"]
        torch.testing.assert_close(r["ours"]["losses"], r["reference"]["losses"], rtol=1e-5, atol=0)
        for step in range(STEPS):
            for g, g_ref in zip(r["ours"]["grads"][step], r["reference"]["grads"][step]):
                torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)
        # With find_unused_parameters DDP keeps its first buckets (it does not rebuild them), so its
        # compressed steps differ; it ran all of them, equal to the reference before START.
        assert len(r["unused"]["losses"]) == STEPS
        torch.testing.assert_close(r["unused"]["losses"][:START + 1], r["reference"]["losses"][:START + 1],
                                   rtol=1e-5, atol=0)
        # The steps before START reduce uncompressed, as fp32 DDP; from START on the gradients are
        # low-rank approximations, which the fp32 ones are not.
        for step in range(STEPS):
            same = all(torch.allclose(g, g32, rtol=1e-4, atol=1e-6)
                       for g, g32 in zip(r["ours"]["grads"][step], r["fp32"]["grads"][step]))
            assert same == (step < START), step
    for run in ("ours", "unused"):
        for g0, g1 in zip(results[0][run]["grads"][-1], results[1][run]["grads"][-1]):
            assert torch.equal(g0, g1)  # the ranks' gradients agree


def test_a_bucket_layout_change_drops_powersgds_memories(gloo, caplog):
    # Realignment calls it when it re-creates the reducer and when the realigned buckets appear. In the
    # flows tried, PyTorch's step count starts compression only after both (with static_graph the new
    # reducer's first step calls no hook), so this is a safety net: one bucket's error must never be
    # added to another's gradients.
    own = own_hook(dist.group.WORLD, None, parse_compression("powersgd:2:2"))
    own.state.error_dict[0] = torch.ones(3)
    own.state.p_memory_dict[0], own.state.q_memory_dict[0] = torch.ones(2), torch.ones(2)
    with caplog.at_level(logging.INFO, logger="ddp_opt.compression.powersgd"):
        own.buckets_changed()
    assert not (own.state.error_dict or own.state.p_memory_dict or own.state.q_memory_dict)
    assert "the error feedback and the warm start restart from zero" in caplog.text
    own.buckets_changed()  # nothing kept: nothing said
    assert caplog.text.count("restart from zero") == 1


class _Shapes(torch.nn.Module):
    """Matrices of three shapes (two alike) and vectors in one bucket: the memories' layout by shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = torch.nn.Linear(64, 48), torch.nn.Linear(48, 48)
        self.c, self.d = torch.nn.Linear(48, 96), torch.nn.Linear(96, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def test_the_hook_under_ddps_reducer_is_pytorchs_arithmetic_with_the_fast_products(gloo):
    # One bucket whose compressed matrices come in three shapes, out of order, rank 4 (QR): the hook
    # compile_ddp registers must lay out and draw its memories as PyTorch's hook does, step by step.
    runs = {}
    for hook in (sequenced_powersgd_hook, powersgd_hook):
        ddp = DDP(_Shapes())
        state = parse_compression("powersgd:4:2").state(ddp.process_group)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data, grads = torch.Generator().manual_seed(7), []
        for _ in range(6):
            ddp(torch.randn(16, 64, generator=data)).square().mean().backward()
            grads.append([p.grad.clone() for p in ddp.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[hook.__name__] = grads, state
    (theirs, their_state), (ours, our_state) = runs.values()
    for step, (mine, ref) in enumerate(zip(ours, theirs)):
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step}: {m}")
    assert our_state.iter == 6 and our_state.error_dict[0].abs().max() > 0  # steps 2 to 5 were compressed
    assert our_state.compression_stats() == their_state.compression_stats()
    torch.testing.assert_close(our_state.q_memory_dict[0], their_state.q_memory_dict[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(our_state.error_dict[0], their_state.error_dict[0], rtol=1e-4, atol=1e-5)


class _Bucket:
    """A GradBucket as the hook sees it: one flat buffer and its gradients as views of it."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        numel = sum(torch.Size(shape).numel() for shape in shapes)
        self._buffer = torch.randn(numel, generator=torch.Generator().manual_seed(3))
        self._views, at = [], 0
        for shape in shapes:
            self._views.append(self._buffer[at:at + torch.Size(shape).numel()].view(shape))
            at += self._views[-1].numel()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def test_the_bucket_hook_makes_no_copy_of_the_bucket(gloo):
    # PyTorch's hook copies the whole bucket to take the error as copy - result; ours writes each
    # gradient's error as it writes its result, so nothing as large as the bucket is allocated.
    from ddp_opt.compression.bucket_powersgd import compress_bucket

    state = parse_compression("powersgd:4:2").state(dist.group.WORLD)
    bucket = _Bucket([(256, 512), (512,), (512, 256), (256,)])
    for _ in range(3):  # two plain all-reduces, then the first compressed step makes the memories
        compress_bucket(state, bucket)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        compress_bucket(state, bucket)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < bucket.buffer().nbytes // 4, (largest, bucket.buffer().nbytes)
    assert state.error_dict[0].abs().max() > 0


def test_the_bucket_hook_refuses_gradients_outside_the_buckets_buffer(gloo):
    from ddp_opt.compression.bucket_powersgd import compress_bucket

    state = parse_compression("powersgd:4:2").state(dist.group.WORLD)
    state.iter = state.start_powerSGD_iter
    bucket = _Bucket([(256, 512), (256,)])
    bucket._views = [view.clone() for view in bucket._views]  # not views of the buffer: nothing to write back to
    with pytest.raises(RuntimeError, match="given a gradient that does not lie in the bucket's buffer.*This is a bug"):
        compress_bucket(state, bucket)


# --- settings and refusals, in process ---------------------------------------------------------


@pytest.mark.parametrize("given, spec", [("powersgd:4", PowerSGD(4, 10)), ("PowerSGD:1:200", PowerSGD(1, 200)),
                                         (PowerSGD(8, 5), PowerSGD(8, 5)), ("none", None), (None, None)])
def test_compression_is_parsed(given, spec):
    assert parse_compression(given) == spec
    assert DDPCompileConfig(compression=given).compression == spec


@pytest.mark.parametrize("given, needle", [
    ("powersgd", r"'powersgd' names no compression: expected 'powersgd:RANK' or 'powersgd:RANK:START'"),
    ("topk:4", r"'topk:4' names no compression"),
    ("powersgd:0", r"powersgd:0:10: the rank is the number of columns of P and Q, at least 1. Pass e.g. "
                   r"'powersgd:4'. Or pass compression=None to reduce the gradients as they are"),
    ("powersgd:4:1", r"powersgd:4:1: the start must be at least 2: .* DDP rebuilds its buckets after step 1. "
                     r"Pass e.g. 'powersgd:4:10'. Or pass compression=None"),
])
def test_a_compression_that_cannot_work_is_refused(given, needle):
    with pytest.raises(SettingError, match=r"compile_ddp\(compression=.*\): " + needle) as caught:
        DDPCompileConfig(compression=given)
    assert caught.value.setting == "compression"


@pytest.mark.parametrize("more, needle", [
    (dict(reduce_dtype="bf16"), r"compile_ddp\(compression='powersgd:4', reduce_dtype=torch.bfloat16\): both "
                                r"choose how the gradients cross the link, .* Pass one of the two."),
])
def test_compression_with_a_setting_it_cannot_share_is_refused(more, needle):
    with pytest.raises(SettingError, match=needle):
        DDPCompileConfig(compression="powersgd:4", **more)


def test_compression_leaves_the_cache_key_alone():
    assert DDPCompileConfig(compression="powersgd:4").cache_settings() == DDPCompileConfig().cache_settings()


def test_compression_with_a_users_comm_hook_is_refused(gloo, clean_dynamo):
    ddp = DDP(torch.nn.Linear(4, 2))
    ddp.register_comm_hook(None, bucket_bf16_hook)
    with pytest.raises(ValueError, match=r"^compile_ddp\(compression='powersgd:4:10'\) all-reduces the gradients "
                                         r"through a comm hook of its own, and the comm hook 'bucket_bf16_hook' is "
                                         r"already registered on this DDP module; DDP calls one hook. Drop "
                                         r"compression to keep your hook, or register no hook and keep "
                                         r"compression.$"):
        compile_ddp(ddp, backend="aot_eager", compression="powersgd:4")


def test_a_comm_hook_registered_after_compression_is_refused(gloo, clean_dynamo):
    compiled = compile_ddp(DDP(torch.nn.Linear(4, 2)), backend="aot_eager", compression="powersgd:4")
    with pytest.raises(ValueError, match=r"register_comm_hook\('bucket_bf16_hook'\): this model was compiled with "
                                         r"compression='powersgd:4:10', .* Compile with compression=None to reduce "
                                         r"through your hook, or drop the hook and keep compression."):
        compiled.register_comm_hook(None, bucket_bf16_hook)


# --- the launcher: ddp.compression -------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_main_jobs_ddp_compresses_with_powersgd(gloo, clean_dynamo, backend):
    from _jobs import one_rank_main_model

    wrapped, x = one_rank_main_model(f"compile={backend}", "ddp.compression=powersgd:2:2")
    for _ in range(3):  # the third step is compressed: one rank's gradient replaced by its rank-2 approximation
        wrapped.forward(x, x)[1].backward()
    assert registered_hook_name(wrapped.module) == "powersgd_hook"
    [(state, _)] = python_comm_hooks(wrapped.module)
    assert state.iter == 3 and state.error_dict, state.iter


def test_the_main_jobs_traced_ddp_compresses_in_the_compiled_backward(gloo, clean_dynamo):
    from _jobs import one_rank_main_model

    wrapped, x = one_rank_main_model("compile=aot_eager", "ddp.strategy=traced", "ddp.compression=powersgd:2:2")
    for _ in range(3):  # the third step is compressed, in the backward compiled for it
        with wrapped.backward_context():
            wrapped.forward(x, x)[1].backward()
    state = wrapped.compiled_ddp.traced_hook
    assert wrapped.compiled_ddp.strategy == "traced" and state.steps == 3 and state.layout
    assert any(e is not None and e.abs().sum() > 0 for e in state.errors)  # what rank 2 left out, kept


@pytest.mark.parametrize("overrides, needle", [
    (["ddp.compression=topk"], r"ddp\.compression='topk' is not valid: 'topk' names no compression: expected "
                               r"'powersgd:RANK' or 'powersgd:RANK:START'.* In the launcher: ddp\.compression=powersgd:4, "
                               r"or ddp\.compression=none to reduce the gradients as they are"),
    (["ddp.compression=powersgd:4:1"], r"ddp\.compression='powersgd:4:1' is not valid: .*the start must be at least 2"),
    (["ddp.compression=powersgd:4", "ddp.reduce_dtype=bf16"], r"ddp\.compression=powersgd:4 with "
                                                              r"ddp\.reduce_dtype=bf16: both choose how the gradients "
                                                              r"cross the link.* Keep one"),
    (["parallel=fsdp", "ddp.compression=powersgd:4"], r"ddp\.compression is set but parallel=fsdp"),
])
def test_a_compression_the_job_cannot_use_is_refused_before_a_process_group(overrides, needle):
    from _jobs import composed
    from launch.checks.validate import validate
    from launch.config.schema import ConfigError

    with pytest.raises(ConfigError, match=needle):
        validate(composed(*overrides), world_size=2)


def test_the_auto_plan_measures_the_link_as_powersgd_sends_a_bucket(gloo, monkeypatch):
    import ddp_opt.api as api
    from ddp_opt.compression.powersgd import link_probe

    sent = []

    def recording(spec, group):
        probe = link_probe(spec, group)

        def record(tensor):
            sent.append(tensor.numel())
            return probe(tensor)
        return record

    monkeypatch.setattr(api, "powersgd_probe", recording)
    model = api.resolve_cost_model(DDP(torch.nn.Linear(4, 2)), DDPCompileConfig(bucket_cap_mb="auto",
                                                                               compression="powersgd:4"))
    assert model is not None and len(set(sent)) >= 2  # the probe's sizes, each sent the PowerSGD way


@pytest.mark.parametrize("strategy, counted", [("split", True), ("traced", False)])
def test_the_auto_plan_counts_the_hooks_power_iteration_against_backward(gloo, strategy, counted):
    # Under a reducer strategy the hook compresses each bucket on the cores backward runs on; the traced
    # strategy compresses each gradient inside backward however the buckets fall (Note [PowerSGD compression]).
    from ddp_opt.api import resolve_cost_model
    from ddp_opt.planning.solver import NO_HOOK_COMPUTE

    model = resolve_cost_model(DDP(torch.nn.Linear(4, 2)), DDPCompileConfig(
        bucket_cap_mb="auto", compression="powersgd:4", strategy=strategy))
    if counted:
        assert model.hook.s_per_byte > 0  # a bigger bucket's power iteration takes longer
        assert model.hook.shares_cores  # on the CPU: "auto" makes one bucket (Note [Cost-model bucket plan])
    else:
        assert model.hook == NO_HOOK_COMPUTE
    plain = resolve_cost_model(DDP(torch.nn.Linear(4, 2)), DDPCompileConfig(bucket_cap_mb="auto", strategy=strategy))
    assert plain.hook == NO_HOOK_COMPUTE
