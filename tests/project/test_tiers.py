"""The guard between the test tiers (Note [Test tiers] in tests/_tiers.py): an unmarked
test that starts a process or an Inductor compile fails, naming the fix, even where the
code under test catches the refusal; a test asking for a spawning fixture is marked slow. The
slow tier's order names files that are there, each in one package folder of tests/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import _tiers


def _item(nodeid="tests/test_x.py::test_y", fixturenames=()):
    marks = []
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixturenames), add_marker=marks.append, marks=marks)


def test_a_subprocess_in_an_unmarked_test_is_refused_with_the_fix():
    with pytest.raises(_tiers.SpawnInFastTier, match=r"test_y started a subprocess but is not marked slow.*"
                                                     r"Mark the test @pytest.mark.slow"):
        with _tiers.no_spawn(_item()):
            subprocess.run([sys.executable, "-c", "pass"])


def test_a_refusal_the_code_under_test_swallows_still_fails_the_test():
    with pytest.raises(pytest.fail.Exception, match="started a multiprocessing process"):
        with _tiers.no_spawn(_item()):
            import multiprocessing

            try:
                multiprocessing.get_context("spawn").Process(target=print).start()
            except BaseException:  # noqa: BLE001 - as careless code under test would
                pass


def test_an_inductor_compile_is_refused_before_it_starts_a_compiler():
    torch._dynamo.reset()
    try:
        with pytest.raises(_tiers.SpawnInFastTier, match="started an Inductor compile"):
            with _tiers.no_spawn(_item()):
                torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.ones(3))
    finally:
        torch._dynamo.reset()


def test_aot_eager_and_in_process_work_pass_the_guard():
    torch._dynamo.reset()
    with _tiers.no_spawn(_item()):
        out = torch.compile(lambda x: x.sin() + 1, backend="aot_eager")(torch.ones(3))
    torch._dynamo.reset()
    assert torch.allclose(out, torch.ones(3).sin() + 1)


def test_tests_asking_for_spawning_fixtures_are_marked_slow():
    ranks, job, plain = _item(fixturenames=["run_ranks"]), _item(fixturenames=["tmp_path", "torchrun"]), _item(
        fixturenames=["tmp_path"])
    _tiers.mark_spawning_tests([ranks, job, plain])
    assert [m.name for m in ranks.marks] == ["slow"] and [m.name for m in job.marks] == ["slow"]
    assert plain.marks == []


def _marked(fixturenames=(), marks=(), path="tests/test_x.py"):
    item = _item(fixturenames=fixturenames)
    item.marks.extend(marks)
    item.get_closest_marker = lambda name: next((m for m in item.marks if m.name == name), None)
    item.path = SimpleNamespace(name=path.rsplit("/", 1)[-1])
    return item


def test_a_test_loading_the_machine_runs_alone_and_every_alone_test_is_slow():
    busy, marked, plain = (_marked(fixturenames=["busy_machine"]), _marked(marks=[pytest.mark.alone.mark]),
                           _marked(fixturenames=["tmp_path"]))
    _tiers.mark_alone_tests([busy, marked, plain])
    assert [m.name for m in busy.marks] == ["alone", "slow"] and [m.name for m in marked.marks] == ["alone", "slow"]
    assert plain.marks == []


def test_the_longest_files_come_first_in_their_order_and_the_others_keep_theirs():
    first, second = _tiers.LONGEST_FIRST[:2]
    items = [_marked(path=p) for p in ("tests/test_a.py", f"tests/{second}", "tests/test_b.py", f"tests/{first}")]
    _tiers.longest_first(items)
    assert [i.path.name for i in items] == [first, second, "test_a.py", "test_b.py"]


def test_each_longest_file_is_one_file_in_a_package_folder_and_none_is_at_the_top():
    # LONGEST_FIRST names files, not paths: a file renamed must not drop out of the order silently
    tests = Path(_tiers.__file__).parent
    where = {name: [p.parent.name for p in tests.glob(f"*/{name}")] for name in _tiers.LONGEST_FIRST}
    assert {name: folders for name, folders in where.items() if len(folders) != 1} == {}
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert top == [], f"{top}: tests/ mirrors the packages, each test file in its package's folder (docs/contributing.md)"


def test_a_test_module_imports_another_only_from_its_own_folder():
    # pytest puts each test file's folder on sys.path as it collects it, so `from test_x import ...` of a file in
    # another folder works only when that folder happened to be collected first (a single file run fails)
    import re

    tests = Path(__file__).resolve().parents[1]
    here = {p.stem: p.parent for p in tests.rglob("test_*.py")}
    crossing = []
    for path in tests.rglob("test_*.py"):
        text = path.read_text()
        for name in re.findall(r"^\s*from (test_\w+) import", text, re.M):
            if here.get(name) != path.parent and f'/ "{here.get(name, Path()).name}"' not in text:
                crossing.append(f"{path.relative_to(tests)} imports {name}")
    assert not crossing, crossing
