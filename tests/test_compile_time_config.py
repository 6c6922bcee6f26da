"""Launcher settings of issue 6: compile.cache_dir and compile.regional."""

import pytest

from launch.config.schema import ConfigError
from launch.checks.validate import validate

from _jobs import composed as _job


def test_cache_dir_and_regional_are_accepted_with_ddp(tmp_path):
    cfg = _job(f"compile.cache_dir={tmp_path / 'cache'}", "compile.regional=true", "compile.blocks=blocks")
    validate(cfg, world_size=2)
    assert (cfg.compile.cache_dir, cfg.compile.regional, cfg.compile.blocks) == (str(tmp_path / "cache"), True, "blocks")
    assert _job().compile.cache_dir is None and _job().compile.regional is False


@pytest.mark.parametrize("parallel", ["fsdp", "none"])
def test_cache_dir_is_accepted_with_fsdp_and_none(tmp_path, parallel):
    from launch.runtime.parallel import fsdp_config

    cfg = _job(f"compile.cache_dir={tmp_path / 'cache'}", f"parallel={parallel}")
    validate(cfg, world_size=2 if parallel == "fsdp" else 1)
    assert fsdp_config(cfg.fsdp, cfg.compile).compile.cache_dir == str(tmp_path / "cache")


def test_regional_with_fsdp_is_accepted():
    # fsdp_opt always compiles per block: regional=true says what already happens.
    validate(_job("parallel=fsdp", "compile.regional=true"), world_size=2)


BAD = [
    (["compile.cache_dir=FILE"], r"compile\.cache_dir='.*not_a_dir' is not a directory: .*compile\.cache_dir=/scratch"),
    (["compile.cache_dir=FILE", "parallel=fsdp"], r"compile\.cache_dir='.*not_a_dir' is not a directory"),
    (["compile.cache_dir=/tmp/c", "parallel=fsdp", "compile=eager"],
     r"compile\.cache_dir='/tmp/c' with compile\.backend=eager: nothing is compiled.*compile\.backend=inductor"),
    (["compile.cache_dir=/tmp/c", "compile=eager"], r"compile\.cache_dir='/tmp/c' with compile\.backend=eager: nothing is compiled"),
    (["compile.regional=true", "parallel=none"],
     r"compile\.regional=true with parallel=none: .*Use parallel=ddp \(also on one rank\) or compile\.regional=false"),
]


@pytest.mark.parametrize("overrides,match", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_compile_time_settings_say_how_to_fix(overrides, match, tmp_path):
    f = tmp_path / "not_a_dir"
    f.write_text("")
    cfg = _job(*[o.replace("FILE", str(f)) for o in overrides], "train.batch_size=8")
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=2)


def test_regional_reaches_compile_ddp_and_a_bad_blocks_name_says_how_to_fix(tmp_path):
    from _dist import single_rank_group
    from launch.runtime.dist import DistEnv
    from launch.runtime.parallel import apply_parallel, build_model
    import torch

    cfg = _job("compile=aot_eager", "compile.regional=true", "compile.blocks=layers")
    with single_rank_group():
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
        with pytest.raises(ValueError, match=r"blocks='layers': \['layers'\] not found in GPT.*compile\.regional=false"):
            apply_parallel(build_model(cfg.model), cfg, env)


def test_fsdp_compile_config_refuses_a_cache_dir_that_is_a_file(tmp_path):
    import fsdp_opt

    f = tmp_path / "a_file"
    f.write_text("")
    with pytest.raises(ValueError, match=r"CompileConfig\(cache_dir='.*a_file'\) is not a directory: .*cache_dir=None"):
        fsdp_opt.CompileConfig(cache_dir=str(f))
    assert fsdp_opt.CompileConfig(cache_dir=str(tmp_path / "cache")).cache_dir == str(tmp_path / "cache")
