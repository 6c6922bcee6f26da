"""What a checkpoint says about itself: the run that wrote it and the bytes it holds.

Note [Checkpoint identity and manifest]

Background
    A checkpoint folder is worth loading only when it continues *this* training
    trajectory and its bytes are the ones written. Without checks, a torchrun restart
    adopts whatever lies in ``train.checkpoint_dir``, a flipped byte loads silently, and
    a 4-layer checkpoint loads partially into a 2-layer model.

Algorithm
    - The *identity* is every config value that defines the trajectory, as dotted keys,
      plus the world size; its digest is the sha256 of the canonical JSON. Values that
      may change on resume are left out (:data:`RESUMABLE`: length, logging, cadence,
      timeouts, how the same math is compiled, ``train.lr``/``weight_decay``). Keys added
      later (:data:`ADDED_LATER`) are left out at their defaults, so older checkpoints
      keep their digest.
    - Under ``parallel=ddp`` and ``none`` every rank holds the whole model, so
      :func:`same_trajectory` ignores the world size: an elastic restart on fewer or
      more nodes continues. FSDP keeps it (resharding on load is not tested).
    - ``identity.json`` holds the fields, the digest and ``TORCHELASTIC_RUN_ID`` (outside
      the digest), so a restart adopts only checkpoints its own invocation wrote.
    - ``manifest.json``, written last by rank 0, holds every other file's size and
      checksum (Note [Checkpoint integrity]).

Notes
    A legacy checkpoint (written before identities existed) has neither file; one with
    only one of them is damaged (``missing_files``); ``launch.checkpoint.resume`` decides.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from ..config.schema import ConfigError, JobConfig, ParallelMode
from ..data.tokens import fingerprint
from .integrity import IDENTITY_FILE, MANIFEST_FILE, verify_manifest, write_json, write_manifest  # re-exported too

__all__ = [
    "RESUMABLE",
    "ADDED_LATER",
    "IDENTITY_FILE",
    "MANIFEST_FILE",
    "CheckpointError",
    "RunIdentity",
    "run_identity",
    "flat_config",
    "digest_of",
    "WHOLE_STATE_MODES",
    "same_trajectory",
    "resumes_on_any_world_size",
    "only_world_size_differs",
    "world_size_change",
    "write_identity",
    "read_identity",
    "differences",
    "write_manifest",
    "verify_manifest",
]

_VERSION = 1

# Dotted keys (or whole sections, ending in ".") that may differ between a checkpoint
# and the run resuming it. Everything else is the trajectory and must match.
RESUMABLE = frozenset({
    "train.steps", "train.log_interval", "train.checkpoint_dir", "train.checkpoint_every", "train.keep_last",
    "train.resume", "train.timeout_s", "train.no_recompile_after_warmup",
    "train.lr", "train.weight_decay",  # applied to the loaded optimizer, with a line saying so
    "compile.", "ddp.", "parallel.dist_backend",  # how the same math is compiled, bucketed, communicated
    "fsdp.shard_unit_mb", "fsdp.prefetch", "fsdp.reshard_after_forward", "fsdp.checkpointing",
    "fsdp.strategy", "fsdp.memory_budget_mb",  # traced and per_block save the same DTensors under the same names
    "diagnose", "diagnose_json",
    "log.", "profile.",  # what is written about the run, not what it computes
    "train.eval_every", "train.eval_batches",  # evaluation reads the model, it does not change it
    "train.allow_data_change",  # decides on the data fingerprint, kept beside the fields
})

# Trajectory keys added after checkpoints carried identities: left out of the identity at
# these values (their defaults, which behave as before the key existed), so that a
# checkpoint written before the key still resumes and keeps its digest.
ADDED_LATER = {"train.lr_schedule": "constant", "train.warmup_steps": 0, "train.min_lr": 0.0,
               "train.max_grad_norm": 0.0}


# Parallel modes whose checkpoints hold every parameter and optimizer state whole on each rank:
# they resume on any number of ranks.
WHOLE_STATE_MODES = (ParallelMode.DDP.value, ParallelMode.NONE.value)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed: foreign, corrupt or incompatible. A
    ConfigError, so the job prints it as one message and exits with code 2."""


def _resumable(key: str) -> bool:
    return key in RESUMABLE or any(p.endswith(".") and key.startswith(p) for p in RESUMABLE)


def _canonical(value: Any) -> Any:
    """JSON-safe and stable: enums as their value, tuples as lists, the rest as repr."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, str):
        return str(value)  # a str-valued Enum becomes its plain value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return repr(value)


@dataclass(frozen=True)
class RunIdentity:
    """The trajectory-defining config of a run (dotted key -> value), and torchrun's run id."""

    fields: dict[str, Any]
    run_id: str | None = None
    # The token file's fingerprint (data=tokens), beside the fields: not in the digest, so a
    # checkpoint written before fingerprints existed keeps its digest.
    data: str | None = None

    @property
    def digest(self) -> str:
        return digest_of(self.fields)


