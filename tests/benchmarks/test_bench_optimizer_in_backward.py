"""benchmarks.studies.optimizer_in_backward and its report: the limit and the goals from the rows,
the docs block, the command line, the malloc shim's count of a known allocation (built with the C
compiler: slow), and one tiny end-to-end run (slow)."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import heap_peak
from benchmarks.render.optimizer_in_backward_report import END, START, done_when, limit_columns, results_markdown
from benchmarks.studies.optimizer_in_backward import main, parse_args
from benchmarks.studies.optimizer_in_backward_ranks import lazy_peer_missing

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"mode", "bucket_cap_mb", "optimizer_in_backward", "peak_mib", "grad_mib", "step_ms_median", "link",
            "device", "torch", "ratio_vs_without", "ratio_vs_without_q1", "ratio_vs_without_q3", "fwd_ms", "bwd_ms",
            "opt_ms", "comm_ms"}
JOB = dict(backend="inductor", device="cpu", torch="2.13.0+cpu", world_size=2, rounds=3, warmup=1, date="2026-11-26",
           model="GPT(layers=4, embd=256, heads=4, vocab=512, seq=64), batch 8/rank", bucket_cap_mb="auto",
           command="python -m benchmarks.studies.optimizer_in_backward --out x.json")


def _row(link: str, in_bwd: bool, **kw) -> dict:
    row = dict(JOB, mode="split", link=link, optimizer_in_backward=in_bwd, grad_mib=12.0, fwd_ms=50.0, bwd_ms=100.0,
               opt_ms=0.5 if in_bwd else 30.0, comm_ms=500.0, step_ms_median=600.0, step_ms_q1=590.0,
               step_ms_q3=610.0, ratio_vs_without=1.0, ratio_vs_without_q1=1.0, ratio_vs_without_q3=1.0,
               last_bucket_mib=3.0, peak_mib=200.0, peak_above_start_mib=40.0, forward_end_mib=34.0,
               backward_end_mib=13.0, skipped=None, batch=8)
    row.update(kw)
    return row


def _rows() -> list[dict]:
    return [_row("200mbit", False),
            _row("200mbit", True, step_ms_median=580.0, ratio_vs_without=0.97, ratio_vs_without_q1=0.95,
                 ratio_vs_without_q3=0.99, peak_mib=189.0, peak_above_start_mib=29.0, backward_end_mib=1.0),
            _row("none", False, comm_ms=20.0, step_ms_median=200.0),
            _row("none", True, comm_ms=20.0, step_ms_median=206.0, ratio_vs_without=1.03, ratio_vs_without_q1=1.01,
                 ratio_vs_without_q3=1.05, peak_mib=199.0, forward_end_mib=34.0, backward_end_mib=1.0,
                 bucket_mib=[9.0, 3.0]),
            dict(JOB, mode="traced", link="none", batch=8, optimizer_in_backward=True, grad_mib=12.0, peak_mib=None,
                 step_ms_median=None, skipped="compile_ddp(strategy='traced', optimizer=...): not yet")]


def test_the_limit_with_the_optimizer_in_backward_hides_all_but_the_last_buckets_update():
    rows = {(r["link"], r["optimizer_in_backward"]): r for r in limit_columns(_rows()) if r["mode"] == "split"}
    without, with_ = rows["200mbit", False], rows["200mbit", True]
    # without: fwd + max(bwd, comm) + opt; with: fwd + max(bwd + opt, comm + opt * 3 / 12), opt from the row without
    assert without["limit_ms"] == pytest.approx(50 + 500 + 30)
    assert with_["limit_ms"] == pytest.approx(50 + max(100 + 30, 500 + 7.5))
    assert with_["limit_opt_last_ms"] == pytest.approx(7.5) and without["limit_opt_last_ms"] is None
    assert with_["limit_gain_ms"] == pytest.approx(min(500 - 100, 30 - 7.5)) and with_["link_bound"]
    assert with_["peak_saved_mib"] == pytest.approx(11.0) and with_["peak_saved_of_grad"] == pytest.approx(11 / 12)
    assert with_["backward_end_saved_of_grad"] == pytest.approx(1.0)
    # compute-bound: both limits are fwd + bwd + opt
    assert rows["none", True]["limit_ms"] == pytest.approx(rows["none", False]["limit_ms"]) == pytest.approx(180.0)
    assert rows["none", True]["limit_gain_ms"] == 0 and not rows["none", True]["link_bound"]


def test_the_goals_name_the_figures_and_say_why_a_row_missed_one():
    goals = {g["link"]: g for g in done_when(limit_columns(_rows()))}
    assert set(goals) == {"200mbit", "none"}  # the skipped traced row has none
    assert goals["200mbit"]["memory_met"] and goals["200mbit"]["speed_met"] and goals["200mbit"]["why"] is None
    none = goals["none"]
    assert none["peak_saved_of_grad"] == pytest.approx(1 / 12) and not none["memory_met"]
    assert none["ratio"] == 1.03 and not none["speed_met"]
    assert none["why"].startswith("compute-bound (bwd 100 ms >= comm 20 ms): both limits are fwd + bwd + opt")
    assert none["memory_why"] == ("the step's own peak is 40.0 MiB, of which 34.0 MiB are forward's activations; the "
                                  "other 6.0 MiB are backward's temporaries and the gradients live at once: under "
                                  "DDP's reducer each bucket's buffer, which holds its gradients, lives from the "
                                  "bucket's first gradient to backward's end, where the reducer reads every bucket; the "
                                  "auto plan's 2 bucket(s): the largest 9.0 MiB, the last reduced 3.0 MiB, of 12.0 MiB")
    rows = limit_columns(_rows())
    rows[3]["forward_end_mib"] = 39.0  # the peak within 0.2 of the gradients of the activations
    assert done_when(rows)[1]["memory_why"] == ("the step's own peak (40.0 MiB) is forward's activations (39.0 MiB "
                                                "live when forward ended) as backward starts, before any gradient "
                                                "exists to free")
    rows[3].update(ratio_vs_without=1.02, link_bound=True, limit_gain_ms=5.0)
    assert done_when(rows)[1]["why"] == ("link-bound, but the limits allow at most min(comm - bwd, opt - opt_last) = "
                                         "min(-80, 22) = 5 ms (2% of the step), inside the ratio's IQR [1.010, "
                                         "1.050]")


def test_a_traced_row_says_what_no_update_could_save_or_how_large_its_buckets_are():
    """Batch 8: the peak without is 4 MiB above the start plus forward's activations, so no update could lower it
    by 0.8 of the gradient bytes. Batch 1: the bound is far, the plan's large bucket is the reason given."""
    def traced(batch, in_bwd, **kw):
        return _row("none", in_bwd, mode="traced", batch=batch, comm_ms=20.0, start_mib=38.0, **kw)

    rows = [traced(8, False, peak_mib=76.0), traced(8, True, peak_mib=78.0, bucket_mib=[1.0, 7.0, 2.0, 2.0]),
            traced(1, False, peak_mib=74.0, forward_end_mib=4.0),
            traced(1, True, peak_mib=74.0, forward_end_mib=4.0, peak_above_start_mib=36.0, bucket_mib=[1.0, 11.0])]
    batch8, batch1 = done_when(limit_columns(rows))
    assert batch8["peak_saved_bound_of_grad"] == pytest.approx(4 / 12) and not batch8["memory_met"]
    assert batch8["memory_why"] == (
        "the step starts with 0.0 MiB fewer bytes live than without (between steps the traced strategy holds no "
        "gradient memory in either mode: `zero_grad()` frees the gradients without the update, and DDP's C++ bucket "
        "buffers, unused there, are freed when it compiles); no update could: the peak without is only 4.0 MiB (0.33 "
        "x the gradient bytes) above this step's start plus forward's activations (34.0 MiB live when forward ended, "
        "before any gradient exists), and the step cannot peak below that")
    assert batch1["peak_saved_bound_of_grad"] == pytest.approx(32 / 12)
    assert batch1["memory_why"].endswith(
        "a bucket's gradients live from its backward until its update; the auto plan's 2 bucket(s): the largest "
        "11.0 MiB, the last reduced 11.0 MiB, of 12.0 MiB")
    assert "at most 0.33 x possible" in results_markdown(rows)


