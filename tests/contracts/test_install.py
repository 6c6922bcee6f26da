"""Install hygiene (Note [Install layout] in launch/__init__.py): the wheel installs the
libraries only, and the main job finds its own configs and models whatever the current
folder holds, from a checkout (``python -m launch.train``) and from a non-editable install
(the ``distcompile-train`` console script)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from launch.config.location import CONFIG_DIR, config_dir, searchpath_override

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = {"compiler", "ddp_opt", "fsdp_opt", "launch"}
JOB = ["compile.backend=aot_eager", "train.steps=2"]


def _strangers_folder(path: Path, *, with_launch: bool = False) -> Path:
    """A project folder with its own ``models`` (no GPT) and ``configs`` (another
    ``config.yaml``) packages, and with ``with_launch``, its own ``launch`` (as ROS 2 ships)."""
    (path / "models").mkdir(parents=True)
    (path / "models" / "__init__.py").write_text('"""Somebody else\'s models: no GPT here."""\n')
    (path / "configs").mkdir()
    (path / "configs" / "__init__.py").write_text("")
    (path / "configs" / "config.yaml").write_text("defaults:\n  - _self_\noptimizer: {lr: 1.0}\n")
    if with_launch:
        (path / "launch").mkdir()
        (path / "launch" / "__init__.py").write_text('raise ImportError("somebody else\'s launch package")\n')
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel --no-deps`` builds from a copy of this checkout (built in the copy,
    so that no build folder lands in the checkout), offline."""
    src = tmp_path_factory.mktemp("src")
    skip = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist", "outputs", "results")
    for path in ROOT.iterdir():
        if skip(str(ROOT), [path.name]):
            continue
        (shutil.copytree(path, src / path.name, ignore=skip) if path.is_dir() else shutil.copy(path, src / path.name))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("distcompile-*.whl")
    return built


def test_the_configs_are_found_from_the_launcher_not_the_current_folder(tmp_path):
    assert CONFIG_DIR == ROOT / "configs"  # a checkout
    installed = tmp_path / "site-packages" / "launch"
    (installed / "configs").mkdir(parents=True)
    assert config_dir(installed) == tmp_path / "site-packages" / "configs"  # nothing shipped: the checkout's place
    (installed / "configs" / "config.yaml").write_text("defaults: []\n")
    assert config_dir(installed) == installed / "configs"  # a wheel: the shipped folder
    assert searchpath_override(Path("/a b/configs")) == "hydra.searchpath=['file:///a b/configs']"


@pytest.mark.slow
def test_the_wheel_installs_the_library_packages_only_and_all_of_them(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top == LIBRARIES, f"top-level names of the wheel: {sorted(top)}"
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert set(zipfile.ZipFile(wheel).read(top_level).decode().split()) == LIBRARIES
    modules = {str(p.relative_to(ROOT)) for lib in LIBRARIES for p in (ROOT / lib).rglob("*.py")}
    assert sorted(modules - set(names)) == [], "modules of the checkout missing from the wheel (setup.cfg packages)"
    configs = {f"launch/configs/{p.relative_to(ROOT / 'configs')}" for p in (ROOT / "configs").rglob("*.yaml")}
    assert sorted(configs - set(names)) == [], "configs missing from the wheel (setup.cfg package_data)"
    assert "launch/models/gpt.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "distcompile-train = launch.launcher:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_the_installed_wheel_runs_the_main_job_from_a_folder_with_its_own_packages(wheel, tmp_path):
    # a fresh venv holding the wheel alone (not editable); torch, hydra and the rest come from this
    # interpreter's site-packages by PYTHONPATH, which holds no distcompile package of its own
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, timeout=300)
    folder = _strangers_folder(tmp_path / "project", with_launch=True)
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--no-python",
           str(venv / "bin" / "distcompile-train"), *JOB]
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: steps 1..2" in proc.stdout


def test_python_m_launch_train_runs_from_a_folder_with_its_own_models_and_configs(torchrun, tmp_path):
    from _torchrun import ok

    folder = _strangers_folder(tmp_path / "project")
    proc = torchrun(folder, *JOB, nproc=1)
    ok(proc)
    assert "done: steps 1..2" in proc.stdout
