"""benchmarks.studies.convergence without running it: arguments, the corpus, a run's summary, the
tolerance and the docs block (the runs themselves are the benchmark's, under torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.studies.convergence import _overrides, _verdict, corpus_text, parse_args, results_markdown, summarize


def test_quick_defaults_explicit_flags_and_a_window_longer_than_the_run():
    args = parse_args(["--quick", "--steps", "40"])
    assert (args.steps, args.last, args.plot) == (40, 10, None) and args.json.startswith("bench_out/")
    full = parse_args([])
    assert (full.steps, full.last, full.plot) == (300, 50, "benchmarks/results/convergence.png")
    with pytest.raises(SystemExit):
        parse_args(["--steps", "50", "--last", "50"])
    over = _overrides(full, Path("/t/tokens.bin"), Path("/t/run"), ["ddp.reduce_dtype=bf16"])
    assert "data=tokens" in over and "data.path=/t/tokens.bin" in over and "model.vocab_size=256" in over
    assert over[-1] == "ddp.reduce_dtype=bf16" and "train.steps=300" in over and "train.eval_every=300" in over


def test_the_corpus_is_the_repositorys_own_text_in_a_fixed_order(tmp_path):
    (tmp_path / "README.md").write_text("readme")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("b")
    (tmp_path / "docs" / "a.md").write_text("a")
    (tmp_path / "docs" / "skip.png").write_text("not text")
    assert corpus_text(tmp_path) == "readme\na\nb"
    assert len(corpus_text()) > 100_000


def _row(label, losses, evals=((3, 2.0),)):
    return summarize(label, {"losses": [[i + 1, x] for i, x in enumerate(losses)], "eval_losses": list(evals)}, 2)


def test_summary_tolerance_and_block():
    rows = [_row("fp32", [5.0, 3.0, 2.0, 2.0]), _row("bf16", [5.0, 3.0, 2.0, 2.02]),
            _row("fp32, another seed", [5.0, 3.0, 2.1, 2.1], evals=())]
    assert (rows[0]["final_loss"], rows[0]["mean_last"], rows[0]["eval_loss"]) == (2.0, 2.0, 2.0)
    assert rows[2]["eval_loss"] is None
    verdict = _verdict(rows)
    assert verdict["seed_gap"] == pytest.approx(0.05) and verdict["bf16_gap"] == pytest.approx(0.005)
    assert verdict["tolerance"] == pytest.approx(0.05) and verdict["equal"]
    assert not _verdict([rows[0], _row("bf16", [5, 3, 3, 3]), _row("fp32, another seed", [5, 3, 2, 2])])["equal"]
    assert "powersgd_gap" not in verdict  # no PowerSGD run: no PowerSGD verdict
    meta = {"model": "m", "backend": "aot_eager", "steps": 4, "batch_size": 2, "seq_len": 8, "last": 2,
            "tokens": 1234, "torch": "2.x", "plot": "convergence.png", "command": "python -m x"}
    text = results_markdown({"meta": meta, "rows": rows, "verdict": verdict})
    assert "| bf16 | 2.0200 | 2.0100 | +0.50% | 2.0000 | +0.00% |" in text
    assert "| fp32, another seed | 2.1000 | 2.1000 | +5.00% | - |  |" in text
    assert "(5.00% on the mean of the last 2) and 1%; bf16's gap is 0.50%: **equal within it**." in text
    assert "(benchmarks/results/convergence.png)" in text and "1,234 tokens" in text


def test_powersgd_is_held_to_three_percent_or_the_seed_gap():
    base = [_row("fp32", [5.0, 3.0, 2.0, 2.0]), _row("bf16", [5.0, 3.0, 2.0, 2.0]),
            _row("fp32, another seed", [5.0, 3.0, 2.01, 2.01])]  # seed gap 0.5%: the bound is 3%
    within = _verdict([*base, _row("PowerSGD rank 4", [5.0, 3.0, 2.05, 2.05])])
    assert within["powersgd_gap"] == pytest.approx(0.025) and within["powersgd_tolerance"] == pytest.approx(0.03)
    assert within["powersgd_equal"]
    outside = _verdict([*base, _row("PowerSGD rank 4", [5.0, 3.0, 2.1, 2.1])])
    assert not outside["powersgd_equal"]
    meta = {"model": "m", "backend": "aot_eager", "steps": 4, "batch_size": 2, "seq_len": 8, "last": 2,
            "tokens": 1, "torch": "2.x", "plot": None, "command": "python -m x"}
    text = results_markdown({"meta": meta, "rows": [*base, _row("PowerSGD rank 4", [5.0, 3.0, 2.1, 2.1])],
                             "verdict": outside})
    assert "PowerSGD (rank 4, from the end of the warm-up) is held to the larger of the seed-to-seed gap and 3% " \
           "(3.00%); its gap is 5.00%: **outside it**." in text
    assert "| PowerSGD rank 4 | 2.1000 | 2.1000 | +5.00% |" in text
