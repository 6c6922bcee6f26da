"""The training-step switches through run() on one rank: the warm-up pass leaves
training unchanged, and grad_accum cuts the same data into micro-batches."""

from __future__ import annotations

import pytest
import torch

from launch.config.schema import CompileConfig, DataConfig, JobConfig
from launch.train import run
from _jobs import ONE_BLOCK, tiny_job

pytestmark = pytest.mark.usefixtures("one_thread", "clean_dynamo")


def _job(tmp_path, backend: str, data: DataConfig, **train) -> JobConfig:
    return tiny_job(tmp_path, model=dict(ONE_BLOCK, block_size=32), compile=CompileConfig(backend=backend), data=data,
                    train=dict(steps=4, seq_len=32, **train))


def test_warmup_does_not_change_training(tmp_path, capsys):
    data = DataConfig(lengths="skewed", padding="max")
    plain = run(_job(tmp_path, "aot_eager", data))
    torch._dynamo.reset()
    warmed = run(_job(tmp_path, "aot_eager", data, no_recompile_after_warmup=True))
    assert plain["warmup_s"] is None and warmed["warmup_s"] is not None
    assert "warm-up: compiled 1 input shape(s) (4, 32)" in capsys.readouterr().out
    # same weights, data and RNG: the warm-up took no optimizer step and restored the RNG
    assert warmed["losses"] == plain["losses"]
    assert (warmed["graphs"], warmed["recompiles"], warmed["recompiles_after_warmup"]) == (1, 0, 0)


def test_grad_accum_sees_the_same_data_as_one_batch(tmp_path):
    data = DataConfig(lengths="fixed")
    one = run(_job(tmp_path, "eager", data))
    two = run(_job(tmp_path, "eager", data, grad_accum=2))
    assert one["shapes_seen"] == [[[4, 32], 4]] and two["shapes_seen"] == [[[2, 32], 8]]
    assert one["padding_waste"] == 0.0 and one["real_tokens"] == two["real_tokens"] == 4 * 4 * 32
    for (step, a), (_, b) in zip(one["losses"], two["losses"]):
        assert abs(a - b) < 1e-5, f"step {step}: loss {b} with grad_accum=2 vs {a} in one batch"


def test_diagnosis_probe_reuses_the_trained_shape_and_metrics_record_what_ran(tmp_path):
    # The end-of-run probe of exposed communication runs micro-batches of the trained
    # shape, so it compiles nothing new; metrics.json records dynamic=False, which
    # padding=multiple compiles with, not the unset value of the config.
    from torch._dynamo.utils import counters

    job = _job(tmp_path, "aot_eager", DataConfig(lengths="fixed", padding="multiple"), grad_accum=2)
    before = counters["stats"]["unique_graphs"]
    metrics = run(JobConfig(**{**job.__dict__, "diagnose": True}))
    assert metrics["diagnosis"] is not None and metrics["shapes_seen"] == [[[2, 32], 8]]
    # the warm-up compiled one graph per padded length (8, 16, 24, 32); the probe added none
    assert metrics["graphs"] == 4 and counters["stats"]["unique_graphs"] - before == metrics["graphs"]
    assert metrics["config"]["compile"]["dynamic"] is False
