"""compiler.cache.trust: the private runtime folder, files made without following links, and
folders that are unsafe to load code from (Note [Trusted folders])."""

from __future__ import annotations

import os

import pytest

from compiler.cache.trust import UnsafePath, read_private, runtime_dir, unsafe_folder, write_private

OTHER_UID = 4242  # a uid that is not this process's (tests run as root in CI: chown works)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_runtime_dir_is_private_and_reused(private_tmp):
    first = runtime_dir()
    assert first == private_tmp / f"distcompile-{os.getuid()}"
    assert os.stat(first).st_mode & 0o777 == 0o700
    assert runtime_dir() == first


def test_runtime_dir_prefers_a_private_xdg_runtime_dir(private_tmp, monkeypatch):
    xdg = private_tmp / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert runtime_dir() == xdg / "distcompile"
    xdg.chmod(0o755)  # not private: the temporary folder instead
    assert runtime_dir() == private_tmp / f"distcompile-{os.getuid()}"


def test_runtime_dir_refuses_a_link_planted_at_its_path(private_tmp):
    elsewhere = private_tmp / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (private_tmp / f"distcompile-{os.getuid()}").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match=r"is not a directory \(a link or a file\).*Remove it"):
        runtime_dir()


def test_runtime_dir_refuses_a_folder_others_can_enter(private_tmp):
    (private_tmp / f"distcompile-{os.getuid()}").mkdir(mode=0o777)
    os.chmod(private_tmp / f"distcompile-{os.getuid()}", 0o777)
    with pytest.raises(UnsafePath, match=r"has mode 777, which lets others in \(want 700\)"):
        runtime_dir()


def test_write_private_never_writes_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "marker"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_private(link, b"message")
    write_private(link, b"message", replace=True)  # replaces the link itself
    assert victim.read_text() == "precious"
    assert not link.is_symlink() and link.read_bytes() == b"message"
    assert os.stat(link).st_mode & 0o777 == 0o600


def test_read_private_ignores_links_and_files_others_wrote_or_may_write(tmp_path):
    mine = tmp_path / "mine"
    write_private(mine, b"ours")
    assert read_private(mine) == b"ours"
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert read_private(link) is None
    open_to_all = tmp_path / "open"
    open_to_all.write_bytes(b"theirs")
    open_to_all.chmod(0o666)
    assert read_private(open_to_all) is None
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.write_bytes(b"theirs")
        foreign.chmod(0o600)
        os.chown(foreign, OTHER_UID, OTHER_UID)
        assert read_private(foreign) is None
    assert read_private(tmp_path / "missing") is None


def test_unsafe_folder(tmp_path):
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o755)
    assert unsafe_folder(safe) is None
    assert unsafe_folder(safe / "not" / "made" / "yet") is None
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)
    assert unsafe_folder(world) == f"{world} is writable by everyone (mode 777)"
    assert unsafe_folder(world / "cache") == f"{world} is writable by everyone (mode 777)"
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    assert unsafe_folder(group) == f"{group} is writable by its group (mode 775)"
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert unsafe_folder(sticky) is not None  # others may add files to the folder itself
    (sticky / "mine").mkdir(mode=0o755)
    assert unsafe_folder(sticky / "mine") is None  # ... but not rename ours: /tmp/mycache is fine
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o755)
        os.chown(foreign, OTHER_UID, OTHER_UID)
        assert unsafe_folder(foreign) == f"{foreign} is owned by uid {OTHER_UID}, another user, who can put files in it"
