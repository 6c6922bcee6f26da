"""compile.cache_dir with parallel=fsdp (fsdp_opt's per-block compile), 2 ranks on gloo under
torchrun: a restart on a fresh Inductor dir is served from the entry."""

import pytest

from _cache_mode_job import run_mode_job


@pytest.mark.slow
def test_a_restart_with_parallel_fsdp_hits_the_cache_and_builds_no_kernel(tmp_path):
    cold = run_mode_job(tmp_path / "cache", tmp_path / "inductor_cold", "fsdp")
    assert cold["load"] == "missing" and cold["saved"]
    assert cold["aot"].get("autograd_cache_miss", 0) > 0 and cold["inductor"].get("fxgraph_cache_miss", 0) > 0
    warm = run_mode_job(tmp_path / "cache", tmp_path / "inductor_warm", "fsdp")
    assert warm["load"] == "loaded" and not warm["saved"]
    assert warm["aot"].get("autograd_cache_hit", 0) == cold["aot"]["autograd_cache_miss"]
    assert warm["aot"].get("autograd_cache_miss", 0) == 0
    assert warm["inductor"].get("fxgraph_cache_hit", 0) == cold["inductor"]["fxgraph_cache_miss"]
    # Both ranks install into the one Inductor dir; whichever came first wrote the files.
    assert warm["so_files"] == cold["so_files"], "a C++ kernel was rebuilt"
    assert warm["loss"] == pytest.approx(cold["loss"], rel=1e-5)
