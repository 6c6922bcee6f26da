"""The modes of ``benchmarks.studies.lightning_compare`` and their rows (Note [Lightning on a shaped
link] there): what a Lightning user writes in each mode and the bucket cap it runs at, and the
table rows from what the fits measured. Pure: no torch, no Lightning, so that the command line and
the docs block (``lightning_compare``) and the ranks (``lightning_fits``) share it without importing
each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..harness.report import fmt, markdown_table, with_iqr
from ..harness.stats import median, ratio_summary

__all__ = ["LightningMode", "MODES", "BASELINE", "COMMAND_ENV", "DDP_DEFAULT_CAP_MB", "HEADERS", "mode_rows",
           "format_table"]

BASELINE = "lightning_compile"  # the ratio column divides by Lightning's own idiom, round by round
COMMAND_ENV = "BENCH_LIGHTNING_COMMAND"  # the user's command line, handed to the workers by relaunch
DDP_DEFAULT_CAP_MB = 25.0  # DistributedDataParallel's bucket_cap_mb default


@dataclass(frozen=True)
class LightningMode:
    """One way a Lightning user trains the model: what they write, and the bucket cap it runs at."""

    name: str
    code: str  # what the user writes, as shown in the table
    compiled: bool
    bucket_cap_mb: float | str = DDP_DEFAULT_CAP_MB
    ours: bool = False

    def strategy(self, backend: str):
        """The Trainer's ``strategy`` argument of this mode."""
        if not self.ours:
            return "ddp"
        from ddp_opt.frameworks.lightning import CompiledDDPStrategy

        cap = {"bucket_cap_mb": self.bucket_cap_mb} if self.bucket_cap_mb == "auto" else {}
        return CompiledDDPStrategy(backend=backend, **cap)


MODES: dict[str, LightningMode] = {m.name: m for m in (
    LightningMode("eager", 'strategy="ddp"', compiled=False),
    LightningMode(BASELINE, 'fit(torch.compile(model)), strategy="ddp"', compiled=True),
    LightningMode("ours", "strategy=CompiledDDPStrategy()", compiled=True, ours=True),
    LightningMode("ours_auto", 'strategy=CompiledDDPStrategy(bucket_cap_mb="auto")', compiled=True,
                  bucket_cap_mb="auto", ours=True),
)}


# --- pure: the rows from what was measured, and their text ------------------------------------------


def mode_rows(fits: Mapping[str, Sequence[Sequence[float]]], baseline: str = BASELINE) -> list[dict]:
    """One row per mode from ``fits[mode][round]``, the measured step seconds of that mode's fit
    in that round: ``step_ms_median`` (every measured step pooled), ``step_ms_rounds`` (each
    fit's median) and ``vs_lightning_compile`` (median, q1, q3 of the per-round ratios of the
    fits' medians to ``baseline``'s)."""
    per_round = {mode: [median(steps) for steps in rounds] for mode, rounds in fits.items()}
    rows = []
    for mode, rounds in fits.items():
        mid, q1, q3 = ratio_summary(per_round[mode], per_round[baseline])
        rows.append({"mode": mode, "step_ms_median": median([s for steps in rounds for s in steps]) * 1e3,
                     "step_ms_rounds": [t * 1e3 for t in per_round[mode]],
                     "vs_lightning_compile": {"median": mid, "q1": q1, "q3": q3}})
    return rows


HEADERS = ["mode", "what the user writes", "bucket_cap_mb", "step ms", f"vs {BASELINE} [IQR]",
           "fwd / bwd / opt ms", "partitions", "alignment", "loss diff"]


def _cells(r: dict) -> list[str]:
    ratio = r["vs_lightning_compile"]
    phases = " / ".join(fmt(r.get(k), ".0f") for k in ("fwd_ms", "bwd_ms", "opt_ms"))
    return [f"`{r['mode']}`", f"`{MODES[r['mode']].code}`" if r["mode"] in MODES else "?",
            str(r["bucket_cap_mb"]) if isinstance(r["bucket_cap_mb"], str) else f"{r['bucket_cap_mb']:g}",
            fmt(r["step_ms_median"], ".0f"), with_iqr(ratio["median"], ratio["q1"], ratio["q3"]), phases,
            fmt(r.get("buckets"), "d"), fmt(r.get("alignment"), ".2f"), fmt(r.get("loss_max_abs_diff"), ".1e")]


def format_table(rows: Sequence[dict]) -> str:
    """The rows as the docs block's Markdown table."""
    return markdown_table(HEADERS, [_cells(r) for r in rows])
