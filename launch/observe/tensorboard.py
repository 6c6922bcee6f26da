"""``log.tensorboard=true``: TensorBoard event files and a picture of the run's curves.

Rank 0 writes, into the run directory (where ``metrics.json`` goes):

- event files (``events.out.tfevents.*``), one scalar per step for every per-step
  curve of the :class:`~launch.observe.report.Tally` (``loss``, ``step_s``, ``tokens_per_s``,
  and whatever else the loop records as ``(step, value)`` pairs: the learning rate,
  the gradient norm, the held-out loss), and at the end one ``run/<key>`` scalar for
  every number of the metrics (``run/median_step_ms``, ``run/diagnosis.exposed_comm_ms``
  with ``diagnose=true``, ``run/profile.exposed_comm_ms`` with ``profile.steps``);
- ``curves.png`` at the end: each curve over the steps (needs matplotlib, the
  ``bench`` extra; without it the picture is skipped with a warning).

Nothing here names a curve: a new ``(step, value)`` field of the Tally shows up by itself.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..config.schema import ConfigError, JobConfig
from ..runtime.dist import print0
from .report import Tally

log = logging.getLogger(__name__)

__all__ = ["CURVES_PNG", "RunLog", "check_log", "plot_curves", "summary_scalars"]

CURVES_PNG = "curves.png"
INSTALL = "pip install -e .[tensorboard]"


def check_log(cfg: JobConfig) -> None:
    """``log.tensorboard`` is a bool, and with true the ``tensorboard`` package imports."""
    value = cfg.log.tensorboard
    if not isinstance(value, bool):
        raise ConfigError(f"log.tensorboard={value!r} is not valid: it must be true or false (write TensorBoard "
                          "event files into the run directory). Use log.tensorboard=true or log.tensorboard=false.")
    if not value:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401 - needs the tensorboard package
    except ImportError as e:
        raise ConfigError(
            f"log.tensorboard=true needs the `tensorboard` package, which does not import here ({e}): torch's "
            f"SummaryWriter writes the event files with it. Install it with `{INSTALL}` (or `pip install "
            "tensorboard`), or set log.tensorboard=false."
        ) from None


class RunLog:
    """Rank 0's TensorBoard writer for one run."""

    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.writer = SummaryWriter(log_dir=folder)

    def step(self, tally: Tally, step: int) -> None:
        """Every curve's value at ``step``."""
        for name, value in tally.curves_at(step).items():
            self.writer.add_scalar(name, value, step)

    def finish(self, tally: Tally, metrics: dict[str, Any]) -> None:
        """The run's numbers as ``run/*`` scalars at the last step, the config as text, and the picture."""
        last = metrics.get("steps") or 0
        for key, value in summary_scalars(metrics).items():
            self.writer.add_scalar(f"run/{key}", value, last)
        if metrics.get("config") is not None:
            self.writer.add_text("config", "```\n" + json.dumps(metrics["config"], indent=1, default=str) + "\n```")
        self.close()
        print0(f"tensorboard: event files in {self.folder} (tensorboard --logdir {self.folder})")
        png = plot_curves(tally.curves(), os.path.join(self.folder, CURVES_PNG))
        if png:
            print0(f"curves: {png}")

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def summary_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """Every number of ``metrics``, top-level and one level into its sections (``diagnosis.exposed_comm_ms``)."""
    out = {}
    for key, value in metrics.items():
        if _number(value):
            out[key] = float(value)
        elif isinstance(value, dict) and key != "config":
            out.update({f"{key}.{k}": float(v) for k, v in value.items() if _number(v)})
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def plot_curves(curves: dict[str, list[tuple[int, float]]], path: str) -> str | None:
    """One panel per curve over the steps; returns ``path``, or None (with a warning) without matplotlib.

    Time and rate panels are drawn on a log scale: the first step pays for compiles."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print0(f"warning: {os.path.basename(path)} skipped: matplotlib does not import ({e}). Install it with "
               "`pip install -e .[bench]`; the event files are written either way.")
        return None
    names = list(curves)
    if not names:
        return None
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        steps, values = zip(*curves[name])
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if name.endswith("_s") and min(values) > 0 and max(values) > 5 * min(values):
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
