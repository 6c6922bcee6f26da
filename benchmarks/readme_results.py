"""Regenerate a README's benchmark section from a ``ddp_compare --json`` file.

Only the text between the markers ``<!-- bench:ddp:start -->`` and
``<!-- bench:ddp:end -->`` is replaced; the rest of the file is left byte for byte.

    python -m benchmarks.readme_results bench_out/full.json README.md --plot bench_out/full.png
    python -m benchmarks.readme_results bench_out/sweep_slow.json bench_out/sweep_fast.json README.md \
        --plot bench_out/sweep_slow.png --plot bench_out/sweep_fast.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Sequence

__all__ = ["START", "END", "results_markdown", "replace_section", "update_file", "main",
           "PADDING_START", "PADDING_END", "padding_markdown", "update_padding_section"]

START = "<!-- bench:ddp:start -->"
END = "<!-- bench:ddp:end -->"


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def results_markdown(rows: Sequence[dict], plot: str | None = None) -> str:
    """A Markdown table (one line per mode and cap) and, if given, the plot link."""
    predicted = any(r.get("predicted_exposed_comm_ms") is not None for r in rows)
    header = (
        "| cap MiB | mode | backend | step ms (median) | ratio vs builtin [IQR] | exposed comm ms "
        + ("| predicted exposed ms " if predicted else "")
        + "| overlap | cold compile s | warm compile s | partitions | alignment | max loss diff |"
    )
    lines = [header, "|" + "---|" * (13 if predicted else 12)]
    # numeric caps in order, then auto (a sweep's cost-model plan)
    for r in sorted(rows, key=lambda r: (isinstance(r["bucket_cap_mb"], str), str(r["bucket_cap_mb"])
                                         if isinstance(r["bucket_cap_mb"], str) else r["bucket_cap_mb"],
                                         r.get("mode_order", 0))):
        ratio = _fmt(r.get("ratio_vs_builtin"), ".3f")
        if r.get("ratio_q1") is not None and r.get("ratio_q3") is not None:
            ratio += f" [{_fmt(r['ratio_q1'], '.3f')}, {_fmt(r['ratio_q3'], '.3f')}]"
        if r.get("ratio_baseline") and r.get("runner") and r["mode"] != "builtin" and "@" in r["ratio_baseline"] \
                and r["ratio_baseline"].split("@")[1] != str(r["runner"]).split("@")[1]:
            ratio += f" vs {r['ratio_baseline']}"
        cap = r["bucket_cap_mb"]
        lines.append(
            "| " + " | ".join([
                cap if isinstance(cap, str) else _fmt(cap, "g"), r["mode"], r["backend"],
                _fmt(r["step_ms_median"], ".1f"), ratio, _fmt(r.get("exposed_comm_ms"), ".1f"),
                *([_fmt(r.get("predicted_exposed_comm_ms"), ".1f")] if predicted else []), _fmt(r.get("overlap"), ".2f"),
                _fmt(r.get("compile_cold_s", r.get("compile_s")), ".1f"), _fmt(r.get("compile_warm_s"), ".1f"),
                _fmt(r.get("partitions"), "d"), _fmt(r.get("alignment"), ".2f"), _fmt(r.get("loss_max_abs_diff"), ".2e"),
            ]) + " |"
        )
    parts = []
    sweep = any(r.get("runner") and r["runner"] != r["mode"] for r in rows)
    if rows:
        r0 = rows[0]
        model = f" {r0['model']}, {r0['grad_mib']:.1f} MiB of gradients;" if r0.get("model") and r0.get("grad_mib") else ""
        parts.append(
            f"Link `{r0['link']}`, world size {r0.get('world_size', '?')},{model} "
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
            "Exposed comm = synchronised forward+backward minus the same under `no_sync`; "
            "overlap = (compute + comm - step) / min(compute, comm), 1.0 hides all communication. "
            "Alignment = fraction of gradient bytes whose runtime DDP bucket is exactly one partition "
            "(- where not measured: eager has no partitions, PyTorch's splitter keeps its plan to itself). "
            + ("" if sweep else
               "Compile seconds = first step minus the median step; cold = fresh inductor cache dir, "
               "warm = `torch._dynamo.reset()` and recompile in the same process with the same cache dir. ")
            + "Generated by `python -m benchmarks.readme_results` from the benchmark's JSON."
        )
    if rows and rows[0].get("command"):
        parts.append(f"Command: `{rows[0]['command']}`")
    parts.append("\n".join(lines))
    if sweep:
        from .sweep import format_summary, sweep_summary

        summary = format_summary(sweep_summary(rows))
        if summary:
            parts.append(summary)
    if plot:
        parts.append(f"![step time vs bucket cap]({plot})")
    return "\n\n".join(parts)


def replace_section(text: str, body: str, start: str = START, end: str = END) -> str:
    """``text`` with everything between the ``start`` and ``end`` markers replaced by ``body``.

    Raises:
        ValueError: a marker is missing, repeated or out of order.
    """
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(
            f"Expected exactly one {start!r} followed by one {end!r} in the file, found "
            f"{text.count(start)} start and {text.count(end)} end marker(s). Add the two markers "
            "where the results belong; nothing outside them is touched."
        )
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


PADDING_START = "<!-- bench:padding:start -->"
PADDING_END = "<!-- bench:padding:end -->"


def padding_markdown(result: dict) -> str:
    """The ``bench:padding`` section: one table line per padding strategy
    (``python -m benchmarks.padding_compare`` JSON)."""
    rows = result["rows"]
    lines = ["| padding | real tokens/s | tokens/s incl. padding | padding waste | compile s (warm-up) "
             "| graphs | recompiles | after warm-up | shapes seen | median step ms | final loss |",
             "|" + "---|" * 11]
    for r in rows:
        name = r["padding"] + (f" ({r['pad_multiple']})" if r["padding"] == "multiple" else "")
        lines.append("| " + " | ".join([
            name, _fmt(r.get("real_tokens_per_s"), ",.0f"), _fmt(r.get("tokens_per_s"), ",.0f"),
            _fmt(100 * r["padding_waste"] if r.get("padding_waste") is not None else None, ".1f") + "%",
            _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("graphs"), "d"), _fmt(r.get("recompiles"), "d"),
            _fmt(r.get("recompiles_after_warmup"), "d"), _fmt(r.get("shapes_seen"), "d"),
            _fmt(r.get("median_step_ms"), ".1f"), _fmt(r.get("final_loss"), ".4f"),
        ]) + " |")
    meta = result.get("meta", {})
    text = (
        f"Backend `{meta.get('backend', '?')}` on {meta.get('device', '?')}, {meta.get('nproc', '?')} rank(s), "
        f"`{meta.get('model', '?')}`, global batch {meta.get('batch_size', '?')} x seq_len {meta.get('seq_len', '?')}, "
        f"skewed lengths (log-normal around seq_len/8), {meta.get('steps', '?')} steps per run, "
        f"{meta.get('rounds', '?')} round(s) with the strategies in rotating order, each run a fresh process "
        "and a fresh inductor cache; medians over rounds. Every run warms up first "
        "(`train.no_recompile_after_warmup=true`): compile s = the warm-up pass (all graphs); real tokens/s "
        "counts only non-padding tokens, over the steps after the first. "
        "Generated by `python -m benchmarks.padding_compare` (`--render` re-renders from the JSON)."
    )
    parts = [text]
    if meta.get("command"):
        parts.append(f"Command: `{meta['command']}`")
    parts.append("\n".join(lines))
    return "\n\n".join(parts)


def update_padding_section(result: dict, target: str | Path) -> str:
    """Rewrite ``target``'s ``bench:padding`` section from a padding_compare result."""
    body = padding_markdown(result)
    target = Path(target)
    target.write_text(replace_section(target.read_text(), body, PADDING_START, PADDING_END))
    return body


def update_file(json_path: str | Path | Sequence[str | Path], target: str | Path,
                plot: str | Sequence[str] | None = None) -> str:
    """Rewrite ``target``'s marked section from the rows in ``json_path``; return the new body.

    Several JSON files (e.g. one sweep per link) give one block each, in order;
    ``plot`` is then a list with one image per file (or None).
    """
    paths = [json_path] if isinstance(json_path, (str, Path)) else list(json_path)
    plots = [plot] if plot is None or isinstance(plot, str) else list(plot)
    plots += [None] * (len(paths) - len(plots))
    body = "\n\n".join(results_markdown(json.loads(Path(p).read_text()), plot=pl) for p, pl in zip(paths, plots))
    target = Path(target)
    target.write_text(replace_section(target.read_text(), body))
    return body


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="rows written by python -m benchmarks.ddp_compare --json (one block each)")
    p.add_argument("target", help="Markdown file with the bench:ddp markers (e.g. README.md)")
    p.add_argument("--plot", action="append", default=None,
                   help="image path to link, relative to the target file (once per JSON file, in order)")
    args = p.parse_args(argv)
    update_file(args.json, args.target, plot=args.plot)
    print(f"updated {args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
