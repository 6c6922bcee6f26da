"""Files the launcher keeps in temporary folders (launch.config.bad_input's config-error
marker): made in this user's private runtime folder, never through a link, and a marker
this job did not write is ignored (Note [Trusted folders], Note [Config errors under
torchrun]). Every path here is under tmp_path: TMPDIR and XDG_RUNTIME_DIR point there."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from launch.config import bad_input
from launch.config.bad_input import config_error_reported_before, report_config_error

OTHER_UID = 4242  # a uid that is not this process's (tests run as root in CI: chown works)
MESSAGE = "train.steps=0 is not valid: it must be a positive integer"


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A stand-in for /tmp, and torchrun's environment for local rank 0 of run ``job-1``."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return shared


def _old_marker(shared) -> str:
    """Where the marker used to be: a name anyone can read off ``ps`` (run id, agent pid)."""
    return str(shared / f"distcompile-config-error-job-1-{os.getppid()}")


def _restarted(monkeypatch, local_rank: int = 0) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_a_link_planted_at_the_marker_paths_is_not_written_through(shared_tmp, tmp_path, capfd):
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    marker = bad_input._marker_path()
    for path in {_old_marker(shared_tmp), _old_marker(shared_tmp) + ".tmp", marker}:
        os.symlink(target, path)
    assert report_config_error(MESSAGE) == 2
    assert target.read_text() == "precious"
    assert capfd.readouterr().err == f"error: {MESSAGE}\n"
    assert not os.path.islink(marker) and open(marker).read() == MESSAGE  # the link was replaced, not followed
    assert os.stat(marker).st_mode & 0o777 == 0o600 and os.path.dirname(marker) != str(shared_tmp)


def test_a_marker_that_cannot_be_written_is_said_in_one_line_and_nothing_is_written_through(shared_tmp, tmp_path,
                                                                                             capfd):
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    marker = bad_input._marker_path()
    os.symlink(target, f"{marker}.{os.getpid()}.tmp")  # where the marker is written before it is moved into place
    assert report_config_error(MESSAGE) == 2
    assert target.read_text() == "precious" and not os.path.exists(marker)
    assert capfd.readouterr().err.splitlines() == [
        f"error: {MESSAGE}",
        f"warning: the config error could not be recorded at {marker} (File exists), so the other ranks print it too "
        "and a torchrun restart finds it again. Clear that folder of what is in the way, or free space."]


def test_a_restart_after_a_config_error_stops_at_once_and_hands_torchrun_the_message(shared_tmp, tmp_path,
                                                                                     monkeypatch, capfd):
    assert not config_error_reported_before()  # no restart yet
    report_config_error(MESSAGE)
    (tmp_path / "error.json").unlink()
    capfd.readouterr()
    _restarted(monkeypatch)
    assert config_error_reported_before()
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == f"ConfigError: {MESSAGE}"
    _restarted(monkeypatch, local_rank=1)
    assert config_error_reported_before()  # local rank 0 has failed first: no wait
    assert capfd.readouterr().err == ""  # nothing printed again


@pytest.mark.parametrize("where", ["old path", "other user's", "writable by others"])
def test_a_marker_this_job_did_not_write_is_ignored(shared_tmp, tmp_path, monkeypatch, where):
    if where == "old path":
        planted = _old_marker(shared_tmp)
    else:
        planted = bad_input._marker_path()  # the runtime folder is private: only a misconfiguration gets one there
    with open(planted, "w") as f:
        f.write("error: someone else's text")
    if where == "other user's":
        os.chown(planted, OTHER_UID, OTHER_UID)
    elif where == "writable by others":
        os.chmod(planted, 0o666)
    _restarted(monkeypatch)
    assert not config_error_reported_before()  # the restart composes the config as usual
    assert not (tmp_path / "error.json").exists()


def test_a_runtime_folder_taken_by_a_link_is_not_used_and_the_error_is_still_printed(shared_tmp, tmp_path, capfd):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, shared_tmp / f"distcompile-{os.getuid()}")
    assert report_config_error(MESSAGE) == 2
    err = capfd.readouterr().err.splitlines()
    assert err[0] == f"error: {MESSAGE}"
    assert len(err) == 2 and err[1].startswith(
        "warning: the config error was not recorded for torchrun's restarts, so each rank printed it and a restart "
        f"will find it again: {shared_tmp}/distcompile-{os.getuid()} is not a directory (a link or a file)"), err
    assert "set XDG_RUNTIME_DIR to a private folder" in err[1]
    assert list(elsewhere.iterdir()) == []
