"""Which checkpoint a run resumes, and loading it only once it is known to fit.

Note [Resume policy]

Background
    ``train.checkpoint_dir`` can hold checkpoints of another run, of this config
    under another torchrun invocation, damaged ones, or legacy ones written before
    checkpoints carried an identity (Note [Checkpoint identity and manifest]).

Algorithm
    :func:`plan_resume` reads only small files, so the checks run it before any
    process group starts (a refusal exits 2) and :func:`resume` again at load time.
    - Fresh run: nothing is loaded; a folder holding checkpoints is refused when this
      run would write there too.
    - ``train.resume=true``: the newest checkpoint must have this run's identity
      (else one message lists what differs); older ones of it are fall-backs. A
      legacy checkpoint loads with a warning: the user asked, and shapes are checked.
    - A published checkpoint missing a file is damaged: named, skipped, never taken
      for legacy (Note [Checkpoint integrity]).
    - torchrun restart without ``train.resume``: only checkpoints of this identity and
      this invocation (``TORCHELASTIC_RUN_ID``) are this run's.
    - The world size may change under ``parallel=ddp`` and ``none`` (one line says so);
      under FSDP the run is refused with what to do.
    Rank 0 alone verifies candidates newest first against their manifests and
    broadcasts the first intact one: the ranks share the files, and one reader costs
    1/world_size of all reading. Names and shapes are compared before loading, so a
    checkpoint never loads partially; ``train.lr`` and ``train.weight_decay`` come from
    the config, with one line when they differ.

Notes
    The other ranks wait in a broadcast bounded by ``train.timeout_s`` while rank 0
    checksums, so the checkpoint must be read within it (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn, optim

from ..config.schema import ConfigError, TrainConfig
from ..runtime.dist import print0
from ..step.schedule import Schedule, resume_note
from .integrity import missing_files
from .run_identity import (CheckpointError, RunIdentity, differences, only_world_size_differs, read_identity,
                           resumes_on_any_world_size, same_trajectory, verify_manifest, world_size_change)
from .store import CheckpointInfo, load_checkpoint, published_checkpoints

__all__ = ["ResumePlan", "plan_resume", "resume"]


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoints to try, newest first (load the first intact one), whether they
    are legacy (no identity, no manifest), and warnings for rank 0 to print."""

    candidates: tuple[CheckpointInfo, ...] = ()
    legacy: bool = False
    notes: tuple[str, ...] = ()


def plan_resume(t: TrainConfig, now: RunIdentity, *, restarted: bool) -> ResumePlan:
    """Choose the checkpoints this run may resume (Note [Resume policy]); reads small files only.

    Raises:
        ConfigError: the folder cannot be used as asked, with what differs and how to fix it.
    """
    published = published_checkpoints(t.checkpoint_dir)[::-1]
    if not (t.resume or restarted):
        if published and t.checkpoint_every > 0:
            raise ConfigError(
                f"train.checkpoint_dir={t.checkpoint_dir!r} already holds checkpoints of another run (latest: step "
                f"{published[0].step}) and train.resume=false: writing new ones there would mix two runs. Continue "
                "it with train.resume=true, pick another train.checkpoint_dir, or delete the folder."
            )
        return ResumePlan()
    if t.resume and not published and not restarted:
        raise ConfigError(
            f"train.resume=true but there is no checkpoint in train.checkpoint_dir={t.checkpoint_dir!r} "
            f"(looked for {os.path.join(t.checkpoint_dir, 'latest')}). Point train.checkpoint_dir at the "
            "folder of the run to continue, or set train.resume=false to start fresh."
        )
    plan = _explicit(t, published, now) if t.resume else _restart(t, published, now)
    if plan.candidates and plan.candidates[0].step >= t.steps:
        raise ConfigError(
            f"train.resume=true but the latest checkpoint ({plan.candidates[0].path}) is already at step "
            f"{plan.candidates[0].step} >= train.steps={t.steps}: there is nothing left to train. Raise train.steps "
            "to train further."
        )
    return plan


def _identities(published: list[CheckpointInfo], notes: list[str]) -> list[tuple[CheckpointInfo, RunIdentity | None]]:
    """Each checkpoint with its identity (None: legacy, Note [Checkpoint integrity]); one that lacks
    a file or whose identity.json is damaged is left out, with a note naming it and why."""
    out = []
    for info in published:
        try:
            if problem := missing_files(info.path):
                raise CheckpointError(problem)
            out.append((info, read_identity(info.path)))
        except CheckpointError as e:
            notes.append(f"skipping checkpoint {info.path}: {e}; a damaged checkpoint is never loaded (delete the "
                         "folder to silence this)")
    return out