def test_the_block_is_rendered_from_the_json_between_its_markers_only(tmp_path):
    out, page = tmp_path / "rows.json", tmp_path / "page.md"
    rows = limit_columns(_rows())
    out.write_text(json.dumps(rows))
    page.write_text(f"# page\n\n{START}\nOLD TABLE\n{END}\n\ntail\n")
    assert main(["--render", "--out", str(out), "--page", str(page)]) == 0
    text = page.read_text()
    assert text.startswith(f"# page\n\n{START}\n") and text.endswith(f"{END}\n\ntail\n") and "OLD TABLE" not in text
    assert results_markdown(rows) in text
    assert ("| 200mbit | 8 | split | yes | 580 [590, 610] | 0.970 [0.950, 0.990] | 189.0 | 29.0 | 0.92 | 34.0 | 1.0 | "
            "558 | 1.04 | 50 / 100 / 500 / 30 / 8 |") in text
    assert "| none | 8 | traced | yes | skipped (below) |" in text
    assert "\nSkipped, traced: compile_ddp(strategy='traced', optimizer=...): not yet\n" in text
    assert ("- 200mbit, batch 8, split: peak lowered by 0.92 x the gradient bytes (met, goal >= 0.8), live bytes at "
            "backward's end by 1.00 x; step 0.970 [0.950, 0.990] x without (met, goal <= 1.00)") in text
    assert "step 1.030 [1.010, 1.050] x without (not met, goal <= 1.00): compute-bound" in text
    assert "torch 2.13.0+cpu, cpu, 2026-11-26: 2 ranks over gloo; links: 200mbit, none" in text
    assert "GPT(layers=4, embd=256, heads=4, vocab=512, seq=64), batch 8 sequences per rank" in text
    assert "Command: `python -m benchmarks.studies.optimizer_in_backward --out x.json`" in text


