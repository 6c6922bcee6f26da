"""What each lever of the DDP optimizer gives on one shaped-link sweep, read from
the sweep's rows: every ratio compares two runners measured in the same
interleaved rounds (median of per-round ratios, IQR); a lever not built gets its
ceiling, computed from what the sweep measured.

Note [Lever ablation]

Background
    Five levers make up ours; the ablation reports the measured
    gain of each. One sweep (``ddp_compare --sweep``) runs every mode at every cap
    in each round, so a lever's gain is a ratio of two of its runners.

Algorithm
    - 1, cost-model plan: a strategy at ``auto`` against the same strategy at its
      best fixed cap in this sweep (below 1: the plan beats every cap tried), and
      the plan's predicted exposed communication over the measured one, before
      and after calibrating it on the measured rounds (backward scale and
      contention; Note [Calibration from a measured backward] in
      ``ddp_opt.planning.calibrate``), whether the calibrated model would choose another
      plan, and the same ratio for the strategy's fixed caps, predicted with the
      contention fitted on ``auto`` (out of sample).
    - 2, traced strategy: ``ours_traced@auto`` over ``ours@auto`` (split).
    - 4, first bucket at most 1 MiB: ``ours_traced@4`` over ``compiled_autograd@4``,
      whose fusion pass groups 1 MiB first, then 4 MiB. With an earlier sweep run
      before the cap (``before``), the same ratio there, where the first bucket
      was 4 MiB.
    - 3, optimizer overlapped with communication (not built): its ceiling. The
      optimizer of every bucket but the last could run under the link, so a step
      gains at most the optimizer step: ``(step - opt) / step`` of our best ``auto`` row.
    - 5, ``strategy=auto`` (not built): picking the faster strategy from a timed
      warm-up can give at most the faster of split and traced at ``auto``; its
      ceiling over ``strategy="traced"`` is the split row over the traced row
      when split is faster by median, else 1.
    - Last, the result: our faster ``auto`` row against the best peer at its best cap.
"""

from __future__ import annotations

from typing import Sequence

from ..harness.limit import PEER_MODES
from ..harness.stats import ratio_summary

__all__ = ["ablation_rows", "ablation_markdown"]

SPLIT, TRACED = "ours", "ours_traced"


def _row(rows: Sequence[dict], mode: str, cap: float | str) -> dict | None:
    return next((r for r in rows if r["mode"] == mode and r.get("bucket_cap_mb") == cap and r.get("step_ms_rounds")),
                None)


def _best_fixed(rows: Sequence[dict], mode: str) -> dict | None:
    fixed = [r for r in rows if r["mode"] == mode and not isinstance(r.get("bucket_cap_mb"), str)
             and r.get("step_ms_rounds")]
    return min(fixed, key=lambda r: r["step_ms_median"]) if fixed else None


def _ratio(lever: str, what: str, a: dict | None, b: dict | None, note: str = "") -> dict | None:
    if a is None or b is None:
        return None
    mid, q1, q3 = ratio_summary(a["step_ms_rounds"], b["step_ms_rounds"])
    return {"lever": lever, "comparison": f"{a['runner']} / {b['runner']}", "what": what, "ratio": mid,
            "ratio_q1": q1, "ratio_q3": q3, "note": note}


def _quoted(r: dict) -> str:
    return f"{r['ratio']:.3f} [{r['ratio_q1']:.3f}, {r['ratio_q3']:.3f}]"


def _prediction_note(r: dict | None, rows: Sequence[dict]) -> str:
    if r is None or r.get("predicted_exposed_comm_ms") is None or not r.get("exposed_comm_ms"):
        return ""
    pred, meas = r["predicted_exposed_comm_ms"], r["exposed_comm_ms"]
    note = f"exposed comm predicted {pred:.1f} ms, measured {meas:.1f} ms ({pred / meas:.2f}x)"
    calibrated = r.get("calibrated_predicted_exposed_comm_ms")
    if calibrated is None:
        return note
    gain = r.get("calibrated_plan_gain_ms", 0.0)
    plan = "keeps the plan" if not r.get("calibrated_plan_changes") else (
        f"re-plans to {len(r['calibrated_plan_mib'])} buckets, " + (f"{gain:.1f} ms sooner" if gain >= 0 else
                                                                   f"{-gain:.1f} ms later but more robust"))
    rounds = r.get("calibration_rounds", 3)  # sweeps before the column calibrated on their first 3 rounds
    note = (f"{note}; calibrated (backward x{r['backward_scale']:.2f}, contention "
            f"{r.get('contention_ms_per_mib', 0.0):.2f} ms/MiB, on {rounds} rounds): {calibrated:.1f} ms "
            f"({calibrated / meas:.2f}x), {plan}")
    fixed = [x for x in rows if x["mode"] == r["mode"] and not isinstance(x.get("bucket_cap_mb"), str)
             and x.get("calibrated_predicted_exposed_comm_ms") is not None and x.get("exposed_comm_ms")]
    if fixed:
        note += "; fixed caps calibrated alike: " + ", ".join(
            f"@{x['bucket_cap_mb']:g} {x['calibrated_predicted_exposed_comm_ms'] / x['exposed_comm_ms']:.2f}x"
            for x in fixed)
    return note


