"""The benchmarks' plots (matplotlib, Agg backend): for DDP, step time against
bucket cap, one line per mode, and a second panel with each mode's per-round ratio
to ``builtin`` and its IQR (``plot_caps``); for FSDP, one bar per mode (``plot_modes``).
Both draw the physical limit (``benchmarks.harness.limit``) when the rows carry it. Training-loss
curves, one line per run (``plot_losses``, ``benchmarks.studies.convergence``).

    python -m benchmarks.harness.plot benchmarks/results/ddp_shaped_100mbit.json   # redraw a PNG from its JSON
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

__all__ = ["plot_caps", "plot_losses", "plot_modes", "plot_rows", "replot", "main"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path, **layout) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(**layout)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _series(ax, rows: Sequence[dict], key: str, lo: str, hi: str) -> None:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for i, mode in enumerate(modes):
        pts = sorted((r for r in rows if r["mode"] == mode and r.get(key) is not None), key=lambda r: r["bucket_cap_mb"])
        if not pts:
            continue
        # Nudge each mode sideways a little so error bars at the same cap stay readable.
        caps = [r["bucket_cap_mb"] * (1 + 0.04 * (i - (len(modes) - 1) / 2)) for r in pts]
        mid = [r[key] for r in pts]
        if all(r.get(lo) is not None and r.get(hi) is not None for r in pts):
            err = [[m - r[lo] for m, r in zip(mid, pts)], [r[hi] - m for m, r in zip(mid, pts)]]
            ax.errorbar(caps, mid, yerr=err, marker="o", capsize=3, label=mode)
        else:
            ax.plot(caps, mid, marker="o", label=mode)
    ax.set_xscale("log")
    ax.minorticks_off()
    caps_all = sorted({r["bucket_cap_mb"] for r in rows})
    ax.set_xticks(caps_all)
    ax.set_xticklabels([f"{c:g}" for c in caps_all])
    ax.set_xlabel("DDP bucket_cap_mb (MiB)")
    ax.grid(True, alpha=0.3)


def plot_losses(runs: Sequence[tuple[str, Sequence[float]]], path: str | Path, title: str = "") -> Path:
    """One training-loss curve per ``(label, losses by step)``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in runs:
        ax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def plot_caps(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Draw ``step_ms_median`` (IQR bars from ``step_ms_q1``/``q3`` when present) and
    ``ratio_vs_builtin`` (``ratio_q1``/``q3``) against ``bucket_cap_mb``, per ``mode``.

    Args:
        rows: benchmark rows as ``ddp_compare --json`` writes them.
        path: the PNG to write.
        title: figure title.

    Returns:
        The path written.
    """
    fig, (left, right) = _pyplot().subplots(1, 2, figsize=(11, 4.2))
    # ours@auto (a sweep) has no cap to put on the x axis: a dashed line at its value.
    auto = [r for r in rows if isinstance(r["bucket_cap_mb"], str)]
    rows = [r for r in rows if not isinstance(r["bucket_cap_mb"], str)]
    for r in auto:
        left.axhline(r["step_ms_median"], ls="--", color="black", lw=1, label=f"{r['mode']}@{r['bucket_cap_mb']}")
        if r.get("ratio_vs_builtin") is not None:
            right.axhline(r["ratio_vs_builtin"], ls="--", color="black", lw=1)
    _limit_line(left, rows)
    _series(left, rows, "step_ms_median", "step_ms_q1", "step_ms_q3")
    left.set_ylabel("median step time (ms)")
    left.set_title("step time vs bucket cap")
    left.legend()
    _series(right, rows, "ratio_vs_builtin", "ratio_q1", "ratio_q3")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_ylabel("step time / builtin (median of per-round ratios)")
    right.set_title("ratio to PyTorch's splitter (lower is faster)")
    if title:
        fig.suptitle(title)
    if len({r["bucket_cap_mb"] for r in rows}) > 1 and not any(r.get("runner", r["mode"]) != r["mode"] for r in rows):
        # Modes are interleaved within a cap; caps run one after another.
        fig.text(0.01, 0.01, "caps are measured one after another: compare modes within a cap, not "
                 "absolute times across caps (the machine's load drifts)", fontsize=8, color="grey")
    return _save(fig, path, rect=(0, 0.03, 1, 1))


def plot_modes(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """One bar per row (``step_ms_median`` with ``step_ms_q1``/``q3`` error bars), labelled
    with its ``mode`` and ``units``, as ``fsdp_compare --json`` writes them; returns the path."""
    fig, ax = _pyplot().subplots(figsize=(6, 3.6))
    for i, r in enumerate(rows):
        err = [[r["step_ms_median"] - r["step_ms_q1"]], [r["step_ms_q3"] - r["step_ms_median"]]]
        ax.bar(i, r["step_ms_median"], yerr=err, capsize=4)
    _limit_line(ax, rows)
    if rows and rows[0].get("limit_ms") is not None:
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['mode']}\n{r['units']} units" for r in rows])
    ax.set_ylabel("median step ms (IQR)")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def _limit_line(ax, rows: Sequence[dict]) -> None:
    if rows and rows[0].get("limit_ms") is not None:
        ax.axhline(rows[0]["limit_ms"], ls=":", color="red", lw=1.2, label="physical limit")


def replot(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Redraw the PNG of a ``ddp_compare`` or ``fsdp_compare`` JSON (default: next to it, .png)."""
    rows = json.loads(Path(json_path).read_text())
    if not rows:
        raise ValueError(f"{json_path} holds no rows, so there is nothing to draw: pass the --json of a finished run.")
    return plot_rows(rows, Path(png) if png else Path(json_path).with_suffix(".png"))


def plot_rows(rows: Sequence[dict], png: str | Path) -> Path:
    """The PNG of a ``ddp_compare`` (``plot_caps``) or ``fsdp_compare`` (``plot_modes``) run's rows,
    titled from them; what both benchmarks write and ``replot`` redraws."""
    r0 = rows[0]
    if "bucket_cap_mb" in r0:
        title = (f"{next((r['backend'] for r in rows if r['backend'] != 'eager'), 'eager')}, net {r0.get('net', 'local')}, "
                 f"link {r0['link']}, {r0.get('world_size', '?')} ranks on {r0.get('device', '?')}")
        return plot_caps(rows, png, title=title)
    title = (f"FSDP2, {next((r['backend'] for r in rows if r['backend'] != 'eager'), 'eager')}, net "
             f"{r0.get('net', 'local')}, {r0.get('world_size', '?')} ranks over {r0.get('transport', '?')}, "
             f"{r0.get('device', '?')}")
    return plot_modes(rows, png, title=title)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="rows written by benchmarks.studies.ddp_compare or benchmarks.studies.fsdp_compare --json")
    p.add_argument("png", nargs="?", default=None, help="where to write (default: the JSON path with .png)")
    args = p.parse_args(argv)
    print(f"wrote {replot(args.json, args.png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
