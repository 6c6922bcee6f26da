"""benchmarks.harness.device without a GPU: ``--device`` resolution, the process-group choice
for ranks sharing GPUs, the CPU clock and peak memory, the job's device, and the
peak-memory column of ddp_compare's table. The CUDA path itself: test_gpu_bench.py."""

import pytest
import torch

from benchmarks.harness.core import GPTJob, max_peak_mib
from benchmarks.studies.ddp_compare import format_table
from benchmarks.harness.device import choose_backend, clock, device_label, peak_bytes, place_rank, reset_peak, resolve_device


@pytest.mark.parametrize("available, requested, expected", [
    (False, "auto", "cpu"), (True, "auto", "cuda"), (True, "cpu", "cpu"), (True, "cuda", "cuda"), (False, "cpu", "cpu"),
])
def test_auto_is_cuda_where_available(monkeypatch, available, requested, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert resolve_device(requested) == expected


def test_cuda_without_cuda_says_what_why_and_how(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda was given, but torch.cuda.is_available\(\) is False.*"
                                         r"cannot put its model on a GPU. Pass --device cpu"):
        resolve_device("cuda")


@pytest.mark.parametrize("ranks, gpus, backend", [(1, 1, "nccl"), (2, 2, "nccl"), (2, 8, "nccl"), (2, 1, "gloo"),
                                                  (3, 2, "gloo")])
def test_nccl_only_when_every_rank_has_a_gpu_of_its_own(ranks, gpus, backend):
    chosen, why = choose_backend(ranks, gpus)
    assert chosen == backend
    if backend == "gloo":
        assert f"{ranks} ranks share {gpus} GPU(s)" in why and "NCCL refuses two ranks on one device" in why
        assert f"Pass --nproc {gpus} for NCCL" in why


def test_the_cpu_placement_clock_and_peak():
    placement = place_rank("cpu")
    assert (placement.device, placement.backend) == (torch.device("cpu"), "gloo")
    cpu = torch.device("cpu")
    assert device_label(cpu) == "cpu"
    reset_peak(cpu)
    assert peak_bytes(cpu) is None
    t0 = clock(cpu)
    assert clock(cpu) >= t0


def test_a_job_runs_on_cpu_or_cuda_and_peaks_are_none_without_measures():
    assert GPTJob().torch_device == torch.device("cpu")
    with pytest.raises(ValueError, match="a job runs on 'cpu' or 'cuda'. Resolve --device auto first"):
        GPTJob(device="auto")
    gathered = [{"peak_mib": {"eager": 10.0, "ours": None}}, {"peak_mib": {"eager": 12.5, "ours": None}}]
    assert max_peak_mib(gathered, "eager") == 12.5 and max_peak_mib(gathered, "ours") is None


def _row(mode, peak):
    return {"mode": mode, "backend": "eager" if mode == "eager" else "inductor", "link": "none", "bucket_cap_mb": 4.0,
            "step_ms_median": 10.0, "ratio_vs_builtin": None, "compute_ms": 8.0, "comm_ms": 0.0,
            "exposed_comm_ms": 1.0, "overlap": None, "compile_cold_s": 1.0, "compile_warm_s": 0.5, "partitions": 2,
            "ddp_buckets": 2, "recompiles": 0, "loss_max_abs_diff": 0.0, "peak_mib": peak, "device": "cpu"}


def test_the_terminal_table_shows_peak_memory_and_a_dash_on_cpu():
    cpu = format_table([_row("eager", None), _row("ours", None)]).splitlines()
    header = [c.strip() for c in cpu[0].strip("|").split("|")]
    col = header.index("peak MiB")
    assert [[c.strip() for c in line.strip("|").split("|")][col] for line in cpu[2:]] == ["-", "-"]
    gpu = format_table([_row("eager", 812.4), _row("ours", 790.0)]).splitlines()
    assert [[c.strip() for c in line.strip("|").split("|")][col] for line in gpu[2:]] == ["812", "790"]


@pytest.mark.parametrize("gpus, devices, backend", [(1, [0, 0], "gloo"), (2, [0, 1], "nccl"), (4, [0, 1], "nccl")])
def test_the_shaped_nets_two_nodes_count_the_ranks_of_both(monkeypatch, gpus, devices, backend):
    # Both nodes of --net shaped are namespaces of one machine with one local rank each: they see the same GPUs.
    from benchmarks.harness.device import machine_env

    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    placements = []
    for node in (0, 1):
        for key, value in machine_env(node, ranks_per_node=1).items():
            monkeypatch.setenv(key, value)
        placements.append(place_rank("cuda"))
    assert chosen == devices and [p.device.index for p in placements] == devices
    assert {p.backend for p in placements} == {backend}
    if backend == "gloo":
        assert "2 ranks share 1 GPU(s)" in placements[0].why and "A machine with 2 GPUs runs them over NCCL" in \
            placements[0].why
    else:
        assert "each of the 2 rank(s) on this machine's simulated nodes has a GPU of its own" in placements[0].why
