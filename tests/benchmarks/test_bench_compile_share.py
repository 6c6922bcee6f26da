"""benchmarks.studies.compile_share: per-round ratios, the docs table, and its argument checks
(the runs themselves are the benchmark's, not the tests')."""

import pytest

from benchmarks.studies import compile_share


def _row(mode, nproc, first, cpu, since):
    return {"mode": mode, "nproc": nproc, "first_step_s": first, "cpu_s_total": cpu, "cpu_since_compile_s": since,
            "partitions": 4}


ROWS = [_row("shared", 4, 30, 70, 40), _row("unshared", 4, 60, 100, 80),
        _row("unshared", 4, 80, 100, 80), _row("shared", 4, 30, 60, 20)]


def test_ratios_pair_the_runs_of_one_round():
    s = compile_share.summarize(ROWS)["shared/4"]
    assert s["first_step_s"]["ratio"] == pytest.approx((30 / 60 + 30 / 80) / 2)
    assert s["cpu_since_compile_s"]["shared"] == 30 and s["cpu_since_compile_s"]["ratio"] == pytest.approx(0.375)


def test_the_readme_table_shows_every_measure_with_its_target():
    result = {"summary": compile_share.summarize(ROWS), "rows": ROWS, "backend": "inductor", "steps": 2, "runs": 2,
              "cpus": 2, "command": "python -m benchmarks.studies.compile_share"}
    text = compile_share.results_markdown(result)
    assert "| 4 | one for all ranks | first step s (rank 0) | 30.0 | 70.0 | 0.44 [0.41, 0.47] | <= 0.5 |" in text
    assert "CPU s, all ranks, compile_ddp to first step end" in text and "(4 partition(s) per rank)" in text


def test_a_single_rank_count_is_refused_with_the_reason(capsys):
    with pytest.raises(SystemExit):
        compile_share.main(["--nprocs", "1"])
    assert "sharing needs a second rank" in capsys.readouterr().err


def test_pytorchs_compile_on_one_rank_gets_its_own_columns_against_unshared():
    rows = ROWS + [_row("one_rank", 4, 54, 90, 72), _row("one_rank", 4, 64, 100, 80)]
    result = {"summary": compile_share.summarize(rows), "rows": rows, "backend": "inductor", "steps": 2, "runs": 2,
              "cpus": 2, "command": "python -m benchmarks.studies.compile_share", "torch": "2.15.0"}
    s = result["summary"]["shared/4"]["first_step_s"]
    assert s["one_rank"] == 59 and s["one_rank_ratio"] == pytest.approx((54 / 60 + 64 / 80) / 2)
    text = compile_share.results_markdown(result)
    assert "| compile.share=true | false | false + compile_on_one_rank | true / false | one_rank / false |" in text
    assert "| 4 | one for all ranks | first step s (rank 0) | 30.0 | 70.0 | 59.0 | 0.44 [0.41, 0.47] |" in text
    assert "torch 2.15.0" in text


def test_one_rank_is_refused_where_torch_lacks_it(capsys, monkeypatch):
    monkeypatch.setattr(compile_share, "has_compile_on_one_rank", lambda: False)
    assert compile_share.available_modes() == ["shared", "unshared"]
    with pytest.raises(SystemExit):
        compile_share.main(["--modes", "shared,unshared,one_rank"])
    assert "has no torch.compiler.config.compile_on_one_rank (torch 2.14+)" in capsys.readouterr().err
