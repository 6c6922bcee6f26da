"""benchmarks.studies.padding_compare without running it: arguments, the per-strategy
summary over rounds, and the docs section renderer."""

from __future__ import annotations

import pytest

from benchmarks.studies.padding_compare import END as PADDING_END
from benchmarks.studies.padding_compare import START as PADDING_START
from benchmarks.studies.padding_compare import _overrides, padding_markdown, parse_args, summarize, update_padding_section


def _metrics(real_tps, waste, warmup_s, graphs=4, recompiles=3):
    return dict(real_tokens_per_s=real_tps, tokens_per_s=real_tps / (1 - waste), padding_waste=waste,
                warmup_s=warmup_s, first_step_s=0.1, median_step_ms=10.0, graphs=graphs, recompiles=recompiles,
                recompiles_after_warmup=0, final_loss=5.0, shapes_seen=[[[8, 16], 3], [[8, 32], 2]])


def test_quick_defaults_and_explicit_flags_win():
    args = parse_args(["--quick", "--steps", "3"])
    assert (args.backend, args.steps, args.rounds, args.strategies) == ("aot_eager", 3, 1, ["max", "multiple", "dynamic"])
    full = parse_args([])
    assert (full.backend, full.seq_len, full.pad_multiple) == ("inductor", 128, 32)
    with pytest.raises(SystemExit):
        parse_args(["--strategies", "max,bucket"])
    over = _overrides(args, "multiple", __import__("pathlib").Path("/tmp/x"))
    assert "data.padding=multiple" in over and "train.no_recompile_after_warmup=true" in over
    assert "data.lengths=skewed" in over and "compile=aot_eager" in over


def test_summary_takes_medians_over_rounds_and_flags_count_mismatches():
    row = summarize("multiple", [_metrics(100.0, 0.5, 3.0), _metrics(300.0, 0.5, 5.0), _metrics(200.0, 0.5, 4.0)], 16)
    assert (row["real_tokens_per_s"], row["compile_s"], row["graphs"], row["recompiles"]) == (200.0, 4.0, 4, 3)
    assert row["shapes_seen"] == 2 and len(row["per_round"]) == 3 and "note" not in row
    odd = summarize("multiple", [_metrics(1.0, 0.5, 1.0), _metrics(1.0, 0.5, 1.0, recompiles=4)], 16)
    assert odd["note"].startswith("counts differ between rounds")


def test_padding_section_renders_between_its_markers_only(tmp_path):
    result = {"meta": {"backend": "inductor", "device": "cpu", "nproc": 1, "steps": 30, "rounds": 2,
                       "command": "python -m benchmarks.studies.padding_compare"},
              "rows": [summarize("max", [_metrics(50.0, 0.8, 2.0, 1, 0)], 32),
                       summarize("multiple", [_metrics(150.0, 0.3, 6.0)], 32)]}
    body = padding_markdown(result)
    assert "| max | 50 | 250 | 80.0% | 2.0 | 1 | 0 | 0 | 2 | 10.0 | 5.0000 |" in body
    assert "| multiple (32) | 150 | 214 | 30.0% | 6.0 | 4 | 3 | 0 | 2 |" in body
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{PADDING_START}\nold\n{PADDING_END}\ntail\n")
    update_padding_section(result, readme)
    text = readme.read_text()
    assert text.startswith(f"head\n{PADDING_START}\n") and text.endswith(f"\n{PADDING_END}\ntail\n") and "old" not in text
