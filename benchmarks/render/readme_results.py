"""Regenerate a docs page's DDP benchmark section from ``ddp_compare --json`` files.

Only the text between the markers ``<!-- bench:ddp:start -->`` and
``<!-- bench:ddp:end -->`` is replaced; the rest of the file is left byte for byte.

    python -m benchmarks.render.readme_results bench_out/full.json docs/benchmarks/ddp-shaped.md --plot results/full.png
    python -m benchmarks.render.readme_results bench_out/sweep_slow.json bench_out/sweep_fast.json PAGE.md \
        --plot bench_out/sweep_slow.png --plot bench_out/sweep_fast.png

``--plot`` is linked relative to the page. The committed pages are regenerated together,
from ``benchmarks/results/``, by ``python -m benchmarks.render.pages``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from ..harness import report
from .ablation import ablation_markdown
from ..harness.report import cap_label, fmt, markdown_table, update_section, with_iqr

__all__ = ["START", "END", "results_markdown", "replace_section", "section_body", "update_file", "main"]

START = "<!-- bench:ddp:start -->"
END = "<!-- bench:ddp:end -->"


def _cells(r: dict, predicted: bool, peak: bool, limit: bool) -> list[str]:
    """One table line of a row; the ratio names its baseline when that ran at another cap."""
    ratio = with_iqr(r.get("ratio_vs_builtin"), r.get("ratio_q1"), r.get("ratio_q3"))
    if r.get("ratio_baseline") and r.get("runner") and r["mode"] != "builtin" and "@" in r["ratio_baseline"] \
            and r["ratio_baseline"].split("@")[1] != str(r["runner"]).split("@")[1]:
        ratio += f" vs {r['ratio_baseline']}"
    return [
        cap_label(r["bucket_cap_mb"]), r["mode"], r["backend"], fmt(r["step_ms_median"], ".1f"), ratio,
        *([with_iqr(r.get("ratio_vs_best_peer"), r.get("ratio_vs_best_peer_q1"), r.get("ratio_vs_best_peer_q3")),
           fmt(r.get("step_over_limit"), ".2f")] if limit else []),
        fmt(r.get("exposed_comm_ms"), ".1f"), *([fmt(r.get("predicted_exposed_comm_ms"), ".1f")] if predicted else []),
        fmt(r.get("overlap"), ".2f"), fmt(r.get("compile_cold_s", r.get("compile_s")), ".1f"),
        fmt(r.get("compile_warm_s"), ".1f"), fmt(r.get("partitions"), "d"), fmt(r.get("alignment"), ".2f"),
        *([fmt(r.get("peak_mib"), ".0f")] if peak else []), fmt(r.get("loss_max_abs_diff"), ".2e"),
    ]


def results_markdown(rows: Sequence[dict], plot: str | None = None, before: Sequence[dict] | None = None) -> str:
    """A Markdown table (one line per mode and cap) and, if given, the plot link. The
    predicted and peak-memory columns appear when some row has them (peak: CUDA runs).
    A sweep with a limit gets the against-peers and lever-ablation tables; ``before``:
    an earlier sweep's rows for the ablation (Note [Lever ablation])."""
    predicted = any(r.get("predicted_exposed_comm_ms") is not None for r in rows)
    peak = any(r.get("peak_mib") is not None for r in rows)
    limit = any(r.get("limit_ms") is not None for r in rows)
    headers = ["cap MiB", "mode", "backend", "step ms (median)", "ratio vs builtin [IQR]",
               *(["vs best peer [IQR]", "step / limit"] if limit else []), "exposed comm ms",
               *(["predicted exposed ms"] if predicted else []), "overlap", "cold compile s", "warm compile s",
               "partitions", "alignment", *(["peak MiB"] if peak else []), "max loss diff"]
    # numeric caps in order, then auto (a sweep's cost-model plan)
    ordered = sorted(rows, key=lambda r: (isinstance(r["bucket_cap_mb"], str), str(r["bucket_cap_mb"])
                                          if isinstance(r["bucket_cap_mb"], str) else r["bucket_cap_mb"],
                                          r.get("mode_order", 0)))
    table = markdown_table(headers, [_cells(r, predicted, peak, limit) for r in ordered])
    parts = []
    sweep = any(r.get("runner") and r["runner"] != r["mode"] for r in rows)
    if rows:
        r0 = rows[0]
        model = f" {r0['model']}, {r0['grad_mib']:.1f} MiB of gradients;" if r0.get("model") and r0.get("grad_mib") else ""
        device = f" device `{r0['device']}`," if r0.get("device") else ""
        device += f" torch {r0['torch']}," if r0.get("torch") else " torch not recorded (2.13 or older),"
        net = r0.get("net", "local")
        where = (f"Network `{net}` (two nodes in their own network namespaces, the link between them shaped with "
                 f"`tc tbf`; no simulated link)" if net != "local" else f"Link `{r0['link']}`")
        parts.append(
            f"{where}, world size {r0.get('world_size', '?')},{device}{model} "
            + (f"{r0.get('rounds', '?')} measured rounds in which every (mode, cap) pair, `ours@auto` included, "
               "takes its turn (one interleaved sweep: absolute times compare across caps). "
               "Ratios are medians of per-round ratios to `builtin` at the same cap, `auto`/eager to `builtin@25` "
               "(IQR in brackets; below 1 is faster). Predicted exposed ms = the cost model's communication tail "
               "after backward for the plan it chose. Compile seconds: the first step in a shared process, with "
               "Inductor's on-disk caches left from earlier runs, which `ours` partitions can hit and PyTorch's "
               "splitter bypasses: not a cold-compile comparison (see the compile-time benchmark); no warm "
               "compile in a sweep. "
               if sweep else
               f"{r0.get('rounds', '?')} measured rounds per cap, modes interleaved round by round "
               "(caps run one after another, so compare modes within a cap, not absolute times across caps). "
               "Ratios are medians of per-round ratios to `builtin` (IQR in brackets; below 1 is faster). ") +
            ("Gradients zeroed in place between steps (`--keep-grads`: `zero_grad(set_to_none=False)`, as "
             "with a compiled optimizer), so every backward adds to existing gradients. "
             if r0.get("keep_grads") else "") +
            "Exposed comm = synchronised forward+backward minus the same under `no_sync`; "
            "overlap = (compute + comm - step) / min(compute, comm), 1.0 hides all communication. "
            "Alignment = fraction of gradient bytes whose runtime DDP bucket is exactly one partition "
            "(- where not measured: eager has no partitions, PyTorch's splitter keeps its plan to itself). "
            + (f"Physical limit {r0['limit_ms']:.1f} ms = fwd {r0['limit_fwd_ms']:.1f} + max(bwd "
               f"{r0['limit_bwd_ms']:.1f}, comm {r0['limit_comm_ms']:.1f}) + opt {r0['limit_opt_ms']:.1f} "
               "(the fastest forward, backward and optimizer step of any mode, and one all-reduce of all the "
               "gradient bytes over the same link; Note [Physical limit of a step] in `benchmarks.harness.limit`); "
               "step / limit = 1.0 is a perfect step. Best peer = the fastest of eager DDP, PyTorch's splitter "
               f"and compiled autograd's reducer at any cap (here `{r0.get('best_peer')}`); its ratio is the "
               "median of per-round ratios. " if limit else "")
            + ("Peak MiB = `torch.cuda.max_memory_allocated` over a synchronised step, max over ranks and "
               "measured rounds. " if peak else "")
            + ("" if sweep else
               "Compile seconds = first step minus the median step; cold = fresh inductor cache dir, "
               "warm = `torch._dynamo.reset()` and recompile in the same process with the same cache dir. ")
            + "Generated by `python -m benchmarks.render.readme_results` from the benchmark's JSON."
        )
    if rows and rows[0].get("command"):
        parts.append(f"Command: `{rows[0]['command']}`")
    parts.append(table)
    if sweep:
        from ..studies.sweep import format_summary, sweep_summary

        summary = format_summary(sweep_summary(rows))
        if summary:
            parts.append(summary)
    if sweep and limit:
        parts.append(_peers_markdown(rows))
        parts.append(ablation_markdown(rows, before))
    if plot:
        parts.append(f"![step time vs bucket cap]({plot})")
    return "\n\n".join(p for p in parts if p)


