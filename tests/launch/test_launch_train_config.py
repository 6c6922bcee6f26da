"""Config of the lr schedule, gradient clipping and evaluation (train.lr_schedule,
warmup_steps, min_lr, max_grad_norm, eval_every, eval_batches): defaults change
nothing, each bad value fails with what, why and how to fix before any process group
starts, a user dataset without eval_batch is refused with eval_every > 0, and the
checkpoint identity holds the trajectory keys but not the evaluation ones."""

from __future__ import annotations

import pytest

from launch.checkpoint.run_identity import run_identity
from launch.checks.validate import validate
from launch.config.schema import ConfigError
from launch.observe.banner import describe

from _jobs import composed as _job


def test_defaults_are_off_and_good_values_validate(tmp_path):
    t = _job().train
    assert (t.lr_schedule, t.warmup_steps, t.min_lr, t.max_grad_norm, t.eval_every, t.eval_batches) == (
        "constant", 0, 0.0, 0.0, 0, 4)
    good = _job("train.lr_schedule=cosine", "train.warmup_steps=5", "train.min_lr=1e-4", "train.max_grad_norm=1.0",
                "train.eval_every=5", "train.eval_batches=2", f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    validate(good, world_size=2)
    assert ("lr_schedule=cosine warmup_steps=5 min_lr=0.0001 max_grad_norm=1.0 eval_every=5 eval_batches=2"
            in describe(good))
    validate(_job("train.warmup_steps=20", f"train.checkpoint_dir={tmp_path / 'ckpt'}"), world_size=2)  # constant


BAD = [
    (["train.lr_schedule=step"],
     r"^train\.lr_schedule='step' is not one of constant, cosine, linear: it is the lr after the warm-up\. "
     r"Use train\.lr_schedule=constant"),
    (["train.warmup_steps=-1"], r"^train\.warmup_steps=-1 is negative: .*or 0 for no warm-up\.$"),
    (["train.warmup_steps=21"],
     r"^train\.warmup_steps=21 with train\.steps=20: the warm-up would not reach train\.lr before the run ends\. "
     r"Lower train\.warmup_steps below 20, or raise train\.steps\.$"),
    (["train.lr_schedule=cosine", "train.warmup_steps=20"],
     r"^train\.warmup_steps=20 with train\.steps=20: the cosine decay starts after the warm-up .* at least one step "
     r"after the warm-up\. Lower train\.warmup_steps"),
    (["train.lr_schedule=linear", "train.min_lr=0.1"],
     r"^train\.min_lr=0\.1 is not in \[0, train\.lr=0\.003\]: it is the lr the linear schedule decays to"),
    (["train.lr_schedule=cosine", "train.min_lr=-1e-5"], r"^train\.min_lr=-1e-05 is not in \[0, train\.lr"),
    (["train.min_lr=1e-4"],
     r"^train\.min_lr=0\.0001 with train\.lr_schedule=constant: only cosine and linear decay to min_lr, so it would "
     r"be silently ignored\. Use train\.lr_schedule=cosine \(or linear\), or drop train\.min_lr\.$"),
    (["train.max_grad_norm=-1"],
     r"^train\.max_grad_norm=-1\.0 is not valid: .*Set e\.g\. train\.max_grad_norm=1\.0, or 0 to switch clipping off\.$"),
    (["train.max_grad_norm=nan"], r"^train\.max_grad_norm=nan is not valid"),
    (["train.eval_every=-5"], r"^train\.eval_every=-5 is negative: .*or 0 to switch evaluation off\.$"),
    (["train.eval_every=5", "train.eval_batches=0"],
     r"^train\.eval_batches=0 is not valid: it must be a positive integer; each evaluation averages .* or "
     r"train\.eval_every=0 to switch evaluation off\.$"),
]


@pytest.mark.parametrize("overrides,match", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_values_name_the_setting_and_the_fix(overrides, match, tmp_path):
    cfg = _job(*overrides, f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=2)


def test_a_user_dataset_needs_eval_batch_for_evaluation(tmp_path):
    base = ("compile.backend=aot_eager", "data=custom", f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    validate(_job(*base, "data._target_=_custom_parts.NoHeldOut"), world_size=2)  # no evaluation: fine
    with pytest.raises(ConfigError, match=r"^train\.eval_every=5 with data\._target_='_custom_parts\.NoHeldOut': the "
                                          r"dataset has no eval_batch method, so there are no held-out batches .*Add "
                                          r"eval_batch\(index, rank, world_size, batch_size, seq_len\) must return .*; "
                                          r"or set train\.eval_every=0 to switch evaluation off\.$"):
        validate(_job(*base, "data._target_=_custom_parts.NoHeldOut", "train.eval_every=5"), world_size=2)
    with pytest.raises(ConfigError, match=r"^data\._target_='_custom_parts\.BadHeldOut': the inputs of eval_batch\(\) "
                                          r"has dtype torch\.int32, expected torch\.int64"):
        validate(_job(*base, "data._target_=_custom_parts.BadHeldOut", "train.eval_every=5"), world_size=2)
    validate(_job(*base, "data._target_=_custom_parts.HeldOut", "train.eval_every=5"), world_size=2)
    validate(_job(*base, "train.eval_every=5"), world_size=2)  # the example: launch.data.SyntheticTokens has one


def test_identity_holds_the_trajectory_keys_not_evaluation(tmp_path):
    ckpt = f"train.checkpoint_dir={tmp_path / 'ckpt'}"
    base = run_identity(_job(ckpt), world_size=2)
    # new keys at their defaults are left out: checkpoints written before them keep their digest
    assert not any(k in base.fields for k in ("train.lr_schedule", "train.warmup_steps", "train.min_lr",
                                              "train.max_grad_norm", "train.eval_every", "train.eval_batches"))
    assert run_identity(_job(ckpt, "train.eval_every=3", "train.eval_batches=2"), world_size=2).digest == base.digest
    for override, key in (("train.lr_schedule=cosine", "train.lr_schedule"), ("train.warmup_steps=3", "train.warmup_steps"),
                          ("train.max_grad_norm=1.0", "train.max_grad_norm")):
        other = run_identity(_job(ckpt, override), world_size=2)
        assert other.digest != base.digest and key in other.fields, override
    cosine = run_identity(_job(ckpt, "train.lr_schedule=cosine"), world_size=2)
    assert run_identity(_job(ckpt, "train.lr_schedule=cosine", "train.min_lr=1e-4"), world_size=2).digest != cosine.digest
