"""The docs block of ``benchmarks.studies.optimizer_in_backward`` from its rows: each row's limit
with the optimizer in backward and without (Note [Optimizer in backward study], step 4), the
done-when figures with why a row missed one, and the table.

    python -m benchmarks.studies.optimizer_in_backward --render --out benchmarks/results/optimizer_in_backward.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..harness.report import fmt, markdown_table, update_section, with_iqr

__all__ = ["START", "END", "PAGE", "HEADERS", "limit_columns", "done_when", "peer_lines", "row_cells",
           "results_markdown", "render"]

START = "<!-- bench:optimizer-in-backward:start -->"
END = "<!-- bench:optimizer-in-backward:end -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "optimizer-in-backward.md"


def _job(row: dict) -> tuple[str, int | None]:
    """The job a row was measured in: its link and batch."""
    return row["link"], row.get("batch")


def _run(row: dict) -> tuple:
    """The run a row was measured in (rows merged from another run differ)."""
    return row.get("date"), row.get("command")


def limit_columns(rows: list[dict]) -> list[dict]:
    """Each measured row with its limit and parts (Note [Optimizer in backward study], step 4), per job;
    each row with the optimizer in backward also with ``peak_saved_mib``, ``peak_saved_of_grad``,
    ``peak_saved_bound_mib`` (the most any update could save: the peak without less this row's start and
    forward's activations, before any gradient exists) and ``limit_gain_ms`` against its strategy's row
    without."""
    for job in dict.fromkeys(_job(r) for r in rows):
        measured = [r for r in rows if _job(r) == job and not r.get("skipped")]
        # The parts come from the compiled strategies' rows; the eager peer gets the same limit where it was
        # measured in the same run (one merged in from another run gets none: peer_lines names its run).
        compiled = [r for r in measured if r["mode"] != "eager"]
        without = [r for r in compiled if not r["optimizer_in_backward"]]
        if not without:
            continue
        fwd, bwd = min(r["fwd_ms"] for r in compiled), min(r["bwd_ms"] for r in compiled)
        opt, comm = min(r["opt_ms"] for r in without), compiled[0]["comm_ms"]
        measured = [r for r in measured if r["mode"] != "eager" or _run(r) == _run(compiled[0])]
        for r in measured:
            last = r.get("last_bucket_mib")
            opt_last = opt * last / r["grad_mib"] if last is not None else 0.0  # unknown: 0 keeps it a bound
            limit = fwd + (max(bwd + opt, comm + opt_last) if r["optimizer_in_backward"] else max(bwd, comm) + opt)
            r.update(limit_ms=limit, limit_fwd_ms=fwd, limit_bwd_ms=bwd, limit_comm_ms=comm, limit_opt_ms=opt,
                     limit_opt_last_ms=opt_last if r["optimizer_in_backward"] else None, link_bound=comm > bwd,
                     step_over_limit=r["step_ms_median"] / limit)
        for r in measured:
            base = next((b for b in without if b["mode"] == r["mode"]), None)
            if r["optimizer_in_backward"] and base is not None:
                saved = _less(base, r, "peak_mib")
                freed = _less(base, r, "backward_end_mib")
                r.update(peak_saved_mib=saved, peak_saved_of_grad=saved / r["grad_mib"] if saved is not None else None,
                         start_saved_mib=_less(base, r, "start_mib"), peak_saved_bound_mib=_bound(base, r),
                         backward_end_saved_of_grad=freed / r["grad_mib"] if freed is not None else None,
                         limit_gain_ms=base["limit_ms"] - r["limit_ms"])
    return rows


def _less(base: dict, r: dict, key: str) -> float | None:
    return base[key] - r[key] if base.get(key) is not None and r.get(key) is not None else None


def _bound(base: dict, r: dict) -> float | None:
    """The most the update could lower the peak: when forward ends no gradient exists in either mode, so
    the step cannot peak below its start plus forward's activations."""
    parts = (base.get("peak_mib"), r.get("start_mib"), r.get("forward_end_mib"))
    return parts[0] - parts[1] - parts[2] if None not in parts else None


def _why_not_faster(r: dict) -> str:
    """Why a row with the optimizer in backward did not step faster, from its limit's parts."""
    bwd, comm, opt, last = (r[f"limit_{k}_ms"] for k in ("bwd", "comm", "opt", "opt_last"))
    if not r["link_bound"]:
        return (f"compute-bound (bwd {bwd:.0f} ms >= comm {comm:.0f} ms): both limits are fwd + bwd + opt, so the "
                "update only moves into backward, where it competes for the same core")
    return (f"link-bound, but the limits allow at most min(comm - bwd, opt - opt_last) = min({comm - bwd:.0f}, "
            f"{opt - last:.0f}) = {r['limit_gain_ms']:.0f} ms ({r['limit_gain_ms'] / r['step_ms_median']:.0%} of the "
            f"step), inside the ratio's IQR [{r['ratio_vs_without_q1']:.3f}, {r['ratio_vs_without_q3']:.3f}]")


def _why_not_lower(r: dict) -> str:
    """Why a row with the optimizer in backward did not lower the peak by 0.8 of the gradient bytes."""
    own, activations, grad = r["peak_above_start_mib"], r["forward_end_mib"], r["grad_mib"]
    at_rest = r.get("start_saved_mib")
    rest = ""
    if at_rest is not None and at_rest < 0.8 * grad:
        shown = round(at_rest, 1) + 0.0  # + 0.0: no "-0.0"
        rest = f"the step starts with {abs(shown):.1f} MiB {'more' if shown < 0 else 'fewer'} bytes live than without"
        if r["mode"] == "traced":
            rest += (" (between steps the traced strategy holds no gradient memory in either mode: `zero_grad()` "
                     "frees the gradients without the update, and DDP's C++ bucket buffers, unused there, are freed "
                     "when it compiles)")
        rest += "; "
    bound = r.get("peak_saved_bound_mib")
    if own - activations < 0.2 * grad:
        return (rest + f"the step's own peak ({own:.1f} MiB) is forward's activations ({activations:.1f} MiB live "
                "when forward ended) as backward starts, before any gradient exists to free")
    if bound is not None and bound < 0.8 * grad:
        return (rest + f"no update could: the peak without is only {bound:.1f} MiB ({bound / grad:.2f} x the gradient "
                f"bytes) above this step's start plus forward's activations ({activations:.1f} MiB live when forward "
                "ended, before any gradient exists), and the step cannot peak below that")
    buckets = r.get("bucket_mib") or []
    lives = ("under DDP's reducer each bucket's buffer, which holds its gradients, lives from the bucket's first "
             "gradient to backward's end, where the reducer reads every bucket" if r["mode"] == "split"
             else "a bucket's gradients live from its backward until its update")
    text = rest + (f"the step's own peak is {own:.1f} MiB, of which {activations:.1f} MiB are forward's activations; "
                   f"the other {own - activations:.1f} MiB are backward's temporaries and the gradients live at once: "
                   + lives)
    if buckets:
        text += (f"; the auto plan's {len(buckets)} bucket(s): the largest {max(buckets):.1f} MiB, the last reduced "
                 f"{buckets[-1]:.1f} MiB, of {grad:.1f} MiB")
    return text


def done_when(rows: Sequence[dict]) -> list[dict]:
    """Per link and strategy with the optimizer in backward measured: peak saved / gradient bytes
    (goal >= 0.8), the step ratio to the same strategy without (goal <= 1.00) and, where that
    ratio is above 1.00, why from the limit's parts."""
    out = []
    for r in rows:
        if r["optimizer_in_backward"] and not r.get("skipped") and "limit_gain_ms" in r:
            ratio = r["ratio_vs_without"]
            saved = r.get("peak_saved_of_grad")
            bound = r.get("peak_saved_bound_mib")
            out.append({"link": r["link"], "batch": r.get("batch"), "mode": r["mode"], "peak_saved_of_grad": saved,
                        "peak_saved_bound_of_grad": bound / r["grad_mib"] if bound is not None else None,
                        "memory_met": saved is not None and saved >= 0.8,
                        "backward_end_saved_of_grad": r.get("backward_end_saved_of_grad"), "ratio": ratio,
                        "ratio_q1": r["ratio_vs_without_q1"], "ratio_q3": r["ratio_vs_without_q3"],
                        "speed_met": ratio <= 1.0, "why": None if ratio <= 1.0 else _why_not_faster(r),
                        "memory_why": None if saved is None or saved >= 0.8 else _why_not_lower(r)})
    return out


HEADERS = ["link", "batch", "mode", "optimizer in backward", "step ms [IQR]", "vs without [IQR]", "peak MiB",
           "step's own peak MiB", "peak saved / grad bytes", "live at forward's end MiB", "live at backward's end MiB",
           "limit ms", "step / limit",
           "fwd / bwd / comm / opt / opt_last ms"]


def _mode_cell(r: dict) -> str:
    """The mode column: the strategy, or the peer (eager DDP with ``lazy_bucket_allocation=True``)."""
    return "eager, lazy buckets" if r["mode"] == "eager" and r.get("lazy_bucket_allocation") else r["mode"]


def row_cells(r: dict) -> list[str]:
    if r.get("skipped"):
        return [r["link"], fmt(r.get("batch"), "d"), r["mode"], "yes" if r["optimizer_in_backward"] else "no",
                "skipped (below)", *[""] * (len(HEADERS) - 5)]
    parts = " / ".join(fmt(r.get(f"limit_{k}_ms"), ".0f") for k in ("fwd", "bwd", "comm", "opt", "opt_last"))
    return [r["link"], fmt(r.get("batch"), "d"), _mode_cell(r), "yes" if r["optimizer_in_backward"] else "no",
            with_iqr(r["step_ms_median"], r.get("step_ms_q1"), r.get("step_ms_q3"), ".0f"),
            with_iqr(r["ratio_vs_without"], r.get("ratio_vs_without_q1"), r.get("ratio_vs_without_q3")),
            fmt(r["peak_mib"], ".1f"), fmt(r.get("peak_above_start_mib"), ".1f"),
            fmt(r.get("peak_saved_of_grad"), ".2f"), fmt(r.get("forward_end_mib"), ".1f"),
            fmt(r.get("backward_end_mib"), ".1f"), fmt(r.get("limit_ms"), ".0f"),
            fmt(r.get("step_over_limit"), ".2f"), parts]


def peer_lines(rows: Sequence[dict]) -> list[str]:
    """Per job with the peer (eager DDP, ``lazy_bucket_allocation=True``): its peak against split with the
    optimizer in backward of the same link and batch, and the run it came from where that is not the table's."""
    first = next((r for r in rows if not r.get("skipped")), {})
    out = []
    for r in rows:
        if r.get("skipped") or r["mode"] != "eager" or not r.get("lazy_bucket_allocation"):
            continue
        ours = next((b for b in rows if _job(b) == _job(r) and b["mode"] == "split" and b["optimizer_in_backward"]
                     and not b.get("skipped")), None)
        line = (f"- {r['link']}, batch {fmt(r.get('batch'), 'd')}: peak {fmt(r['peak_mib'], '.1f')} MiB (the step's "
                f"own {fmt(r.get('peak_above_start_mib'), '.1f')}, from {fmt(r.get('start_mib'), '.1f')} MiB live at "
                f"its start)")
        if ours is not None and ours.get("peak_mib") is not None and r.get("peak_mib") is not None:
            below = r["peak_mib"] - ours["peak_mib"]
            line += (f"; split with the optimizer in backward peaks at {ours['peak_mib']:.1f} MiB, "
                     f"{abs(below):.1f} MiB ({abs(below) / r['grad_mib']:.2f} x the gradient bytes) "
                     f"{'below' if below >= 0 else 'above'} it")
        if _run(r) != _run(first):
            line += (f" (measured in a run of its own, {r.get('date', '?')}: `{r.get('command', '?')}`; its step time "
                     "and limit are not comparable with the table's)")
        out.append(line)
    return out


def _goal_line(g: dict) -> str:
    met = {True: "met", False: "not met"}
    return (f"- {g['link']}, batch {fmt(g['batch'], 'd')}, {g['mode']}: peak lowered by "
            f"{fmt(g['peak_saved_of_grad'], '.2f')} x the gradient bytes ({met[g['memory_met']]}, goal >= 0.8"
            + (f"; at most {g['peak_saved_bound_of_grad']:.2f} x possible" if g["peak_saved_bound_of_grad"] is not None
               else "") + "), live "
            f"bytes at backward's end by {fmt(g['backward_end_saved_of_grad'], '.2f')} x; step "
            f"{with_iqr(g['ratio'], g['ratio_q1'], g['ratio_q3'])} x without ({met[g['speed_met']]}, goal <= 1.00)"
            + (f": {g['why']}" if g["why"] else "") + (f"; memory: {g['memory_why']}" if g["memory_why"] else ""))


def results_markdown(rows: Sequence[dict]) -> str:
    """The docs block: how it was measured, the table, the done-when figures, the command. The derived
    columns (limits, savings) are computed again from the measured ones, as this code defines them."""
    rows = limit_columns([dict(r) for r in rows])
    measured = [r for r in rows if not r.get("skipped")]
    r0 = (measured or list(rows))[0]
    peak_how = ("torch.cuda.max_memory_allocated" if str(r0["device"]).startswith("cuda") else
                "the live CPU tensor bytes of the rank's process, every thread included (its `c10::alloc_cpu` less "
                "`c10::free_cpu`, counted by a preloaded shim, `benchmarks/harness/heap_peak.py`; the whole heap's "
                "peak is `peak_heap_mib` in the JSON)" if "peak_heap_mib" in r0 else
                "the live heap bytes of the rank's process, every thread included (a malloc shim, "
                "`benchmarks/harness/heap_peak.py`)")
    text = (f"torch {r0['torch']}, {r0['device']}, {r0.get('date', '?')}: {r0['world_size']} ranks over gloo; links: "
            + ", ".join(dict.fromkeys(r["link"] for r in rows)) + " (none = loopback; a rate = two nodes in network "
            f"namespaces joined by a `tc tbf` link). {r0['model'].rsplit(', batch', 1)[0]}, batch "
            + ", ".join(str(b) for b in dict.fromkeys(r.get("batch") for r in rows)) + " sequences per rank (one job "
            f"per link and batch), {r0['grad_mib']:.1f} MiB of fp32 gradients, "
            f"AdamW, `{r0['backend']}`, `bucket_cap_mb=\"auto\"`; per job {r0.get('warmup', '?')} warm-up and "
            f"{r0.get('rounds', '?')} measured interleaved rounds. Peak: the most over ranks and steps of {peak_how} "
            "during a synchronised step (forward, backward, `optimizer.step()`, `zero_grad()`), measured in a job of "
            f"that mode alone ({r0.get('memory_rounds', '?')} steps after one warm-up, the same link; one copy of the "
            "model per process, so what the rank keeps between steps counts); the step's own peak "
            "is that minus the bytes live when the step started (the weights, optimizer states and whatever else "
            "the process holds); live at forward's and backward's end: the bytes live when the forward or `backward()` "
            "returned minus those at the start (median over rounds, most over ranks): forward's activations, and "
            "the gradients unless their updates freed them. vs without: median of per-round ratios to the same "
            "strategy without the optimizer in backward, IQR in brackets. limit: without "
            "`fwd + max(bwd, comm) + opt`, with `fwd + max(bwd + opt, comm + opt_last)`.")
    skipped = {r["mode"]: r["skipped"] for r in rows if r.get("skipped")}
    parts = [text, markdown_table(HEADERS, [row_cells(r) for r in rows]),
             "\n".join(f"Skipped, {mode}: {why}" for mode, why in skipped.items())]
    goals = done_when(rows)
    if goals:
        parts.append("Against the goals:\n\n" + "\n".join(_goal_line(g) for g in goals))
    peers = peer_lines(rows)
    if peers:
        parts.append("The peer, eager DDP built with `lazy_bucket_allocation=True` (DDP's own caps, no compile, "
                     "`optimizer.step()` after backward; torch 2.15 added it), against split with the optimizer in "
                     "backward in the table:\n\n" + "\n".join(peers))
    parts += [f"Command: `{r0['command']}`" if r0.get("command") else "",
              "Generated by `python -m benchmarks.render.pages` from `benchmarks/results/optimizer_in_backward.json`."]
    return "\n\n".join(p for p in parts if p)


def render(out: str | Path, page: str | Path = PAGE) -> str:
    """Rewrite ``page``'s block from the rows at ``out``; return the block."""
    return update_section(page, results_markdown(json.loads(Path(out).read_text())), START, END)
