"""The fsdp_compare harness: argument defaults, the docs section writer, and one
tiny end-to-end run on 2 gloo ranks on the CPU (``--device cpu``, also where CUDA is
available) with aot_eager. Checks the rows, never the timings. The CUDA path:
test_gpu_bench.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.studies.fsdp_compare import END, ROW_KEYS, START, main, parse_args, replace_section, results_markdown

REPO = Path(__file__).resolve().parents[2]
# Two blocks of ~0.19 MiB each: per_block has 2 units, grouped (0.3 MiB target) puts both in 1.
TINY = ["--device", "cpu", "--backend", "aot_eager", "--layers", "2", "--embd", "64", "--heads", "2", "--vocab", "256",
        "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1", "--shard-unit-mb", "0.3"]


def test_quick_defaults_and_explicit_flags_win():
    args = parse_args(["--quick", "--json", "x/out.json"])
    assert (args.backend, args.steps, args.warmup) == ("aot_eager", 20, 2)
    assert args.plot == str(Path("x/out.png"))
    assert parse_args(["--quick", "--backend", "eager"]).backend == "eager"
    assert parse_args([]).backend == "inductor"


def test_bad_mode_fails_before_launching():
    with pytest.raises(ValueError, match="valid modes are eager, per_block, grouped"):
        main(["--modes", "eager,fast"])


def test_device_cuda_without_cuda_exits_before_launching(monkeypatch, capsys):
    import torch

    import benchmarks.studies.fsdp_compare as fsdp_compare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fsdp_compare, "here_or_relaunched", lambda *a, **k: pytest.fail("launched anyway"))
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cuda"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda was given, but torch.cuda.is_available() is False" in err and "Pass --device cpu" in err


def test_from_json_needs_readme(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--from-json", "rows.json"])
    assert "give --readme docs/fsdp.md too" in capsys.readouterr().err


def test_replace_section_touches_only_the_fsdp_markers():
    text = f"intro\n{START}\nold\n{END}\n<!-- bench:ddp:start -->\nddp\n<!-- bench:ddp:end -->\n"
    new = replace_section(text, "NEW")
    assert new == f"intro\n{START}\nNEW\n{END}\n<!-- bench:ddp:start -->\nddp\n<!-- bench:ddp:end -->\n"
    with pytest.raises(ValueError, match="Expected exactly one"):
        replace_section("no markers", "x")


@pytest.mark.slow
def test_tiny_run_writes_rows_table_and_readme_section(tmp_path):
    out, readme = tmp_path / "rows.json", tmp_path / "README.md"
    readme.write_text(f"# t\n{START}\n{END}\ntail\n")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.fsdp_compare", *TINY, "--json", str(out), "--readme", str(readme)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["eager", "per_block", "grouped"]
    for r in rows:
        assert set(ROW_KEYS) <= set(r), f"{r['mode']} lacks {set(ROW_KEYS) - set(r)}"
        assert r["backend"] == ("eager" if r["mode"] == "eager" else "aot_eager") and r["step_ms_median"] > 0
        assert r["loss_max_abs_diff"] < 1e-4, f"{r['mode']} drifted from eager by {r['loss_max_abs_diff']}"
        assert len(r["peak_mem_mib_per_rank"]) == 2 and all(m > 0 for m in r["peak_mem_mib_per_rank"])
        assert r["transport"].startswith("gloo")
        assert r["device"] == "cpu" and r["peak_mib"] is None  # RSS is per process, not per mode
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["per_block"]["units"] == 2 and by_mode["grouped"]["units"] == 1
    assert by_mode["grouped"]["prefetch"] == 1 and by_mode["per_block"]["prefetch"] == 0
    assert by_mode["per_block"]["ratio_vs_per_block"] == pytest.approx(1.0)
    # the physical limit, one for the job: unsharded compute, the link's all-gathers and reduce-scatter, opt
    r0 = rows[0]
    assert len({r["limit_ms"] for r in rows}) == 1 and r0["limit_allgather_ms"] > 0 and r0["limit_reduce_scatter_ms"] > 0
    assert r0["limit_ms"] == pytest.approx(max(r0["limit_fwd_ms"] + r0["limit_bwd_ms"],
                                               2 * r0["limit_allgather_ms"] + r0["limit_reduce_scatter_ms"],
                                               r0["limit_fwd_ms"] + r0["limit_reduce_scatter_ms"]) + r0["limit_opt_ms"])
    assert r0["limit_opt_ms"] == pytest.approx(min(r["opt_ms"] for r in rows))
    assert all(r["step_over_limit"] == pytest.approx(r["step_ms_median"] / r["limit_ms"]) for r in rows)
    peer = by_mode[r0["best_peer"]]
    assert peer["mode"] in ("eager", "per_block") and peer["ratio_vs_best_peer"] == pytest.approx(1.0)
    assert "unsharded_per_block" in proc.stderr and "physical limit" in proc.stderr  # the reference took its turns
    assert "| grouped" in proc.stdout  # the table
    assert "round 2/2" in proc.stderr and "process group gloo, device cpu" in proc.stderr  # progress
    text = readme.read_text()
    assert text.startswith(f"# t\n{START}\n") and text.endswith(f"{END}\ntail\n")
    assert "| grouped | aot_eager |" in text and "plain gloo" in text and "RSS high-water mark" in text
    assert "device `cpu`" in text and "Physical limit" in text
    assert results_markdown(rows) in text


def test_from_json_rewrites_readme_without_running(tmp_path):
    rows = [{"mode": "eager", "backend": "eager", "step_ms_median": 10.0, "ratio_vs_per_block": 0.9, "ratio_q1": 0.8,
             "ratio_q3": 1.0, "peak_mem_mib_per_rank": [100.0, 101.0], "loss_max_abs_diff": 0.0, "units": 2,
             "unit_mib": [0.5, 0.5], "prefetch": 0, "compile_s": 0.0, "transport": "gloo"}]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    readme = tmp_path / "README.md"
    readme.write_text(f"{START}\n{END}\n")
    assert main(["--from-json", str(tmp_path / "rows.json"), "--readme", str(readme)]) == 0
    assert "| eager | eager | 10.0 | 0.900 [0.800, 1.000] | - | - | 0.0 | 100/101 | 0.0e+00 | 2 (0.50 each) | 0 |" in readme.read_text()


@pytest.mark.slow
def test_bf16_and_replicate_modes_get_the_limit_and_peers_of_their_own_reduction(tmp_path):
    out, readme = tmp_path / "rows.json", tmp_path / "README.md"
    readme.write_text(f"{START}\n{END}\n")
    modes = "eager,grouped,eager_bf16,grouped_bf16,replicate_eager,replicate_whole,replicate_grouped"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.fsdp_compare", *TINY, "--modes", modes, "--json", str(out),
         "--readme", str(readme)], cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_mode = {r["mode"]: r for r in json.loads(out.read_text())}
    assert list(by_mode) == modes.split(",")
    sharded = [by_mode[m] for m in ("eager", "grouped")]
    bf16 = [by_mode[m] for m in ("eager_bf16", "grouped_bf16")]
    replicated = [by_mode[m] for m in ("replicate_eager", "replicate_whole", "replicate_grouped")]
    # sharded in fp32 and in bf16: one all-gather time, a reduce-scatter time per dtype, peers of the same dtype
    assert {r["reduce_dtype"] for r in bf16} == {"bf16"} and {r["reduce_dtype"] for r in sharded} == {"fp32"}
    assert {r["limit_allgather_ms"] for r in sharded + bf16} == {sharded[0]["limit_allgather_ms"]}
    assert {r["best_peer"] for r in sharded} == {"eager"} and {r["best_peer"] for r in bf16} == {"eager_bf16"}
    assert all(r["best_fp32_peer"] == "eager" and r["ratio_vs_best_fp32_peer"] > 0 for r in bf16)
    # replicate: DDP's limit over one all-reduce, its own optimizer steps, replicate peers only
    r0 = replicated[0]
    assert not any(r["replicate"] for r in sharded + bf16) and all(r["replicate"] for r in replicated)
    assert "limit_allgather_ms" not in r0 and r0["limit_comm_ms"] > 0
    assert r0["limit_ms"] == pytest.approx(r0["limit_fwd_ms"] + max(r0["limit_bwd_ms"], r0["limit_comm_ms"])
                                           + r0["limit_opt_ms"])
    assert r0["limit_opt_ms"] == pytest.approx(min(r["opt_ms"] for r in replicated))
    peers = {r["best_peer"] for r in replicated}  # the faster of the two replicate peers that ran
    assert len(peers) == 1 and peers <= {"replicate_eager", "replicate_whole"}
    assert by_mode["replicate_grouped"]["units"] == 1 and by_mode["replicate_whole"]["units"] == 2
    # replicate trains as sharded FSDP2 does; bf16 reduction moves the losses by rounding only
    assert all(r["loss_max_abs_diff"] < 1e-4 for r in replicated), [r["loss_max_abs_diff"] for r in replicated]
    assert all(r["loss_max_abs_diff"] < 1e-2 for r in bf16), [r["loss_max_abs_diff"] for r in bf16]
    assert "physical limit, replicate" in proc.stderr and "physical limit, bf16" in proc.stderr
    text = readme.read_text()
    assert "Physical limits fp32: " in text and "reduce-scatter in bf16" in text and "replicate: " in text
    assert "`replicate_grouped` (ours) = replicate, per-block compile" in text and "`replicate_whole` = " in text