def test_every_measured_row_of_the_committed_json_has_the_issues_fields():
    rows = json.loads((REPO / "benchmarks" / "results" / "optimizer_in_backward.json").read_text())
    assert {r["link"] for r in rows} == {"none", "200mbit", "800mbit"}
    for r in rows:
        peer = r["mode"] == "eager"  # eager DDP with lazy_bucket_allocation=True (torch 2.15), DDP's own caps
        assert r["mode"] in ("split", "traced", "eager") and r["batch"] in (8, 1)
        assert r["bucket_cap_mb"] == (None if peer else "auto") and r.get("lazy_bucket_allocation", False) == peer
        assert r.get("skipped") or ROW_KEYS <= set(r), r.get("runner")
    assert {r["batch"] for r in rows if r["mode"] == "eager" and r["peak_mib"] is not None} == {8, 1}


def test_the_lazy_buckets_peer_is_a_row_of_its_own_compared_with_split_in_backward():
    def peer(**kw):
        return _row("none", False, mode="eager", lazy_bucket_allocation=True, bucket_cap_mb=None, peak_mib=197.0,
                    ratio_vs_without=None, ratio_vs_without_q1=None, ratio_vs_without_q3=None, opt_ms=1.0, **kw)

    rows = limit_columns([*_rows(), peer()])
    # The peer leaves the job's limit parts to the compiled rows (opt stays 30 ms) and, from the same run, gets
    # the same limit; it has no goals (those are for the rows with the optimizer in backward).
    assert rows[3]["limit_ms"] == pytest.approx(180.0) and rows[-1]["limit_ms"] == pytest.approx(180.0)
    assert len(done_when(rows)) == 2
    text = results_markdown(rows)
    assert "| none | 8 | eager, lazy buckets | no | 600 [590, 610] | - | 197.0 | 40.0 | - | 34.0 | 13.0 | 180 |" in text
    assert ("- none, batch 8: peak 197.0 MiB (the step's own 40.0, from - MiB live at its start); split with the "
            "optimizer in backward peaks at 199.0 MiB, 2.0 MiB (0.17 x the gradient bytes) above it\n") in text
    # Merged in from a run of its own: no limit from another run's parts, and the line names its run.
    other = peer(date="2026-11-29", command="python -m benchmarks.studies.optimizer_in_backward --strategies split")
    rows = limit_columns([*_rows(), other])
    assert "limit_ms" not in rows[-1]
    assert ("above it (measured in a run of its own, 2026-11-29: `python -m benchmarks.studies.optimizer_in_backward "
            "--strategies split`; its step time and limit are not comparable with the table's)"
            ) in results_markdown(rows)


def test_links_are_shaped_rates_or_none(capsys):
    assert parse_args(["--out", "x.json", "--links", "none,200,800mbit"]).links == ("none", "200mbit", "800mbit")
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--links", "fast"])
    err = capsys.readouterr().err
    assert "--links 'fast': 'fast' is not a link rate" in err and "or none (loopback), e.g. none,200,800" in err
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--strategies", "split,whole"])
    assert "--strategies 'split,whole': choose from split, traced" in capsys.readouterr().err


def test_without_a_c_compiler_there_is_no_shim_and_it_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(heap_peak.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="benchmarks.harness.heap_peak"):
        assert heap_peak.build_shim(tmp_path) is None
    assert "no CPU peak memory: no C compiler (cc or gcc) on PATH to build the malloc shim" in caplog.text
    assert "peak_mib is recorded as null; install gcc" in caplog.text
    assert heap_peak.preload_env(None, {"A": "1"}) == {"A": "1"}


