"""The main job's ``ddp.optimizer_in_backward=true`` (Note [Launcher features and the optimizer in
backward] in ``launch.checks.rules_in_backward``): the settings that read every gradient after
backward are refused before any process group, in one line each; the warm-up updates nothing;
and under torchrun with 2 ranks the losses equal those of the job without the flag, also across
a resume."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from _jobs import REFERENCE_RUN, composed
from _torchrun import metrics as _metrics, ok as _ok
from launch.runtime.dist import DistEnv

FLAG = "ddp.optimizer_in_backward=true"
SMALL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.vocab_size=64", "model.block_size=16"]
ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
OFF = r"or set ddp\.optimizer_in_backward=false to step the optimizer after backward\.$"


# --- refusals, before any process group --------------------------------------------------------


@pytest.mark.parametrize("overrides, needle", [
    (["parallel=fsdp"], r"^ddp\.optimizer_in_backward=true with parallel=fsdp: the update inside backward follows "
                        r"each DDP bucket's all-reduce, and parallel=fsdp has no DDP buckets\. Use parallel=ddp, "
     + OFF),
    (["parallel=none"], r"^ddp\.optimizer_in_backward=true with parallel=none: .* Use parallel=ddp, " + OFF),
    (["compile=eager"], r"^ddp\.optimizer_in_backward=true with compile\.backend=eager: the update inside backward "
                        r"is part of compile_ddp.* Use compile\.backend=aot_eager or inductor, " + OFF),
    (["train.max_grad_norm=1.0"], r"^train\.max_grad_norm=1\.0 with ddp\.optimizer_in_backward=true: clipping to "
                                  r"the gradients' total norm needs every gradient before any update, and each "
                                  r"bucket is updated inside backward as soon as its all-reduce completes\. Set "
                                  r"train\.max_grad_norm=0 \(no clipping\), " + OFF),
    (["train.precision=fp16"], r"^train\.precision=fp16 with ddp\.optimizer_in_backward=true: the fp16 GradScaler "
                               r"unscales every gradient and skips the step on an inf one before any update.* Use "
                               r"train\.precision=bf16 \(no scaler\) or fp32, " + OFF),
    (["compile.optimizer=true"], r"^compile\.optimizer=true with ddp\.optimizer_in_backward=true: the optimizer runs "
                                 r"inside backward, bucket by bucket, so no optimizer step is left after backward to "
                                 r"compile\. Set compile\.optimizer=false, " + OFF),
    (["train.on_nonfinite=skip"], r"^train\.on_nonfinite=skip with ddp\.optimizer_in_backward=true: skipping decides "
                                  r"after backward.* no update is left to skip\. Use train\.on_nonfinite=stop "
                                  r"\(the default: .*\), " + OFF),
    (["ddp.strategy=traced", "ddp.compression=powersgd:2"],
     r"^ddp\.compression=powersgd:2 with ddp\.optimizer_in_backward=true and ddp\.strategy=traced: the traced "
     r"PowerSGD hook writes each gradient after it returned, so an update traced right after it would read the "
     r"gradient unreduced\. Use ddp\.strategy=split \(.*\) or ddp\.compression=none, " + OFF),
    (["diagnose=true"], r"^diagnose=true with ddp\.optimizer_in_backward=true: the diagnosis times forward and "
                        r"backward with gradient sync after training, and every synchronised backward would update "
                        r"the model\. Diagnose the same job with ddp\.optimizer_in_backward=false\.$"),
])
def test_a_setting_that_needs_the_gradients_after_backward_is_refused(overrides, needle):
    from launch.checks.validate import validate
    from launch.config.schema import ConfigError

    with pytest.raises(ConfigError, match=needle) as e:
        validate(composed("compile=aot_eager", FLAG, *overrides), world_size=2)
    assert "\n" not in str(e.value)


def test_the_flag_with_accumulation_a_schedule_and_bf16_passes_validation():
    from launch.checks.validate import validate

    cfg = composed("compile=aot_eager", FLAG, "train.grad_accum=2", "train.batch_size=8", "train.lr_schedule=cosine",
                   "train.warmup_steps=2", "train.precision=bf16", "ddp.reduce_dtype=bf16")
    assert cfg.ddp.optimizer_in_backward is True
    validate(cfg, world_size=2)
    assert composed().ddp.optimizer_in_backward is False  # configs/ddp/default.yaml: off


def test_a_bad_lr_with_the_flag_is_refused_as_without_it():
    """validate builds a stand-in optimizer for DDPCompileConfig before train.lr is checked: not with train.lr."""
    from launch.checks.validate import validate
    from launch.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"^train\.lr=-1\.0 is not valid: it must be a positive number"):
        validate(composed("compile=aot_eager", FLAG, "train.lr=-1.0"), world_size=2)


def test_compile_ddps_own_refusal_of_the_optimizer_is_told_in_the_launchers_spelling(gloo, monkeypatch):
    """What compile_ddp refuses once it sees the model and the optimizer ends the job as a config error."""
    from compiler import SettingError
    from launch.config.schema import ConfigError
    from launch.runtime import parallel
    from launch.step.optim import wrap_with_optimizer

    def refuse(ddp, *, config):
        assert config.optimizer is not None  # the job's AdamW reached compile_ddp
        raise SettingError("optimizer", "compile_ddp(strategy='traced', optimizer=...): the traced backward does not "
                                        "run the update yet. Pass strategy='split' to update each bucket inside "
                                        "backward, or drop optimizer=.")

    monkeypatch.setattr(parallel, "compile_ddp", refuse)
    cfg = composed("compile=aot_eager", FLAG, "ddp.strategy=traced", *SMALL)
    with pytest.raises(ConfigError) as e:
        wrap_with_optimizer(parallel.build_model(cfg.model), cfg, ENV)
    assert str(e.value) == (
        "ddp.optimizer_in_backward=true with ddp.strategy=traced is refused by compile_ddp: compile_ddp(strategy="
        "'traced', optimizer=...): the traced backward does not run the update yet. Pass strategy='split' to "
        "update each bucket inside backward, or drop optimizer=. In this job: set ddp.optimizer_in_backward=false "
        "to step the optimizer after backward.")


# --- one rank in this process: the warm-up and the step ----------------------------------------


@pytest.mark.parametrize("strategy", ["split", "traced"])
def test_the_warm_up_updates_nothing_and_the_step_updates_inside_backward(gloo, clean_dynamo, strategy):
    """Note [Warm-up]: under the flag its backwards run without sync, so nothing is updated; a
    training step then updates every parameter inside backward and leaves no gradient. Under
    ddp.strategy=traced (Note [Traced update]) the update is traced into the compiled backward,
    the warm-up's no_sync backward returns before it, and each parameter's update is counted."""
    from launch.data.source import SyntheticTokens
    from launch.runtime.parallel import build_model
    from launch.step.optim import OptimizerStep, wrap_with_optimizer
    from launch.step.train_step import StepRunner, micro_batches

    cfg = composed("compile=aot_eager", FLAG, f"ddp.strategy={strategy}", *SMALL, "ddp.bucket_cap_mb=0.01")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    wrapped, optimizer = wrap_with_optimizer(model, cfg, ENV)
    assert wrapped.compiled_ddp.strategy == strategy
    runner = StepRunner(wrapped.forward, wrapped.module, OptimizerStep(optimizer), update_in_backward=True,
                        backward_context=wrapped.backward_context)
    data = SyntheticTokens(vocab_size=64, seed=0)
    before = [p.detach().clone() for p in model.parameters()]

    runner.warm_up(data, rank=0, world_size=1, micro_batch=2, seq_len=16, padding="max", pad_multiple=8)
    assert wrapped.in_backward_updates() == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "the warm-up updated the model"

    batches = micro_batches(data, step=1, rank=0, world_size=1, local_batch=4, seq_len=16, grad_accum=2,
                            lengths="fixed", padding="max", pad_multiple=8, seed=0, device=ENV.device)
    runner.step(batches, 1)
    if strategy == "traced":  # each parameter once, by the synchronising backward only
        assert wrapped.in_backward_updates() == len(before)
    else:  # each bucket once (several at ddp.bucket_cap_mb=0.01)
        assert wrapped.in_backward_updates() > 1
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a parameter was not updated"


# --- 2 ranks under torchrun ---------------------------------------------------------------------

# The reference run's model and checkpoints, with accumulation, an lr schedule and the warm-up.
RUN = [*REFERENCE_RUN, "train.batch_size=8", "train.grad_accum=2", "train.lr_schedule=cosine", "train.warmup_steps=2",
       "train.no_recompile_after_warmup=true"]


@pytest.fixture(scope="module")
def in_backward_run(tmp_path_factory, torchrun):
    """One uninterrupted 2-rank run with the flag: ``run/metrics.json``, ``checkpoints/step_00000{2,4,6,8}``
    and its stdout."""
    cwd = tmp_path_factory.mktemp("in_backward_run")
    proc = torchrun(cwd, *RUN, FLAG, "hydra.run.dir=run", timeout=240)
    _ok(proc)
    return cwd, proc.stdout


def _same_losses(got: list, ref: dict) -> None:
    for step, loss in got:
        assert loss == pytest.approx(ref[step], rel=1e-6, abs=1e-7), f"loss differs at step {step}"


@pytest.mark.slow
def test_two_ranks_train_as_without_the_flag_and_say_the_optimizer_ran_in_backward(in_backward_run, tmp_path,
                                                                                   torchrun):
    cwd, stdout = in_backward_run
    proc = torchrun(tmp_path, *RUN, "hydra.run.dir=run", timeout=240)
    _ok(proc)
    base, got = _metrics(tmp_path / "run"), _metrics(cwd / "run")
    assert [s for s, _ in got["losses"]] == list(range(1, 9))
    _same_losses(got["losses"], dict(base["losses"]))
    assert got["config"]["ddp"]["optimizer_in_backward"] is True
    said = re.search(r"^optimizer in backward: (\d+) bucket update\(s\) on rank 0, each run inside backward right "
                     r"after its bucket's all-reduce \(ddp\.optimizer_in_backward=true", stdout, re.M)
    # every step's synchronising backward updates each of the several buckets (ddp.bucket_cap_mb=0.05)
    assert said and int(said[1]) >= 2 * 8, stdout[-3000:]
    assert "optimizer_in_backward" in stdout.split("distcompile main job")[1].split("\n  data")[0]  # the banner
    assert "optimizer in backward" not in proc.stdout


@pytest.mark.slow
def test_a_resume_with_the_flag_continues_as_the_uninterrupted_run(in_backward_run, tmp_path, torchrun):
    """Stopped after the checkpoint of step 4: the optimizer state loads into the optimizer that
    compile_ddp runs inside backward, and steps 5..8 give the uninterrupted run's losses."""
    cwd, _ = in_backward_run
    shutil.copytree(cwd / "checkpoints", tmp_path / "checkpoints")
    for later in ("step_000006", "step_000008"):
        shutil.rmtree(tmp_path / "checkpoints" / later)
    proc = torchrun(tmp_path, *RUN, FLAG, "train.resume=true", "hydra.run.dir=second", timeout=240)
    _ok(proc)
    assert "resumed from checkpoints/step_000004 at step 4" in proc.stdout
    got = _metrics(tmp_path / "second")
    assert got["start_step"] == 4 and [s for s, _ in got["losses"]] == [5, 6, 7, 8]
    _same_losses(got["losses"], dict(_metrics(cwd / "run")["losses"]))


