"""Two gloo ranks, the launcher's training step with train.max_grad_norm (Note [Gradient
clipping] in launch/step/optim.py) against one process clipping with
torch.nn.utils.clip_grad_norm_ on the whole global batch: compiled DDP with gradient
accumulation, and eager FSDP2 (DTensor gradients). Then the held-out evaluation (Note
[Evaluation] in launch/step/evaluate.py) on the same models: one loss for every rank, the mean
over ranks, and the training graphs neither recompiled nor added to."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.data.source import SyntheticTokens
from launch.step.evaluate import Evaluator
from launch.step.optim import OptimizerStep
from launch.step.train_step import StepRunner, micro_batches
from launch.models import GPT, GPTConfig

STEPS = 3
LR = 1e-2
MAX_NORM = 0.5  # below the norms of this model's first steps (1.3 to 1.7 seen): clipping is active
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
LOCAL_BATCH, SEQ = 4, 16
# fp32, the same sums in another order (a 2-rank all-reduce, micro-batches): within 1e-5
NORM_TOL = dict(rel=1e-5)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
# The attention's key bias has an analytically zero gradient, and Adam normalises its float noise
# to about lr * g / eps (Note [Compiled optimizer step] in launch/step/optim.py): 1.2e-5 seen with lr 1e-2.
QKV_BIAS_TOL = dict(rtol=0.0, atol=1e-4)


def _rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    return {"ddp": _scenario(rank, world_size, "ddp", grad_accum=2),
            "fsdp": _scenario(rank, world_size, "fsdp", grad_accum=1)}


def _global_batch(data, step: int, world_size: int):
    """Every rank's batch of ``step``, concatenated: what one process would train on."""
    parts = [data.batch(step, r, world_size, LOCAL_BATCH, SEQ) for r in range(world_size)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _scenario(rank: int, world_size: int, mode: str, grad_accum: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    ref, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    if mode == "ddp":
        from ddp_opt import compile_ddp

        module = DDP(model, bucket_cap_mb=0.02)
        forward = compile_ddp(module, backend="aot_eager")
    else:
        import fsdp_opt

        fsdp_opt.apply(model, fsdp_opt.FSDPConfig(compile=None))
        module = forward = model
    runner = StepRunner(forward, module, OptimizerStep(torch.optim.AdamW(model.parameters(), lr=LR),
                                                       max_grad_norm=MAX_NORM))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    unclipped_opt = torch.optim.AdamW(unclipped.parameters(), lr=LR)
    data = SyntheticTokens(seed=5, vocab_size=CFG.vocab_size)
    norms, ref_norms = [], []
    for step in range(1, STEPS + 1):
        batches = micro_batches(data, step=step, rank=rank, world_size=world_size, local_batch=LOCAL_BATCH,
                                seq_len=SEQ, grad_accum=grad_accum, lengths="fixed", padding="max", pad_multiple=8,
                                seed=5, device=torch.device("cpu"))
        runner.step(batches, step)
        norms.append(runner.grad_norm.item())
        x, y = _global_batch(data, step, world_size)
        ref(x, y)[1].backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        ref_opt.step()
        ref_opt.zero_grad()
        unclipped(x, y)[1].backward()
        unclipped_opt.step()
        unclipped_opt.zero_grad()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    out = dict(norms=norms, ref_norms=ref_norms, params=full, ref_params=dict(ref.named_parameters()),
               unclipped=dict(unclipped.named_parameters()))
    out.update(_evaluate(rank, world_size, module, runner, data, ref, grad_accum))
    return out


def _evaluate(rank, world_size, module, runner, data, ref, grad_accum) -> dict:
    """Evaluate, then take one more training step (the same shapes): count the graphs each compiles."""
    inner = module.module if isinstance(module, DDP) else module
    evaluator = Evaluator(inner, data, every=1, last=STEPS, batches=2, batch_size=LOCAL_BATCH, seq_len=SEQ,
                          rank=rank, world_size=world_size)
    before = counters["stats"]["unique_graphs"]
    loss = evaluator()
    after_eval = counters["stats"]["unique_graphs"]
    assert inner.training, "evaluation left the model in eval mode"
    batches = micro_batches(data, step=STEPS + 1, rank=rank, world_size=world_size, local_batch=LOCAL_BATCH,
                            seq_len=SEQ, grad_accum=grad_accum, lengths="fixed", padding="max", pad_multiple=8, seed=5,
                            device=torch.device("cpu"))
    runner.step(batches, STEPS + 1)
    # what one process would compute: the mean of every rank's held-out batches (reference weights)
    with torch.no_grad():
        ref_loss = torch.stack([ref(*data.eval_batch(i, r, world_size, LOCAL_BATCH, SEQ))[1]
                                for r in range(world_size) for i in range(2)]).mean().item()
    after_step = counters["stats"]["unique_graphs"]
    control = None
    if isinstance(module, DDP):  # the control: the same evaluation through the compiled forward compiles anew
        inner.eval()
        with torch.no_grad():
            inner(*data.eval_batch(0, rank, world_size, LOCAL_BATCH // grad_accum, SEQ))
        inner.train()
        control = counters["stats"]["unique_graphs"] - after_step
    return dict(eval_loss=loss, ref_eval_loss=ref_loss, graphs_by_eval=after_eval - before,
                graphs_by_next_step=after_step - after_eval, graphs_by_compiled_eval=control)


@pytest.fixture(scope="module")
def results(run_ranks) -> list[dict]:
    return run_ranks(_rank, world_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_clipping_matches_clip_grad_norm_on_the_global_batch(results, mode):
    for rank, r in enumerate(res[mode] for res in results):
        for step, (a, b) in enumerate(zip(r["norms"], r["ref_norms"]), 1):
            assert b > MAX_NORM, f"step {step}: norm {b} is under the cap, so nothing was clipped"
            assert a == pytest.approx(b, **NORM_TOL), f"{mode} rank {rank} step {step}: norm {a} vs reference {b}"
        for name, p in r["params"].items():
            tol = QKV_BIAS_TOL if name.endswith("qkv.bias") else PARAM_TOL
            torch.testing.assert_close(p, r["ref_params"][name], **tol,
                                       msg=lambda m: f"{mode} rank {rank} {name} after {STEPS} steps: {m}")
        moved = max((r["unclipped"][n] - r["ref_params"][n]).abs().max().item() for n in r["params"])
        assert moved > 1e-4, "clipping changed nothing: the comparison cannot see it"
    assert results[0][mode]["norms"] == results[1][mode]["norms"], "the ranks logged different norms"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_evaluation_is_the_mean_over_ranks_and_compiles_nothing(results, mode):
    r0, r1 = results[0][mode], results[1][mode]
    assert r0["eval_loss"] == r1["eval_loss"], "ranks disagree on the held-out loss"
    assert r0["eval_loss"] == pytest.approx(r0["ref_eval_loss"], rel=1e-5)
    for rank, r in enumerate((r0, r1)):
        assert r["graphs_by_eval"] == 0, f"rank {rank}: evaluation compiled {r['graphs_by_eval']} graph(s)"
        assert r["graphs_by_next_step"] == 0, f"rank {rank}: the step after evaluation recompiled"
        if mode == "ddp":
            assert r["graphs_by_compiled_eval"] > 0, "the control: a compiled eval-mode forward compiles new graphs"
