"""The main job's finite-loss guard and preemption in one process: ``run(cfg)`` with
step callbacks that break the loss or signal the process (Note [Finite-loss guard]
in ``launch.runtime.guard``, Note [Preemption] in ``launch.runtime.preempt``). The two-rank runs
under torchrun are in ``test_launch_reliability_runs.py``."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace

import pytest
import torch

from launch.checkpoint.store import save_checkpoint
from launch.checks.rules_train import check_nonfinite
from launch.config.schema import CompileConfig, ConfigError, JobConfig, TrainConfig
from launch.runtime.guard import NonFinite
from launch.runtime.preempt import EXIT_PREEMPTED, Preempted
from launch.train import run
from _jobs import tiny_job


pytestmark = pytest.mark.usefixtures("no_process_group_left")


def _job(tmp_path, **train) -> JobConfig:
    return tiny_job(tmp_path, compile=CompileConfig(backend="eager"), train={"steps": 6, **train})


def _published(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))


def _inf_weights_from(first: int):
    """From step ``first`` on, a weight is inf: every later loss is NaN."""
    def callback(job, step):
        if step == first:
            with torch.no_grad():
                next(job.wrapped.module.parameters()).fill_(float("inf"))
    return callback


def _inf_loss_at(steps: set[int]):
    """At the given steps the forward's loss is inf (the weights stay finite)."""
    def callback(job, step):
        runner = job.runner
        if not hasattr(runner, "_real_forward"):
            runner._real_forward = runner.forward
        real = runner._real_forward
        if step in steps:
            def forward(*args):
                logits, loss = real(*args)
                return logits, loss * float("inf")
            runner.forward = forward
        else:
            runner.forward = real
    return callback


