"""What the job trusts on disk: a private runtime folder, files made without following
links, and the check that a folder which loads code is not writable by others.

Note [Trusted folders]

Background
    The job trusts its own ranks and its own folders, nothing else (docs/trust.md).
    Two things on a machine can break that without touching the job's code:

    - another local user who can guess a path in a shared temporary folder (``/tmp``
      is writable by everyone) plants a symlink there, or a file of their own, before
      the job writes it; a plain ``open(path, "w")`` follows the link and writes
      wherever it points, and a plain read takes the stranger's file for the job's;
    - a folder the job loads code from (a compile cache, whose artifacts are Python
      and shared libraries; a checkpoint, which DCP and pickle may unpickle) that is
      writable by a group or by everyone lets anyone in that group put code there.

Algorithm
    - :func:`runtime_dir` is one folder per user, mode 0700, owned by the user:
      ``$XDG_RUNTIME_DIR/distcompile`` when that is a private folder of this user,
      else ``<tempdir>/distcompile-<uid>``. It is created with ``mkdir(0o700)``; an
      existing path there is used only when ``lstat`` shows a real directory (not a
      link) owned by this user with no group or other permission bits, and is
      otherwise refused with :class:`UnsafePath` (another user made it first).
    - :func:`write_private` creates a file with ``O_CREAT | O_EXCL | O_NOFOLLOW``,
      mode 0600, so it never writes through a link or into a file it did not create;
      ``replace=True`` writes a temporary file that way and ``os.replace``-s it.
    - :func:`read_private` opens with ``O_NOFOLLOW`` and reads only a regular file
      owned by this user (or root) that no one else may write; anything else reads as
      absent (None): a file this job did not write is ignored.
    - :func:`unsafe_folder` says why a folder cannot be trusted to load code from, or
      None: the folder, or a folder above it, can be written by another user. A
      folder above with the sticky bit (``/tmp``) is fine: others may add entries
      there but cannot rename or remove ours. The folder itself must be owned by this
      user or root and not writable by group or others, sticky or not, because others
      could add a file this job would then load.

Notes
    The checks use ``lstat``/``fstat`` on what was opened, not a name looked up twice,
    where it matters (files); for folders the check is advisory, a guard against a
    misconfigured mount or ``chmod 777``, not against a race by root.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["UnsafePath", "read_private", "read_secret", "runtime_dir", "unsafe_folder", "write_private"]


class UnsafePath(OSError):
    """A path the job would write or read through is not private to this user."""


def _private_dir_problem(st: os.stat_result) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a link or a file)"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o}, which lets others in (want 700)"
    return None


def runtime_dir() -> Path:
    """This user's private runtime folder (see Note [Trusted folders]), created if needed.

    Raises:
        UnsafePath: the folder's path is taken by something this user does not own or
            that others may enter.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            if _private_dir_problem(os.lstat(xdg)) is None:
                return _make_private_dir(Path(xdg) / "distcompile")
        except OSError:
            pass
    return _make_private_dir(Path(tempfile.gettempdir()) / f"distcompile-{os.getuid()}")


def _make_private_dir(path: Path) -> Path:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    problem = _private_dir_problem(os.lstat(path))
    if problem is not None:
        raise UnsafePath(f"{path} {problem}: the job keeps private files there, so it must be a folder of this "
                         f"user's that no one else can enter. Remove it (another user may have made it first), or "
                         f"set XDG_RUNTIME_DIR to a private folder of yours.")
    return path


def write_private(path: str | os.PathLike, data: bytes, *, replace: bool = False) -> None:
    """Create ``path`` with ``data``, mode 0600, never through a link.

    Args:
        replace: False: the file must not exist (``FileExistsError`` otherwise, nothing
            written). True: write a fresh temporary file beside it the same way and move it
            over ``path`` (``os.replace`` replaces a link, never writes through it).
    """
    path = os.fspath(path)
    target = path + f".{os.getpid()}.tmp" if replace else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if replace:
            os.replace(target, path)
    except BaseException:
        if replace:
            try:
                os.unlink(target)
            except OSError:
                pass
        raise


def read_private(path: str | os.PathLike) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a link) of this user or root that
    no one else may write; None otherwise, and when it does not exist."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
            return None
        return f.read()


def read_secret(path: str | os.PathLike) -> bytes:
    """The bytes of ``path``, a file only this user may read: :func:`read_private`'s rules, and
    no permission bits for group or others at all (a secret others can read is no secret).

    Raises:
        UnsafePath: it is a link, not a regular file, another user's, or open to others.
        OSError: it cannot be opened.
    """
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise UnsafePath(f"{path} is owned by uid {st.st_uid}, not this user ({os.getuid()})")
        if st.st_mode & 0o077:
            raise UnsafePath(f"{path} has mode {stat.S_IMODE(st.st_mode):o}, which lets its group or others "
                             f"read or write it (want 600)")
        return f.read()


def unsafe_folder(path: str | os.PathLike) -> str | None:
    """Why ``path`` (a folder the job loads code from) is not safe to load from, or None.
    A folder that does not exist yet is judged by the folders above it (this job will make it)."""
    p = Path(os.path.abspath(path))
    own = True  # the folder itself (or, when missing, where it will be made)
    while True:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if p.parent == p:
                return None
            p, own = p.parent, False  # made by this job when missing: what is above it decides
            continue
        except OSError as e:
            return f"{p} cannot be checked ({e.strerror})"
        if st.st_uid not in (os.getuid(), 0):
            return f"{p} is owned by uid {st.st_uid}, another user, who can put files in it"
        writable = st.st_mode & 0o022
        sticky = st.st_mode & stat.S_ISVTX
        if writable and (own or not sticky):
            who = "everyone" if st.st_mode & 0o002 else "its group"
            return f"{p} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
        own = False
        if p.parent == p:
            return None
        p = p.parent
