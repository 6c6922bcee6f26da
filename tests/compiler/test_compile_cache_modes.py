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


@pytest.mark.slow
def test_a_ddp_entry_written_on_two_ranks_warms_four_ranks_and_one(tmp_path):
    # DDP's split graphs hold no collective: with the same per-rank batch they are the same on
    # every world size, and so is the entry (its key says world_size "any").
    cold = run_mode_job(tmp_path / "cache", tmp_path / "inductor_cold", "ddp", nproc=2)
    assert cold["load"] == "missing" and cold["saved"] and cold["aot"].get("autograd_cache_miss", 0) > 0
    warm = run_mode_job(tmp_path / "cache", tmp_path / "inductor_4", "ddp", nproc=4)
    assert warm["load"] == "loaded" and not warm["saved"], warm  # nothing new: every graph came from the entry
    assert warm["aot"].get("autograd_cache_miss", 0) == 0 and warm["aot"].get("autograd_cache_hit", 0) == 4
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0 and warm["so_files"] == cold["so_files"]
    # Rank 0's first loss: the same weights and batch on every world size, from the loaded graphs.
    assert warm["loss"] == pytest.approx(cold["loss"], rel=1e-6)
    # One rank: the entry loads and Inductor compiles nothing, but AOTAutograd's key differs
    # (measured; Note [Compile cache]), so it traces again and the entry gains its artifact.
    one = run_mode_job(tmp_path / "cache", tmp_path / "inductor_1", "ddp", nproc=1)
    assert one["load"] == "loaded" and one["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert one["so_files"] == cold["so_files"] and one["loss"] == pytest.approx(cold["loss"], rel=1e-6)