def flat_config(cfg: JobConfig) -> dict[str, Any]:
    """The whole config as dotted keys (``model.n_layer``, ``model.kwargs.dim``) to
    JSON-safe values; an empty dict stays one key."""
    def flat(tree: Any, prefix: str) -> dict[str, Any]:
        if isinstance(tree, dict) and tree:
            return {k: v for name, sub in tree.items() for k, v in flat(sub, f"{prefix}{name}.").items()}
        return {prefix[:-1]: _canonical(tree)}

    return flat(dataclasses.asdict(cfg), "")


def digest_of(fields: dict[str, Any]) -> str:
    """The sha256 of flat config ``fields`` (key order does not matter)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def run_identity(cfg: JobConfig, world_size: int, run_id: str | None = None) -> RunIdentity:
    """The identity of the run ``cfg`` on ``world_size`` ranks.

    Args:
        cfg: the job config.
        world_size: the number of ranks.
        run_id: torchrun's ``TORCHELASTIC_RUN_ID``; default: read from the environment.
    """
    fields = {"world_size": world_size, **{k: v for k, v in flat_config(cfg).items()
                                           if not _resumable(k) and not (k in ADDED_LATER and v == ADDED_LATER[k])}}
    data = fingerprint(cfg.data.path) if cfg.data.name == "tokens" and cfg.data.path else None
    return RunIdentity(fields, run_id if run_id is not None else os.environ.get("TORCHELASTIC_RUN_ID"), data)


def _without_world_size(identity: RunIdentity) -> str:
    return digest_of({k: v for k, v in identity.fields.items() if k != "world_size"})


def resumes_on_any_world_size(identity: RunIdentity) -> bool:
    """Whether the run's checkpoints hold the whole state on every rank (``parallel=ddp`` or
    ``none``), so that they resume on any number of ranks."""
    mode = identity.fields.get("parallel.name")
    # a value built in code may be the enum's repr (ParallelMode.DDP); composed configs hold "ddp"
    return isinstance(mode, str) and mode.rsplit(".", 1)[-1].lower() in WHOLE_STATE_MODES


def only_world_size_differs(saved: RunIdentity, now: RunIdentity) -> bool:
    """Whether the two identities differ, and in the world size alone."""
    return saved.digest != now.digest and _without_world_size(saved) == _without_world_size(now)


def same_trajectory(saved: RunIdentity, now: RunIdentity) -> bool:
    """Whether a checkpoint with identity ``saved`` continues the run ``now``: the same
    identity, or one that differs only in the world size where every rank holds the whole
    state (Note [Checkpoint identity and manifest])."""
    return saved.digest == now.digest or (resumes_on_any_world_size(now) and only_world_size_differs(saved, now))


def world_size_change(saved: RunIdentity, now: RunIdentity) -> str | None:
    """One line on resuming a checkpoint written by another number of ranks (None when the
    same): the global batch stays, the batch per rank changes."""
    before, after = saved.fields.get("world_size"), now.fields.get("world_size")
    if before == after or not isinstance(before, int) or not isinstance(after, int):
        return None
    batch = now.fields.get("train.batch_size")
    per_rank = (f": train.batch_size={batch} stays the global batch, {batch // after} per rank (was "
                f"{batch // before})" if isinstance(batch, int) else "")
    return (f"resuming a checkpoint written by {before} rank(s) on {after}{per_rank}; from here on each rank draws "
            f"other samples than a run that kept {before} rank(s) would")


def write_identity(folder: str, identity: RunIdentity) -> None:
    write_json(os.path.join(folder, IDENTITY_FILE),
                {"version": _VERSION, "digest": identity.digest, "run_id": identity.run_id, "fields": identity.fields,
                 "data": identity.data})


def read_identity(folder: str) -> RunIdentity | None:
    """The identity a checkpoint was written with; None for a legacy checkpoint (no file).

    Raises:
        CheckpointError: the file exists but is not an identity this code wrote.
    """
    path = os.path.join(folder, IDENTITY_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        identity = RunIdentity(dict(data["fields"]), data.get("run_id"), data.get("data"))
        ok = data["digest"] == identity.digest
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if not ok:
        raise CheckpointError(f"{path} does not match its own digest: the file was changed after it was written")
    return identity


def differences(saved: RunIdentity, now: RunIdentity) -> list[str]:
    """What differs between a checkpoint's identity and this run's, one phrase per key."""
    out = []
    for key in sorted(set(saved.fields) | set(now.fields)):
        a, b = saved.fields.get(key, "<unset>"), now.fields.get(key, "<unset>")
        if a != b:
            out.append(f"{key} {json.dumps(a)} in the checkpoint, {json.dumps(b)} now")
    return out
