"""The docs block of a compressed-reduction sweep (``ddp_compare --sweep`` with the ``*_bf16`` or
``*_powersgd`` modes): every row with what and how many bytes it sends, its ratio to the best peer
that sends the same and to the best fp32 peer, and its distance from the limit of its own bytes;
then the compression goal rows, each with the measured value beside its bound.

    python -m benchmarks.render.compression_report benchmarks/results/ddp_shaped_200mbit_bf16.json   # print the block
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from ..harness.limit import PEER_MODES, wire_kind
from ..harness.report import cap_label, fmt, markdown_table, with_iqr

__all__ = ["START", "END", "goals", "results_markdown", "main"]

START = "<!-- bench:compression:start -->"
END = "<!-- bench:compression:end -->"


def _ratio(mine: dict, other: dict) -> float:
    from ..harness.stats import ratio_summary

    return ratio_summary(mine["step_ms_rounds"], other["step_ms_rounds"])[0]


# The compression goals' bound against the best fp32 peer, by what a row sends.
_FP32_BOUND = {"bf16": 0.60, "powersgd": 0.45}


def goals(rows: Sequence[dict]) -> list[list[str]]:
    """The compression goals for compressed rows of ours at ``auto``, each as (goal, bound, measured, met)."""
    out = []
    peers = [r for r in rows if r["mode"] in PEER_MODES and r.get("step_ms_rounds")]
    for mine in (r for r in rows if r["mode"] not in PEER_MODES and wire_kind(r) != "fp32"
                 and r.get("bucket_cap_mb") == "auto"):
        name, kind = mine["runner"], wire_kind(mine)
        bound = _FP32_BOUND[kind.split(":")[0]]
        checks = [(f"{name} vs the best {kind} peer ({mine.get('best_peer')})", "<= 1.00",
                   mine.get("ratio_vs_best_peer"), 1.00),
                  (f"{name} vs the best fp32 peer ({mine.get('best_fp32_peer')})", f"<= {bound:.2f}",
                   mine.get("ratio_vs_best_fp32_peer"), bound)]
        if mine.get("link_bound") and kind == "bf16":
            checks.append((f"{name} step / limit on bf16 bytes (the link exceeds backward)", "<= 1.05",
                           mine.get("step_over_limit"), 1.05))
        if kind.startswith("powersgd") and mine.get("limit_compress_ms"):  # a limit with the power iteration's compute
            checks.append((f"{name} step / limit (its bytes, and its power iteration on backward's core)", "<= 1.15",
                           mine.get("step_over_limit"), 1.15))
        for peer in (p for p in peers if wire_kind(p) == "bf16" == kind):  # peers that send bf16 too
            if peer.get("step_over_limit") is not None and peer["step_over_limit"] >= 1.10:
                checks.append((f"{name} vs {peer['runner']} ({peer['step_over_limit']:.2f} of its limit)", "<= 0.90",
                               _ratio(mine, peer), 0.90))
        out += [[goal, bound, fmt(value, ".3f"), "-" if value is None else ("yes" if value <= limit else "**no**")]
                for goal, bound, value, limit in checks]
    return out


def results_markdown(rows: Sequence[dict], command: str | None = None) -> str:
    """The block: the rows (fastest first) and the goal rows."""
    r0 = rows[0]
    table = markdown_table(
        ["cap MiB", "mode", "sends", "MiB on the wire", "step ms [IQR]", "vs best peer, same dtype [IQR]",
         "vs best fp32 peer [IQR]", "step / limit of its bytes", "limit ms"],
        [[cap_label(r["bucket_cap_mb"]), r["mode"], wire_kind(r), fmt(r.get("wire_mib"), ".1f"),
          with_iqr(r["step_ms_median"], r.get("step_ms_q1"), r.get("step_ms_q3"), ".1f"),
          with_iqr(r.get("ratio_vs_best_peer"), r.get("ratio_vs_best_peer_q1"), r.get("ratio_vs_best_peer_q3")),
          with_iqr(r.get("ratio_vs_best_fp32_peer"), r.get("ratio_vs_best_fp32_peer_q1"),
                   r.get("ratio_vs_best_fp32_peer_q3")),
          fmt(r.get("step_over_limit"), ".2f"), fmt(r.get("limit_ms"), ".1f")]
         for r in sorted(rows, key=lambda r: r["step_ms_median"])])
    backend = next((r["backend"] for r in rows if r.get("backend") not in (None, "eager")), r0.get("backend", "?"))
    text = (f"`{r0.get('model', '?')}`, {r0.get('world_size', '?')} ranks, backend `{backend}`, net "
            f"`{r0.get('net', '?')}`, torch {r0.get('torch', '?')}, {r0.get('rounds', '?')} interleaved rounds; "
            "ratios are medians of per-round ratios. Each row's limit is fwd + max(bwd, comm) + opt with comm one "
            "all-reduce of the bytes it sends (Note [Physical limit of a step]). Generated "
            "by `python -m benchmarks.render.pages` from the sweep's JSON.")
    compress = {wire_kind(r): (r["limit_compress_ms"], r.get("limit_compress_alone_ms"))
                for r in rows if r.get("limit_compress_ms")}
    for kind, (ms, alone) in compress.items():
        text += f" The {kind} rows' limit adds the power iteration's own compute to backward: {ms:.1f} ms, "
        text += ("its matmuls and orthogonalisation timed alone on the model's gradient shapes, no collective."
                 if not alone else "its matmuls and orthogonalisation timed inside an eager backward that ran them "
                 "on each gradient as it was made, on every rank at once, no collective "
                 f"(timed alone: {alone:.1f} ms).")
    parts = [text]
    if command or r0.get("command"):
        parts.append(f"Command: `{command or r0['command']}`")
    parts += [table, "Compression goals for the compressed rows at `auto`, as measured here:",
              markdown_table(["goal", "bound", "measured", "met"], goals(rows))]
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.render.compression_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, help="a ddp_compare --json file")
    print(results_markdown(json.loads(p.parse_args(argv).json.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