@pytest.mark.slow
def test_two_ranks_under_the_traced_strategy_train_as_without_the_flag(tmp_path, torchrun):
    """ddp.strategy=traced (Note [Traced update]): the update traced into the compiled backward gives
    the losses of the same strategy with the optimizer step after backward, over RUN's accumulation,
    cosine schedule and warm-up; the banner counts one update per parameter per step."""
    from launch.runtime.parallel import build_model

    runs = {}
    for name, flag in (("with", [FLAG]), ("without", [])):
        (tmp_path / name).mkdir()
        proc = torchrun(tmp_path / name, *RUN, "ddp.strategy=traced", *flag, "hydra.run.dir=run", timeout=300)
        _ok(proc)
        runs[name] = (_metrics(tmp_path / name / "run"), proc.stdout)
    (got, stdout), (base, _) = runs["with"], runs["without"]
    assert got["config"]["ddp"]["strategy"] == "traced" and got["config"]["ddp"]["optimizer_in_backward"] is True
    assert [s for s, _ in got["losses"]] == list(range(1, 9))
    _same_losses(got["losses"], dict(base["losses"]))
    assert re.search(r"^ddp\.strategy=traced: the all-reduces run inside the compiled backward graph", stdout,
                     re.M), stdout[-3000:]  # no fallback to the split strategy
    said = re.search(r"^optimizer in backward: (\d+) parameter update\(s\) on rank 0, traced into the compiled "
                     r"backward after their bucket's all-reduce", stdout, re.M)
    params = len(list(build_model(composed(*RUN).model).parameters()))
    assert said and int(said[1]) == 8 * params, stdout[-3000:]
