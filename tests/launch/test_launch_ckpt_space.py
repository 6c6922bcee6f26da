"""A checkpoint that cannot be written (Note [Checkpoint write errors]): too little room is
found before anything is written, a write that fails leaves no partial folder, and both end
the run with one line naming the last good checkpoint and the room needed, exit code 4."""

from __future__ import annotations

import errno
from collections import namedtuple

import pytest

import launch.checkpoint.space as space
import launch.checkpoint.store as store
from _jobs import tiny_job
from launch.checkpoint.space import EXIT_CHECKPOINT_WRITE, CheckpointWriteError
from launch.config.schema import CompileConfig
from launch.train import run

pytestmark = pytest.mark.usefixtures("no_process_group_left")


def _job(tmp_path, steps):
    return tiny_job(tmp_path, compile=CompileConfig(backend="eager"), train=dict(steps=steps, checkpoint_every=1))


def _published(tmp_path):
    return sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))


def test_a_disk_that_fills_during_a_save_leaves_no_partial_folder_and_names_the_last_good_one(tmp_path, monkeypatch):
    real = store.dcp.save

    def fills_up(state, checkpoint_id):
        if checkpoint_id.endswith("step_000002.tmp"):
            real(state, checkpoint_id=checkpoint_id)  # some bytes land, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", checkpoint_id)
        return real(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(store.dcp, "save", fills_up)
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint step 2 could not be written to \S+ckpt \(the disk is "
                                                   r"full: [\d.]+ MiB free with [\d.]+ MiB written\); its partial folder was removed. The last good "
                                                   r"checkpoint is \S+step_000001; it needs about [\d.]+ MiB free") as e:
        run(_job(tmp_path, steps=3))
    assert e.value.exit_code == EXIT_CHECKPOINT_WRITE == 4
    assert _published(tmp_path) == ["step_000001"]  # and no step_000002.tmp


def test_too_little_room_is_found_before_anything_is_written(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    real = space.shutil.disk_usage

    def after_the_first(path):
        full = (tmp_path / "ckpt" / "step_000001").is_dir()
        return usage(1 << 30, 1 << 30, 1024) if full else real(path)

    monkeypatch.setattr(space.shutil, "disk_usage", after_the_first)
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint step 2 was not written: \S+ckpt has 0.0 MiB free and "
                                                   r"the last checkpoint \(\S+step_000001\) took [\d.]+ MiB; the last "
                                                   r"good checkpoint is \S+step_000001. Free [\d.]+ MiB or more"):
        run(_job(tmp_path, steps=3))
    assert _published(tmp_path) == ["step_000001"]


def test_an_error_that_is_not_a_write_failure_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(state, checkpoint_id):
        raise RuntimeError("a bug in a state dict")

    monkeypatch.setattr(store.dcp, "save", broken)
    with pytest.raises(RuntimeError, match="a bug in a state dict") as e:
        run(_job(tmp_path, steps=1))
    assert not isinstance(e.value, CheckpointWriteError)
    assert not list((tmp_path / "ckpt").glob("*.tmp"))
