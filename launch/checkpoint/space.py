"""Room for a checkpoint, and one line when a checkpoint cannot be written.

Note [Checkpoint write errors]

Background
    A checkpoint folder on a full disk failed with up to 195 lines of tracebacks from
    every rank (``[enforce fail at inline_container.cc:672] unexpected pos``, "No space
    left on device" missing in one try of three), left a partial ``step_*.tmp`` on
    the full disk, and said nothing of which checkpoint was the last good one.

Algorithm
    - Before a save, rank 0 compares the free space of the folder's filesystem with
      the size of the newest published checkpoint (the next one is about as large),
      and every rank agrees on the answer with one all-reduce: too little room stops
      every rank before anything is written.
    - A save that fails anyway (an I/O error, another writer filling the disk) has its
      partial ``.tmp`` folder removed, and every rank raises
      :class:`CheckpointWriteError`: one line with what failed, the last good
      checkpoint and the room needed, exit code :data:`EXIT_CHECKPOINT_WRITE`.
    - Rotation deletes the oldest checkpoint after the new one is published, so the
      folder needs room for ``keep_last`` checkpoints plus the one being written
      (``keep_last=1``: two checkpoints' room).
"""

from __future__ import annotations

import errno
import os
import shutil

import torch
import torch.distributed as dist

__all__ = ["CheckpointWriteError", "EXIT_CHECKPOINT_WRITE", "folder_bytes", "room_everywhere", "write_error"]

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


def _agree(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def room_everywhere(root: str, step: int, last: str | None, device: torch.device) -> None:
    """Raise :class:`CheckpointWriteError` on every rank when rank 0 sees less free space under
    ``root`` than the newest checkpoint ``last`` took (nothing is written then)."""
    need = folder_bytes(last) * MARGIN if dist.get_rank() == 0 else 0
    free = shutil.disk_usage(root).free if dist.get_rank() == 0 else 0
    if not _agree(free >= need, device):
        raise CheckpointWriteError(
            f"checkpoint step {step} was not written: {root} has {_mib(free)} free and the last checkpoint "
            f"({last}) took {_mib(need / MARGIN)}; the last good checkpoint is {last}. Free "
            f"{_mib(need - free)} or more (the folder holds train.keep_last checkpoints plus the one being "
            "written), or point train.checkpoint_dir elsewhere and resume from it.")


# What an I/O failure inside DCP's writers says once DCP has wrapped it (CheckpointException).
_IO_SIGNS = ("No space left on device", "Disk quota exceeded", "Input/output error", "Read-only file system",
             "Permission denied", "unexpected pos", "[Errno")


def write_error(root: str, step: int, last: str | None, e: BaseException, partial: str
                ) -> CheckpointWriteError | None:
    """The one line for a save of ``step`` into ``partial`` (not yet removed) that raised ``e``;
    None when ``e`` is not a write failure (a bug keeps its traceback)."""
    text = str(e)
    if not isinstance(e, OSError) and not any(sign in text for sign in _IO_SIGNS):
        return None
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (exc, traceback)
    cause = next((getattr(f, "exc", f) for f in failures.values()), e) if failures else e
    free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
    full = free < 2**20 or any("No space left on device" in str(x) or getattr(x, "errno", None) == errno.ENOSPC
                               for x in (e, cause, e.__cause__, e.__context__))
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
    reason = f"the disk is full: {_mib(free)} free with {_mib(folder_bytes(partial))} written" if full else first
    need = folder_bytes(last) * MARGIN
    room = f"it needs about {_mib(need)} free" if last else "it needs more than was written"
    return CheckpointWriteError(
        f"checkpoint step {step} could not be written to {root} ({reason}); its partial folder was removed. The last "
        f"good checkpoint is {last or 'none (this run saved none yet)'}; {room}. Free space or point "
        "train.checkpoint_dir elsewhere, then resume with train.resume=true.")
