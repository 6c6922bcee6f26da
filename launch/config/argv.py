"""The command line, checked before Hydra composes it, so that the mistakes Hydra would
answer in its own terms get one message in ours (exit 2, as every bad input).

Note [Command line before Hydra]

- A key that is neither a config group nor a field of the job (``modle=gpt_tiny``):
  Hydra suggests ``+modle=gpt_tiny``, which the job then refuses. Here: the key, the
  close valid names, and the lists of groups and keys.
- A field that a section does not have (``compile.split=false``): Hydra printed
  ``Could not override`` and the schema's class over several lines, without the valid
  fields. Here: the field, the close ones, and the section's fields.
- ``hydra.run.dir`` that cannot be made (under a read-only folder, or a file):
  Hydra raised a bare ``OSError`` that did not name the setting.
- A config file of one's own (``--config-dir``/``--config-path`` with
  ``--config-name``) that is not valid YAML: 75 lines of parser traceback. Here: the
  file, the line and column, and what the parser expected.
- ``--config-path DIR``: Hydra replaces the job's config directory with DIR, so the
  job's own groups (``model``, ``train``, ...) and ``config.yaml`` were not found
  (``Could not load 'config'``). The job's configs are added to the search path
  (``hydra.searchpath=['file://<the job's configs>']``), so a config of one's own can list them in its
  defaults, as Hydra documents for ``--config-dir``.
- ``-v`` (``--verbose``) is the shorthand of ``log.verbose=true``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Sequence

from .location import CONFIG_DIR, searchpath_override
from .schema import JobConfig

__all__ = ["check_argv", "hydra_flags", "GROUPS_DIR"]

GROUPS_DIR = CONFIG_DIR
_FLAGS = {"--config-path": "path", "-cp": "path", "--config-dir": "dir", "-cd": "dir", "--config-name": "name",
          "-cn": "name"}


def hydra_flags(argv: Sequence[str]) -> dict[str, str]:
    """Hydra's config flags in ``argv``: ``path`` (``--config-path``), ``dir`` (``--config-dir``) and
    ``name`` (``--config-name``), each as given (``--flag value`` or ``--flag=value``)."""
    out, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _FLAGS:
            if not eq and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            out[_FLAGS[name]] = value
        i += 1
    return out


def _known_names() -> tuple[list[str], list[str]]:
    groups = sorted(p.name for p in GROUPS_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    keys = sorted(f.name for f in dataclasses.fields(JobConfig))
    return groups, keys


def _unknown_key(arg: str, groups: list[str], keys: list[str]) -> str | None:
    key = arg.split("=", 1)[0]
    head = re.split(r"[./@]", key, maxsplit=1)[0]
    if head in keys and key[len(head):].startswith("."):
        return _unknown_field(arg, head, key[len(head) + 1:])
    if not head or head == "hydra" or head in groups or head in keys:
        return None
    close = difflib.get_close_matches(head, sorted(set(groups + keys)), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return (f"{arg!r}: {head!r} is neither a config group nor a setting of the job; {hint}The groups are "
            f"{', '.join(groups)}; the settings are {', '.join(keys)} (their fields as group.field=value, e.g. "
            "train.steps=100). A new key of one's own needs a leading +, and the job refuses keys it does not read.")


def _unknown_field(arg: str, head: str, rest: str) -> str | None:
    """``head.field...=value`` where the section ``head`` of the job has no such field."""
    section = next(f for f in dataclasses.fields(JobConfig) if f.name == head)
    if section.default_factory is dataclasses.MISSING or not dataclasses.is_dataclass(section.default_factory):
        return None
    name = re.split(r"[./@]", rest, maxsplit=1)[0]
    names = [f.name for f in dataclasses.fields(section.default_factory)]
    if name in names:
        return None
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f"Did you mean {' or '.join(f'{head}.{c}' for c in close)}? " if close else ""
    return (f"{arg!r}: {name!r} is not a setting of {head}, so nothing would read it. {hint}The settings of {head} "
            f"are {', '.join(names)} (as {head}.field=value).")


def _run_dir_problem(path: str) -> str | None:
    """Make the run directory now (Hydra would, a moment later), so that a folder that cannot
    be made is named with the setting."""
    try:
        os.makedirs(Path(path).expanduser(), exist_ok=True)
    except OSError as e:
        return (f"hydra.run.dir={path!r} cannot be created ({e.strerror or type(e).__name__}). Give a folder you "
                "can write to, e.g. hydra.run.dir=outputs/run1.")
    return None


def _yaml_problem(flags: dict[str, str]) -> str | None:
    folder, name = flags.get("dir") or flags.get("path"), flags.get("name")
    if not folder or not name:
        return None
    path = Path(folder) / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        return None
    import yaml

    try:
        yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        return (f"the config file {path} is not valid YAML{where}: {what}"
                + (f" ({context})" if context else "") + ". Fix the file and run again.")
    return None


def _verbose_flag(argv: list[str]) -> list[str]:
    """``-v``/``--verbose`` as the override ``log.verbose=true``, placed beside the other
    overrides (Hydra's parser takes them as one run of arguments)."""
    if not any(a in ("-v", "--verbose") for a in argv):
        return argv
    argv = [a for a in argv if a not in ("-v", "--verbose")]
    at = max((i + 1 for i, a in enumerate(argv) if "=" in a and not a.startswith("-")), default=len(argv))
    return [*argv[:at], "log.verbose=true", *argv[at:]]


def check_argv(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """``argv`` as Hydra should see it (with the job's configs on the search path after a
    ``--config-path``), and the one message for a mistake found in it, or None."""
    argv = _verbose_flag(list(argv))
    flags = hydra_flags(argv)
    groups, keys = _known_names()
    own = Path(flags.get("dir") or flags.get("path") or GROUPS_DIR)  # a config folder of one's own: its groups too
    if own.is_dir() and own != GROUPS_DIR:
        groups = sorted({*groups, *(p.name for p in own.iterdir() if p.is_dir() and not p.name.startswith("."))})
    overrides = [a for a in argv if "=" in a and not a.startswith(("-", "+", "~"))]
    for arg in overrides:
        problem = _unknown_key(arg, groups, keys)
        if problem:
            return argv, problem
        if arg.startswith("hydra.run.dir="):
            problem = _run_dir_problem(arg.split("=", 1)[1])
            if problem:
                return argv, problem
    problem = _yaml_problem(flags)
    if problem:
        return argv, problem
    if "path" in flags and not any(a.startswith("hydra.searchpath=") for a in argv):
        # next to the other overrides: Hydra's parser takes them as one run of arguments
        at = next((i + 1 for i, a in enumerate(argv) if a in overrides), len(argv))
        argv.insert(at, searchpath_override())
    return argv, None
