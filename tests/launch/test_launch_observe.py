"""What the run writes about itself: TensorBoard event files and the curves picture
(log.tensorboard), and the up-front checks of log.* and profile.*; the timeline is
read from a hand-made trace. One process; the 2-rank profile is in
test_launch_profile.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from launch.config.schema import CompileConfig, ConfigError, JobConfig, LogConfig, ProfileConfig
from launch.observe.report import Tally, curve_name
from launch.observe.tensorboard import summary_scalars
from launch.observe.timeline import read_step
from launch.train import run
from _jobs import tiny_job

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _job(tmp_path, steps=4, **kw) -> JobConfig:
    return tiny_job(tmp_path, train=dict(steps=steps), **kw)


def _scalars(folder: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}




@pytest.mark.usefixtures("no_process_group_left")
def test_tensorboard_writes_every_curve_per_step_and_the_run_numbers(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    metrics = run(_job(tmp_path, compile=CompileConfig(backend="eager"), log=LogConfig(tensorboard=True)),
                  output_dir=str(tmp_path))
    assert list(tmp_path.glob("events.out.tfevents.*")), "no event file in the run directory"
    scalars = _scalars(tmp_path)
    for tag in ("loss", "step_s", "tokens_per_s"):
        assert [s.step for s in scalars[tag]] == [1, 2, 3, 4], tag
    assert [s.value for s in scalars["loss"]] == pytest.approx([loss for _, loss in metrics["losses"]])
    assert scalars["run/median_step_ms"][0].value == pytest.approx(metrics["median_step_ms"])
    assert scalars["run/tokens_per_s"][0].step == 4
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert f"tensorboard: event files in {tmp_path}" in out and f"curves: {png}" in out


@pytest.mark.usefixtures("no_process_group_left")
def test_without_matplotlib_the_curves_picture_is_skipped_with_a_warning(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    run(_job(tmp_path, steps=2, compile=CompileConfig(backend="eager"), log=LogConfig(tensorboard=True)),
        output_dir=str(tmp_path))
    assert "warning: curves.png skipped: matplotlib does not import" in capsys.readouterr().out
    assert not (tmp_path / "curves.png").exists() and list(tmp_path.glob("events.out.tfevents.*"))
    assert (tmp_path / "metrics.json").exists()


def test_every_step_pair_field_of_the_tally_is_a_curve_whatever_its_name():
    tally = Tally()
    tally.add_step(1, 2.5, 10, 16, 0.5, first=True)
    tally.grad_norms = [(1, 0.7)]  # as another part of the loop may record
    tally.lrs = []  # empty: not a curve yet
    assert tally.curves_at(1) == {"loss": 2.5, "step_s": 0.5, "tokens_per_s": 32.0, "grad_norm": 0.7}
    tally.add_step(2, 2.0, 10, 16, 0.25, first=False)
    assert tally.curves_at(2) == {"loss": 2.0, "step_s": 0.25, "tokens_per_s": 64.0}  # no grad norm at step 2
    assert [curve_name(n) for n in ("losses", "eval_losses", "lrs", "step_s", "tokens_per_s")] == [
        "loss", "eval_loss", "lr", "step_s", "tokens_per_s"]


def test_summary_scalars_are_every_number_of_the_metrics_one_level_deep():
    metrics = {"steps": 4, "final_loss": 1.5, "alignment": None, "world_size": 2, "compiled": True,
               "diagnosis": {"exposed_comm_ms": 3.0, "advice": ["x"]}, "config": {"train": {"lr": 1.0}}}
    assert summary_scalars(metrics) == {"steps": 4.0, "final_loss": 1.5, "world_size": 2.0,
                                        "diagnosis.exposed_comm_ms": 3.0}


@pytest.mark.parametrize("section, match", [
    (dict(log=LogConfig(tensorboard="yes")), r"log\.tensorboard='yes' is not valid: it must be true or false"),
    (dict(profile=ProfileConfig(steps=[2])), r"profile\.steps=\[2\] is not valid: it must be two integers"),
    (dict(profile=ProfileConfig(steps=[1.5, 2])), r"profile\.steps=\[1\.5, 2\] is not valid: it must be two integers"),
    (dict(profile=ProfileConfig(steps=[0, 2])), r"profile\.steps=\[0,2\] is not within the run: it needs 1 <= first"),
    (dict(profile=ProfileConfig(steps=[3, 2])), r"profile\.steps=\[3,2\] is not within the run"),
    (dict(profile=ProfileConfig(steps=[3, 5])), r"profile\.steps=\[3,5\] is not within the run: .*train\.steps=4.*"
                                                r"profile\.steps=null to switch profiling off"),
])
def test_bad_log_and_profile_settings_are_refused_up_front(tmp_path, section, match):
    with pytest.raises(ConfigError, match=match):
        run(_job(tmp_path, **section))
    assert not dist.is_initialized()


def test_tensorboard_without_the_package_is_refused_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"log\.tensorboard=true needs the `tensorboard` package.*"
                                          r"pip install -e \.\[tensorboard\].*or set log\.tensorboard=false"):
        run(_job(tmp_path, log=LogConfig(tensorboard=True)))


def test_python_m_launch_train_exits_2_on_a_bad_profile_range(launch_cli):
    proc = launch_cli("train.steps=3", "profile.steps=[2,9]")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "profile.steps=[2,9] is not within the run" in proc.stderr


def _x(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_timeline_rows_and_exposed_communication_from_a_trace():
    trace = {"traceEvents": [
        _x("step 7", 1000, 100_000),
        _x("partition 0 forward", 2000, 5000), _x("partition 1 forward", 7000, 5000),
        _x("partition 1 backward", 20_000, 10_000), _x("partition 0 backward", 31_000, 20_000),
        _x("gloo:all_reduce", 32_000, 10_000, tid=2), _x("gloo:all_reduce", 52_000, 30_000, tid=3),
        _x("torch.distributed.ddp.reducer::copy_bucket_to_grad", 71_000, 10),
        _x("Optimizer.step#AdamW.step", 85_000, 5000),
        _x("gloo:all_reduce", 95_000, 1000, tid=2),  # the loop's own all-reduce of loss and tokens
        _x("step 6", 0, 900), _x("gloo:all_reduce", 500, 100),  # another step
    ]}
    buckets = [{"size": 2**20}, {"size": 2**19}]
    tl = read_step(trace, 7, buckets)
    assert [name for name, _ in tl.rows] == [
        "forward (partitions)", "partition 1 backward", "partition 0 backward",
        "all-reduce bucket 1 (0.50 MiB)", "all-reduce bucket 0 (1.00 MiB)", "optimizer step"]
    assert tl.backward_end_ms == pytest.approx(50.0) and tl.comm_end_ms == pytest.approx(70.0)
    assert tl.exposed_comm_ms == pytest.approx(20.0)  # to DDP's copy back, not to the worker's late end (81 ms)
    with pytest.raises(ValueError, match="step 3 was not profiled"):
        read_step(trace, 3)
