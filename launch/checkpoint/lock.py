"""One job per checkpoint folder: an exclusive OS lock held for the job's lifetime.

Note [Checkpoint folder lock]

Background
    Two jobs started on the same ``train.checkpoint_dir`` (a requeue while the
    first still runs, a copy-pasted command with another seed) overwrite each
    other's ``step_*.tmp`` folders and ``latest`` marker: one job's shards under
    the other's ``identity.json``, or a ``FileNotFoundError`` in the middle of a
    save. Both can exit 0.

Algorithm
    - Global rank 0 (the rank that publishes checkpoints) opens
      ``<checkpoint_dir>/.distcompile.lock`` and takes ``fcntl.flock(LOCK_EX |
      LOCK_NB)`` on it before any checkpoint is read or written, then writes who
      holds it (host, pid, start time, run id) into the file. The kernel drops a
      flock when its process ends, however it ends, so a killed job never leaves a
      lock behind; flock works on local disks and on NFSv4 (as a POSIX lock).
    - The outcome is broadcast to every rank: when the folder is held, every rank
      raises ``ConfigError`` (exit 2, one message naming the holder) before
      touching the folder.
    - A holder record not marked released (its job died without ending, say
      ``kill -9``) is taken over with a warning naming that job.
    - At the end of the job the record is marked released and the lock dropped.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
from typing import Iterator

import torch.distributed as dist

from ..config.schema import ConfigError, TrainConfig
from ..runtime.dist import DistEnv

log = logging.getLogger(__name__)

__all__ = ["checkpoint_folder_lock", "LOCK_NAME"]

LOCK_NAME = ".distcompile.lock"


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"host {h['host']}, pid {h['pid']}, started {h['started']}, run id {h['run_id']}"
    except (ValueError, KeyError, TypeError):
        return "a job that has not written its name yet"


def _take(path: str) -> tuple[int | None, str]:
    """Rank 0: the lock's file descriptor, or None and why the folder is busy."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)  # private: Note [Checkpoint integrity]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with open(path) as f:
            held = f.read()
        os.close(fd)
        return None, _holder(held)
    before = os.read(fd, 1 << 16).decode(errors="replace")
    with contextlib.suppress(ValueError, TypeError):
        if before and not json.loads(before).get("released", False):
            log.warning("checkpoint folder %s: taking over the lock of %s, which ended without releasing it (killed?)",
                        os.path.dirname(path), _holder(before))
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "run_id": os.environ.get("TORCHELASTIC_RUN_ID", "none"), "released": False}
    _write(fd, record)
    return fd, ""


def _write(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)


@contextlib.contextmanager
def checkpoint_folder_lock(t: TrainConfig, env: DistEnv) -> Iterator[None]:
    """Hold ``t.checkpoint_dir`` for the block (a job that saves or resumes checkpoints);
    raises ``ConfigError`` on every rank when another job holds it (see the Note)."""
    if t.checkpoint_every <= 0 and not t.resume:
        yield
        return
    path = os.path.join(t.checkpoint_dir, LOCK_NAME)
    fd, busy = _take(path) if env.rank == 0 else (None, "")
    if env.world_size > 1:
        shared = [busy]
        dist.broadcast_object_list(shared, src=0)
        busy = shared[0]
    if busy:
        raise ConfigError(
            f"train.checkpoint_dir={t.checkpoint_dir!r} is in use by another job ({busy}): two jobs writing one "
            "folder overwrite each other's checkpoints. Wait for that job to end (or stop it), or give this one "
            "another train.checkpoint_dir.")
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError, ValueError):
                record = json.loads(os.pread(fd, 1 << 16, 0).decode())
                _write(fd, {**record, "released": True})
            os.close(fd)  # drops the flock
