"""Launcher settings for compile time: compile.cache_dir and ddp.strategy=regional."""

import pytest
import torch

from launch.config.schema import ConfigError
from launch.checks.validate import validate

from _jobs import composed as _job


def test_cache_dir_and_regional_are_accepted_with_ddp(tmp_path):
    cfg = _job(f"compile.cache_dir={tmp_path / 'cache'}", "ddp.strategy=regional", "compile.blocks=blocks")
    validate(cfg, world_size=2)
    assert (cfg.compile.cache_dir, cfg.ddp.strategy, cfg.compile.blocks) == (str(tmp_path / "cache"), "regional", "blocks")
    assert _job().compile.cache_dir is None and _job().ddp.strategy == "split"


@pytest.mark.parametrize("old", ["compile.split=false", "compile.regional=true"])
def test_an_old_compile_switch_is_an_unknown_setting_naming_the_valid_ones(old):
    # ddp.strategy is the one spelling; the command line refuses the old one before Hydra composes it.
    from launch.config.argv import check_argv

    _, problem = check_argv([old])
    assert problem is not None and problem.startswith(f"{old!r}: {old.split('.')[1].split('=')[0]!r} is not a "
                                                      "setting of compile, so nothing would read it. ")
    assert "The settings of compile are backend, mode, " in problem and problem.endswith("(as compile.field=value).")
    with pytest.raises(ConfigError, match=rf"^{old.split('=')[0]} is not a setting of this job: .*Valid keys of "
                                          r"compile: backend, mode, .*blocks\."):
        _job("+" + old)


@pytest.mark.parametrize("parallel", ["fsdp", "none"])
def test_cache_dir_is_accepted_with_fsdp_and_none(tmp_path, parallel):
    from launch.runtime.parallel import fsdp_config

    cfg = _job(f"compile.cache_dir={tmp_path / 'cache'}", f"parallel={parallel}")
    validate(cfg, world_size=2 if parallel == "fsdp" else 1)
    assert fsdp_config(cfg.fsdp, cfg.compile).compile.cache_dir == str(tmp_path / "cache")


BAD = [
    (["compile.cache_dir=FILE"], r"compile\.cache_dir='.*not_a_dir' is not a directory: .*compile\.cache_dir=/scratch"),
    (["compile.cache_dir=FILE", "parallel=fsdp"], r"compile\.cache_dir='.*not_a_dir' is not a directory"),
    (["compile.cache_dir=/tmp/c", "parallel=fsdp", "compile=eager"],
     r"compile\.cache_dir='/tmp/c' with compile\.backend=eager: nothing is compiled.*compile\.backend=inductor"),
    (["compile.cache_dir=/tmp/c", "compile=eager"], r"compile\.cache_dir='/tmp/c' with compile\.backend=eager: nothing is compiled"),
    (["ddp.strategy=regional", "parallel=none"],
     r"ddp\.strategy is set but parallel=none: ddp\.\* settings configure DistributedDataParallel"),
    (["ddp.strategy=whole", "compile=eager"],
     r"ddp\.strategy=whole with compile\.backend=eager: .*nothing is compiled.*drop ddp\.strategy"),
    (["ddp.strategy=fused"], r"ddp\.strategy='fused' is not valid: it must be one of split \(.*\); whole \(.*"
                             r"regional \(.*traced \(.*Use e\.g\. ddp\.strategy=split"),
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

    cfg = _job("compile=aot_eager", "ddp.strategy=regional", "compile.blocks=layers")
    with single_rank_group():
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
        with pytest.raises(ValueError, match=r"blocks='layers': \['layers'\] not found in GPT.*ddp\.strategy=split"):
            apply_parallel(build_model(cfg.model), cfg, env)


def test_fsdp_compile_config_refuses_a_cache_dir_that_is_a_file(tmp_path):
    import fsdp_opt

    f = tmp_path / "a_file"
    f.write_text("")
    with pytest.raises(ValueError, match=r"CompileConfig\(cache_dir='.*a_file'\) is not a directory: .*cache_dir=None"):
        fsdp_opt.FSDPCompileConfig(cache_dir=str(f))
    assert fsdp_opt.FSDPCompileConfig(cache_dir=str(tmp_path / "cache")).cache_dir == str(tmp_path / "cache")


def test_the_compile_group_maps_one_to_one_onto_compiler_compile_options():
    import dataclasses

    import fsdp_opt
    from compiler import CompileOptions
    from ddp_opt import DDPCompileConfig
    from launch.config.schema import CompileConfig

    group = {f.name: f for f in dataclasses.fields(CompileConfig)}
    for f in dataclasses.fields(CompileOptions):
        assert f.name in group, f"compiler.CompileOptions.{f.name} has no compile.{f.name} in the launcher's schema"
    # Same defaults: the schema's defaults build the library's defaults.
    assert CompileConfig().compile_options() == CompileOptions()
    # The DDP and FSDP configs embed the same fields (their subclasses), so each is defined once.
    assert issubclass(DDPCompileConfig, CompileOptions) and issubclass(fsdp_opt.FSDPCompileConfig, CompileOptions)
    # Every shared setting reaches both libraries by name, with no list kept by hand.
    from launch.runtime.parallel import ddp_compile_config, fsdp_config

    cfg = _job("compile.fullgraph=true", "compile.share=false", "compile.share_timeout_s=60",
               "compile.dynamic=false", "+compile.options.shape_padding=true")
    want = CompileOptions(fullgraph=True, share=False, share_timeout_s=60.0, dynamic=False,
                          options={"shape_padding": True})
    assert cfg.compile.compile_options() == want
    assert ddp_compile_config(cfg).compile_options() == want
    assert fsdp_config(cfg.fsdp, cfg.compile).compile.compile_options() == want


def test_the_fsdp_group_reaches_fsdp_config_by_name():
    import dataclasses

    import fsdp_opt
    from launch.config.schema import FSDPOptions
    from launch.runtime.parallel import fsdp_config

    # Every fsdp.* setting but the launcher's precision choices (which become mp_policy) is an
    # FSDPConfig field of the same name, so a new one needs no mapping of its own.
    names = {f.name for f in dataclasses.fields(FSDPOptions)} - {"mixed_precision", "reduce_dtype"}
    assert names <= {f.name for f in dataclasses.fields(fsdp_opt.FSDPConfig)}
    cfg = _job("parallel=fsdp", "fsdp.shard_unit_mb=4", "fsdp.prefetch=0", "fsdp.reshard_after_forward=false",
               "fsdp.checkpointing=true", "fsdp.mixed_precision=bf16")
    made = fsdp_config(cfg.fsdp, cfg.compile)
    assert (made.shard_unit_mb, made.prefetch, made.reshard_after_forward, made.checkpointing) == (4.0, 0, False, True)
    assert made.mp_policy.param_dtype == torch.bfloat16