# --- config ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,needle", [
    ("on_nonfinite", "ignore", r"train\.on_nonfinite='ignore' is not one of stop, skip: .*train\.on_nonfinite=stop"),
    ("max_consecutive_skips", 0, r"train\.max_consecutive_skips=0 is not valid: .*diverged run does not spin"),
])
def test_bad_nonfinite_settings_are_refused_up_front(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        check_nonfinite(TrainConfig(**{field: value}))


# --- on_nonfinite=stop ------------------------------------------------------------------


def test_stop_ends_the_run_at_the_first_nan_and_keeps_the_finite_checkpoints(tmp_path, capsys):
    # The case: inf from step 5, checkpoint_every=2, keep_last=2; compiled (aot_eager), so that a run to its end
    # reports the buckets' alignment.
    cfg = replace(_job(tmp_path, steps=10, checkpoint_every=2, keep_last=2), compile=CompileConfig(backend="aot_eager"))
    with pytest.raises(NonFinite, match=r"^the loss at step 5 is nan, not finite, .*lower train\.lr.*"
                                        r"train\.on_nonfinite=skip.*the last finite checkpoint, \S+step_000004, is "
                                        r"kept: resume from it with train\.resume=true") as stop:
        run(cfg, step_callbacks=[_inf_weights_from(5)])
    assert _published(tmp_path) == ["step_000002", "step_000004"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_000004"
    # The summary says where and why it stopped, and the last finite loss; not "done", nor a figure the stop
    # interrupted (the buckets' alignment, read after the stop).
    out = capsys.readouterr().out.splitlines()
    (summary,) = [line for line in out if line.startswith(("done:", "stopped"))]
    last_finite = [loss for step, loss in stop.value.metrics["losses"] if step == 4][0]
    assert summary.startswith(f"stopped at step 5 of 1..10: the loss is nan; last finite loss {last_finite:.4f} at "
                              "step 4, median step "), summary
    assert not any(line.startswith("alignment:") for line in out)
    assert stop.value.metrics["stopped_at"] == {"at": 5, "why": "the loss is nan"}
    assert stop.value.metrics["alignment"] is None


def test_a_nan_at_step_1_promises_no_checkpoint_that_does_not_exist(tmp_path):
    with pytest.raises(NonFinite, match=r"^the loss at step 1 is nan, .*no checkpoint was saved before it "
                                        r"\(train\.checkpoint_every sets how often\), so a new run starts from step 0"):
        run(_job(tmp_path, steps=4, checkpoint_every=2), step_callbacks=[_inf_weights_from(1)])


def _nan_evaluation(job, step):
    """The evaluation loss is NaN (the training loss stays finite)."""
    if step == 1:
        real = job.evaluator
        job.evaluator = type("NanEval", (), {"due": staticmethod(real.due), "__call__": lambda self: float("nan")})()


def test_a_nan_only_in_evaluation_follows_on_nonfinite(tmp_path, capsys):
    with pytest.raises(NonFinite, match=r"^the evaluation loss at step 2 is nan, not finite.*train\.on_nonfinite=stop"):
        run(_job(tmp_path, steps=4, eval_every=2, eval_batches=1), step_callbacks=[_nan_evaluation])
    out = tmp_path / "skip"
    out.mkdir()
    metrics = run(_job(out, steps=4, eval_every=2, eval_batches=1, on_nonfinite="skip"), output_dir=str(out),
                  step_callbacks=[_nan_evaluation])
    assert "step 2: the evaluation loss is nan, not finite (train.on_nonfinite=skip: training goes on" in \
        capsys.readouterr().out
    assert [step for step, _ in metrics["losses"]] == [1, 2, 3, 4]  # training went on to the end
    text = (out / "metrics.json").read_text()
    saved = json.loads(text)  # strict JSON: no bare NaN
    assert "NaN" not in text and saved["nonfinite"], saved.get("nonfinite")
    assert all(saved_value is None for saved_value in _at(saved, saved["nonfinite"]))


def _at(data, paths):
    for path in paths:
        value = data
        for key in path.split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
        yield value


def test_a_non_finite_model_is_never_published(tmp_path, gloo):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(str(tmp_path / "ckpt"), 1, model, optimizer, keep_last=1)
    with torch.no_grad():
        model.bias[2] = float("nan")
    with pytest.raises(NonFinite, match=r"parameters after step 2 are not finite, so checkpoint step 2 was not saved"):
        save_checkpoint(str(tmp_path / "ckpt"), 2, model, optimizer, keep_last=1)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step_000001"]  # kept, not rotated out


# --- on_nonfinite=skip ------------------------------------------------------------------


def test_skip_does_not_apply_the_update_of_a_non_finite_step(tmp_path):
    seen = {}

    def snapshot(job, step):
        if step in (3, 4):
            seen[step] = [p.detach().clone() for p in job.wrapped.module.parameters()]
            seen[f"adam_step_{step}"] = next(iter(job.optimizer.state.values()))["step"].item()

    metrics = run(_job(tmp_path, on_nonfinite="skip"), step_callbacks=[_inf_loss_at({3}), snapshot])
    assert metrics["skipped_steps"] == 1 and metrics["skipped_at"] == [3]
    for before, after in zip(seen[3], seen[4]):
        assert torch.equal(before, after), "step 3's update was applied"
    assert seen["adam_step_3"] == seen["adam_step_4"] == 2.0  # Adam's step count did not move either
    assert [s for s, _ in metrics["losses"]] == list(range(1, 7)) and all(
        torch.isfinite(torch.tensor(loss)) for s, loss in metrics["losses"] if s != 3)


def test_skip_stops_after_max_consecutive_skips(tmp_path):
    cfg = _job(tmp_path, steps=10, on_nonfinite="skip", max_consecutive_skips=3, checkpoint_every=1, keep_last=1)
    with pytest.raises(NonFinite, match=r"^the loss was not finite for 3 steps in a row, up to step 5 "
                                        r"\(train\.max_consecutive_skips=3\)"):
        run(cfg, step_callbacks=[_inf_loss_at(set(range(3, 11)))])
    # The skipped steps left the weights finite: their checkpoints are published.
    assert _published(tmp_path) == ["step_000004"]


# --- preemption ---------------------------------------------------------------------------


def _signal_at(step_: int, sig: int):
    def callback(job, step):
        if step == step_:
            os.kill(os.getpid(), sig)
    return callback


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resume_is_bit_equal(tmp_path, sig):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    reference = run(_job(tmp_path / "ref"))
    torch._dynamo.reset()
    with pytest.raises(Preempted, match=rf"^stopped after step 3 on SIGTERM/SIGINT \(preemption\): saved .*"
                                        rf"step_000003; continue with train\.resume=true \(exit code {EXIT_PREEMPTED}"):
        run(_job(tmp_path, checkpoint_every=100), step_callbacks=[_signal_at(3, sig)])
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "run() must restore the signal handlers"
    assert _published(tmp_path) == ["step_000003"]
    torch._dynamo.reset()
    resumed = run(_job(tmp_path, checkpoint_every=100, resume=True))
    assert resumed["start_step"] == 3
    assert resumed["losses"] == reference["losses"][3:]  # exactly, not within a tolerance


def test_a_preempted_run_and_its_torchrun_restart_leave_one_metrics_json_with_every_attempt(tmp_path, monkeypatch):
    import launch.runtime.dist as dist_module

    monkeypatch.setattr(dist_module, "die_with_agent", lambda: False)  # this test process is no torchrun worker
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(Preempted):
        run(_job(tmp_path, checkpoint_every=100), output_dir=str(out), step_callbacks=[_signal_at(3, signal.SIGTERM)])
    first = json.loads((out / "metrics.json").read_text())
    assert first["attempt"] == 0 and first["stopped"].startswith("stopped after step 3 on SIGTERM/SIGINT")
    assert [s for s, _ in first["losses"]] == [1, 2, 3]
    torch._dynamo.reset()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the group: it resumes its own
    run(_job(tmp_path, checkpoint_every=100), output_dir=str(out))
    final = json.loads((out / "metrics.json").read_text())
    assert final["attempt"] == 1 and final["stopped"] is None and [s for s, _ in final["losses"]] == [4, 5, 6]
    assert [(a["attempt"], [s for s, _ in a["losses"]]) for a in final["earlier_attempts"]] == [(0, [1, 2, 3])]


def test_a_signal_without_checkpoints_says_nothing_was_saved(tmp_path, capsys):
    with pytest.raises(Preempted, match=r"no checkpoint saved \(train\.checkpoint_every=0\)") as stop:
        run(_job(tmp_path), step_callbacks=[_signal_at(2, signal.SIGTERM)])
    # the summary says where it stopped and why; step 2 ran to its end, so its loss is the final one
    (summary,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("done:", "stopped"))]
    final = stop.value.metrics["losses"][-1]
    assert final[0] == 2 and summary.startswith(
        f"stopped after step 2 of 1..6: SIGTERM/SIGINT (preemption); final loss {final[1]:.4f}, median step "), summary


def test_cli_bad_on_nonfinite_exits_2_with_one_message(launch_cli):
    proc = launch_cli("train.on_nonfinite=ignore")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("train.on_nonfinite='ignore' is not one of stop, skip") == 1
    assert "Traceback" not in proc.stderr + proc.stdout
