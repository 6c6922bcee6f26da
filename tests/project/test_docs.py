"""The documentation: the MkDocs site builds with no warning, the README stays a short
front page whose test commands are the ones CI runs, no page grows past 400 lines, and
every generated table is what its committed JSON renders (``benchmarks.render.pages``)."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.render import pages as docs_pages
from benchmarks.harness.report import replace_section

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").rglob("*.md"))
MARKER = re.compile(r"<!-- [\w-]+(:[\w-]+)?:start -->")


def test_the_site_builds_in_strict_mode_with_no_warning(tmp_path, caplog):
    """``mkdocs build --strict``: a broken link, a missing anchor or a page left out of
    the nav aborts the build (mkdocs.yml's ``validation`` makes each a warning)."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(config_file=str(REPO / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    with caplog.at_level(logging.WARNING, logger="mkdocs"):
        build(config)  # raises mkdocs.exceptions.Abort on any warning in strict mode
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    site = tmp_path / "site"
    assert (site / "benchmarks" / "ddp-shaped" / "index.html").exists()
    # the plots come from benchmarks/results/ through tools/mkdocs_hooks.py, not from a copy in docs/
    assert (site / "benchmarks" / "results" / "ddp_shaped_800mbit.png").exists()
    assert 'src="../results/ddp_shaped_800mbit.png"' in (site / "benchmarks" / "ddp-shaped" / "index.html").read_text()


def test_a_broken_link_fails_the_strict_build(tmp_path):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    shutil.copytree(REPO / "docs", tmp_path / "docs")
    (tmp_path / "docs" / "fsdp.md").write_text("# FSDP2\n\nSee [the missing page](nowhere.md).\n")
    config = load_config(config_file=str(REPO / "mkdocs.yml"), docs_dir=str(tmp_path / "docs"),
                         site_dir=str(tmp_path / "site"), strict=True)
    with pytest.raises(Abort, match="warnings in strict mode"):
        build(config)


def test_the_readme_is_a_short_front_page_with_no_generated_block():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert not MARKER.search(readme), "generated blocks live in docs/ (python -m benchmarks.render.pages)"
    assert max(len(line) for line in readme.splitlines() if not line.startswith("|")) <= 400
    # its first commands set up a machine and run the main job; the next run the tests
    commands = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert "pip install torch==" in commands[0] and "distcompile-train --standalone" in commands[0]
    assert commands[1].startswith("python -m pytest -q")
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / link).exists(), link


def _test_commands(page: Path) -> list[str]:
    block = re.search(r"## Tests\n\n```bash\n(.*?)```", page.read_text(), re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines()]


def test_ci_runs_the_readmes_test_commands_in_their_order():
    commands = _test_commands(REPO / "README.md")
    assert [c.split(" -m ")[2].split(" -")[0] for c in commands] == ['"not slow"', '"slow and not alone"', "alone"]
    assert _test_commands(REPO / "docs" / "getting-started.md") == commands
    ci = (REPO / ".ci" / "run").read_text()
    at = ci.index(". .venv/bin/activate")  # the current release's environment: the whole suite
    for command in commands:  # each on a line of its own (set -e ends the run at a failing one), flags may follow
        at = ci.index(f"\n{command} ", at) + 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO / "docs")))
def test_no_page_is_over_400_lines(page):
    assert len(page.read_text().splitlines()) <= 400


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_once():
    import yaml

    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == sorted(str(p.relative_to(REPO / "docs")) for p in PAGES)


def test_every_generated_block_is_what_its_committed_json_renders():
    assert docs_pages.stale_pages() == [], "run `python -m benchmarks.render.pages`"
    blocks = {(b.page, b.start) for b in docs_pages.BLOCKS}
    found = {(str(p.relative_to(REPO)), m.group(0)) for p in PAGES for m in MARKER.finditer(p.read_text())}
    assert found - {("docs/getting-started.md", "<!-- torch-matrix:start -->")} == blocks


def test_the_torch_table_is_what_its_committed_json_renders():
    spec = importlib.util.spec_from_file_location("torch_matrix", REPO / "tools" / "torch_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    page = (REPO / "docs" / "getting-started.md").read_text()
    rows = json.loads(matrix.JSON.read_text())
    assert replace_section(page, matrix.render(rows), matrix.START, matrix.END) == page


def test_a_table_edited_by_hand_is_named_and_rewritten(tmp_path, capsys):
    for block in docs_pages.BLOCKS:
        (tmp_path / block.page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / block.page, tmp_path / block.page)
    page = tmp_path / "docs" / "benchmarks" / "padding.md"
    page.write_text(page.read_text().replace("| max |", "| max (typed) |"))
    assert docs_pages.stale_pages(tmp_path) == ["docs/benchmarks/padding.md"]
    assert docs_pages.write_pages(tmp_path) == ["docs/benchmarks/padding.md"]
    assert page.read_text() == (REPO / "docs" / "benchmarks" / "padding.md").read_text()

    page.write_text(page.read_text().replace("| max |", "| max (typed) |"))
    assert docs_pages.main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/benchmarks/padding.md: its generated blocks differ" in capsys.readouterr().err


def test_every_cited_note_is_defined_once():
    defined = docs_pages.note_definitions()
    text = "\n".join(p.read_text() for package in docs_pages.SOURCES for p in (REPO / package).rglob("*.py"))
    cited = {" ".join(title.split()) for title in re.findall(r"Note \[([^]]+)\]", text)}
    assert sorted(cited - set(defined)) == []
    assert {title: where for title, where in defined.items() if len(where) > 1} == {}
    assert defined["Traced strategy"] == ["ddp_opt/strategies/traced/plan.py"] and defined["Step gate"] == ["compiler/ranks/step_gate.py"]
