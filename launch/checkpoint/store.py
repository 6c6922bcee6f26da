"""Checkpoints of the main job with ``torch.distributed.checkpoint`` (DCP).

Note [Write, then publish]

Background
    A job can die at any instant, also half-way through writing a checkpoint. A resume
    must never load such a checkpoint.

Algorithm
    - Every rank writes its shards with ``dcp.save`` into ``step_NNNNNN.tmp``; state comes
      from ``get_state_dict``, so the same code serves DDP and FSDP.
    - Rank 0 adds ``train_state.json`` (the step is all the position there is: data, RNG
      and lr schedule are functions of it), ``identity.json`` and, last,
      ``manifest.json`` (Note [Checkpoint identity and manifest], Note [Checkpoint
      integrity]), then renames the folder to ``step_NNNNNN`` (atomic on POSIX) and
      replaces the ``latest`` marker. Barriers on either side keep ranks in step; the one
      after tells every rank whether rank 0 published.
    - Only a finite model is published (``launch.runtime.guard.model_finite``), and
      rotation beyond ``keep_last`` runs after publishing, so it never deletes the last
      finite checkpoint.
    - :func:`latest_checkpoint` returns only a published folder with ``.metadata`` and
      ``train_state.json``; ``*.tmp`` is never read. :func:`published_checkpoints` returns
      every published folder, so a resume names a damaged one and says why it is skipped.

Notes
    On several machines ``train.checkpoint_dir`` must be on a filesystem every node sees:
    rank 0 publishes what all ranks wrote.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn, optim
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..runtime.guard import model_finite, nonfinite_model
from .run_identity import RunIdentity, write_identity, write_manifest
from .space import CheckpointWriteError, agree, room_everywhere, write_error

log = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "latest_checkpoint", "published_checkpoints", "save_checkpoint", "load_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_LATEST = "latest"
_TRAIN_STATE = "train_state.json"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, _TRAIN_STATE))


def _published(root: str, *, complete: bool = True) -> list[CheckpointInfo]:
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)) and (not complete or _complete(os.path.join(root, name))):
            found.append(CheckpointInfo(int(m.group(1)), os.path.join(root, name)))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(root: str) -> CheckpointInfo | None:
    """The newest complete, published checkpoint under ``root``, or None.

    The ``latest`` marker is trusted when it names a complete checkpoint; a job
    killed between publishing a folder and updating the marker leaves a newer
    complete folder, which is found by scanning.
    """
    published = _published(root)
    marker = os.path.join(root, _LATEST)
    if os.path.isfile(marker):
        with open(marker) as f:
            name = f.read().strip()
        m = _STEP_DIR.match(name)
        if m and _complete(os.path.join(root, name)):
            newest = published[-1] if published else None
            if newest is None or newest.step <= int(m.group(1)):
                return CheckpointInfo(int(m.group(1)), os.path.join(root, name))
    return published[-1] if published else None


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: optim.Optimizer, *, keep_last: int = 2,
                    identity: RunIdentity | None = None, train_state: dict | None = None) -> str:
    """Save model + optimizer state after ``step`` steps (collective: every rank calls it).

    Args:
        root: ``train.checkpoint_dir``.
        step: the number of optimizer steps taken.
        model: the DDP (or FSDP, or plain) module, not its compiled wrapper.
        optimizer: the optimizer over ``model``'s parameters.
        keep_last: how many published checkpoints to keep.
        identity: the run's identity, written as ``identity.json`` (Note [Checkpoint
            identity and manifest] in ``launch.checkpoint.run_identity``).
        train_state: more of the loop's state for ``train_state.json``, next to the step
            (the lr schedule's: ``launch.step.schedule``).

    Returns:
        The published folder.

    Raises:
        NonFinite: a parameter or buffer is inf or NaN on some rank; nothing was written.
        CheckpointWriteError: too little room, or the write failed; the partial folder is
            removed (Note [Checkpoint write errors] in ``launch.checkpoint.space``).
    """
    latest = latest_checkpoint(root)
    last = latest.path if latest is not None else None
    if not model_finite(model):
        raise nonfinite_model(step, last)
    rank = dist.get_rank()
    device = next(model.parameters()).device
    name = f"step_{step:06d}"
    tmp, final = os.path.join(root, name + ".tmp"), os.path.join(root, name)

    def prepare() -> None:
        os.makedirs(root, mode=0o700, exist_ok=True)  # private whatever the umask: Note [Checkpoint integrity]
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a job killed while writing

    _on_rank_0(prepare, root, step, last, tmp, device)  # every rank waits for it
    room_everywhere(root, step, last, device)  # Note [Checkpoint write errors]

    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        dist.barrier()  # every rank's shards are written
    except (OSError, RuntimeError, dcp.CheckpointException) as e:  # DCP's is a BaseException, on every rank
        error = write_error(root, step, last, e, tmp)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise
        raise error from e

    def publish() -> None:
        _write_atomic(os.path.join(tmp, _TRAIN_STATE), json.dumps({**(train_state or {}), "step": step}))
        if identity is not None:
            write_identity(tmp, identity)
        write_manifest(tmp)  # last: the checksum of every file above
        if os.path.isdir(final):  # published earlier by a run that then died before `latest` moved on
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomic(os.path.join(root, _LATEST), name)
        for old in _published(root)[:-keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)

    _on_rank_0(publish, root, step, last, tmp, device)  # nobody reads `latest` before it is published
    log.debug("checkpoint saved: %s", final)  # the loop prints "checkpoint: PATH" once
    return final


def _on_rank_0(work, root: str, step: int, last: str | None, tmp: str, device) -> None:
    """Run ``work`` on rank 0 while the others wait; every rank raises when it failed
    (Note [Checkpoint write errors]): rank 0 its one line (or the error itself, for a bug), the
    others a line pointing at rank 0's."""
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            work()
        except Exception as e:  # noqa: BLE001 -- told to every rank below, then re-raised
            error = e
    if agree(error is None, device):
        return
    if dist.get_rank() == 0:
        line = write_error(root, step, last, error, tmp) if isinstance(error, OSError) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if line is None:
            raise error
        raise line from error
    raise CheckpointWriteError(f"checkpoint step {step} could not be written to {root}: rank 0 failed (its line "
                               "says why)")


def load_checkpoint(info: CheckpointInfo, model: nn.Module, optimizer: optim.Optimizer) -> int:
    """Load a checkpoint saved by :func:`save_checkpoint` in place; return its step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=info.path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(info.path, _TRAIN_STATE)) as f:
        step = int(json.load(f)["step"])
    log.info("resumed from %s (step %d)", info.path, step)
    return step


def published_checkpoints(root: str) -> list[CheckpointInfo]:
    """Every published checkpoint folder under ``root``, oldest first, damaged ones included
    (``launch.checkpoint.integrity.missing_files`` tells them; ``*.tmp`` folders are not published)."""
    return _published(root, complete=False)
