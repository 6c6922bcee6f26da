"""The main job in one process: `run(cfg)` called directly (no Hydra), and the
`python -m launch.train` shell's exit codes for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from launch.config.schema import CompileConfig, ConfigError, DDPConfig, FSDPOptions, ParallelConfig
from launch.train import run
from _jobs import tiny_job as _job


pytestmark = pytest.mark.usefixtures("no_process_group_left")


def test_one_process_ddp_eager_trains_and_writes_metrics(tmp_path, capsys):
    cfg = _job(tmp_path, compile=CompileConfig(backend="eager"), train=dict(steps=4))
    metrics = run(cfg, output_dir=str(tmp_path))
    out = capsys.readouterr().out
    assert "distcompile main job: 1 rank(s), cpu + gloo" in out and "step     4/4" in out and "done:" in out
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["losses"] == [list(x) for x in metrics["losses"]] and len(saved["losses"]) == 4
    assert saved["config"]["train"]["steps"] == 4 and saved["world_size"] == 1


def test_one_process_ddp_aot_eager_prints_partition_table(tmp_path, capsys, caplog):
    cfg = _job(tmp_path, compile=CompileConfig(backend="aot_eager"), ddp=DDPConfig(bucket_cap_mb=0.1))
    metrics = run(cfg)
    out = capsys.readouterr().out
    assert "DDP buckets = graph partitions" in out and "partitions: " in out and " compiled in " in out
    assert len(metrics["buckets"]) > 1 and all(p["status"] == "compiled" for p in metrics["partitions"])
    assert "partition 1/" in caplog.text  # compile progress, logger compiler.graph.partition


@pytest.fixture
def inline_list_restored():
    """The traced strategy makes dynamo inline torch.nn.parallel.distributed process-wide (as DDP
    does under optimize_ddp='python_reducer'); put the list back for the tests after."""
    rules = torch._dynamo.trace_rules
    saved = set(rules.LEGACY_MOD_INLINELIST)
    yield
    rules.LEGACY_MOD_INLINELIST.clear()
    rules.LEGACY_MOD_INLINELIST.update(saved)
    rules.get_legacy_mod_inlinelist.cache_clear()


def test_one_process_ddp_traced_strategy_trains(tmp_path, capsys, inline_list_restored):
    cfg = _job(tmp_path, compile=CompileConfig(backend="aot_eager"), ddp=DDPConfig(strategy="traced"),
               train=dict(steps=3, grad_accum=2))
    metrics = run(cfg)
    out = capsys.readouterr().out
    # aot_eager has no Inductor fusion pass: one all-reduce per gradient, inside the compiled backward.
    assert "ddp.strategy=traced: the all-reduces run inside the compiled backward graph; no fusion recorded" in out
    assert "DDP buckets = graph partitions" not in out
    assert len(metrics["losses"]) == 3 and all(loss == loss for _, loss in metrics["losses"])
    assert metrics["buckets"] == []


@pytest.mark.parametrize("overrides,needle", [
    (dict(ddp=DDPConfig(strategy="pipelined")), r"ddp\.strategy='pipelined' is not valid: it must be one of split .*"
                                                r"traced \("),
    (dict(ddp=DDPConfig(strategy="traced"), compile=CompileConfig(backend="eager")),
     r"ddp\.strategy=traced with compile\.backend=eager"),
])
def test_ddp_strategy_refused_before_a_process_group(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        run(_job(tmp_path, **overrides))


@pytest.mark.parametrize("model", ["gpt_tiny", "hf_gpt2"])
def test_parallel_none_compiles_the_plain_model(model, tmp_path):
    if model == "hf_gpt2":
        pytest.importorskip("transformers")
    cfg = _job(tmp_path, model=dict(name=model), parallel=ParallelConfig(name="none"),
               compile=CompileConfig(backend="aot_eager"), train=dict(steps=2))
    metrics = run(cfg)
    assert len(metrics["losses"]) == 2 and metrics["buckets"] == []


@pytest.mark.parametrize("replicate", [False, True])
def test_fsdp_one_process_checkpoints_and_resumes(tmp_path, replicate):
    if not hasattr(pytest.importorskip("fsdp_opt"), "apply"):
        pytest.skip("fsdp_opt.apply does not exist in this checkout")
    common = dict(parallel=ParallelConfig(name="fsdp"), compile=CompileConfig(backend="aot_eager"),
                  fsdp=FSDPOptions(replicate=replicate))
    first = run(_job(tmp_path, **common, train=dict(steps=2, checkpoint_every=2)))
    assert first["checkpoints"][-1].endswith("step_000002")
    torch._dynamo.reset()
    resumed = run(_job(tmp_path, **common, train=dict(steps=3, checkpoint_every=2, resume=True)))
    assert resumed["start_step"] == 2 and [s for s, _ in resumed["losses"]] == [3]


def test_run_validates_before_starting_a_process_group(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps=0"):
        run(_job(tmp_path, train=dict(steps=0)))


def _cli(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "launch.train", *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize("overrides,needle", [
    (["ddp.bucket_cap_mb=-1"], "ddp.bucket_cap_mb=-1.0 is not valid"),
    (["ddp.bucket_cap_mb=abc"], "ddp.bucket_cap_mb"),  # a type error, found by Hydra while composing
])
def test_cli_bad_input_exits_2_with_one_message(tmp_path, launch_cli, overrides, needle):
    proc = launch_cli(*overrides)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_python_m_launch_train_exits_2_with_one_message_in_its_own_process(tmp_path):
    # The smoke test of the real entry point (launch.train.main: exit_now; launch.config.shell.main: argv);
    # every other exit-code check runs the same shell in process (the launch_cli fixture).
    proc = _cli(tmp_path, "ddp.bucket_cap_mb=-1")
    assert proc.returncode == 2, proc.stderr
    assert "ddp.bucket_cap_mb=-1.0 is not valid" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "ckpt").exists()
