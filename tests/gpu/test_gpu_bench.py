"""The benchmarks' CUDA path (Note [Benchmark device] in ``benchmarks.harness.device``) on one
GPU: ``ddp_compare`` and ``fsdp_compare --quick --device cuda --nproc 1`` end to end
(rows on the GPU, a peak memory per mode, compiled losses next to eager's), and the
simulated link's comm hook under DDP on a CUDA model. Checks the rows, never the
timings. Skipped without CUDA; the CPU path is tested by test_bench_*_compare.py."""

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,  # starts the benchmarks' processes (Note [Test tiers])
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA: the benchmarks' --device cuda path (model, batches and clocks on the GPU, "
                              "peak GPU memory per mode)"),
]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 840  # below pytest's 900 s: inductor compiles every mode twice (cold and warm) in the DDP run


def _run(module: str, args: list[str], out: Path) -> tuple[list[dict], subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", module, *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc


def _check_cuda_rows(rows: list[dict], modes: list[str]) -> None:
    assert [r["mode"] for r in rows] == modes
    for r in rows:
        assert r["device"].startswith("cuda"), f"{r['mode']} ran on {r['device']}"
        assert r["peak_mib"] is not None and r["peak_mib"] > 0, f"{r['mode']}: peak_mib {r['peak_mib']}"
        assert r["step_ms_median"] > 0
        if r["backend"] != "eager":  # a compiled mode, against eager's losses
            assert r["loss_max_abs_diff"] <= 1e-3, f"{r['mode']} drifted from eager by {r['loss_max_abs_diff']}"


def test_ddp_compare_quick_on_one_gpu(tmp_path):
    rows, proc = _run("benchmarks.studies.ddp_compare",
                      ["--quick", "--device", "cuda", "--nproc", "1", "--link", "none", "--backend", "inductor"],
                      tmp_path / "ddp.json")
    _check_cuda_rows(rows, ["eager", "builtin", "nosplit", "ours"])
    assert all(r["backend"] == "inductor" for r in rows if r["mode"] != "eager")
    assert "process group nccl" in proc.stderr  # one rank, one GPU: NCCL, and rank 0 says so
    assert "peak MiB" in proc.stdout  # the table's column


def test_fsdp_compare_quick_on_one_gpu(tmp_path):
    rows, proc = _run("benchmarks.studies.fsdp_compare", ["--quick", "--device", "cuda", "--nproc", "1"],
                      tmp_path / "fsdp.json")
    _check_cuda_rows(rows, ["eager", "per_block", "grouped"])
    for r in rows:
        assert r["transport"].startswith("nccl") and r["peak_mem_kind"].startswith("cuda")
        assert len(r["peak_mem_mib_per_rank"]) == 1 and r["peak_mem_mib_per_rank"][0] == r["peak_mib"]
    assert "process group nccl" in proc.stderr


def test_simulated_link_hook_on_cuda_gives_exact_gradients_after_the_link():
    """The hook's CUDA future (devices=[the bucket's]) and side stream under a real DDP
    reducer over NCCL: gradients equal a plain model's, and backward waits for the link."""
    from benchmarks.link.shaping import LinkModel, SimulatedLink

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
        ref = copy.deepcopy(model)
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.0001)  # several buckets
        alpha = 0.02
        link = SimulatedLink(LinkModel(alpha_s=alpha, bandwidth=1e9))
        ddp.register_comm_hook(link, SimulatedLink.hook)
        for step in range(3):  # DDP rebuilds its buckets after the first step
            x = torch.randn(5, 8, device=device)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ddp(x).square().sum().backward()
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            ref(x).square().sum().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step}, {name}: {m}")
                p.grad, q.grad = None, None
            stats = link.take_step_stats()
            # The first step runs in one bucket (torch 2.11 on CUDA and 2.13 on CPU alike);
            # the cap applies from the rebuild after it.
            assert stats.buckets >= (2 if step else 1), stats
            # a serial link: every bucket holds it for at least alpha
            assert elapsed >= stats.buckets * alpha - 1e-3, f"step {step}: {elapsed:.4f} s for {stats.buckets} buckets"
        del ddp  # the reducer goes before its process group
    finally:
        dist.destroy_process_group()
