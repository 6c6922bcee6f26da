"""``parallel=fsdp`` in the main job: the ``fsdp.*`` options compose, validate with
their own messages and reach ``fsdp_opt``; under torchrun with 2 gloo ranks the
documented command exits 0, and a run killed mid-way resumes from its sharded DCP
checkpoint to the same losses and final parameters as an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from launch.checks.validate import validate
from launch.config.schema import ConfigError, FSDPOptions
from launch.observe.banner import describe
from launch.runtime.parallel import fsdp_config
from fsdp_opt import plan_fsdp
from launch.models import GPT, GPTConfig
from _torchrun import final_params as _final_params, metrics as _metrics, ok as _ok
from _jobs import composed as _job


# --- config: compose, validate, convert (no process group) ---------------------------


def test_fsdp_options_compose_and_reach_fsdp_config():
    cfg = _job("parallel=fsdp", "compile.backend=aot_eager", "fsdp.shard_unit_mb=4", "fsdp.prefetch=2",
               "fsdp.reshard_after_forward=false", "fsdp.checkpointing=true", "fsdp.mixed_precision=bf16")
    validate(cfg, world_size=2)
    fc = fsdp_config(cfg.fsdp, cfg.compile)
    assert (fc.shard_unit_mb, fc.prefetch, fc.reshard_after_forward, fc.checkpointing) == (4.0, 2, False, True)
    assert fc.mp_policy.param_dtype == torch.bfloat16 and fc.mp_policy.reduce_dtype == torch.float32
    assert fc.compile.backend == "aot_eager" and fc.compile.fullgraph is False
    assert "fsdp       strategy=per_block shard_unit_mb=4.0 prefetch=2" in describe(cfg)


def test_fsdp_defaults_are_per_block_with_auto_units_and_eager_means_no_compile():
    cfg = _job("parallel=fsdp", "compile=eager")
    assert cfg.fsdp == FSDPOptions()
    fc = fsdp_config(cfg.fsdp, cfg.compile)
    assert fc.compile is None and fc.shard_unit_mb == "auto" and fc.prefetch == 1 and fc.mp_policy is None
    assert fc.strategy == "per_block"
    assert "strategy=per_block shard_unit_mb=auto" in describe(cfg)
    # per_block's auto is one shard unit per block (measured its fastest, docs/fsdp.md)
    assert [u.blocks for u in plan_fsdp(GPT(GPTConfig(n_layer=2)), fc).units] == [("blocks.0",), ("blocks.1",)]


def test_fsdp_strategy_traced_composes_and_a_misspelling_is_named():
    cfg = _job("parallel=fsdp", "fsdp.strategy=traced", "fsdp.memory_budget_mb=8")
    validate(cfg, world_size=2)
    fc = fsdp_config(cfg.fsdp, cfg.compile)
    assert (fc.strategy, fc.memory_budget_mb) == ("traced", 8.0)
    with pytest.raises(ConfigError, match=r"fsdp\.strategy='trace' is not valid: per_block compiles each block.*"
                                          r"fsdp\.strategy=traced"):
        validate(_job("parallel=fsdp", "fsdp.strategy=trace"), world_size=2)
    with pytest.raises(ConfigError, match=r"fsdp\.memory_budget_mb=8\.0 with fsdp\.strategy=per_block: .*"
                                          r"Set fsdp\.strategy=traced, or drop fsdp\.memory_budget_mb"):
        validate(_job("parallel=fsdp", "fsdp.memory_budget_mb=8"), world_size=2)


@pytest.mark.parametrize("overrides,match", [
    (["fsdp.shard_unit_mb=0"], r"fsdp\.shard_unit_mb=0\.0 is not valid: it must be a positive size in MiB.*"
                               r"fsdp\.shard_unit_mb=null for one unit per block"),
    (["fsdp.prefetch=-1"], r"fsdp\.prefetch=-1 is not valid.*non-negative.*fsdp\.prefetch=0 to leave"),
    (["fsdp.mixed_precision=fp8"], r"fsdp\.mixed_precision='fp8' is not one of none, bf16.*mixed_precision=none"),
])
def test_bad_fsdp_values_are_named_with_a_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(_job("parallel=fsdp", *overrides), world_size=2)


def test_fsdp_options_without_parallel_fsdp_are_refused():
    with pytest.raises(ConfigError, match=r"fsdp\.prefetch=2 is set but parallel=ddp.*Use parallel=fsdp, or drop"):
        validate(_job("fsdp.prefetch=2"), world_size=2)


def test_cli_bad_fsdp_value_exits_2(launch_cli):
    proc = launch_cli("parallel=fsdp", "fsdp.mixed_precision=fp8")
    assert proc.returncode == 2, proc.stderr
    assert "fsdp.mixed_precision='fp8'" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


# --- 2 ranks under torchrun ---------------------------------------------------------

SMALL = ["parallel=fsdp", "compile.backend=aot_eager", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
         "train.batch_size=4", "train.seq_len=32", "fsdp.shard_unit_mb=0.3"]  # both blocks (~0.19 MiB each) in one unit
STEPS, EVERY, KILL_AT = 6, 2, 5  # checkpoints after steps 2, 4, 6; rank 1 dies at the start of step 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory, torchrun):
    """An uninterrupted 2-rank FSDP run with checkpoints: the yardstick for the resume test."""
    cwd = tmp_path_factory.mktemp("fsdp_reference")
    proc = torchrun(cwd, *SMALL, f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}", "hydra.run.dir=run")
    _ok(proc)
    return cwd, proc


@pytest.mark.slow
def test_two_rank_fsdp_run_shards_in_units_trains_and_exits(reference):
    cwd, proc = reference
    out = proc.stdout
    assert "distcompile main job: 2 rank(s), cpu + gloo" in out and "parallel   fsdp (auto)" in out
    assert "fsdp_opt: 2 blocks in 1 shard units, prefetch 1, compile aot_eager" in out
    assert out.count("fsdp_opt: 2 blocks") == 1  # the plan is logged by rank 0 only
    for step in range(1, STEPS + 1):
        assert f"step     {step}/{STEPS}  loss" in out
    assert f"done: steps 1..{STEPS}" in out
    metrics = _metrics(cwd / "run")
    assert metrics["world_size"] == 2 and len(metrics["losses"]) == STEPS
    assert metrics["config"]["fsdp"]["shard_unit_mb"] == 0.3
    losses = [loss for _, loss in metrics["losses"]]
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"


@pytest.mark.slow
def test_killed_fsdp_run_resumes_from_sharded_checkpoint_to_same_losses_and_parameters(reference, tmp_path, torchrun):
    ref_dir, _ = reference
    common = [*SMALL, f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}"]
    died = torchrun(tmp_path, *common, "hydra.run.dir=first", fault=f"{KILL_AT}:1")
    assert died.returncode != 0, "the injected fault did not kill the job"
    assert "killing myself at step 5" in died.stderr
    assert not (tmp_path / "checkpoints" / f"step_{STEPS:06d}").exists()
    resumed_proc = torchrun(tmp_path, *common, "train.resume=true", "hydra.run.dir=second")
    _ok(resumed_proc)
    assert "resumed from checkpoints/step_000004 at step 4" in resumed_proc.stdout
    ref, got = _metrics(ref_dir / "run"), _metrics(tmp_path / "second")
    assert got["start_step"] == 4 and [s for s, _ in got["losses"]] == [5, 6]
    ref_losses = dict(ref["losses"])
    for step, loss in got["losses"]:
        torch.testing.assert_close(loss, ref_losses[step], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, step=step: f"loss differs at step {step}: {m}")
    ref_p = _final_params(ref_dir / "checkpoints" / f"step_{STEPS:06d}")
    got_p = _final_params(tmp_path / "checkpoints" / f"step_{STEPS:06d}")
    assert ref_p.keys() == got_p.keys() and any(k.startswith("blocks.1.") for k in ref_p)
    for name in ref_p:
        torch.testing.assert_close(got_p[name], ref_p[name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=name: f"final parameter {name} differs: {m}")


@pytest.mark.slow
def test_traced_trains_as_per_block_and_per_block_resumes_the_traced_checkpoint(reference, tmp_path, torchrun):
    # The reference job under fsdp.strategy=traced (the whole model compiled, its collectives in the graph):
    # the same losses step by step; then per_block resumes the traced run's step-4 checkpoint (the same DTensors
    # under the same names) to the reference's losses and final parameters.
    ref_dir, _ = reference
    common = [*SMALL, f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}"]
    traced = torchrun(tmp_path, *common, "fsdp.strategy=traced", "hydra.run.dir=traced")
    _ok(traced)
    assert "fsdp_opt: strategy traced, 2 blocks, compile aot_eager" in traced.stdout
    assert "forward graph collectives:" in traced.stdout and "backward graph collectives:" in traced.stdout
    ref, got = _metrics(ref_dir / "run"), _metrics(tmp_path / "traced")
    assert got["config"]["fsdp"]["strategy"] == "traced"
    for (step, loss), (_, want) in zip(got["losses"], ref["losses"], strict=True):
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"traced's loss differs from per_block's at step {step}: {m}")
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / f"step_{STEPS:06d}")  # the newest left is step 4, written by traced
    resumed = torchrun(tmp_path, *common, "fsdp.strategy=per_block", "train.resume=true", "hydra.run.dir=resumed")
    _ok(resumed)
    assert "resumed from checkpoints/step_000004 at step 4" in resumed.stdout
    again = _metrics(tmp_path / "resumed")
    ref_losses = dict(ref["losses"])
    assert [s for s, _ in again["losses"]] == [5, 6]
    for step, loss in again["losses"]:
        torch.testing.assert_close(loss, ref_losses[step], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"resumed loss differs at step {step}: {m}")
    ref_p = _final_params(ref_dir / "checkpoints" / f"step_{STEPS:06d}")
    got_p = _final_params(tmp_path / "checkpoints" / f"step_{STEPS:06d}")
    assert ref_p.keys() == got_p.keys()
    for name in ref_p:
        torch.testing.assert_close(got_p[name], ref_p[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"final parameter {name} differs: {m}")
