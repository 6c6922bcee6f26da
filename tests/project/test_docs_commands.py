"""Every ``launch.train`` and ``distcompile-train`` command the README and the docs show, as a
user would type it.

Each command line in a fenced block is parsed as the shell would (``\\`` continuations
joined, comments dropped, torchrun's ``--nproc-per-node`` and ``--nnodes`` giving the
world size) and run through the launcher's own shell in this process
(``launch.config.shell.run_cli``: the argv check, Hydra's composition, the typed
config) into the job's validation, for that world size, instead of training; a
``distcompile-train`` command runs through ``launch.launcher.launch`` up to the point where
it would start the ranks. Where the
page shows the command failing (``error: ...`` and the exit code after it) the same
message and code must come back; otherwise it must pass validation. The outputs the
pages show were copied from real runs; this keeps the commands themselves true as the
settings change. torchrun exits 1 when a worker fails, whatever the worker's code, so a
failing torchrun command shows 1 where its worker exits 2; ``distcompile-train`` exits 2.

A command that resumes (``train.resume=true``) follows a run that wrote the checkpoint;
it is validated with ``train.resume=false``, and with ``true`` the only refusal allowed is
the missing checkpoint (resuming itself: ``tests/launch/test_launch_reliability_ckpt.py``).

Left out, and why: ``-m`` (multirun) through ``hydra/launcher=slurm``, which needs the
``slurm`` extra and a Slurm cluster.
"""

from __future__ import annotations

import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import launch.launcher as launcher
from launch import prepare_data
from launch.checks.validate import validate
from launch.config.shell import run_cli
from launch.runtime.elastic import split_argv

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# a shell line that runs the job: python or torchrun first (after a prompt, variables or `;`)
COMMAND = re.compile(r"(^|; )(\$ )?(\w+=\S+ )*((python|torchrun)\b.*-m launch\.train\b|distcompile-train\b)")


@dataclass(frozen=True)
class Shown:
    """One command as a page shows it, and the failure the page shows after it (if any)."""

    where: str
    line: str
    overrides: tuple[str, ...]
    world_size: int
    error: str | None
    code: int | None
    launcher: bool = False  # distcompile-train: the launcher checks in its own process


def _world_size(tokens: list[str]) -> int:
    if tokens[0] != "torchrun":
        return 1

    def flag(name: str, default: str) -> str:
        for i, t in enumerate(tokens):
            if t == name:
                return tokens[i + 1]
            if t.startswith(name + "="):
                return t.split("=", 1)[1]
        return default
    return int(flag("--nproc-per-node", "1")) * int(flag("--nnodes", "1").split(":")[-1])


def _parse(where: str, line: str, output: list[str]) -> Shown | None:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    tokens = list(lexer)
    start = next(i for i in range(len(tokens)) if tokens[i] in ("python", "torchrun", "distcompile-train"))
    tokens = tokens[start:]
    tokens = tokens[:tokens.index(";")] if ";" in tokens else tokens
    launcher_line = tokens[0] == "distcompile-train"
    if launcher_line:
        flags, args = split_argv(tokens[1:])
        tokens, at = ["torchrun", *flags], len(flags) + 1
    else:  # torchrun ... -m launch.train, or torchrun ... --no-python distcompile-train (the worker entry point)
        at = tokens.index("launch.train") if "launch.train" in tokens else tokens.index("distcompile-train")
        args = tokens[at + 1:]
    if "-m" in args:  # a multirun through a Hydra launcher plugin (see the module docstring)
        return None
    shown = [o for o in output if o.strip() and not o.startswith("(")]
    error = shown[0] if shown and shown[0].startswith("error:") else None
    code = int(shown[-1]) if error and "echo $?" in line and shown[-1].strip().isdigit() else None
    return Shown(where, line, tuple(args), _world_size(tokens[:at]), error, code, launcher_line)


