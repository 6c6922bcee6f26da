"""Room for a checkpoint, and one line when a checkpoint cannot be written.

Note [Checkpoint write errors]

Background
    A checkpoint written to a full disk fails deep in the writer, on every rank, with
    tracebacks that may not even say "No space left on device", leaves a partial
    ``step_*.tmp`` on the full disk, and says nothing of the last good checkpoint.

Algorithm
    - Before a save, rank 0 compares the folder's free space with the newest published
      checkpoint's size (the next is about as large), and every rank agrees with one
      all-reduce: too little room stops every rank before anything is written.
    - A save that fails anyway has its partial ``.tmp`` removed, and every rank raises
      :class:`CheckpointWriteError`: one line with what failed, the last good
      checkpoint and the room needed, exit code :data:`EXIT_CHECKPOINT_WRITE`.
    - A folder that cannot be written for another reason (read-only, no permission,
      vanished, a file) is not a full disk: its line gives the errno and path and says
      to make it writable or choose another. Only DCP's inner error is told.
    - Rank 0 alone makes and publishes the folder; its failure is agreed on with one
      all-reduce (:func:`agree`), so every rank stops with the same line.
    - Rotation deletes the oldest checkpoint after publishing the new one, so the
      folder needs room for ``keep_last`` checkpoints plus one.
"""

from __future__ import annotations

import errno
import os
import shutil

import torch
import torch.distributed as dist

__all__ = ["CheckpointWriteError", "EXIT_CHECKPOINT_WRITE", "agree", "folder_bytes", "room_everywhere", "write_error"]

EXIT_CHECKPOINT_WRITE = 4  # a checkpoint could not be written (disk full, I/O error): the last good one is named
MARGIN = 1.05  # the next checkpoint's room: the last one's size and 5%


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message is one line (rank 0 prints it)."""

    exit_code = EXIT_CHECKPOINT_WRITE


def folder_bytes(path: str | None) -> int:
    if path is None:
        return 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def agree(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce; a barrier too)."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def room_everywhere(root: str, step: int, last: str | None, device: torch.device) -> None:
    """Raise :class:`CheckpointWriteError` on every rank when rank 0 sees less free space under
    ``root`` than the newest checkpoint ``last`` took (nothing is written then)."""
    need = folder_bytes(last) * MARGIN if dist.get_rank() == 0 else 0
    free = shutil.disk_usage(root).free if dist.get_rank() == 0 else 0
    if not agree(free >= need, device):
        raise CheckpointWriteError(
            f"checkpoint step {step} was not written: {root} has {_mib(free)} free and the last checkpoint "
            f"({last}) took {_mib(need / MARGIN)}; the last good checkpoint is {last}. Free "
            f"{_mib(need - free)} or more (the folder holds train.keep_last checkpoints plus the one being "
            "written), or point train.checkpoint_dir elsewhere and resume from it.")


# What an I/O failure inside DCP's writers says once DCP has wrapped it (CheckpointException).
_IO_SIGNS = ("No space left on device", "Disk quota exceeded", "Input/output error", "Read-only file system",
             "Permission denied", "unexpected pos", "[Errno")

# A folder that can no longer be written (not a full disk): what happened, in words.
_FOLDER_ERRNOS = {
    errno.EROFS: "its filesystem turned read-only",
    errno.EACCES: "the job may no longer write there",
    errno.EPERM: "the job may no longer write there",
    errno.ENOENT: "the folder vanished",
    errno.ENOTDIR: "the folder was replaced by a file",
    errno.EEXIST: "a file stands where a folder should be",
}


def _causes(e: BaseException) -> list[BaseException]:
    """``e``, what DCP wrapped in it (its ``failures``: rank -> (exception, stack) or a wrapper), and
    what it was raised from."""
    failures = getattr(e, "failures", None) or {}
    wrapped = [f[0] if isinstance(f, tuple) and f else getattr(f, "exc", f) for f in failures.values()]
    return [x for x in (*wrapped, e, e.__cause__, e.__context__) if isinstance(x, BaseException)]


def _errno_text(x: OSError, partial: str) -> str:
    """``[Errno 30] Read-only file system: 'PATH'``: the errno, its words and the path (``partial``
    when the error names none)."""
    return f"[Errno {x.errno}] {x.strerror or os.strerror(x.errno)}: {x.filename or partial!r}"


def write_error(root: str, step: int, last: str | None, e: BaseException, partial: str
                ) -> CheckpointWriteError | None:
    """The one line for a save of ``step`` into ``partial`` (not yet removed) that raised ``e``;
    None when ``e`` is not a write failure (a bug keeps its traceback)."""
    causes = _causes(e)
    oserror = next((x for x in causes if isinstance(x, OSError) and x.errno), None)
    if oserror is None and not any(sign in str(x) for x in causes for sign in _IO_SIGNS):
        return None
    free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
    full = any("No space left on device" in str(x) or getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
               for x in causes) or (oserror is None and free < 2**20)
    kept = (f"The last good checkpoint is {last}" if last and os.path.isdir(last)
            else f"No checkpoint of this run is left in {root}")
    if full:
        need = folder_bytes(last) * MARGIN
        room = f"it needs about {_mib(need)} free" if last else "it needs more than was written"
        return CheckpointWriteError(
            f"checkpoint step {step} could not be written to {root} (the disk is full: {_mib(free)} free with "
            f"{_mib(folder_bytes(partial))} written); its partial folder was removed. {kept}; {room}. Free space "
            "or point train.checkpoint_dir elsewhere, then resume with train.resume=true.")
    if oserror is not None:
        what = _FOLDER_ERRNOS.get(oserror.errno, "the write failed")
        return CheckpointWriteError(
            f"checkpoint step {step} could not be written to {root}: {_errno_text(oserror, partial)} ({what}); its "
            f"partial folder was removed. {kept}. Make {root} writable again or point train.checkpoint_dir at a "
            "folder you can write, then resume with train.resume=true.")
    first = next((line.strip() for line in str(causes[0]).splitlines() if line.strip()), type(causes[0]).__name__)
    return CheckpointWriteError(
        f"checkpoint step {step} could not be written to {root} ({first[:200]}); its partial folder was removed. "
        f"{kept}. Check the folder's filesystem or point train.checkpoint_dir elsewhere, then resume with "
        "train.resume=true.")
