"""The ddp_compare harness end to end on a tiny model: 2 gloo ranks on the CPU
(``--device cpu``, also where CUDA is available), aot_eager, simulated 1ms,100MB/s
link. Checks the rows, never the timings. The CUDA path: test_gpu_bench.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.studies.ddp_compare import ROW_KEYS, main, parse_args

REPO = Path(__file__).resolve().parents[2]
# ~2 MiB of gradients (vocab 1024 x 128 tied embedding + 2 blocks): at cap 1 MiB, 2-3 buckets.
# Caps below 1 MiB are out: PyTorch's splitter rejects them.
TINY = ["--device", "cpu", "--backend", "aot_eager", "--layers", "2", "--embd", "128", "--heads", "2", "--vocab", "1024",
        "--seq", "16", "--batch", "2", "--caps", "1", "--steps", "2", "--warmup", "1", "--link", "1ms,100MB/s"]


def test_quick_defaults_and_explicit_flags_win():
    args = parse_args(["--quick", "--json", "x/out.json"])
    assert (args.backend, args.steps, args.warmup) == ("aot_eager", 8, 3) and len(args.caps) == 1
    assert args.plot == str(Path("x/out.png"))
    assert parse_args(["--quick", "--backend", "eager", "--caps", "2,8"]).backend == "eager"
    full = parse_args([])
    assert full.backend == "inductor" and full.caps == (1.0, 4.0, 25.0)


def test_bad_link_fails_before_launching():
    with pytest.raises(ValueError, match="is not a link description"):
        main(["--link", "fast"])


def test_device_cuda_without_cuda_exits_before_launching(monkeypatch, capsys):
    import torch

    import benchmarks.studies.ddp_compare as ddp_compare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ddp_compare, "here_or_relaunched", lambda *a, **k: pytest.fail("launched anyway"))
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cuda", "--quick"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda was given, but torch.cuda.is_available() is False" in err
    assert "cannot put its model on a GPU. Pass --device cpu (or leave --device at auto)" in err
    assert parse_args(["--quick"]).device == "cpu"  # auto, without CUDA


def test_bad_mode_and_small_cap_are_named():
    from benchmarks.studies.ddp_bench import BenchConfig

    with pytest.raises(ValueError, match="valid modes are eager, builtin, nosplit, ours"):
        BenchConfig(modes=("eager", "fast"))
    with pytest.raises(ValueError, match="below 1 MiB.*drop builtin"):
        BenchConfig(caps=(0.5, 4))
    BenchConfig(modes=("eager", "ours"), caps=(0.5,))


def test_baseline_must_run_and_regional_stays_out_of_sweeps():
    from benchmarks.studies.ddp_bench import BenchConfig

    with pytest.raises(ValueError, match="--baseline nosplit is not among --modes eager,ours.*Add nosplit to --modes"):
        BenchConfig(modes=("eager", "ours"), baseline="nosplit")
    with pytest.raises(ValueError, match="--sweep does not take the regional mode.*buckets are whole blocks"):
        BenchConfig(modes=("ours", "regional"), sweep=True)
    BenchConfig(modes=("eager", "ours"))  # no builtin, no baseline: no ratio, no error


@pytest.mark.slow
def test_tiny_run_writes_rows_for_every_mode(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.ddp_compare", *TINY, "--modes", "eager,builtin,nosplit,ours,regional",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["eager", "builtin", "nosplit", "ours", "regional"]
    for r in rows:
        assert set(ROW_KEYS) <= set(r), f"{r['mode']} lacks {set(ROW_KEYS) - set(r)}"
        assert r["device"] == "cpu" and r["peak_mib"] is None  # no per-mode allocator counter on the CPU
        assert r["backend"] == ("eager" if r["mode"] == "eager" else "aot_eager") and r["link"] == "1ms,100MB/s"
        assert r["bucket_cap_mb"] == 1.0 and r["step_ms_median"] > 0
        assert r["loss_max_abs_diff"] < 1e-4, f"{r['mode']} drifted from eager by {r['loss_max_abs_diff']}"
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["ours"]["partitions"] > 1 and by_mode["nosplit"]["partitions"] == 1
    assert 0.0 <= by_mode["ours"]["alignment"] <= 1.0 and by_mode["eager"]["alignment"] is None
    assert by_mode["builtin"]["ratio_vs_builtin"] == pytest.approx(1.0)
    # the physical limit: one for the job, every step at or above it; the best peer's ratio to itself is 1
    limits = {r["limit_ms"] for r in rows}
    assert len(limits) == 1 and all(r["net"] == "local" for r in rows)
    limit = rows[0]
    assert limit["limit_ms"] == pytest.approx(limit["limit_fwd_ms"] + max(limit["limit_bwd_ms"], limit["limit_comm_ms"])
                                              + limit["limit_opt_ms"])
    assert limit["limit_fwd_ms"] == pytest.approx(min(r["fwd_ms"] for r in rows))
    # the simulated link charges one message of all the gradient bytes its latency plus bytes / bandwidth
    assert limit["limit_comm_ms"] >= 1.0 + limit["grad_mib"] * 2**20 / 100e6 * 1e3 - 1e-6
    assert all(r["step_over_limit"] == pytest.approx(r["step_ms_median"] / r["limit_ms"]) for r in rows)
    peer = by_mode[limit["best_peer"]]
    assert peer["mode"] in ("eager", "builtin") and peer["ratio_vs_best_peer"] == pytest.approx(1.0)
    assert peer["step_ms_median"] == min(r["step_ms_median"] for r in rows if r["mode"] in ("eager", "builtin"))
    # regional: one block graph; DDP's runtime buckets are its planned buckets of whole blocks
    regional = by_mode["regional"]
    assert regional["partitions"] == 1 and regional["alignment"] == 1.0
    assert regional["ddp_buckets"] == len(regional["plan_bucket_mib"]) >= 2
    assert "| ours" in proc.stdout and "peak MiB" in proc.stdout  # the table
    assert "round 2/2" in proc.stderr and "compile" in proc.stderr  # progress
    assert "process group gloo, device cpu" in proc.stderr
    try:
        import matplotlib  # noqa: F401  (the bench extra; the plot is skipped without it)
    except ImportError:
        return
    assert (tmp_path / "rows.png").stat().st_size > 0


def test_relaunch_keeps_nproc_away_from_torchrun():
    # torchrun's parser reads a worker's --nproc as its own --nproc-per-node and exits
    from benchmarks.harness.torchrun import _without_nproc

    assert _without_nproc(["--nproc", "1", "--modes", "ours", "--nproc=2", "--json", "x"]) == ["--modes", "ours", "--json", "x"]


@pytest.mark.parametrize("keep", [False, True])
def test_keep_grads_zeroes_the_gradients_in_place_between_steps(gloo, keep):
    # --keep-grads: every backward then adds to existing gradients (a compiled optimizer's way, and
    # gradient accumulation's synchronised step), the backward graph the traced strategy had to fix.
    from benchmarks.studies.ddp_bench import BenchConfig, run_step
    from benchmarks.link.shaping import LinkModel, SimulatedLink
    from benchmarks.studies.modes_ddp import build_runner

    assert parse_args(["--keep-grads"] if keep else []).keep_grads is keep
    cfg = BenchConfig(device="cpu", backend="eager", modes=("eager",), layers=1, embd=32, heads=2, vocab=64, seq=8,
                      batch=2, keep_grads=keep)
    link = SimulatedLink(LinkModel())  # none: the real (in-process) all-reduce only
    r = build_runner("eager", cfg, 25.0, link)
    run_step(r, cfg, link)
    grads = [p.grad for p in r.ddp.parameters()]
    if keep:
        assert all(g is not None and not g.any() for g in grads)
    else:
        assert all(g is None for g in grads)


@pytest.mark.slow
def test_a_powersgd_row_gets_a_limit_with_its_power_iteration_timed_in_backward(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.ddp_compare", "--sweep", "--caps", "1", "--link", "none",
         "--modes", "eager,eager_powersgd", "--device", "cpu", "--layers", "1", "--embd", "128", "--heads", "2",
         "--vocab", "512", "--steps", "2", "--warmup", "0", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "matrices took" in proc.stdout + proc.stderr and "inside an eager backward" in proc.stdout + proc.stderr
    rows = {r["runner"]: r for r in json.loads(out.read_text())}
    assert rows["eager@25"]["limit_compress_ms"] == 0 and rows["eager@25"]["limit_compress_alone_ms"] == 0
    for label in ("eager_powersgd@1", "eager_powersgd@25"):
        r = rows[label]
        assert r["compression"] == "powersgd:4:2"
        assert r["limit_compress_ms"] > 0 and r["limit_compress_alone_ms"] > 0
        assert r["limit_ms"] == pytest.approx(r["limit_fwd_ms"] + max(r["limit_bwd_ms"] + r["limit_compress_ms"],
                                                                      r["limit_comm_ms"]) + r["limit_opt_ms"])