SHIM_CHECK = """
import threading, torch
from benchmarks.harness.heap_peak import HeapPeak
heap = HeapPeak.from_env()
heap.reset(); start = heap.live()
x = torch.empty(64 * 2**20, dtype=torch.uint8)
live_with = heap.live() - start
del x
freed, peak = heap.live() - start, heap.peak() - start
heap.reset(); start = heap.live()
thread = threading.Thread(target=lambda: torch.ones(32 * 2**20, dtype=torch.uint8))
thread.start(); thread.join()
thread_peak = heap.peak() - start
heap.reset(); tensors, everything = heap.tensor_live(), heap.live()
x = torch.empty(16 * 2**20, dtype=torch.uint8)
objects = [bytearray(1024) for _ in range(8000)]  # 8 MiB of heap (malloc: over 512 bytes) in no tensor
storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
storage.resize_(8 * 2**20)  # a storage taken back, as DDP's buckets are under the optimizer in backward
grown = heap.tensor_live() - tensors
storage.resize_(0); del x
print(live_with, freed, peak, thread_peak, grown, heap.tensor_peak() - tensors, heap.tensor_live() - tensors,
      heap.live() - everything, int(heap.counts_tensors()))
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_the_shim_counts_known_allocations_live_then_freed_on_any_thread_and_tensors_apart(tmp_path):
    lib = heap_peak.build_shim(tmp_path)
    assert lib is not None and lib.exists()
    env = heap_peak.preload_env(lib)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", SHIM_CHECK], env=env, capture_output=True, text=True, check=True)
    live_with, freed, peak, thread_peak, grown, tensor_peak, tensor_left, heap_left, counts = \
        (int(v) for v in out.stdout.split())
    MiB = 2**20
    assert 64 * MiB <= live_with < 64 * MiB + MiB // 4
    assert abs(freed) < MiB // 4
    assert 64 * MiB <= peak < 64 * MiB + MiB // 4
    assert 32 * MiB <= thread_peak < 32 * MiB + MiB // 4
    # the tensor count: the tensor and the resized storage, not the 8 MiB of bytearrays the heap count holds
    assert counts == 1
    assert 24 * MiB <= grown < 24 * MiB + MiB // 4
    assert 24 * MiB <= tensor_peak < 24 * MiB + MiB // 4
    assert abs(tensor_left) < MiB // 4
    assert heap_left > 7 * MiB


@pytest.mark.slow
def test_a_quick_run_writes_both_rows_per_strategy_and_frees_the_gradients_in_backward(tmp_path):
    out = tmp_path / "quick.json"
    assert main(["--quick", "--rounds", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    peer = {("eager", False)} if lazy_peer_missing() is None else set()  # eager DDP, lazy_bucket_allocation=True
    assert {(r["mode"], r["optimizer_in_backward"]) for r in rows} == {(s, b) for s in ("split", "traced")
                                                                       for b in (False, True)} | peer
    split = {r["optimizer_in_backward"]: r for r in rows if r["mode"] == "split"}
    for r in split.values():
        assert ROW_KEYS <= set(r) and r["link"] == "none" and r["backend"] == "aot_eager"
        assert r["loss_max_abs_diff_vs_without"] == 0.0
    assert split[True]["peak_mib"] is not None  # the shim was preloaded into the ranks
    # Memory from each mode's own job, where the rank with the update in backward gives its bucket buffers back
    # at the end of every synchronised backward (Note [Bucket buffers between steps])
    assert all(r["memory_rounds"] == 3 and r["peak_shared_mib"] is not None for r in split.values())
    # (a count, not the heap: this model's 1.8 MiB of gradients are within two processes' other differences)
    assert split[True]["released_mib"] == pytest.approx(split[True]["grad_mib"])
    assert split[False]["released_mib"] is None
    assert split[True]["backward_end_saved_of_grad"] > 0.8  # each gradient freed after its update
    assert split[True]["opt_ms"] < split[False]["opt_ms"]  # optimizer.step() after backward found nothing
    for r in (r for r in rows if r["mode"] == "eager"):  # measured in a job of its own, the buckets lazy
        assert r["lazy_bucket_allocation"] and r["peak_mib"] is not None and r["memory_rounds"] == 3
    for r in (r for r in rows if r["mode"] == "traced"):
        assert (r["skipped"] and "compile_ddp(strategy='traced', optimizer=...)" in r["skipped"]) or \
            r["peak_mib"] is not None
