"""compile.cache_dir with parallel=none (the launcher's torch.compile path, one process) and
parallel=fsdp (fsdp_opt's per-block compile, 2 ranks on gloo under torchrun): a restart on a
fresh Inductor dir is served from the entry (one small inductor job, run twice per mode)."""

import pytest

from _cache_mode_job import run_mode_job


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "fsdp"])
def test_a_restart_hits_the_cache_and_builds_no_kernel(tmp_path, mode):
    cold = run_mode_job(tmp_path / "cache", tmp_path / "inductor_cold", mode)
    assert cold["load"] == "missing" and cold["saved"]
    assert cold["aot"].get("autograd_cache_miss", 0) > 0 and cold["inductor"].get("fxgraph_cache_miss", 0) > 0
    warm = run_mode_job(tmp_path / "cache", tmp_path / "inductor_warm", mode)
    assert warm["load"] == "loaded" and not warm["saved"]  # nothing new to write
    # Counters summed over ranks. Cold, with shared compile, each graph missed on the rank that
    # compiled it and hit on the ranks that loaded its artifacts; warm, every rank hits every graph
    # (rank 0's entry holds the graphs the other rank compiled too).
    for kind, counter in (("aot", "autograd_cache"), ("inductor", "fxgraph_cache")):
        assert warm[kind].get(f"{counter}_hit", 0) == sum(cold[kind].get(f"{counter}_{x}", 0) for x in ("hit", "miss"))
    assert warm["aot"].get("autograd_cache_miss", 0) == 0
    assert warm["so_files"] == cold["so_files"], "a C++ kernel was rebuilt"
    if mode == "none":  # with 2 ranks both install into the one Inductor dir: whichever came first wrote the files
        assert warm["installed"] == cold["so_files"]
    assert warm["loss"] == pytest.approx(cold["loss"], rel=1e-5)
