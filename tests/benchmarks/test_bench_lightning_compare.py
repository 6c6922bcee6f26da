"""benchmarks.studies.lightning_compare, the parts that run no process: the rows' ratios from what
each fit measured, the docs block rendered from a fixture JSON, and the refusals of the
command line. The run itself needs root and a shaped link (benchmarks/link/netns.py)."""

import json

import pytest

from benchmarks.studies.lightning_compare import END, START, main, mode_rows, parse_args, results_markdown

JOB = dict(comm_ms=530.0, compute_ms=140.0, compute_fwd_ms=50.0, compute_bwd_ms=85.0, compute_opt_ms=5.0, grad_mib=12.6,
           backend="inductor", link_mbit=200.0, rounds=3, steps=20, fit_warmup=3,
           model="GPT(layers=4, embd=256, heads=4, vocab=512, seq=64), batch 8/rank", world_size=2,
           torch="2.13.0+cpu", lightning="2.6.6", date="2026-11-26", machine="2-core CPU (AMD EPYC)", cpus=2,
           loadavg=[3.9, 5.2], command="python -m benchmarks.studies.lightning_compare --link-mbit 200 --rounds 3 --out x.json")


def _fits() -> dict:
    # Round medians: lightning_compile 100, 300, 200 ms; ours 90, 300, 150 ms (ratios 0.9, 1.0, 0.75).
    return {"lightning_compile": [[0.1, 0.1, 0.1], [0.3, 0.3, 0.3], [0.2, 0.2, 0.2]],
            "ours": [[0.09, 0.09, 0.5], [0.3, 0.3, 0.3], [0.15, 0.15, 0.15]]}


def _rows() -> list[dict]:
    rows = mode_rows(_fits())
    for row in rows:
        ours = row["mode"] == "ours"
        row.update(bucket_cap_mb=25.0, fwd_ms=50.0, bwd_ms=560.0 if ours else 590.0, opt_ms=5.0,
                   buckets=3 if ours else 1, bucket_mib=[1.0, 5.6, 6.0] if ours else None,
                   alignment=1.0 if ours else None, loss_max_abs_diff=2e-6, **JOB)
    return rows


def test_the_ratio_is_the_median_of_per_round_ratios_to_lightnings_idiom():
    rows = {r["mode"]: r for r in mode_rows(_fits())}
    assert rows["lightning_compile"]["vs_lightning_compile"] == {"median": 1.0, "q1": 1.0, "q3": 1.0}
    ratio = rows["ours"]["vs_lightning_compile"]
    assert ratio["median"] == pytest.approx(0.9) and ratio["q1"] == pytest.approx(0.825)
    assert ratio["q3"] == pytest.approx(0.95)
    assert rows["ours"]["step_ms_rounds"] == pytest.approx([90.0, 300.0, 150.0])  # each fit's median step
    assert rows["ours"]["step_ms_median"] == pytest.approx(150.0)  # every measured step pooled


def test_the_block_is_rendered_from_the_json_between_its_markers_only(tmp_path):
    out, page = tmp_path / "rows.json", tmp_path / "lightning.md"
    out.write_text(json.dumps(_rows()))
    page.write_text(f"# Lightning\n\nintro\n\n{START}\nold table\n{END}\n\nreading\n")
    assert main(["--render", "--out", str(out), "--page", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Lightning\n\nintro\n\n" + START + "\n") and text.endswith(f"{END}\n\nreading\n")
    assert "old table" not in text and results_markdown(_rows()) in text
    assert ("| `ours` | `strategy=CompiledDDPStrategy()` | 25 | 150 | 0.900 [0.825, 0.950] | 50 / 560 / 5 | 3 | "
            "1.00 | 2.0e-06 |") in text
    assert ("| `lightning_compile` | `fit(torch.compile(model)), strategy=\"ddp\"` | 25 | 200 | "
            "1.000 [1.000, 1.000]") in text
    assert "Lightning 2.6.6, torch 2.13.0+cpu, 2026-11-26" in text and "shaped to 200 Mbit/s" in text
    assert "took 140 ms (fwd 50 + bwd 85 + opt 5); one all-reduce of all 12.6 MiB over the link" in text
    assert "after the rounds, took 530 ms" in text
    assert "`ours` 1.00/5.60/6.00 MiB" in text
    assert "load average read 3.9 to 5.2 on 2 cores" in text and "compare the ratios" in text
    assert "Command: `python -m benchmarks.studies.lightning_compare --link-mbit 200 --rounds 3 --out x.json`" in text


def test_an_idle_machine_is_not_called_shared():
    rows = _rows()
    for r in rows:
        r["loadavg"] = [0.3, 1.1]
    text = results_markdown(rows)
    assert "load average 0.3 to 1.1 on 2 cores during the run" in text and "shared" not in text


def test_modes_without_lightnings_idiom_or_unknown_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--modes", "eager,ours"])
    assert "lightning_compile is missing, and every ratio divides by lightning_compile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--modes", "lightning_compile,fast"])
    err = capsys.readouterr().err
    assert "unknown modes ['fast']" in err and "Choose from eager, lightning_compile, ours, ours_auto" in err


def test_a_run_without_measured_steps_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--fit-warmup", "1"])
    assert "a fit's first two steps compile and rebuild DDP's buckets" in capsys.readouterr().err


def test_without_lightning_it_stops_before_launching(monkeypatch):
    import importlib.util

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a))
    monkeypatch.setattr("benchmarks.harness.torchrun.here_or_relaunched", lambda *a, **k: pytest.fail("launched anyway"))
    with pytest.raises(SystemExit, match=r"lightning package is not installed, .* Install it \(pip install "
                                         r"lightning\)"):
        main(["--out", "x.json"])
