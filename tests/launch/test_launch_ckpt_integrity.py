"""Checkpoint integrity (Note [Checkpoint integrity]), a checkpoint folder that can no longer be
written (Note [Checkpoint write errors]) and one that others can write (Note [Trusted folders]):
pure functions on folders first, then the main job on one rank in this process."""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import launch.checkpoint.store as store
from _jobs import tiny_job
from launch.checkpoint.integrity import verify_manifest, write_manifest
from launch.checkpoint.resume import plan_resume
from launch.checkpoint.run_identity import CheckpointError, run_identity, write_identity
from launch.checkpoint.space import EXIT_CHECKPOINT_WRITE, CheckpointWriteError, write_error
from launch.checks.validate import validate
from launch.config.schema import CompileConfig, ConfigError, JobConfig
from launch.train import run


def _cfg(root: Path, **train) -> JobConfig:
    return tiny_job(root.parent, compile=CompileConfig(backend="eager"),
                    train={**dict(steps=4, log_interval=100, checkpoint_dir=str(root)), **train})


def _checkpoint(root: Path, step: int, cfg: JobConfig) -> Path:
    """A published folder as save_checkpoint leaves it (a small fake shard)."""
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta")
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (d / "train_state.json").write_text(json.dumps({"step": step}))
    write_identity(str(d), run_identity(cfg, 1))
    write_manifest(str(d))
    return d


def _flip(path: Path, at: int, n: int = 4) -> None:
    raw = bytearray(path.read_bytes())
    raw[at:at + n] = bytes(b ^ 0xFF for b in raw[at:at + n])
    path.write_bytes(bytes(raw))


# --- which checkpoints resume may take --------------------------------------------------


def test_a_checkpoint_without_dcp_metadata_is_named_and_skipped(tmp_path):
    cfg = _cfg(tmp_path / "ckpt", resume=True)
    _checkpoint(tmp_path / "ckpt", 1, cfg)
    (_checkpoint(tmp_path / "ckpt", 2, cfg) / ".metadata").unlink()
    plan = plan_resume(cfg.train, run_identity(cfg, 1), restarted=False)
    assert [c.step for c in plan.candidates] == [1] and not plan.legacy
    assert plan.notes == (f"skipping checkpoint {tmp_path / 'ckpt' / 'step_000002'}: it has no .metadata (DCP's index "
                          "of the shards): deleted or lost after writing; a damaged checkpoint is never loaded "
                          "(delete the folder to silence this)",)


def test_a_checkpoint_without_its_identity_is_damaged_not_legacy(tmp_path):
    cfg = _cfg(tmp_path / "ckpt", resume=True)
    _checkpoint(tmp_path / "ckpt", 1, cfg)
    newest = _checkpoint(tmp_path / "ckpt", 2, cfg)
    (newest / "identity.json").unlink()
    (newest / "__0_0.distcp").write_bytes(b"damaged")  # a damaged shard beside it
    plan = plan_resume(cfg.train, run_identity(cfg, 1), restarted=False)
    assert [c.step for c in plan.candidates] == [1] and not plan.legacy
    assert len(plan.notes) == 1 and plan.notes[0].startswith(
        f"skipping checkpoint {newest}: it has no identity.json (the run that wrote it): deleted or lost")
    # a manifest lost instead: the same; and with neither, the checkpoint is legacy (as before)
    write_identity(str(newest), run_identity(cfg, 1))
    (newest / "manifest.json").unlink()
    assert "it has no manifest.json (the checksums of its files)" in plan_resume(
        cfg.train, run_identity(cfg, 1), restarted=False).notes[0]
    (newest / "identity.json").unlink()
    assert plan_resume(cfg.train, run_identity(cfg, 1), restarted=False).legacy


def test_only_damaged_checkpoints_is_one_message_naming_each(tmp_path):
    cfg = _cfg(tmp_path / "ckpt", resume=True)
    (_checkpoint(tmp_path / "ckpt", 1, cfg) / "train_state.json").unlink()
    with pytest.raises(CheckpointError, match=r"^train\.resume=true but no checkpoint in train\.checkpoint_dir=.* "
                                              r"can be read: skipping checkpoint .*step_000001: it has no "
                                              r"train_state\.json"):
        plan_resume(cfg.train, run_identity(cfg, 1), restarted=False)


def test_the_manifest_checksum_finds_four_flipped_bytes_and_sha256_manifests_still_verify(tmp_path):
    d = _checkpoint(tmp_path, 1, _cfg(tmp_path))
    entry = json.loads((d / "manifest.json").read_text())["files"]["__0_0.distcp"]
    assert set(entry) == {"bytes", "crc32"}
    _flip(d / "__0_0.distcp", 500)
    assert verify_manifest(str(d)) == ("__0_0.distcp does not match its crc32 in the manifest (the bytes changed "
                                       "after writing)")
    write_manifest(str(d), "sha256")  # as written by an earlier version
    assert json.loads((d / "manifest.json").read_text())["version"] == 1
    assert verify_manifest(str(d)) is None
    _flip(d / "__0_0.distcp", 10)
    assert "__0_0.distcp does not match its sha256 in the manifest" in verify_manifest(str(d))


