"""Traced FSDP on two gloo ranks against eager FSDP2 with the same settings, step by step:
losses, gradients (before each optimizer step) and parameters, under AdamW with
global-norm clipping and gradient accumulation, bf16 compute with activation
checkpointing, bf16 reduction with the units kept gathered; how many collectives each
graph holds; and DCP checkpoints that move between traced and per_block both ways."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from launch.models import GPT, GPTConfig

CFG = GPTConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=128, block_size=32)
STEPS, LR = 3, 1e-2
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SCENARIOS = {
    # (settings both models get, accumulation micro-batches, clipping max norm, traced's own settings)
    "fp32": (dict(), 2, 0.5, dict(shard_unit_mb="auto")),
    "bf16_checkpointing": (dict(mp_policy=BF16, checkpointing=True), 1, None, dict(shard_unit_mb=None)),
    "bf16_reduce_kept": (dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), reshard_after_forward=False),
                         1, None, dict(shard_unit_mb=None)),
}


def _batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _models(settings: dict, traced: dict, backend: str):
    import fsdp_opt

    torch.manual_seed(0)
    ref, model = GPT(CFG), GPT(CFG)
    model.load_state_dict(ref.state_dict())
    fsdp_opt.apply(ref, compile=None, **settings)  # eager FSDP2, one unit per block
    plan = fsdp_opt.apply(model, strategy="traced", compile=backend, **settings, **traced)
    return ref, model, plan


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _scenario(rank: int, name: str, backend: str) -> dict:
    torch._dynamo.reset()
    settings, accum, clip, traced = SCENARIOS[name]
    ref, model, plan = _models(settings, traced, backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, model)]
    out = dict(losses=[], ref_losses=[], grad_diff=[], norms=[])
    for step in range(STEPS):
        for micro in range(accum):
            last = micro == accum - 1
            x, y = _batch(rank, step, micro)
            losses = []
            for m in (ref, model):
                m.set_requires_gradient_sync(last)
                loss = m(x, y)[1]
                (loss / accum).backward()
                losses.append(loss.item())
        out["ref_losses"].append(losses[0])
        out["losses"].append(losses[1])
        if clip is not None:
            out["norms"].append([float(_full(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
                                 for m in (ref, model)])
        out["grad_diff"].append(max((_full(a.grad) - _full(b.grad)).abs().max().item()
                                    for a, b in zip(ref.parameters(), model.parameters())))
        for o in opts:
            o.step()
            o.zero_grad()
    out["param_diff"] = max((_full(a) - _full(b)).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    out["placements"] = {k: sorted((p.kind, p.unit) for p in v) for k, v in plan.traced.placements.items()}
    out["units"] = [u.blocks for u in plan.traced.units]
    out["resharded"] = [u.resharded for u in plan.traced.units]
    out["names"] = sorted(n for n, _ in model.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    out["placement"] = {str(p.placements) for p in model.parameters()}
    out["share"] = plan.share.stats.as_dict() if plan.share is not None else None
    return out


def _train(rank: int, world_size: int, names: list[str], backend: str) -> dict:
    torch.set_num_threads(1)
    return {name: _scenario(rank, name, backend) for name in names}


def _check(results: list[dict], name: str, loss_tol: float, grad_tol: float, param_tol: float | None = None) -> None:
    for rank, by_name in enumerate(results):
        r = by_name[name]
        for step, (loss, ref) in enumerate(zip(r["losses"], r["ref_losses"])):
            assert abs(loss - ref) <= loss_tol, f"{name} rank {rank} step {step}: traced {loss} vs FSDP2 {ref}"
        for step, diff in enumerate(r["grad_diff"]):
            assert diff <= grad_tol, f"{name} rank {rank} step {step}: gradients differ by {diff}"
        for step, (ref_norm, norm) in enumerate(r["norms"]):
            assert norm == pytest.approx(ref_norm, rel=1e-5), f"{name} rank {rank} step {step}: clip norm"
        limit = param_tol if param_tol is not None else grad_tol * 10
        assert r["param_diff"] <= limit, f"{name} rank {rank}: parameters drifted by {r['param_diff']}"
        assert r["names"] and r["placement"] == {"(Shard(dim=0),)"}, r
    assert results[0][name]["losses"] != results[1][name]["losses"]  # the ranks saw different batches


def _collectives(r: dict) -> dict:
    counts = {}
    for kind, placements in r["placements"].items():
        for collective, _ in placements:
            collective = "reduction" if collective in ("reduce-scatter", "all-to-all (reduce)") else collective
            counts[(kind, collective)] = counts.get((kind, collective), 0) + 1
    return counts


@pytest.mark.slow
def test_traced_trains_as_eager_fsdp2_with_clipping_accumulation_bf16_and_checkpointing(run_ranks):
    results = run_ranks(_train, list(SCENARIOS), "aot_eager", timeout=600)
    _check(results, "fp32", 1e-5, 1e-5)
    # bf16: the gradients agree within bf16's rounding at every step, but AdamW normalises each update, so an
    # element whose gradient is near zero may step by up to lr either way (0.02 seen on torch 2.15 after 3 steps)
    _check(results, "bf16_checkpointing", 1e-3, 1e-3, param_tol=STEPS * LR)
    _check(results, "bf16_reduce_kept", 1e-3, 1e-3, param_tol=STEPS * LR)
    # one all-gather per unit in forward; backward gathers again every unit that reshards, also with the
    # blocks checkpointed, and reduce-scatters every unit once (the accumulating micro-batches none)
    for name, r in results[0].items():
        units, again = len(r["units"]), sum(r["resharded"])
        counts = _collectives(r)
        assert counts[("forward", "all-gather")] == units, (name, counts)
        assert counts.get(("backward", "all-gather"), 0) == again, (name, counts)
        assert counts[("backward", "reduction")] == units, (name, counts)
    assert results[0]["bf16_checkpointing"]["resharded"] == [False, True, True, True]  # the root stays gathered
    assert results[0]["bf16_reduce_kept"]["resharded"] == [False] * 4


def _round_trip(rank: int, world_size: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import fsdp_opt

    torch.set_num_threads(1)

    def build(strategy: str):
        torch.manual_seed(0)
        m = GPT(CFG)
        if strategy == "traced":
            fsdp_opt.apply(m, strategy="traced", compile="aot_eager", shard_unit_mb=None)
        else:
            fsdp_opt.apply(m, compile=None)
        return m, torch.optim.AdamW(m.parameters(), lr=LR)

    def train(m, opt, first: int, n: int) -> list[float]:
        out = []
        for step in range(first, first + n):
            loss = m(*_batch(rank, step, 0))[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    results = {}
    for src, dst in (("traced", "per_block"), ("per_block", "traced")):
        torch._dynamo.reset()
        m, opt = build(src)
        train(m, opt, 0, 2)
        model_sd, optim_sd = get_state_dict(m, opt)
        path = f"{folder}/{src}"
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        kept_going = train(m, opt, 2, 2)
        other, other_opt = build(dst)
        train(other, other_opt, 50, 1)  # state of its own first, which the load must replace
        model_sd, optim_sd = get_state_dict(other, other_opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        results[f"{src}->{dst}"] = (kept_going, train(other, other_opt, 2, 2), sorted(model_sd))
    return results


@pytest.mark.slow
def test_a_checkpoint_saved_under_traced_resumes_under_per_block_and_the_reverse(run_ranks):
    with tempfile.TemporaryDirectory() as folder:
        results = run_ranks(_round_trip, folder, timeout=600)
    for rank, r in enumerate(results):
        for direction, (kept_going, resumed, keys) in r.items():
            assert resumed == pytest.approx(kept_going, abs=1e-6), f"rank {rank} {direction}"
            assert "wte.weight" in keys and "blocks.2.mlp.proj.weight" in keys, keys


@pytest.mark.slow
def test_traced_with_inductor_trains_as_eager_fsdp2_and_the_ranks_share_the_compile(run_ranks):
    results = run_ranks(_train, ["fp32"], "inductor", timeout=900)
    # Inductor's fused kernels round differently from eager's: within a few float32 ulps of the loss
    _check(results, "fp32", 1e-4, 1e-4)
    # One rank compiled each graph (the forward, with its backward; again at the synchronising micro-batch),
    # the other loaded it (Note [Shared compile]): the two graphs of gradient accumulation, one each way
    # or both one way, but never compiled twice.
    shares = [r["fp32"]["share"] for r in results]
    assert sum(s["compiled"] for s in shares) == 2 and sum(s["loaded"] for s in shares) == 2, shares