def ablation_rows(rows: Sequence[dict], before: Sequence[dict] | None = None) -> list[dict]:
    """The lever-by-lever rows of one sweep (Note [Lever ablation]); ``before``: the
    rows of an earlier sweep of the same job, for lever 4's ratio before its cap."""
    out: list[dict | None] = []
    for mode in (SPLIT, TRACED):
        auto = _row(rows, mode, "auto")
        out.append(_ratio("1 cost-model plan", f"{mode} plan vs its best fixed cap", auto, _best_fixed(rows, mode),
                          _prediction_note(auto, rows)))
    split, traced = _row(rows, SPLIT, "auto"), _row(rows, TRACED, "auto")
    out.append(_ratio("2 traced strategy", "traced vs split, both planned", traced, split))
    after = _ratio("4 first bucket <= 1 MiB", "traced at 4 MiB vs the same grouping in compiled autograd",
                   _row(rows, TRACED, 4.0), _row(rows, "compiled_autograd", 4.0))
    if after is not None and before:
        earlier = _ratio("4 first bucket <= 1 MiB", "before the cap", _row(before, TRACED, 4.0),
                         _row(before, "compiled_autograd", 4.0))
        if earlier is not None:
            after["note"] = f"before the cap (4 MiB first bucket, earlier sweep): {_quoted(earlier)}"
    out.append(after)
    ours = [r for r in (split, traced) if r is not None]
    if ours:
        fastest = min(ours, key=lambda r: r["step_ms_median"])
        opt, step = fastest.get("opt_ms"), fastest["step_ms_median"]
        if opt is not None:
            out.append({"lever": "3 optimizer under the link", "comparison": f"ceiling on {fastest['runner']}",
                        "what": "not built: at most the optimizer step", "ratio": (step - opt) / step,
                        "ratio_q1": None, "ratio_q3": None,
                        "note": f"optimizer step {opt:.1f} ms of a {step:.1f} ms step"})
    if split is not None and traced is not None:
        faster = _ratio("5 strategy=auto", "split vs traced", split, traced)
        out.append({"lever": "5 strategy=auto", "comparison": f"ceiling over {traced['runner']}",
                    "what": "not built: at most the faster strategy", "ratio": min(1.0, faster["ratio"]),
                    "ratio_q1": None, "ratio_q3": None, "note": f"split / traced at auto: {_quoted(faster)}"})
        peers = [r for r in rows if r["mode"] in PEER_MODES and r.get("step_ms_rounds")]
        if peers:
            mine = min((split, traced), key=lambda r: r["step_ms_median"])
            out.append(_ratio("result", "our faster auto row vs the best peer at its best cap", mine,
                              min(peers, key=lambda r: r["step_ms_median"])))
    return [r for r in out if r is not None]


def ablation_markdown(rows: Sequence[dict], before: Sequence[dict] | None = None) -> str:
    """The ablation as a Markdown table with its one-line reading ("" without our auto rows)."""
    from ..harness.report import markdown_table, with_iqr

    found = ablation_rows(rows, before)
    if not found:
        return ""
    lines = [[r["lever"], r["what"], f"`{r['comparison']}`", with_iqr(r["ratio"], r["ratio_q1"], r["ratio_q3"])
              if r["ratio_q1"] is not None else f"{r['ratio']:.3f}", r["note"]] for r in found]
    return ("Lever by lever (Note [Lever ablation] in `benchmarks.render.ablation`): medians of per-round ratios [IQR] "
            "between runners of this sweep, below 1 is faster; levers not built show their ceiling:\n\n"
            + markdown_table(["lever", "what", "comparison", "ratio [IQR]", "note"], lines))
