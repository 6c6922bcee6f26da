"""DDP advice (moved out of compiler.graph.diagnose): the launcher's doctor spells each
setting as an override, a Python user reads compile_ddp / DDP arguments."""

from compiler.graph.diagnose import GraphInfo, compile_seconds
from ddp_opt import ddp_advice
from ddp_opt.advice import API_SPELLING
from launch.checks.diagnosis import OVERRIDE_SPELLING


def test_poor_alignment_suggests_the_partition_sizes_as_bucket_caps():
    advice = ddp_advice(alignment=0.39, partition_mib=[1.0078, 1.0085, 1.0093, 0.2822], spelling=OVERRIDE_SPELLING)
    (line,) = [a for a in advice if "match one partition" in a]
    assert line.startswith("only 39% of the gradient bytes are in DDP buckets that match one partition")
    assert "bucket_cap_mb_list=[1.01, 1.01, 1.01, 0.282]" in line
    assert not any("match one partition" in a for a in ddp_advice(alignment=1.0, spelling=OVERRIDE_SPELLING))


def test_exposed_communication_suggests_caps_to_compare():
    advice = ddp_advice(exposed_comm_ms=60.0, compute_ms=200.0, bucket_cap_mb=4.0, spelling=OVERRIDE_SPELLING)
    (line,) = [a for a in advice if "waits for gradient communication" in a]
    assert line.startswith("60 ms of each 260 ms step waits for gradient communication")
    assert "ddp.bucket_cap_mb=2" in line and "ddp.bucket_cap_mb=8" in line and "--modes eager,nosplit,ours --caps 2,4,8,auto" in line
    assert "ddp.bucket_cap_mb=auto" in line
    hidden = ddp_advice(exposed_comm_ms=5.0, compute_ms=200.0, bucket_cap_mb=4.0, spelling=OVERRIDE_SPELLING)
    assert not any("waits for gradient communication" in a for a in hidden)


def test_compile_time_that_dominates_points_at_regional_compile_and_the_cache():
    slow = ddp_advice(compile_s=compile_seconds([GraphInfo(0, 10, 5, compile_s=60.0)]), step_s=0.2,
                      spelling=OVERRIDE_SPELLING)
    (line,) = [a for a in slow if a.startswith("compile took")]
    assert line.startswith("compile took 60.0s, 300x a step")
    assert "ddp.strategy=regional" in line and "compile.cache_dir=DIR" in line
    quick = ddp_advice(compile_s=compile_seconds([GraphInfo(0, 10, 5, compile_s=5.0)]), step_s=0.2,
                       spelling=OVERRIDE_SPELLING)
    assert not any(a.startswith("compile took") for a in quick)


def test_python_api_users_read_compile_ddp_and_ddp_arguments_not_launcher_overrides():
    advice = ddp_advice(alignment=0.5, partition_mib=[1.0, 2.0], exposed_comm_ms=60.0, compute_ms=200.0,
                        bucket_cap_mb=4.0, compile_s=60.0, step_s=0.2)
    assert advice and all("ddp.bucket_cap_mb" not in a and "ddp.strategy" not in a for a in advice)
    text = "\n".join(advice)
    assert "DistributedDataParallel(model, bucket_cap_mb=2)" in text
    assert "compile_ddp(ddp, bucket_cap_mb='auto')" in text
    assert "DistributedDataParallel(model, bucket_cap_mb_list=[1, 2])" in text
    assert "compile_ddp(ddp, strategy='regional')" in text and "compile_ddp(ddp, cache_dir=DIR)" in text
    assert API_SPELLING.compare is None and "benchmarks" not in text