def _explicit(t: TrainConfig, published: list[CheckpointInfo], now: RunIdentity) -> ResumePlan:
    notes: list[str] = []
    found = _identities(published, notes)
    if not found:
        raise CheckpointError(
            f"train.resume=true but no checkpoint in train.checkpoint_dir={t.checkpoint_dir!r} can be read: "
            + "; ".join(notes) + ". Delete the damaged folders, or start fresh with train.resume=false and another "
            "train.checkpoint_dir."
        )
    newest, saved = found[0]
    if saved is None:
        return ResumePlan((newest,), True, (
            *notes,
            f"checkpoint {newest.path} was written before checkpoints carried an identity and checksums: "
            "resuming it as asked (train.resume=true) without checking that it belongs to this config or is "
            "intact; only parameter names and shapes are checked.",
        ))
    if only_world_size_differs(saved, now) and not resumes_on_any_world_size(now):
        raise _sharded_elsewhere("train.resume=true", now, saved, t.checkpoint_dir)
    if not same_trajectory(saved, now):
        any_size = resumes_on_any_world_size(now)  # then the world size may differ: not named
        diffs = [d for d in differences(saved, now) if not (any_size and d.startswith("world_size "))]
        raise CheckpointError(
            f"train.resume=true but the latest checkpoint {newest.path} was written by a run with another "
            f"config: {'; '.join(diffs)}. Resuming it would continue another training "
            "trajectory. Resume with the checkpoint's values, or start fresh with train.resume=false and another "
            "train.checkpoint_dir. (May change on resume: train.steps, train.lr, train.weight_decay, logging, "
            "checkpoint cadence, timeouts, compile.*, ddp.*, and under parallel=ddp or none the number of ranks.)"
        )
    if saved.data is not None and now.data is not None and saved.data != now.data:
        changed = (f"data.path={now.fields.get('data.path')!r} changed since checkpoint {newest.path} was written "
                   f"(then {saved.data}, now {now.data})")
        if not t.allow_data_change:
            raise CheckpointError(
                f"train.resume=true but {changed}: the resumed run would train on other tokens than the run it "
                "continues. Restore the file, or set train.allow_data_change=true to resume on the new one.")
        notes.append(f"{changed}; resuming on the new file as asked (train.allow_data_change=true)")
    if change := world_size_change(saved, now):
        notes.append(change)
    return ResumePlan(tuple(i for i, s in found if s is not None and same_trajectory(s, now)), False, tuple(notes))


def _restart(t: TrainConfig, published: list[CheckpointInfo], now: RunIdentity) -> ResumePlan:
    notes: list[str] = []
    found = _identities(published, notes)
    own = tuple(i for i, s in found if s is not None and same_trajectory(s, now) and now.run_id is not None
                and s.run_id == now.run_id)
    others = [i for i, s in found if i not in own]
    mine = [s for _, s in found if s is not None and now.run_id is not None and s.run_id == now.run_id]
    if mine and only_world_size_differs(mine[0], now) and not resumes_on_any_world_size(now):
        raise _sharded_elsewhere("torchrun restarted this run (an elastic restart)", now, mine[0], t.checkpoint_dir)
    if others and not own and t.checkpoint_every > 0:
        raise ConfigError(
            f"torchrun restarted this run (TORCHELASTIC_RESTART_COUNT > 0), and train.checkpoint_dir="
            f"{t.checkpoint_dir!r} holds checkpoints of another run (latest: {others[0].path}) but none of this "
            "one: resuming them would train on another run's weights, and writing new ones there would mix two "
            "runs. Pick another train.checkpoint_dir, delete the folder, or continue that run with train.resume=true."
        )
    if others:
        notes.append(f"torchrun restart: ignoring {len(others)} checkpoint(s) in {t.checkpoint_dir} written by "
                     f"another run or torchrun invocation (latest: {others[0].path}); train.resume=true adopts a "
                     "checkpoint of the same config.")
    saved = next((s for i, s in found if i is own[0]), None) if own else None
    if saved is not None and (change := world_size_change(saved, now)):
        notes.append(f"torchrun restart (elastic): {change}")
    return ResumePlan(own, False, tuple(notes))