@pytest.mark.usefixtures("no_process_group_left")
def test_flipped_bytes_with_the_identity_deleted_are_skipped_not_loaded(tmp_path, capsys):
    root = tmp_path / "ckpt"
    ref = dict(run(_cfg(root, checkpoint_every=1, keep_last=4))["losses"])
    assert root.stat().st_mode & 0o777 == 0o700  # made private whatever the umask: its resume is not refused
    shutil.rmtree(root / "step_000004")
    (root / "step_000003" / "identity.json").unlink()
    _flip(next((root / "step_000003").glob("*.distcp")), 300)
    capsys.readouterr()
    resumed = run(_cfg(root, resume=True))
    out = capsys.readouterr().out
    assert out.count("warning:") == 1
    assert f"warning: skipping checkpoint {root / 'step_000003'}: it has no identity.json" in out
    assert f"resumed from {root / 'step_000002'} at step 2" in out
    for step, loss in resumed["losses"]:
        assert loss == pytest.approx(ref[step], rel=1e-6), f"loss differs at step {step}"


# --- a checkpoint folder that can no longer be written -----------------------------------


def _real_oserror(tmp_path: Path) -> OSError:
    (tmp_path / "a_file").write_text("x")
    try:
        os.mkdir(tmp_path / "a_file" / "step_000002.tmp")
    except OSError as e:
        return e
    raise AssertionError("mkdir under a file succeeded")


def test_a_folder_that_can_no_longer_be_written_is_one_line_with_errno_and_path(tmp_path):
    root, last = tmp_path / "ckpt", tmp_path / "ckpt" / "step_000001"
    last.mkdir(parents=True)
    partial = str(root / "step_000002.tmp")
    rofs = OSError(errno.EROFS, os.strerror(errno.EROFS), partial)  # what the kernel says, root ignores modes
    line = str(write_error(str(root), 2, str(last), rofs, partial))
    assert line == (f"checkpoint step 2 could not be written to {root}: [Errno 30] Read-only file system: "
                    f"'{partial}' (its filesystem turned read-only); its partial folder was removed. The last good "
                    f"checkpoint is {last}. Make {root} writable again or point train.checkpoint_dir at a folder you "
                    "can write, then resume with train.resume=true.")
    # a real error from a real failing call, as DCP wraps it: (exception, stack) per rank
    real = _real_oserror(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(dcp.CheckpointException) as wrapped:
            dcp.save({"a": torch.zeros(2)}, checkpoint_id=str(tmp_path / "a_file" / "step_000002.tmp"))
    for e in (real, wrapped.value):
        line = str(write_error(str(root), 2, str(last), e, partial))
        assert "[Errno 20] Not a directory: '" in line and "(the folder was replaced by a file)" in line, line
        assert "\n" not in line and "Free" not in line and "FrameSummary" not in line and "Traceback" not in line


@pytest.mark.usefixtures("no_process_group_left")
def test_a_checkpoint_folder_replaced_by_a_file_mid_run_ends_with_one_line(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    real = store.dcp.save

    def folder_gone(state, checkpoint_id):
        if checkpoint_id.endswith("step_000002.tmp"):
            shutil.rmtree(root)
            root.write_text("not a folder")
        return real(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(store.dcp, "save", folder_gone)
    with pytest.raises(CheckpointWriteError) as e:
        run(_cfg(root, steps=3, checkpoint_every=1))
    assert e.value.exit_code == EXIT_CHECKPOINT_WRITE
    assert str(e.value).startswith(f"checkpoint step 2 could not be written to {root}: [Errno 20] Not a directory: ")
    assert f"(the folder was replaced by a file); its partial folder was removed. No checkpoint of this run is left " \
           f"in {root}. Make {root} writable again" in str(e.value)
    assert "\n" not in str(e.value) and "FrameSummary" not in str(e.value) and "Free" not in str(e.value)


# --- a checkpoint folder others can write -----------------------------------------------


def test_a_checkpoint_folder_others_can_write_is_refused_before_the_job_starts(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=rf"^train\.checkpoint_dir='{shared}/ckpt' is not private: {shared} is "
                                          r"writable by everyone \(mode 777\)\. Loading a checkpoint unpickles .*, so "
                                          r"whoever can write there can run code in this job\. Run chmod go-w on that "
                                          r"folder, or choose a folder of your own .*train\.checkpoint_every=0"):
        validate(_cfg(shared / "ckpt", checkpoint_every=2))
    shared.chmod(0o775)
    with pytest.raises(ConfigError, match=r"is writable by its group \(mode 775\)"):
        validate(_cfg(shared / "ckpt", resume=True))
    validate(_cfg(shared / "ckpt"))  # neither written nor read: not checked
    shared.chmod(0o755)
    validate(_cfg(shared / "ckpt", checkpoint_every=2))