def _peers_markdown(rows: Sequence[dict]) -> str:
    """Each of our auto rows against every peer at its default cap and at its best cap."""
    from ..harness.limit import against_peers

    found = against_peers(rows)
    if not found:
        return ""
    lines = [[v["ours"], f"{v['peer']} ({v['which']})",
              f"{fmt(v['ratio'], '.3f')} [{fmt(v['ratio_q1'], '.3f')}, {fmt(v['ratio_q3'], '.3f')}]",
              fmt(v["step_over_limit"], ".2f")] for v in found]
    return ("Ours at `auto` against each peer at its default cap (what users run) and at its best cap in this "
            "sweep; median of per-round ratios [IQR], below 1 is faster:\n\n"
            + markdown_table(["ours", "peer", "ours / peer [IQR]", "ours step / limit"], lines))


def replace_section(text: str, body: str) -> str:
    """``text`` with everything between the DDP markers replaced by ``body``."""
    return report.replace_section(text, body, START, END)


def _per_file(value: str | Sequence[str] | None, n: int) -> list[str | None]:
    """One entry per JSON file: a list as given ("-" for none), padded with None."""
    values = [value] if value is None or isinstance(value, str) else list(value)
    values = [None if v == "-" else v for v in values]
    return values + [None] * (n - len(values))


def section_body(json_path: str | Path | Sequence[str | Path], plot: str | Sequence[str] | None = None,
                 before: str | Sequence[str] | None = None) -> str:
    """The marked section's text for the rows in ``json_path``.

    Several JSON files (e.g. one sweep per link) give one block each, in order;
    ``plot`` and ``before`` (an earlier sweep's JSON for the ablation) are then lists
    with one entry per file ("-" or None for none).
    """
    paths = [json_path] if isinstance(json_path, (str, Path)) else list(json_path)
    plots, befores = _per_file(plot, len(paths)), _per_file(before, len(paths))
    return "\n\n".join(
        results_markdown(json.loads(Path(p).read_text()), plot=pl,
                         before=json.loads(Path(b).read_text()) if b else None)
        for p, pl, b in zip(paths, plots, befores))


def update_file(json_path: str | Path | Sequence[str | Path], target: str | Path,
                plot: str | Sequence[str] | None = None, before: str | Sequence[str] | None = None) -> str:
    """Rewrite ``target``'s marked section from the rows in ``json_path`` (see
    ``section_body``); return the new body."""
    return update_section(target, section_body(json_path, plot, before), START, END)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="rows written by python -m benchmarks.studies.ddp_compare --json (one block each)")
    p.add_argument("target", help="Markdown file with the bench:ddp markers (e.g. docs/benchmarks/ddp-shaped.md)")
    p.add_argument("--plot", action="append", default=None,
                   help="image path to link, relative to the target file (once per JSON file, in order)")
    p.add_argument("--before", action="append", default=None,
                   help="an earlier sweep's JSON for the lever ablation (once per JSON file, in order; - for none)")
    args = p.parse_args(argv)
    update_file(args.json, args.target, plot=args.plot, before=args.before)
    print(f"updated {args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
