"""The memory check reads memory cgroup limits as well as the host's MemAvailable
(launch.checks.rules_resources, Note [Memory a rank can use]): v1 and v2, each ancestor's
limit, "no limit" skipped, the smallest room wins and the refusal names it. Fake cgroup
trees under tmp_path; one real v1 cgroup when this process may make one."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from launch.checks import rules_resources
from launch.checks.rules_resources import available_memory, cgroup_memory_limits
from launch.config.schema import ConfigError

from _jobs import composed as _job

GiB, MiB = 1024**3, 1024**2
V1_NO_LIMIT = 9223372036854771712  # what v1 writes for "no limit"


def _files(root: Path, files: dict[str, object]) -> None:
    for name, value in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"{value}\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A host with 21 GiB MemAvailable, 2 local ranks, and empty cgroup mounts; returns the
    keyword arguments that point the readers at them."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    _files(tmp_path, {"meminfo": "MemTotal:       32000000 kB\nMemAvailable:   22020096 kB"})
    for d in ("v1", "v2", "hybrid"):
        (tmp_path / d).mkdir()
    return {"meminfo": str(tmp_path / "meminfo"), "proc_cgroup": str(tmp_path / "cgroup"),
            "cgroup_v1": str(tmp_path / "v1"), "cgroup_v2": (str(tmp_path / "hybrid"), str(tmp_path / "v2"))}


def test_v1_the_limit_of_the_process_cgroup_or_an_ancestor_wins_over_memavailable(fake, tmp_path):
    _files(tmp_path, {"cgroup": "5:cpu,cpuacct:/elsewhere\n4:memory:/job/step\n0::/",
                      "v1/memory.limit_in_bytes": V1_NO_LIMIT, "v1/memory.usage_in_bytes": 9 * GiB,
                      "v1/job/memory.limit_in_bytes": 3 * GiB // 2, "v1/job/memory.usage_in_bytes": GiB // 2,
                      "v1/job/memory.stat": f"cache 1\ninactive_file 7\ntotal_inactive_file {300 * MiB}",
                      "v1/job/step/memory.limit_in_bytes": V1_NO_LIMIT, "v1/job/step/memory.usage_in_bytes": GiB})
    assert cgroup_memory_limits(fake["proc_cgroup"], fake["cgroup_v1"], fake["cgroup_v2"]) == [
        rules_resources.CgroupLimit(str(tmp_path / "v1/job"), 3 * GiB // 2, 212 * MiB)]
    room, where = available_memory(False, **fake)
    assert room == (3 * GiB // 2 - 212 * MiB) // 2
    assert where == f"cgroup memory limit 1.5 GiB of {tmp_path}/v1/job, 0.2 GiB in use, shared by 2 rank(s)"


def test_v2_each_ancestor_limit_counts_and_max_is_no_limit(fake, tmp_path):
    _files(tmp_path, {"cgroup": "0::/user.slice/job.scope", "v2/cgroup.controllers": "cpu memory",
                      "hybrid/memory.max": 1,  # not a unified mount (no cgroup.controllers): never read
                      "v2/user.slice/memory.max": 2 * GiB, "v2/user.slice/memory.current": GiB,
                      "v2/user.slice/job.scope/memory.max": "max", "v2/user.slice/job.scope/memory.current": GiB // 2})
    room, where = available_memory(False, **fake)
    assert room == GiB // 2 and where.startswith(f"cgroup memory limit 2.0 GiB of {tmp_path}/v2/user.slice, 1.0 GiB")
    _files(tmp_path, {"v2/user.slice/job.scope/memory.max": GiB, "v2/user.slice/job.scope/memory.stat":
                      f"anon 5\ninactive_file {GiB // 4}"})
    room, where = available_memory(False, **fake)
    assert room == (GiB - GiB // 4) // 2 and "job.scope, 0.2 GiB in use" in where


@pytest.mark.parametrize("tree", [
    {"cgroup": "4:memory:/job", "v1/job/memory.limit_in_bytes": V1_NO_LIMIT, "v1/job/memory.usage_in_bytes": GiB},
    {"cgroup": "0::/job", "v2/cgroup.controllers": "memory", "v2/job/memory.max": "max", "v2/job/memory.current": 1},
    {"cgroup": "0::/job", "v2/cgroup.controllers": "cpu"},  # no memory controller: no memory.max files
    {"cgroup": "4:memory:/job", "v1/job/memory.limit_in_bytes": 64 * GiB, "v1/job/memory.usage_in_bytes": 0},
])
def test_no_limit_or_a_large_one_leaves_memavailable(fake, tmp_path, tree):
    _files(tmp_path, tree)
    assert available_memory(False, **fake) == (21 * GiB // 2, "MemAvailable 21.0 GiB shared by 2 rank(s) on this "
                                                             "machine")


def test_a_path_outside_the_mount_is_read_at_its_root(fake, tmp_path):
    # A container that mounts its own cgroup as the root while /proc/self/cgroup names the host's path.
    _files(tmp_path, {"cgroup": "4:memory:/docker/0123abcd", "v1/memory.limit_in_bytes": GiB,
                      "v1/memory.usage_in_bytes": 0})
    assert available_memory(False, **fake)[0] == GiB // 2


def test_a_batch_past_the_cgroup_limit_is_refused_naming_the_limit(fake, tmp_path, monkeypatch):
    _files(tmp_path, {"cgroup": "4:memory:/job", "v1/job/memory.limit_in_bytes": 3 * GiB // 2,
                      "v1/job/memory.usage_in_bytes": GiB // 5})
    monkeypatch.setattr(rules_resources, "available_memory", functools.partial(available_memory, **fake))
    from launch.checks.validate import validate

    cfg = _job("compile.backend=aot_eager", "train.batch_size=2048")  # about 3 GiB a rank
    with pytest.raises(ConfigError, match=r"but a rank here has about 665\.6 MiB \(cgroup memory limit 1\.5 GiB of "
                                          rf"{tmp_path}/v1/job, 0\.2 GiB in use, shared by 2 rank\(s\)\): it would run "
                                          r"out of memory\. .*or run on more ranks, or raise the memory limit of the "
                                          r"job's cgroup \(its container's or allocation's\)\. .*set "
                                          r"train\.memory_check=false\.$"):
        validate(cfg, world_size=2)


def _v1_cgroup_of_this_process() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    path = next((p for _, c, p in (line.split(":", 2) for line in lines) if "memory" in c.split(",")), None)
    folder = Path("/sys/fs/cgroup/memory") / (path or "/").lstrip("/")
    return folder if path is not None and (folder / "memory.limit_in_bytes").exists() else None


@pytest.mark.slow
def test_a_real_v1_memory_cgroup_is_read(tmp_path):
    """A 1.5 GiB v1 cgroup below this process's, a subprocess moved into it that only runs
    the check's reader (no training), and the cgroup removed afterwards."""
    parent = _v1_cgroup_of_this_process()
    if parent is None:
        pytest.skip("no cgroup v1 memory hierarchy for this process")
    child = parent / f"distcompile-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
        (child / "memory.limit_in_bytes").write_text(str(3 * GiB // 2))
    except OSError as e:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot make a v1 memory cgroup here ({e.strerror})")
    code = ("from launch.checks.rules_resources import available_memory\n"
            "print(available_memory(False)[1])")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
            env={**os.environ, "LOCAL_WORLD_SIZE": "2"},
            preexec_fn=lambda: (child / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        child.rmdir()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"cgroup memory limit 1.5 GiB of {child}, "), proc.stdout
    assert proc.stdout.rstrip().endswith("GiB in use, shared by 2 rank(s)"), proc.stdout