def shown_commands() -> list[Shown]:
    found = []
    for page in SOURCES:
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), re.S | re.M):
            lines = re.sub(r"\\\n\s*", "", block).splitlines()
            for i, line in enumerate(lines):
                if not COMMAND.search(line):
                    continue
                prompt = line.startswith("$ ")
                output = []
                for later in lines[i + 1:] if prompt else []:
                    if later.startswith("$ "):
                        break
                    output.append(later)
                parsed = _parse(f"{page.relative_to(REPO)}", line.removeprefix("$ "), output)
                if parsed:
                    found.append(parsed)
    return found


COMMANDS = shown_commands()


def test_the_pages_show_the_commands_this_test_checks():
    where = {c.where for c in COMMANDS}
    assert {"README.md", "docs/main-job.md", "docs/reliability.md", "docs/training.md", "docs/gpu.md"} <= where
    assert sum(c.error is not None for c in COMMANDS) >= 6
    assert sum(c.launcher and c.error is not None for c in COMMANDS) >= 4  # the launcher's own refusals
    assert max(c.world_size for c in COMMANDS) == 16  # the two-node example: 2 x 8


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A folder prepared as the pages' earlier commands leave it: ``input.txt`` (a copy of
    the README, as in docs/main-job.md), ``data/input.bin`` from ``launch.prepare_data``,
    ``data/cut.bin``, its first 1001 bytes (``head -c 1001``), and ``data/input32.bin``, its
    ids written as uint32 with no sidecar."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "README.md", tmp_path / "input.txt")
    assert prepare_data.main(["input.txt", "data/input.bin"]) == 0
    (tmp_path / "data" / "cut.bin").write_bytes((tmp_path / "data" / "input.bin").read_bytes()[:1001])
    np.fromfile(tmp_path / "data" / "input.bin", np.uint16).astype(np.uint32).tofile(tmp_path / "data" / "input32.bin")
    return tmp_path


# what depends on the machine the page's output came from: the memory a rank has
_MACHINE = (re.compile(r"a rank here has about [\d,.]+ GiB \(MemAvailable [\d,.]+ GiB"),
            "a rank here has about N GiB (MemAvailable N GiB")
NO_CHECKPOINT = "train.resume=true but there is no checkpoint in train.checkpoint_dir="


def _validated(shown: Shown, argv: list[str], folder: Path, capfd, monkeypatch) -> tuple[int, str]:
    def validate_only(cfg, output_dir, **_):
        validate(cfg, shown.world_size)

    if not any(a.startswith("hydra.run.dir=") for a in argv):
        argv = [*argv, f"hydra.run.dir={folder / 'run'}"]
    capfd.readouterr()
    if shown.launcher:
        flags, _ = split_argv(shlex.split(shown.line.split(";")[0], comments=True)[1:])
        monkeypatch.setattr(launcher, "run_agent", lambda args: 0)  # up to starting the ranks
        code = launcher.launch([*flags, *argv])
    else:
        code = run_cli(argv, validate_only)
    return code, _MACHINE[0].sub(_MACHINE[1], capfd.readouterr().err)


@pytest.mark.parametrize("shown", COMMANDS, ids=lambda c: f"{c.where}:{' '.join(c.overrides)[:60]}")
def test_a_shown_command_passes_validation_or_fails_as_shown(shown, user_folder, capfd, monkeypatch):
    argv = list(shown.overrides)
    if "train.resume=true" in argv:
        code, err = _validated(shown, argv, user_folder, capfd, monkeypatch)
        assert code == 2 and NO_CHECKPOINT in err, err
        argv[argv.index("train.resume=true")] = "train.resume=false"
    code, err = _validated(shown, argv, user_folder, capfd, monkeypatch)
    if shown.error is None:
        assert code == 0, f"{shown.where}: `{shown.line}` no longer validates:\n{err}"
        return
    assert code == 2, err
    if shown.code is not None:
        assert shown.code == (1 if shown.line.startswith("torchrun") else 2)  # distcompile-train: 2
    expected = _MACHINE[0].sub(_MACHINE[1], shown.error)
    assert expected in err, f"{shown.where} shows:\n{expected}\nthe launcher says:\n{err}"
