"""compile.cache_dir with parallel=none (the launcher's torch.compile path): a restart on a
fresh Inductor dir is served from the entry (one small inductor job, run twice)."""

import pytest

from _cache_mode_job import run_mode_job


@pytest.mark.slow
def test_a_restart_with_parallel_none_hits_the_cache_and_builds_no_kernel(tmp_path):
    cold = run_mode_job(tmp_path / "cache", tmp_path / "inductor_cold", "none")
    assert cold["load"] == "missing" and cold["saved"]
    assert cold["aot"].get("autograd_cache_miss", 0) > 0 and cold["inductor"].get("fxgraph_cache_miss", 0) > 0
    warm = run_mode_job(tmp_path / "cache", tmp_path / "inductor_warm", "none")
    assert warm["load"] == "loaded" and not warm["saved"]  # nothing new to write
    assert warm["aot"].get("autograd_cache_hit", 0) == cold["aot"]["autograd_cache_miss"]
    assert warm["aot"].get("autograd_cache_miss", 0) == 0
    assert warm["inductor"].get("fxgraph_cache_hit", 0) == cold["inductor"]["fxgraph_cache_miss"]
    assert warm["so_files"] == warm["installed"] == cold["so_files"], "a C++ kernel was rebuilt"
    assert warm["loss"] == pytest.approx(cold["loss"], rel=1e-5)
