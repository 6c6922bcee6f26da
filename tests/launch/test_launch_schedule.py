"""The lr schedule (Note [LR schedule] in launch/step/schedule.py): its values, the compiled
optimizer step reading a tensor lr (one compile for every lr, where a float lr
recompiles for each value), and a run interrupted and resumed from its checkpoint
getting the same lr and loss at every step as an uninterrupted one."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch._dynamo.utils import counters

from launch.config.schema import CompileConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from launch.step.optim import OptimizerStep, build_optimizer
from launch.step.schedule import Schedule
from launch.train import run
from launch.models import GPT, GPTConfig
from _jobs import ONE_BLOCK, tiny_job

pytestmark = pytest.mark.usefixtures("one_thread", "clean_dynamo")


def test_lr_at_each_step():
    lr, w, n = 1.0, 2, 6
    assert [Schedule("constant", lr, 0, 0.0, n).lr_at(s) for s in (1, 6)] == [1.0, 1.0]
    assert [Schedule("constant", lr, w, 0.0, n).lr_at(s) for s in range(1, 7)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    cosine = [Schedule("cosine", lr, w, 0.1, n).lr_at(s) for s in range(1, 7)]
    # warm-up 0.5, 1.0; then p = 1/4, 2/4, 3/4, 4/4 of the way from 1.0 down to 0.1
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)]
    assert cosine == pytest.approx(expected, abs=1e-15) and cosine[-1] == pytest.approx(0.1)
    linear = [Schedule("linear", lr, 0, 0.0, 4).lr_at(s) for s in range(1, 5)]
    assert linear == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert not Schedule("constant", lr, 0, 0.0, n).varies and Schedule("constant", lr, 1, 0.0, n).varies


CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _graphs(fn) -> tuple[int, list[torch.Tensor]]:
    """Unique dynamo graphs compiled while ``fn`` runs, and what it returns."""
    before = counters["stats"]["unique_graphs"]
    out = fn()
    return counters["stats"]["unique_graphs"] - before, out


def _train(tensor_lr: bool | None, schedule: Schedule, steps: int) -> dict[str, torch.Tensor]:
    """AdamW on a fresh GPT (same init each time), compiled step unless ``tensor_lr`` is None."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = OptimizerStep(build_optimizer(model.parameters(), schedule.lr, 0.1, torch.device("cpu")),
                        backend=None if tensor_lr is None else "aot_eager", tensor_lr=bool(tensor_lr))
    for step in range(1, steps + 1):
        opt.set_lr(schedule.lr_at(step))
        x, y = _batch(step)
        model(x, y)[1].backward()
        opt()
        group = opt.optimizer.param_groups[0]  # outside the compiled call: a float and the group's own flags
        assert isinstance(group["lr"], float) and group["lr"] == schedule.lr_at(step) and group["foreach"] is True
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_compiled_step_with_a_changing_lr_compiles_once_and_matches_eager():
    schedule, steps = Schedule("cosine", 1e-2, 2, 1e-3, 6), 6
    graphs, compiled = _graphs(lambda: _train(True, schedule, steps))
    assert graphs == 1, f"the compiled optimizer step compiled {graphs} graphs for {steps} lrs"
    eager = _train(None, schedule, steps)
    # The tensor lr is float32 where the eager step multiplies by a Python float: a few ulps apart,
    # which Adam carries on; the attention's key bias (analytically zero gradient) shows them most
    # (the parity tolerances of Note [Compiled optimizer step]).
    for name, p in compiled.items():
        tol = dict(rtol=0.0, atol=1e-4) if name.endswith("qkv.bias") else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p, eager[name], **tol, msg=lambda m: f"{name} after {steps} steps: {m}")
    torch._dynamo.reset()
    # the control: a float lr is a constant to dynamo, so every new value recompiles the step
    graphs_float, _ = _graphs(lambda: _train(False, schedule, 4))
    assert graphs_float == 4


# --- resume --------------------------------------------------------------------------


class _Stop(Exception):
    pass


def _stop_at(step: int):
    def callback(job, now):
        if now == step:
            raise _Stop(f"stopped at the start of step {step}")
    return callback


def _job(tmp_path, steps: int, **train) -> JobConfig:
    return tiny_job(tmp_path, model=ONE_BLOCK, parallel=ParallelConfig(name="ddp"),
                    compile=CompileConfig(backend="aot_eager", optimizer=True),
                    train=dict(steps=steps, lr=1e-2, lr_schedule="cosine", warmup_steps=2, min_lr=1e-3,
                               checkpoint_every=2, **train))


@pytest.mark.slow
def test_a_resumed_run_gets_the_same_lr_and_loss_at_every_step(tmp_path, capsys):
    before = counters["stats"]["unique_graphs"]
    ref = run(_job(tmp_path / "ref", 6))
    # the model's graph (counted by the run) and one optimizer-step graph for six lrs
    assert counters["stats"]["unique_graphs"] - before == ref["graphs"] + 1 and ref["recompiles"] == 0
    torch._dynamo.reset()
    with pytest.raises(_Stop):
        run(_job(tmp_path / "cut", 6), step_callbacks=[_stop_at(5)])  # after the checkpoint of step 4
    state = json.loads((tmp_path / "cut" / "ckpt" / "step_000004" / "train_state.json").read_text())
    assert state == {"step": 4, "lr_schedule": {"kind": "cosine", "lr": 1e-2, "warmup_steps": 2, "min_lr": 1e-3,
                                                 "total_steps": 6, "step": 4, "last_lr": dict(ref["lrs"])[4]}}
    torch._dynamo.reset()
    capsys.readouterr()
    resumed = run(_job(tmp_path / "cut", 6, resume=True))
    out = capsys.readouterr().out
    assert "resumed from" in out and "resume: the lr schedule changed" not in out
    assert [s for s, _ in resumed["lrs"]] == [5, 6]
    assert resumed["lrs"] == ref["lrs"][4:], "the resumed run's lrs differ from the uninterrupted run's"
    for (step, a), (_, b) in zip(resumed["losses"], ref["losses"][4:]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7), f"loss differs at step {step}: {a} resumed vs {b}"
    assert f"lr {dict(ref['lrs'])[6]:.3e}" in out  # the step lines carry the lr


def test_a_resume_with_another_horizon_says_which_lr_the_next_step_gets(tmp_path, capsys):
    common = dict(compile=CompileConfig(backend="eager"), model=ModelConfig(**ONE_BLOCK))
    t = dict(batch_size=4, seq_len=16, lr=1e-2, lr_schedule="linear", checkpoint_every=2,
             checkpoint_dir=str(tmp_path / "ckpt"))
    run(JobConfig(**common, train=TrainConfig(steps=2, **t)))
    capsys.readouterr()
    resumed = run(JobConfig(**common, train=TrainConfig(steps=4, resume=True, **t)))
    # written with steps=2, step 3 would have been past the end (min_lr 0); now it is half-way down
    assert ("resume: the lr schedule changed (train.steps 2 -> 4): step 3 runs at lr 0.0025, where the checkpoint's "
            "run would have used 0") in capsys.readouterr().out
    assert [s for s, _ in resumed["lrs"]] == [3, 4]
    assert [lr for _, lr in resumed["lrs"]] == pytest.approx([0.0025, 0.0], abs=1e-15)
