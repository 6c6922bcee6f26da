"""Where the launcher's own Hydra configs are: a folder found from this file, never from
the current folder or ``sys.path`` (Note [Install layout] in ``launch/__init__.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["CONFIG_DIR", "config_dir", "searchpath_override"]

log = logging.getLogger(__name__)

_LAUNCH = Path(__file__).resolve().parents[1]


def config_dir(launch_dir: Path = _LAUNCH) -> Path:
    """The folder that holds the job's ``config.yaml`` and its groups: ``launch/configs`` in an
    installed wheel, else the repository's top-level ``configs/`` beside ``launch/`` (a checkout,
    or an editable install of one).

    Args:
        launch_dir: the ``launch`` package's folder (tests pass a fake layout).
    """
    shipped, checkout = launch_dir / "configs", launch_dir.parent / "configs"
    for folder in (shipped, checkout):
        if (folder / "config.yaml").is_file():
            return folder
    log.debug("no config.yaml in %s or %s", shipped, checkout)
    return checkout


CONFIG_DIR = config_dir()


def searchpath_override(folder: Path = CONFIG_DIR) -> str:
    """The Hydra override that puts ``folder`` on the config search path by its absolute
    path (``file://``), not by a package name another folder could shadow."""
    quote = "'" if "'" not in str(folder) else '"'
    return f"hydra.searchpath=[{quote}file://{folder}{quote}]"
