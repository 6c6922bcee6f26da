"""DDPCompileConfig: every compile_ddp setting validated in one place, before
anything is measured or compiled; the config can be passed whole; realignment is
turned off, with a warning, on an untested torch."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_opt.api
import ddp_opt.config
import ddp_opt.setup
from compiler import SettingError
from ddp_opt import DDPCompileConfig, LinkEstimate, compile_ddp


pytestmark = pytest.mark.usefixtures("gloo_module", "clean_dynamo")


@pytest.mark.parametrize("kwargs, setting, match", [
    (dict(backend="no_such_backend"), "backend", r"Unknown compile backend 'no_such_backend'.*Valid names:.*aot_eager"),
    (dict(mode="fastest"), "mode", r"Unknown inductor mode 'fastest'. Valid modes:"),
    (dict(backend="aot_eager", mode="max-autotune"), "mode", r"are inductor settings, but backend='aot_eager'"),
    (dict(fallback="ignore"), "fallback", r"fallback='ignore'\): expected one of warn, raise"),
    (dict(bucket_cap_mb=4), "bucket_cap_mb", r"A fixed cap belongs on DDP: DistributedDataParallel\(model, bucket_cap_mb=4\)"),
    (dict(bucket_cap_mb="auto", strategy="whole"), "bucket_cap_mb", r"bucket_cap_mb='auto', strategy='whole'.*Drop one"),
    (dict(link=LinkEstimate(1e-3, 1e8), strategy="regional"), "link", r"link=\.\.\., strategy='regional'"),
    (dict(strategy="fused"), "strategy", r"strategy='fused'\): expected one of 'split': .*'whole': .*'regional': "
                                         r".*'traced': "),
    (dict(share_timeout_s=0), "share_timeout_s", r"compile_ddp\(share_timeout_s=0\): expected a positive number"),
    (dict(blocks=[]), "blocks", r"compile_ddp.blocks=\[\]: expected 'auto', the name of one ModuleList"),
    (dict(cache_dir=""), "cache_dir", r"is not a directory.*cache_dir=None to turn"),
])
def test_each_bad_setting_fails_when_built_naming_its_field(kwargs, setting, match):
    with pytest.raises(SettingError, match=match) as info:
        DDPCompileConfig(**kwargs)
    assert info.value.setting == setting


def test_wrong_kinds_are_type_errors():
    with pytest.raises(TypeError, match=r"link=3\): expected None \(measure dist.all_reduce\)"):
        DDPCompileConfig(bucket_cap_mb="auto", link=3)
    with pytest.raises(TypeError, match=r"wrap_backend='x'\): expected a callable"):
        DDPCompileConfig(wrap_backend="x")


def test_compile_ddp_validates_before_touching_the_model():
    ddp = DDP(nn.Linear(4, 4))
    with pytest.raises(SettingError, match="Unknown compile backend"):
        compile_ddp(ddp, backend="no_such_backend")
    assert "forward" not in ddp.module.__dict__  # nothing compiled in place


def test_a_config_passed_whole_compiles_like_the_keywords():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    x = torch.randn(4, 64)
    want = model(x)
    compiled = compile_ddp(DDP(model, bucket_cap_mb=0.01), config=DDPCompileConfig(backend="aot_eager"))
    torch.testing.assert_close(compiled(x), want)
    assert len(compiled.buckets) >= 2


def test_config_and_keywords_together_are_refused():
    with pytest.raises(ValueError, match=r"config=\.\.\., backend=\.\.\.\): .*dataclasses.replace"):
        compile_ddp(DDP(nn.Linear(4, 4)), config=DDPCompileConfig(), backend="eager")


def test_a_torch_without_realignments_internals_turns_it_off_naming_them(monkeypatch):
    monkeypatch.setattr(ddp_opt.setup, "REALIGN_SUPPORTED", False)
    monkeypatch.setattr("ddp_opt._torch_internals.missing_for_realignment",
                        lambda: ["DDP._bucket_config.per_bucket_bytes_caps"])
    monkeypatch.setattr("compiler.torch_release._features_off", set())
    with pytest.warns(RuntimeWarning, match=r"compile_ddp\(align_buckets=True\) is off on torch .*: it needs "
                                            r"DDP._bucket_config.per_bucket_bytes_caps, which this release lacks, so "
                                            r"DDP keeps its own buckets"):
        compiled = compile_ddp(DDP(nn.Linear(4, 4)), backend="eager")
    assert compiled.align_buckets is False


# --- one definition per setting: the keyword list and the cache key come from the fields ------


def test_compile_ddp_lists_one_keyword_per_config_field():
    import dataclasses
    import inspect

    params = inspect.signature(compile_ddp).parameters  # what help(compile_ddp) shows
    keywords = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - {"config"}
    assert keywords == {f.name for f in dataclasses.fields(DDPCompileConfig)} - {"spelling", "torch_compile_kwargs"}
    assert params["strategy"].default == "split" and params["share"].default is True


def test_the_compile_settings_are_compiler_options_with_ddps_own_added():
    import dataclasses

    from compiler import CompileOptions

    shared = [f.name for f in dataclasses.fields(CompileOptions)]
    assert [f.name for f in dataclasses.fields(DDPCompileConfig)][:len(shared)] == shared
    config = DDPCompileConfig(backend="aot_eager", fullgraph=True, share=False, strategy="whole")
    assert config.compile_options() == CompileOptions(backend="aot_eager", fullgraph=True, share=False)


def test_a_new_field_is_a_keyword_without_any_other_edit():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class WithANewSetting(DDPCompileConfig):
        new_knob: int = 3

    assert WithANewSetting.from_keywords("compile_ddp", {"new_knob": 5, "backend": "eager"}).new_knob == 5


@pytest.mark.parametrize("name, value", [
    (n, v) for n, v in [("mode", "max-autotune"), ("fullgraph", True), ("dynamic", True),
                        ("fallback", "raise"), ("check_plans", False), ("align_buckets", False),
                        ("share", False), ("share_timeout_s", 5.0),
                        ("strategy", "traced"), ("bucket_cap_mb", "auto"), ("disable", True)]
])
def test_every_keyword_given_beside_a_config_is_refused(name, value):
    # No keyword can be silently dropped next to config=.
    with pytest.raises(ValueError, match=rf"config=\.\.\., {name}=\.\.\.\): a DDPCompileConfig carries every"):
        compile_ddp(DDP(nn.Linear(4, 4)), config=DDPCompileConfig(backend="aot_eager"), **{name: value})


def test_an_unknown_keyword_is_refused_with_the_closest_setting():
    ddp = DDP(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"compile_ddp\(\) got an unexpected keyword argument 'stratgy': it is "
                                        r"neither a setting of compile_ddp .* nor one of torch.compile's keywords, "
                                        r"which compile_ddp passes on \(disable.*\)\. Did you mean strategy=\?"):
        compile_ddp(ddp, backend="eager", stratgy="traced")
    assert "forward" not in ddp.module.__dict__


# --- one spelling per setting: the keywords of the unreleased 0.1.0 drafts are gone -----------


@pytest.mark.parametrize("old, near", [("split", ""), ("regional", ""), ("share_compile", r" Did you mean share\w*=\?")])
def test_an_old_keyword_is_an_unknown_keyword_naming_every_setting(old, near):
    ddp = DDP(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=rf"compile_ddp\(\) got an unexpected keyword argument '{old}': it is neither a "
                                        r"setting of compile_ddp \(the fields of ddp_opt.DDPCompileConfig: backend, "
                                        r"mode, .*share, .*strategy, .*wrap_backend\) nor one of torch.compile's keywords"
                                        rf".*\.{near}$"):
        compile_ddp(ddp, backend="eager", **{old: False})
    assert "forward" not in ddp.module.__dict__


def test_a_new_setting_is_in_the_cache_key_without_any_other_edit():
    from dataclasses import dataclass

    from fsdp_opt import FSDPConfig
    from fsdp_opt.apply import _cache_settings

    @dataclass(frozen=True)
    class WithANewSetting(DDPCompileConfig):
        new_knob: int = 3

    key = WithANewSetting(backend="aot_eager").cache_settings()
    assert key["new_knob"] == 3 and key["backend"] == "aot_eager" and key["strategy"] == "split"
    # What the fields declare not_compiled stays out, each with its reason beside it.
    assert not {"cache_dir", "share", "share_timeout_s", "check_plans", "align_buckets", "spelling"} & set(key)

    @dataclass(frozen=True)
    class FSDPWithANewSetting(FSDPConfig):
        new_knob: str = "x"

    fsdp_key = _cache_settings(FSDPWithANewSetting(compile="aot_eager"))
    assert fsdp_key["new_knob"] == "x" and fsdp_key["compile"]["backend"] == "aot_eager"
    assert "prefetch" not in fsdp_key and "share" not in fsdp_key["compile"]


def test_the_cache_key_is_the_same_in_every_run():
    # Callables by qualified name, not address: a backend function keys the same in a restart.
    def my_backend(gm, example_inputs):
        return gm.forward

    a, b = DDPCompileConfig(backend=my_backend), DDPCompileConfig(backend=my_backend, share_timeout_s=9.0)
    assert a.cache_settings() == b.cache_settings()
    assert a.cache_settings()["backend"].endswith("my_backend")
