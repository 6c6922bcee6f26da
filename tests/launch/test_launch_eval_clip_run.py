"""Evaluation and gradient clipping through run() on one rank: evaluation changes no
training loss and no graph count (also under train.no_recompile_after_warmup), its
held-out batches are not training batches, a user dataset's eval_batch is what it
reads; clipping logs the norm of every applied step and none for a skipped one, and
under a GradScaler it clips the unscaled gradients."""

from __future__ import annotations

import copy

import pytest
import torch

import _custom_parts
from launch.config.schema import CompileConfig, DataConfig, JobConfig, ParallelConfig
from launch.data.source import SyntheticTokens
from launch.step.optim import OptimizerStep
from launch.train import run
from launch.models import GPT, GPTConfig
from _jobs import ONE_BLOCK, tiny_job

pytestmark = pytest.mark.usefixtures("one_thread", "clean_dynamo")


def _job(tmp_path, backend="aot_eager", data=None, parallel="ddp", **train) -> JobConfig:
    return tiny_job(tmp_path, model=ONE_BLOCK, parallel=ParallelConfig(name=parallel),
                    compile=CompileConfig(backend=backend),
                    data=data or DataConfig(), train={"steps": 4, **train})


def test_evaluation_changes_no_training_and_compiles_nothing(tmp_path, capsys):
    plain = run(_job(tmp_path, no_recompile_after_warmup=True, log_interval=10))
    torch._dynamo.reset()
    capsys.readouterr()
    evald = run(_job(tmp_path, no_recompile_after_warmup=True, log_interval=10, eval_every=3, eval_batches=2))
    out = capsys.readouterr().out
    assert evald["losses"] == plain["losses"], "evaluation changed the training losses"
    assert (evald["graphs"], evald["recompiles"], evald["recompiles_after_warmup"]) == (
        plain["graphs"], plain["recompiles"], plain["recompiles_after_warmup"]) == (1, 0, 0)
    assert [s for s, _ in evald["eval_losses"]] == [3, 4] and plain["eval_losses"] == []  # every 3rd step and the last
    loss3 = dict(evald["eval_losses"])[3]
    # a step with an evaluation is printed whatever train.log_interval says (10 here)
    assert f"step     3/4  loss {dict(evald['losses'])[3]:.4f}" in out and f"eval_loss {loss3:.4f}" in out
    assert out.count("eval_loss") == 2 and "step     2/4" not in out


def test_held_out_batches_are_not_training_batches():
    data = SyntheticTokens(seed=1337, vocab_size=512)
    held_out = [data.eval_batch(i, rank, 2, 4, 16)[0] for i in range(8) for rank in (0, 1)]
    trained = [data.batch(step, rank, 2, 4, 16)[0] for step in range(0, 200) for rank in (0, 1)]
    assert not any(torch.equal(h, t) for h in held_out for t in trained)
    assert torch.equal(data.eval_batch(0, 0, 2, 4, 16)[0], data.eval_batch(0, 0, 2, 4, 16)[0])  # the same each time


def test_a_user_dataset_s_eval_batch_is_read(tmp_path):
    _custom_parts.HeldOut.calls.clear()
    data = DataConfig(name="custom", _target_="_custom_parts.HeldOut",
                      kwargs={"seed": 1, "vocab_size": 512})
    metrics = run(_job(tmp_path, backend="eager", data=data, eval_every=2, eval_batches=3, grad_accum=2))
    calls = _custom_parts.HeldOut.calls
    assert calls[0] == (0, 0, 2, 16)  # the probe, before the run: one eval batch of the probe's size
    # then 3 batches per evaluation, after steps 2 and 4, of the training micro-batch size (4 / grad_accum 2)
    assert calls[1:] == [(i, 0, 2, 16) for i in range(3)] * 2
    assert [s for s, _ in metrics["eval_losses"]] == [2, 4]


def test_clipping_logs_each_applied_step_s_norm_and_skips_a_non_finite_step(tmp_path, capsys):
    def inf_loss_at_3(job, step):
        runner = job.runner
        real = getattr(runner, "_real_forward", runner.forward)
        runner._real_forward = real
        runner.forward = (lambda *a: (lambda lg, ls: (lg, ls * float("inf")))(*real(*a))) if step == 3 else real

    metrics = run(_job(tmp_path, parallel="none", max_grad_norm=0.5, on_nonfinite="skip"),
                  step_callbacks=[inf_loss_at_3])
    assert metrics["skipped_at"] == [3]
    assert [s for s, _ in metrics["grad_norms"]] == [1, 2, 4]  # no norm for the skipped step
    assert all(n > 0.5 for _, n in metrics["grad_norms"])  # clipping was active
    out = capsys.readouterr().out
    assert f"grad_norm {dict(metrics['grad_norms'])[4]:.4f}" in out


CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)


def test_a_grad_scaler_s_gradients_are_unscaled_before_clipping():
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    scaled = OptimizerStep(torch.optim.AdamW(model.parameters(), lr=1e-2),
                           scaler=torch.amp.GradScaler("cpu", init_scale=1024.0), max_grad_norm=0.5)
    plain = OptimizerStep(torch.optim.AdamW(ref.parameters(), lr=1e-2), max_grad_norm=0.5)
    x = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    scaled.scaler.scale(model(x, x)[1]).backward()
    ref(x, x)[1].backward()
    norm, ref_norm = scaled(), plain()
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6) and ref_norm.item() > 0.5
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # an inf gradient: the norm is inf, the scaler skips the update and backs off
    before = [p.detach().clone() for p in model.parameters()]
    scaled.scaler.scale(model(x, x)[1] * float("inf")).backward()
    assert not torch.isfinite(scaled()).item()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaled.scaler.get_scale() == 512.0


def test_fsdp_with_per_block_compile_clips_and_evaluates(tmp_path):
    # one rank: the DTensor gradient norm and the eager evaluation of the FSDP2 model whose
    # blocks are compiled (two ranks, eager FSDP2: tests/launch/test_launch_clip_multirank.py)
    metrics = run(_job(tmp_path, parallel="fsdp", max_grad_norm=0.5, eval_every=2, eval_batches=1, steps=3))
    assert [s for s, _ in metrics["grad_norms"]] == [1, 2, 3] and all(n > 0.5 for _, n in metrics["grad_norms"])
    assert [s for s, _ in metrics["eval_losses"]] == [2, 3]
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in metrics["eval_losses"])
