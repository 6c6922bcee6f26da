"""compile_ddp(reduce_dtype=torch.bfloat16): the gradients all-reduced in bf16 under the split
strategy (DDP's reducer, a comm hook kept across realignment), the traced strategy (the cast in the
compiled backward) and compile_for_ddp, each step by step against eager DDP with the arithmetic of
PyTorch's own bf16 compress hook (``benchmarks.link.peer_hooks``; Note [Reduced-precision all-reduce])."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _graph_caches import compile_every_graph

from benchmarks.link.peer_hooks import bucket_bf16_hook as torch_bf16_hook
from compiler import SettingError
from ddp_opt import DDPCompileConfig, compile_ddp, compile_for_ddp, compiled_ddp_of
from ddp_opt._torch_internals import registered_hook_name

STEPS, WIDTH = 4, 48


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                 for _ in range(4)], torch.nn.Linear(WIDTH, 3))


def _train(rank: int, model: torch.nn.Module, call, backward) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    losses, grads = [], []
    for _ in range(STEPS):
        x = torch.randn(6, WIDTH, generator=data)
        loss = call(x).square().mean()
        backward(loss)
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "params": [p.detach().clone() for p in model.parameters()]}


CAP_MB = 0.012  # several buckets, so the split strategy realigns them after step 1


def _rank(rank: int, world_size: int, how: str, backend: str = "aot_eager") -> dict:
    compile_every_graph()  # the fusion is recorded when the pass runs (Note [Graph caches off, kernel files kept])
    cap = CAP_MB
    reference = DDP(_model(), bucket_cap_mb=cap)
    reference.register_comm_hook(None, torch_bf16_hook)
    fp32 = DDP(_model(), bucket_cap_mb=cap)
    results = {"reference": _train(rank, reference.module, reference, lambda loss: loss.backward()),
               "fp32": _train(rank, fp32.module, fp32, lambda loss: loss.backward())}
    if how == "compile_for_ddp":
        model = _model()
        compiled_model = compile_for_ddp(model, backend="aot_eager", reduce_dtype="bf16")
        ddp = DDP(compiled_model, bucket_cap_mb=cap)
        results["ours"] = _train(rank, model, ddp, lambda loss: loss.backward())
        controller = compiled_ddp_of(compiled_model)
    else:
        ddp = DDP(_model(), bucket_cap_mb=cap)
        controller = compile_ddp(ddp, backend=backend, strategy=how, reduce_dtype=torch.bfloat16)
        results["ours"] = _train(rank, ddp.module, controller, controller.backward)
    results["aligned"] = controller.aligned_caps is not None
    results["hook"] = registered_hook_name(ddp)
    results["fused"] = controller.traced.fused if controller.traced is not None else None
    results["grad_bytes"] = sum(p.numel() * p.element_size() for p in ddp.parameters())
    return results


def _bf16_exact(t: torch.Tensor) -> bool:
    return torch.equal(t, t.to(torch.bfloat16).float())


@pytest.mark.parametrize("how", ["split", "traced", "compile_for_ddp"])
def test_bf16_reduction_matches_eager_ddp_with_pytorchs_bf16_hook(run_ranks, how):
    _check_parity(run_ranks(_rank, how, timeout=600), how)


def test_traced_inductor_fuses_bf16_buckets_by_gradient_bytes(run_ranks):
    results = run_ranks(_rank, "traced", "inductor", timeout=900)
    _check_parity(results, "traced")
    fused, grad_bytes = results[0]["fused"], results[0]["grad_bytes"]
    assert fused and all(f == fused[0] for f in fused), fused  # every step's backward: one compiled graph
    # Half the gradient bytes crossed, in buckets closed at DDP's cap counted in gradient bytes (counted in
    # bytes on the wire, each bucket would hold twice as many gradients).
    assert sum(fused[0]) * 2 == grad_bytes, (fused, grad_bytes)
    # Each bucket but the last closed once its gradient bytes reached the cap, and not a gradient later:
    # without its last gradient (at most the largest) it was still under the cap.
    cap, largest = int(CAP_MB * 2 ** 20), max(p.numel() * 4 for p in _model().parameters())
    assert len(fused[0]) > 1, fused
    assert all(cap <= 2 * b < cap + largest for b in fused[0][:-1]), (fused, cap, largest)


def _check_parity(results: list[dict], how: str) -> None:
    for r in results:
        ours, ref, fp32 = r["ours"], r["reference"], r["fp32"]
        torch.testing.assert_close(ours["losses"], ref["losses"], rtol=1e-5, atol=0)
        for step in range(STEPS):
            exact = equal = total = 0
            for g, g_ref, g_fp32 in zip(ours["grads"][step], ref["grads"][step], fp32["grads"][step]):
                # What crossed the wire was bf16: every reduced gradient is a bf16 value widened to fp32,
                # which the fp32 reduction's are not.
                assert _bf16_exact(g), (step, g)
                exact += _bf16_exact(g_fp32)
                equal += int((g == g_ref).sum())
                total += g.numel()
                # Within the rounding of one bf16 sum (a gradient a hair apart before the cast may round to
                # the neighbouring bf16 value).
                torch.testing.assert_close(g, g_ref, rtol=0, atol=2 ** -7 * float(g_ref.abs().max()))
            assert equal / total > 0.99, (step, equal, total)
            assert exact < len(ours["grads"][step]), "the fp32 reference was bf16-exact: the test tells nothing"
        for p, p_ref in zip(ours["params"], ref["params"]):
            torch.testing.assert_close(p, p_ref, rtol=1e-4, atol=1e-6)
    if how == "traced":
        assert results[0]["hook"] is None  # the python reducer's hook list, not DDP's reducer
    else:
        # Realigned after step 1 and the hook registered again on the new reducer: steps 2 to 4 were bf16 too.
        assert all(r["aligned"] and r["hook"] == "bucket_hook" for r in results), results[0]["hook"]
    # Each step's losses differ between the ranks (their own batches), the gradients do not.
    assert results[0]["ours"]["losses"] != results[1]["ours"]["losses"]
    for g0, g1 in zip(results[0]["ours"]["grads"][-1], results[1]["ours"]["grads"][-1]):
        assert torch.equal(g0, g1)


# --- settings and refusals, in process ---------------------------------------------------------


@pytest.mark.parametrize("given, dtype", [("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16),
                                          (torch.bfloat16, torch.bfloat16), ("fp16", torch.float16),
                                          (torch.float16, torch.float16), ("fp32", None), (torch.float32, None),
                                          (None, None)])
def test_reduce_dtype_is_normalised(given, dtype):
    assert DDPCompileConfig(reduce_dtype=given).reduce_dtype is dtype


@pytest.mark.parametrize("given", ["int8", torch.int8, 16, "float64"])
def test_a_reduce_dtype_that_cannot_work_is_refused_naming_the_choices(given):
    with pytest.raises(SettingError, match=r"compile_ddp\(reduce_dtype=.*\): expected torch.bfloat16 or "
                                           r"torch.float16 \(or one of 'bf16', .*\).*None to reduce them in their "
                                           r"own dtype") as caught:
        DDPCompileConfig(reduce_dtype=given)
    assert caught.value.setting == "reduce_dtype"


def test_reduce_dtype_changes_the_cache_key():
    # Under the traced strategy the cast is in the compiled backward.
    assert DDPCompileConfig(reduce_dtype="bf16").cache_settings() != DDPCompileConfig().cache_settings()


def _ddp() -> DDP:
    return DDP(torch.nn.Linear(4, 2))


def test_reduce_dtype_with_a_users_comm_hook_is_refused(gloo, clean_dynamo):
    ddp = _ddp()
    ddp.register_comm_hook(None, torch_bf16_hook)
    with pytest.raises(ValueError, match=r"^compile_ddp\(reduce_dtype=torch.bfloat16\) all-reduces the gradients "
                                         r"through a comm hook of its own, and the comm hook 'bucket_bf16_hook' is "
                                         r"already registered on this DDP module; DDP calls one hook. Drop "
                                         r"reduce_dtype to keep your hook, or register no hook and keep "
                                         r"reduce_dtype.$"):
        compile_ddp(ddp, backend="aot_eager", reduce_dtype="bf16", strategy="traced")


def test_compile_for_ddp_with_reduce_dtype_refuses_a_users_hook_at_its_first_call(gloo, clean_dynamo):
    class Net(torch.nn.Module):  # not a torch.nn container: dynamo compiles its forward
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x)

    ddp = DDP(compile_for_ddp(Net(), backend="aot_eager", reduce_dtype="bf16"))
    ddp.register_comm_hook(None, torch_bf16_hook)
    # Raised inside dynamo's backend call, which wraps it; the message is ours.
    with pytest.raises(Exception, match=r"compile_for_ddp\(reduce_dtype=torch.bfloat16\) all-reduces the gradients "
                                        r"through a comm hook of its own, and the comm hook 'bucket_bf16_hook' is "
                                        r"already registered on this DDP module"):
        ddp(torch.randn(3, 4))


def test_a_comm_hook_registered_after_reduce_dtype_is_refused(gloo, clean_dynamo):
    compiled = compile_ddp(_ddp(), backend="aot_eager", reduce_dtype="bf16")
    with pytest.raises(ValueError, match=r"register_comm_hook\('bucket_bf16_hook'\): this model was compiled with "
                                         r"reduce_dtype=torch.bfloat16, .* Compile with reduce_dtype=None to reduce "
                                         r"through your hook, or drop the hook and keep reduce_dtype."):
        compiled.register_comm_hook(None, torch_bf16_hook)


def test_one_rank_bf16_reduction_rounds_the_gradients(gloo, clean_dynamo):
    x = torch.randn(5, WIDTH)
    grads = {}
    for dtype in ("bf16", None):
        ddp = DDP(_model())
        compile_ddp(ddp, backend="aot_eager", reduce_dtype=dtype)(x).square().mean().backward()
        grads[dtype] = [p.grad for p in ddp.parameters()]
    assert all(_bf16_exact(g) for g in grads["bf16"])
    assert not all(_bf16_exact(g) for g in grads[None])
    for g, g32 in zip(grads["bf16"], grads[None]):
        torch.testing.assert_close(g, g32, rtol=2 ** -8, atol=0)  # one rounding to bf16


# --- the launcher: ddp.reduce_dtype ------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_main_jobs_ddp_reduces_in_bf16(gloo, clean_dynamo, backend):
    from _jobs import one_rank_main_model

    wrapped, x = one_rank_main_model(f"compile={backend}", "ddp.reduce_dtype=bf16")
    wrapped.forward(x, x)[1].backward()  # compile.backend=eager: DDP itself, with the same hook
    grads = [p.grad for p in wrapped.module.parameters() if p.grad is not None]
    assert grads and all(_bf16_exact(g) for g in grads)
    assert registered_hook_name(wrapped.module) == "bucket_hook"


@pytest.mark.parametrize("overrides, needle", [
    (["ddp.reduce_dtype=int8"], r"ddp\.reduce_dtype='int8' is not one of fp32, bf16: the dtype the gradients "
                                r"are all-reduced in\. Use ddp\.reduce_dtype=bf16"),
    (["ddp.reduce_dtype=fp16"], r"ddp\.reduce_dtype='fp16' is not one of fp32, bf16: .*fp16 would overflow without a "
                                r"loss scale"),
    (["parallel=fsdp", "ddp.reduce_dtype=bf16"], r"ddp\.reduce_dtype is set but parallel=fsdp"),
    (["parallel=fsdp", "fsdp.reduce_dtype=fp8"], r"fsdp\.reduce_dtype='fp8' is not one of fp32, bf16: the "
                                                 r"dtype the gradients are reduce-scattered in\. Use "
                                                 r"fsdp\.reduce_dtype=bf16"),
    (["fsdp.reduce_dtype=bf16"], r"fsdp\.reduce_dtype='bf16' is set but parallel=ddp"),
])
def test_a_reduce_dtype_the_job_cannot_use_is_refused_before_a_process_group(overrides, needle):
    from _jobs import composed
    from launch.checks.validate import validate
    from launch.config.schema import ConfigError

    with pytest.raises(ConfigError, match=needle):
        validate(composed(*overrides), world_size=2)


# --- FSDP2: fsdp.reduce_dtype is MixedPrecisionPolicy(reduce_dtype=...) ------------------------


@pytest.mark.parametrize("mixed, reduce, param_dtype, reduce_dtype", [
    ("none", "bf16", None, torch.bfloat16), ("bf16", "fp32", torch.bfloat16, torch.float32),
    ("bf16", "bf16", torch.bfloat16, torch.bfloat16)])
def test_fsdp_reduce_dtype_maps_to_fsdp2s_policy(mixed, reduce, param_dtype, reduce_dtype):
    from launch.config.schema import CompileConfig, FSDPOptions
    from launch.runtime.parallel import fsdp_config

    policy = fsdp_config(FSDPOptions(mixed_precision=mixed, reduce_dtype=reduce), CompileConfig()).mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)
    assert fsdp_config(FSDPOptions(), CompileConfig()).mp_policy is None  # fp32 throughout: FSDP2's default


def _fsdp_rank(rank: int, world_size: int, reduce: str) -> list[bool]:
    import fsdp_opt
    from launch.config.schema import CompileConfig, FSDPOptions
    from launch.runtime.parallel import fsdp_config
    from launch.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    fsdp_opt.apply(model, fsdp_config(FSDPOptions(reduce_dtype=reduce), CompileConfig(backend="eager")))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(x, x)[1].backward()
    return [_bf16_exact(p.grad.to_local()) for p in model.parameters() if p.grad is not None]


def test_fsdp_reduce_dtype_bf16_reduce_scatters_in_bf16(run_ranks):
    for rank_exact in run_ranks(_fsdp_rank, "bf16"):
        assert rank_exact and all(rank_exact)
    for rank_exact in run_ranks(_fsdp_rank, "fp32"):
        assert not all(rank_exact)  # the yardstick: fp32 reduction leaves fp32 values