def _sharded_elsewhere(what: str, now: RunIdentity, saved: RunIdentity, folder: str) -> ConfigError:
    """The refusal to resume FSDP's checkpoint on another number of ranks than wrote it."""
    before, after = saved.fields.get("world_size"), now.fields.get("world_size")
    return ConfigError(
        f"{what} on {after} rank(s), but the latest checkpoint of this run in {folder!r} was written by {before}: "
        f"parallel={now.fields.get('parallel.name')} saves distributed tensors laid out for the ranks that wrote "
        "them, and loading them on another number (resharding) is not tested here. Relaunch on "
        f"{before} rank(s) to continue (torchrun --nnodes {before}:{before} with one rank per node, or "
        f"--nproc-per-node {before}), or start over with another train.checkpoint_dir; for an elastic job that may "
        "lose nodes, use parallel=ddp, whose checkpoints resume on any number of ranks."
    )


def _intact(info: CheckpointInfo, legacy: bool) -> str | None:
    """What is wrong with the files of ``info``, or None (rank 0 reads them)."""
    problem = None if legacy else verify_manifest(info.path)
    if problem is None:
        try:
            with open(os.path.join(info.path, "train_state.json")) as f:
                step = int(json.load(f)["step"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"its train_state.json cannot be read ({type(e).__name__}: {e})"
        if step != info.step:
            return f"its train_state.json says step {step}, its name step {info.step}"
    return problem


def _check_shapes(info: CheckpointInfo, model: nn.Module, optimizer: optim.Optimizer) -> None:
    """Refuse a checkpoint whose model entries are not exactly the model's (names and shapes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, _ = get_state_dict(model, optimizer)
    meta = FileSystemReader(info.path).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: list(m.size) for k, m in meta.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    now = {k: list(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    problems = [f"{k} only in the checkpoint" for k in sorted(saved.keys() - now.keys())]
    problems += [f"{k} only in the model" for k in sorted(now.keys() - saved.keys())]
    problems += [f"{k} has shape {saved[k]} in the checkpoint, {now[k]} in the model"
                 for k in sorted(saved.keys() & now.keys()) if saved[k] != now[k]]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {info.path} does not fit the model: {'; '.join(problems[:5])}{more}. It was written for "
            "another model; resume with that checkpoint's model.* settings, or start fresh with "
            "train.resume=false and another train.checkpoint_dir."
        )


def _apply_hyperparameters(t: TrainConfig, optimizer: optim.Optimizer, step: int) -> str | None:
    """Set train.lr and train.weight_decay on every param group; say what changed."""
    changed = []
    for key, value in (("lr", t.lr), ("weight_decay", t.weight_decay)):
        for group in optimizer.param_groups:
            old = float(group[key])
            if old != value:
                changed.append(f"train.{key}={value:g} (the checkpoint's optimizer had {old:g})")
            if isinstance(group[key], torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = value
    if not changed:
        return None
    return f"resume: {', '.join(dict.fromkeys(changed))} applies from step {step + 1}"


def resume(t: TrainConfig, now: RunIdentity, model: nn.Module, optimizer: optim.Optimizer, *,
           restarted: bool, schedule: Schedule | None = None) -> CheckpointInfo | None:
    """Load the checkpoint :func:`plan_resume` picks, verified first (collective). With the
    run's lr ``schedule``, a line says when it differs from the checkpoint's (``launch.step.schedule``).

    Returns:
        The checkpoint loaded, or None to start at step 0.

    Raises:
        CheckpointError: every candidate is corrupt, or the checkpoint does not fit the model.
    """
    plan = plan_resume(t, now, restarted=restarted)
    verdict: list = [None, list(plan.notes)]
    if dist.get_rank() == 0:
        for i, info in enumerate(plan.candidates):
            problem = _intact(info, plan.legacy)
            if problem is None:
                verdict[0] = i
                break
            verdict[1].append(f"checkpoint {info.path} is corrupt ({problem}): "
                              + ("falling back to an earlier one" if i + 1 < len(plan.candidates) else "skipped"))
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    index, notes = verdict
    for note in notes:
        print0(f"warning: {note}")
    if index is None:
        if not plan.candidates:
            return None
        raise CheckpointError(
            f"no intact checkpoint to resume in train.checkpoint_dir={t.checkpoint_dir!r}: "
            f"{'; '.join(n for n in notes if 'corrupt' in n)}. Delete the corrupt folders to resume from an "
            "older checkpoint elsewhere, or start fresh with train.resume=false and another train.checkpoint_dir."
        )
    info = plan.candidates[index]
    _check_shapes(info, model, optimizer)
    step = load_checkpoint(info, model, optimizer)
    for line in (_apply_hyperparameters(t, optimizer, step), schedule and resume_note(info.path, step, schedule)):
        if line:
            print0(line)
    return CheckpointInfo(step, info.path)
