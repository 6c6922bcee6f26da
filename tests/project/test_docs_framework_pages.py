"""The framework pages (docs/frameworks/lightning.md, accelerate.md, hf.md) run as shown.

Each page opens with a complete program (its first ```python block), then a ```bash block with
the route's install line and the command that runs it, then a ```text block of what rank 0
printed. The program and the command are read from the page, not kept here, so page and test
cannot drift: the slow test writes the program to a folder under the name the command gives it
and runs the command (torchrun with 2 CPU gloo ranks and ``aot_eager``), then checks that it
exits 0, that rank 0 said once that ddp_opt is in control (Note [In control, once] in
``ddp_opt/control.py``), word for word as the page shows it, and that the page's sample is what
the run printed (numbers aside). The rest checks in this process what a page promises."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddp_opt.control import PREFIX

REPO = Path(__file__).resolve().parents[2]
# page -> (the packages the route needs, the extra that installs them, the entry point its line names, the script)
PAGES = {
    "lightning": (("lightning",), "lightning", "CompiledDDPStrategy", "lightning_ddp.py"),
    "accelerate": (("accelerate",), "accelerate", "compile_prepared", "accelerate_ddp.py"),
    "hf": (("transformers", "accelerate"), "hf", "compile_trainer", "hf_trainer_ddp.py"),
}
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
NUMBER = re.compile(r"\d+\.\d+(e-?\d+)?")  # losses, norms, rates: what a torch release may change


@dataclass(frozen=True)
class Shown:
    """What a page shows: its first program, the install line and command after it, and the sample."""

    program: str
    install: str
    command: list[str]
    sample: list[str]


def shown(name: str) -> Shown:
    """The page's first ```python block, the ```bash block after it and the ```text block after that."""
    blocks = BLOCK.findall((REPO / "docs" / "frameworks" / f"{name}.md").read_text())
    languages = [lang for lang, _ in blocks]
    first = languages.index("python")
    assert first == 0 and languages[1:3] == ["bash", "text"], (
        f"docs/frameworks/{name}.md must open with the program (```python), then its install line and command "
        f"(```bash), then its output (```text); its blocks are {languages[:4]}")
    bash = [line for line in blocks[1][1].splitlines() if line.strip()]
    assert len(bash) == 2, bash
    return Shown(program=blocks[0][1], install=bash[0], command=shlex.split(bash[1]),
                 sample=blocks[2][1].splitlines())


def _masked(line: str) -> str:
    return NUMBER.sub("#", line)


def _extras() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return set(cfg["options.extras_require"])


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_page_opens_with_a_program_its_install_line_a_two_rank_command_and_its_output(name):
    page = shown(name)
    _, extra, entry, script = PAGES[name]
    assert page.install == f"pip install -e '.[{extra}]'" and extra in _extras(), page.install
    assert page.command == ["torchrun", "--standalone", "--nproc-per-node", "2", script, "aot_eager"], page.command
    # the program is the example of examples/ (the framework tests run its training against eager), whole
    assert page.program == (REPO / "examples" / script).read_text()
    compile(page.program, script, "exec")
    said = [line for line in page.sample if line.startswith(PREFIX)]
    assert len(said) == 1 and said[0].startswith(f"{PREFIX} ({entry}): strategy=split, backend=aot_eager; "), said


def _run(name: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The page's program, saved under the name its command gives, run by that command."""
    for module in PAGES[name][0]:
        pytest.importorskip(module, reason=f"docs/frameworks/{name}.md's program needs {module} "
                                           f"(pip install -e '.[{PAGES[name][1]}]')")
    page = shown(name)
    (tmp_path / page.command[4]).write_text(page.program)
    # torchrun is python -m torch.distributed.run: this interpreter's, whatever is on PATH
    argv = [sys.executable, "-m", "torch.distributed.run", *page.command[1:]]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    said = [line for line in lines if line.startswith(PREFIX)]
    shown_line = next(line for line in page.sample if line.startswith(PREFIX))
    assert said == [shown_line], (said, shown_line)  # once, on rank 0, word for word as the page shows it
    # The sample is what rank 0 printed, in that order ("..." where the page cut it), numbers aside.
    got = iter(_masked(line) for line in lines)
    missing = [line for line in page.sample if line != "..." and _masked(line) not in got]
    assert not missing, f"docs/frameworks/{name}.md shows lines the run did not print in that order: {missing}\n" \
                        + proc.stdout[-3000:]
    return proc


@pytest.mark.slow
def test_the_lightning_page_runs_as_shown_and_its_strategy_says_it_is_in_control(tmp_path):
    lines = _run("lightning", tmp_path).stdout.splitlines()
    assert len(shown("lightning").program.splitlines()) <= 50
    losses = [float(m[1]) for line in lines if (m := re.match(r"^step \d+ loss (\S+)$", line))]
    assert len(losses) == 24 and sum(losses[-4:]) < 0.5 * sum(losses[:4]), lines
    assert "buckets 3 alignment 1.00" in lines


@pytest.mark.slow
def test_the_accelerate_page_runs_as_shown_and_compile_prepared_says_it_is_in_control(tmp_path):
    lines = _run("accelerate", tmp_path).stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 16 and all(line.endswith(" buckets 3") for line in steps), lines
    assert "alignment 1.00 keys ['0.0.bias', '0.0.weight']" in lines
    assert (tmp_path / "accelerate_ckpt" / "model.safetensors").exists()


@pytest.mark.slow
def test_the_hf_page_runs_as_shown_and_compile_trainer_says_it_is_in_control_and_what_it_changed(tmp_path):
    lines = _run("hf", tmp_path).stdout.splitlines()
    assert "buckets 3 alignment 1.00" in lines
    assert next(line for line in lines if line.startswith(PREFIX)).endswith(
        "; changed: find_unused_parameters=False for DDP (the Trainer's default, True, keeps DDP from rebuilding "
        "its buckets; TrainingArguments(ddp_find_unused_parameters=True) keeps it on)")
    from transformers import GPT2LMHeadModel

    assert GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf_out")).config.n_layer == 2
