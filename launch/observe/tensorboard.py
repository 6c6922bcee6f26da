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

__all__ = ["CURVES_PNG", "RunLog", "check_log", "curve_panels", "plot_curves", "summary_scalars"]

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


def curve_panels(curves: dict[str, list[tuple[int, float]]]
                 ) -> tuple[list[tuple[str, list[tuple[int, float]]]], dict[str, float]]:
    """What :func:`plot_curves` draws: (title, points) per panel, and the curves that never
    change, by value. A time or rate curve (``step_s``, ``tokens_per_s``) leaves out its first
    point, the step that paid for the compiles, and gives its value in the title."""
    constant = {name: points[0][1] for name, points in curves.items() if points and len({v for _, v in points}) == 1}
    panels = []
    for name, points in curves.items():
        if name in constant or not points:
            continue
        if name.endswith("_s") and len(points) > 2:
            panels.append((f"{name} (first step {points[0][1]:,.4g}, not drawn)", points[1:]))
        else:
            panels.append((name, points))
    return panels, constant


def plot_curves(curves: dict[str, list[tuple[int, float]]], path: str) -> str | None:
    """One panel per curve over the steps; returns ``path``, or None (with a warning) without matplotlib.

    A curve that never changes (the lr without a schedule) gets no panel: its value is in
    the figure's title. Time and rate panels leave out the run's first step, which paid
    for the compiles (its value is in the panel's title)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print0(f"warning: {os.path.basename(path)} skipped: matplotlib does not import ({e}). Install it with "
               "`pip install -e .[bench]`; the event files are written either way.")
        return None
    panels, constant = curve_panels(curves)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows + 0.4), squeeze=False)
    for ax, (title, points) in zip(axes.flat, panels):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if constant:
        fig.suptitle("constant: " + ", ".join(f"{name} {value:.4g}" for name, value in constant.items()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
