"""Checkpoint identity, manifest and the resume policy (Note [Checkpoint identity and
manifest], Note [Resume policy]): pure functions on folders first, then the main job
on one rank in this process (run() starts a one-rank gloo group)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from launch.checkpoint.resume import plan_resume
from launch.checkpoint.run_identity import (CheckpointError, RunIdentity, differences, read_identity, run_identity,
                                 verify_manifest, write_identity, write_manifest)
from launch.checks.validate import validate
from launch.config.schema import CompileConfig, ConfigError, JobConfig, ModelConfig, ParallelMode, TrainConfig
from launch.train import run


def _cfg(root: Path, *, model: dict | None = None, **train) -> JobConfig:
    return JobConfig(model=ModelConfig(**{**dict(n_layer=2, n_head=2, n_embd=32, block_size=32), **(model or {})}),
                     compile=CompileConfig(backend="eager"),
                     train=TrainConfig(**{**dict(steps=4, batch_size=4, seq_len=32, log_interval=100,
                                                 checkpoint_dir=str(root)), **train}))


def _fake_checkpoint(root: Path, step: int, identity: RunIdentity | None) -> Path:
    """A published folder with the files the resume policy reads (no real shards)."""
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta")
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (d / "train_state.json").write_text(json.dumps({"step": step}))
    if identity is not None:
        write_identity(str(d), identity)
        write_manifest(str(d))
    return d


# --- identity ---------------------------------------------------------------------


def test_identity_ignores_resumable_settings_and_names_what_differs(tmp_path):
    base = run_identity(_cfg(tmp_path), world_size=2, run_id="a")
    same = _cfg(tmp_path / "elsewhere", steps=99, lr=1.0, weight_decay=0.1, log_interval=3, checkpoint_every=7,
                keep_last=5, timeout_s=9.0, resume=True)
    same = dataclasses.replace(same, compile=CompileConfig(backend="aot_eager"))
    assert run_identity(same, world_size=2, run_id="b").digest == base.digest

    for cfg, ws, expected in (
        (_cfg(tmp_path, model=dict(n_layer=4)), 2, 'model.n_layer 4 in the checkpoint, 2 now'),
        (_cfg(tmp_path, seed=1), 2, 'train.seed 1 in the checkpoint, 1337 now'),
        (_cfg(tmp_path), 1, 'world_size 1 in the checkpoint, 2 now'),
    ):
        other = run_identity(cfg, world_size=ws)
        assert other.digest != base.digest
        assert differences(other, base) == [expected]


def test_identity_file_round_trips_and_refuses_garbage(tmp_path):
    identity = run_identity(_cfg(tmp_path), world_size=2, run_id="r1")
    write_identity(str(tmp_path), identity)
    assert read_identity(str(tmp_path)) == identity
    assert read_identity(str(tmp_path / "legacy")) is None  # no file: a legacy checkpoint
    data = json.loads((tmp_path / "identity.json").read_text())
    data["fields"]["model.n_layer"] = 8  # edited by hand: no longer its digest
    (tmp_path / "identity.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"identity\.json does not match its own digest"):
        read_identity(str(tmp_path))
    (tmp_path / "identity.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"identity\.json cannot be read \(JSONDecodeError"):
        read_identity(str(tmp_path))


# --- manifest ---------------------------------------------------------------------


def test_manifest_finds_flipped_truncated_and_missing_files(tmp_path):
    d = _fake_checkpoint(tmp_path, 2, run_identity(_cfg(tmp_path), 1))
    assert verify_manifest(str(d)) is None
    shard = d / "__0_0.distcp"
    good = shard.read_bytes()
    shard.write_bytes(good[:100] + bytes(b ^ 0xFF for b in good[100:116]) + good[116:])  # 16 flipped bytes
    assert "__0_0.distcp does not match its crc32" in verify_manifest(str(d))
    shard.write_bytes(good[:500])
    assert "__0_0.distcp has 500 bytes, the manifest says 1024" in verify_manifest(str(d))
    shard.unlink()
    assert verify_manifest(str(d)) == "__0_0.distcp is missing"
    (d / "manifest.json").write_text("garbage")
    assert "manifest.json cannot be read" in verify_manifest(str(d))
    assert verify_manifest(str(tmp_path / "nothing")) == "it has no manifest.json"


# --- the resume policy, before any process group -------------------------------------


def test_resume_refuses_another_config_with_what_differs(tmp_path):
    _fake_checkpoint(tmp_path, 2, run_identity(_cfg(tmp_path, model=dict(n_layer=4)), 1))
    with pytest.raises(ConfigError, match=r"latest checkpoint .*step_000002 was written by a run with another config: "
                                          r"model\.n_layer 4 in the checkpoint, 2 now\. .*train\.resume=false"):
        validate(_cfg(tmp_path, resume=True))
    fsdp = _fsdp(_cfg(tmp_path, resume=True, model=dict(n_layer=4)))
    _fake_checkpoint(tmp_path, 3, run_identity(fsdp, 1))
    with pytest.raises(ConfigError, match=r"train\.resume=true on 2 rank\(s\), but the latest checkpoint of this run .* "
                                          r"was written by 1: parallel=fsdp saves distributed tensors.*Relaunch on 1 "
                                          r"rank\(s\) to continue.*another train\.checkpoint_dir.*use parallel=ddp"):
        plan_resume(fsdp.train, run_identity(fsdp, 2), restarted=False)


def _fsdp(cfg: JobConfig) -> JobConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, name="fsdp"))


def test_ddp_resumes_on_another_world_size_keeping_the_global_batch(tmp_path):
    cfg = _cfg(tmp_path, resume=True)
    _fake_checkpoint(tmp_path, 2, run_identity(cfg, 1, run_id="old"))
    plan = plan_resume(cfg.train, run_identity(cfg, 2, run_id="new"), restarted=False)
    assert [c.step for c in plan.candidates] == [2]
    assert plan.notes == ("resuming a checkpoint written by 1 rank(s) on 2: train.batch_size=4 stays the global "
                          "batch, 2 per rank (was 4); from here on each rank draws other samples than a run that "
                          "kept 1 rank(s) would",)
    # anything else that differs still refuses, and names the world size beside it
    with pytest.raises(ConfigError, match=r"another config: train\.seed 1337 in the checkpoint, 7 now\. Resuming"):
        plan_resume(cfg.train, run_identity(_cfg(tmp_path, resume=True, seed=7), 2), restarted=False)
    # a config built in code may carry the enum itself
    coded = dataclasses.replace(_cfg(tmp_path / "coded", resume=True),
                                parallel=dataclasses.replace(cfg.parallel, name=ParallelMode.DDP))
    _fake_checkpoint(tmp_path / "coded", 2, run_identity(coded, 1))
    assert [c.step for c in plan_resume(coded.train, run_identity(coded, 2), restarted=False).candidates] == [2]


def test_elastic_restart_on_fewer_ranks_adopts_its_checkpoints_under_ddp_and_says_why_not_under_fsdp(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    cfg = _cfg(tmp_path, checkpoint_every=2, steps=10)
    _fake_checkpoint(tmp_path, 4, run_identity(cfg, 2, run_id="this-run"))  # before a node was lost
    plan = plan_resume(cfg.train, run_identity(cfg, 1, run_id="this-run"), restarted=True)
    assert [c.step for c in plan.candidates] == [4]
    assert plan.notes == ("torchrun restart (elastic): resuming a checkpoint written by 2 rank(s) on 1: "
                          "train.batch_size=4 stays the global batch, 4 per rank (was 2); from here on each rank "
                          "draws other samples than a run that kept 2 rank(s) would",)
    fsdp = _fsdp(cfg)
    _fake_checkpoint(tmp_path / "fsdp", 4, run_identity(fsdp, 2, run_id="this-run"))
    fsdp = dataclasses.replace(fsdp, train=dataclasses.replace(fsdp.train, checkpoint_dir=str(tmp_path / "fsdp")))
    with pytest.raises(ConfigError, match=r"torchrun restarted this run \(an elastic restart\) on 1 rank\(s\), but the "
                                          r"latest checkpoint of this run .* was written by 2: parallel=fsdp saves "
                                          r"distributed tensors.*torchrun --nnodes 2:2"):
        plan_resume(fsdp.train, run_identity(fsdp, 1, run_id="this-run"), restarted=True)
    # its own checkpoints at this world size beside newer ones of another: still refused, none overwritten
    _fake_checkpoint(tmp_path / "fsdp", 2, run_identity(fsdp, 1, run_id="this-run"))
    with pytest.raises(ConfigError, match=r"was written by 2: parallel=fsdp"):
        plan_resume(fsdp.train, run_identity(fsdp, 1, run_id="this-run"), restarted=True)
    # no torchrun run id: no checkpoint is this run's, and the world size is not what is said
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ConfigError, match=r"holds checkpoints of another run"):
        plan_resume(cfg.train, run_identity(cfg, 1, run_id=None), restarted=True)


def test_explicit_resume_adopts_same_config_of_another_invocation_and_legacy_with_warning(tmp_path):
    cfg = _cfg(tmp_path, resume=True)
    _fake_checkpoint(tmp_path, 1, run_identity(cfg, 1, run_id="old"))
    _fake_checkpoint(tmp_path, 2, run_identity(cfg, 1, run_id="old"))
    plan = plan_resume(cfg.train, run_identity(cfg, 1, run_id="new"), restarted=False)
    assert [c.step for c in plan.candidates] == [2, 1] and not plan.legacy and not plan.notes
    _fake_checkpoint(tmp_path, 3, None)
    plan = plan_resume(cfg.train, run_identity(cfg, 1, run_id="new"), restarted=False)
    assert [c.step for c in plan.candidates] == [3] and plan.legacy
    assert "written before checkpoints carried an identity" in plan.notes[0]


def test_damaged_identity_falls_back_to_the_older_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, resume=True)
    _fake_checkpoint(tmp_path, 1, run_identity(cfg, 1))
    (_fake_checkpoint(tmp_path, 2, run_identity(cfg, 1)) / "identity.json").write_text("\x00garbage")
    plan = plan_resume(cfg.train, run_identity(cfg, 1), restarted=False)
    assert [c.step for c in plan.candidates] == [1]
    assert "skipping checkpoint" in plan.notes[0] and "step_000002" in plan.notes[0]


def test_torchrun_restart_adopts_only_its_own_invocations_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "this-run")
    cfg = _cfg(tmp_path)
    _fake_checkpoint(tmp_path, 3, run_identity(_cfg(tmp_path, seed=7), 1, run_id="this-run"))  # another config
    _fake_checkpoint(tmp_path, 2, run_identity(cfg, 1, run_id="earlier-run"))  # same config, other torchrun
    _fake_checkpoint(tmp_path, 0, None)  # legacy
    plan = plan_resume(cfg.train, run_identity(cfg, 1), restarted=True)
    assert plan.candidates == () and "ignoring 3 checkpoint(s)" in plan.notes[0]
    validate(cfg)  # this run writes no checkpoints: it starts from step 0
    with pytest.raises(ConfigError, match=r"torchrun restarted this run .* holds checkpoints of another run "
                                          r"\(latest: .*step_000003\) but none of this one"):
        validate(_cfg(tmp_path, checkpoint_every=2))
    _fake_checkpoint(tmp_path, 1, run_identity(cfg, 1, run_id="this-run"))  # its own, older than the others
    plan = plan_resume(cfg.train, run_identity(cfg, 1), restarted=True)
    assert [c.step for c in plan.candidates] == [1] and "ignoring 3 checkpoint(s)" in plan.notes[0]


# --- the main job on one rank: save, corrupt, resume ------------------------------------


@pytest.fixture
def three_checkpoints(tmp_path):
    """A 4-step run with checkpoints after steps 1..4, the last one deleted; its metrics."""
    root = tmp_path / "ckpt"
    metrics = run(_cfg(root, checkpoint_every=1, keep_last=4))
    # and the folder's lock record (Note [Checkpoint folder lock])
    assert sorted(os.listdir(root)) == [".distcompile.lock", "latest", *(f"step_{s:06d}" for s in range(1, 5))]
    for name in ("identity.json", "manifest.json"):
        assert (root / "step_000004" / name).is_file()
    import shutil
    shutil.rmtree(root / "step_000004")
    return root, dict(metrics["losses"])


@pytest.mark.usefixtures("one_thread")
def test_corrupt_newest_checkpoint_falls_back_with_a_warning(three_checkpoints, capsys):
    root, ref = three_checkpoints
    shard = next((root / "step_000003").glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 16] = bytes(b ^ 0xFF for b in raw[len(raw) // 2: len(raw) // 2 + 16])
    shard.write_bytes(bytes(raw))
    (root / "step_000002" / "train_state.json").write_text("garbage")
    capsys.readouterr()
    resumed = run(_cfg(root, resume=True))
    out = capsys.readouterr().out
    assert "warning: checkpoint " + str(root / "step_000003") + " is corrupt (" + shard.name + " does not match" in out
    assert "train_state.json has 7 bytes" in out
    assert f"resumed from {root / 'step_000001'} at step 1" in out
    assert [s for s, _ in resumed["losses"]] == [2, 3, 4]
    for step, loss in resumed["losses"]:
        assert loss == pytest.approx(ref[step], rel=1e-6), f"loss differs at step {step}"


@pytest.mark.usefixtures("one_thread")
def test_every_checkpoint_corrupt_is_one_message(three_checkpoints):
    root, _ = three_checkpoints
    for step in (1, 2, 3):
        shard = next((root / f"step_{step:06d}").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match=r"no intact checkpoint to resume in train\.checkpoint_dir=.*"
                                              r"step_000003 is corrupt \(.*has 100 bytes.*Delete the corrupt folders"):
        run(_cfg(root, resume=True))


@pytest.mark.usefixtures("one_thread")
def test_changed_lr_applies_and_says_so(three_checkpoints, capsys):
    root, _ = three_checkpoints
    capsys.readouterr()
    run(_cfg(root, resume=True, lr=1e-5))
    assert "resume: train.lr=1e-05 (the checkpoint's optimizer had 0.003) applies from step 4" in capsys.readouterr().out


@pytest.mark.usefixtures("one_thread")
def test_legacy_checkpoint_of_another_shape_is_refused_not_partially_loaded(three_checkpoints):
    root, _ = three_checkpoints
    for step in (1, 2, 3):  # as written before this change: no identity, no manifest
        (root / f"step_{step:06d}" / "identity.json").unlink()
        (root / f"step_{step:06d}" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_000003 does not fit the model: blocks\.1\.attn\.proj\.bias only in the "
                                              r"checkpoint.*resume with that checkpoint's model\.\* settings"):
        run(_cfg(root, resume=True, model=dict(n_layer=1)))
