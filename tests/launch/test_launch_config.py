"""The main job's configs: every group composes with Hydra's compose API into the
typed JobConfig, and every bad value fails validation with its own message."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from launch.checkpoint.store import latest_checkpoint
from launch.checks.validate import validate
from launch.config.schema import ConfigError, JobConfig, register_configs, to_job_config
from launch.data.build import build_data
from launch.data.source import SyntheticTokens
from launch.runtime.parallel import build_model, ddp_bucket_kwargs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GROUPS = ("model", "parallel", "compile", "ddp", "data", "train")


def _compose(overrides=(), **kw):
    register_configs()
    with initialize_config_module("configs", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), **kw)


def _job(*overrides) -> JobConfig:
    return to_job_config(_compose(overrides))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_defaults_compose_to_typed_job_config():
    cfg = _job()
    assert isinstance(cfg, JobConfig)
    assert (cfg.model.name, cfg.parallel.name, cfg.compile.backend) == ("gpt_tiny", "ddp", "inductor")
    assert cfg.ddp.bucket_cap_mb is None and cfg.data.name == "synthetic" and cfg.train.steps > 0
    validate(cfg, world_size=2)


def test_the_default_models_sizes_are_the_gpts_own():
    # launch.models.GPTConfig is the one source of the default model's sizes: ModelConfig and the
    # benchmarks read it; configs/model/gpt_tiny.yaml keeps literal values (Hydra reads YAML), held here.
    from omegaconf import OmegaConf

    from launch.config.schema import ModelConfig
    from launch.models import GPTConfig

    sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout")
    gpt, yaml, schema, composed = GPTConfig(), OmegaConf.load(CONFIGS / "model" / "gpt_tiny.yaml"), ModelConfig(), _job()
    for name in sizes:
        assert yaml[name] == getattr(schema, name) == getattr(composed.model, name) == getattr(gpt, name), (
            f"configs/model/gpt_tiny.yaml's {name}={yaml[name]} is not launch.models.GPTConfig's {getattr(gpt, name)}")


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes(group, option, tmp_path):
    assert _options(group), f"configs/{group}/ has no options"
    more = []
    if (group, option) == ("data", "tokens"):  # data.path is required: a small token file
        (tmp_path / "tokens.bin").write_bytes(bytes(4000))
        more = [f"data.path={tmp_path / 'tokens.bin'}"]
    cfg = _job(f"{group}={option}", *more)
    section = getattr(cfg, group)
    if hasattr(section, "name"):
        assert section.name == option
    if group == "compile":
        assert section.backend == option
    if (group, option) == ("parallel", "fsdp") and not hasattr(importlib.import_module("fsdp_opt"), "apply"):
        pytest.skip("fsdp_opt.apply does not exist in this checkout")
    validate(cfg, world_size=2)


def test_field_overrides_are_typed():
    cfg = _job("compile.backend=aot_eager", "ddp.bucket_cap_mb=1", "ddp.bucket_cap_mb_list=null",
               "train.steps=5", "+compile.options.shape_padding=true", "+model.kwargs.tie_weights=false")
    assert cfg.compile.backend == "aot_eager" and cfg.ddp.bucket_cap_mb == 1.0 and cfg.train.steps == 5
    assert cfg.compile.options == {"shape_padding": True} and cfg.model.kwargs == {"tie_weights": False}
    with pytest.raises(Exception, match="ddp.bucket_cap_mb"):
        _job("ddp.bucket_cap_mb=abc")


@pytest.mark.parametrize("option", ["gpt_tiny", "hf_gpt2", "custom"])
def test_every_model_builds_and_returns_logits_and_loss(option):
    if option == "hf_gpt2":
        pytest.importorskip("transformers")
    cfg = _job(f"model={option}", "model.n_layer=1")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, cfg.model.vocab_size) and loss.ndim == 0


def test_slurm_launcher_config_composes():
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.nodes=4"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher.nodes == 4 and launcher.tasks_per_node == launcher.gpus_per_node


BAD = [
    (["ddp.bucket_cap_mb=-1"], r"ddp\.bucket_cap_mb=-1\.0 is not valid: it must be a positive size in MiB"),
    (["ddp.bucket_cap_mb=0"], r"ddp\.bucket_cap_mb=0\.0 is not valid.*e\.g\. ddp\.bucket_cap_mb=25"),
    (["ddp.first_bucket_cap_mb=0"], r"ddp\.first_bucket_cap_mb=0\.0 is not valid"),
    (["ddp.bucket_cap_mb_list=[1,-2]"], r"ddp\.bucket_cap_mb_list\[1\]=-2\.0 is not valid"),
    (["ddp.bucket_cap_mb_list=[]"], r"ddp\.bucket_cap_mb_list=\[\] gives no caps"),
    (["ddp.first_bucket_cap_mb=8", "ddp.bucket_cap_mb=4"], r"first_bucket_cap_mb=8\.0 is larger than"),
    (["ddp.bucket_cap_mb_list=[1,4]", "ddp.bucket_cap_mb=2"],
     r"ddp\.bucket_cap_mb_list and ddp\.bucket_cap_mb are both set"),
    (["ddp.bucket_cap_mb_list=[1,4]", "ddp.first_bucket_cap_mb=1"],
     r"ddp\.bucket_cap_mb_list and ddp\.first_bucket_cap_mb are both set"),
    (["ddp.bucket_cap_mb_list=[1,4]", "parallel=none"], r"ddp\.bucket_cap_mb_list is set but parallel=none"),
    (["compile.backend=nope"], r"compile\.backend='nope': Unknown compile backend .*Valid names: .*aot_eager"),
    (["compile.mode=fastest"], r"compile\.mode='fastest': Unknown inductor mode .*Valid modes"),
    (["compile=aot_eager", "compile.mode=max-autotune"], r"compile\.mode='max-autotune': .*inductor settings"),
    (["compile=eager", "+compile.options.shape_padding=true"], r"compile\.options=.*inductor settings"),
    (["compile.fallback=ignore"], r"compile\.fallback='ignore' is not one of"),
    (["parallel.dist_backend=mpi"], r"parallel\.dist_backend='mpi' is not one of"),
    (["model.name=llama"], r"model\.name='llama' is not a model this job knows"),
    (["model=custom", "model._target_=no_such_pkg.Model"], r"model\._target_='no_such_pkg\.Model' cannot be imported"),
    (["model.n_head=3"], r"model\.n_embd=128 is not divisible by model\.n_head=3"),
    (["data=custom", "data._target_=null"], r"data='custom' needs data\._target_"),
    (["train.steps=0"], r"train\.steps=0 is not valid: it must be a positive integer"),
    (["train.steps=-3"], r"train\.steps=-3 is not valid"),
    (["train.batch_size=7"], r"train\.batch_size=7 does not divide across 2 ranks.*train\.batch_size=6"),
    (["train.seq_len=128"], r"train\.seq_len=128 is longer than model\.block_size=64"),
    (["train.lr=0"], r"train\.lr=0\.0 is not valid"),
    (["train.checkpoint_every=-1"], r"train\.checkpoint_every=-1 is negative"),
    (["train.timeout_s=0"], r"train\.timeout_s=0\.0 is not valid"),
]


@pytest.mark.parametrize("overrides,match", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_names_the_setting(overrides, match, tmp_path):
    cfg = _job(*overrides, f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    with pytest.raises(ConfigError, match=match) as info:
        validate(cfg, world_size=2)
    assert "." in str(info.value).rstrip(".")  # what + why + how: more than one sentence


def test_fsdp_without_fsdp_opt_is_not_available_yet(monkeypatch):
    import fsdp_opt

    monkeypatch.delattr(fsdp_opt, "apply", raising=False)
    with pytest.raises(ConfigError, match=r"parallel=fsdp is not available yet.*Use parallel=ddp"):
        validate(_job("parallel=fsdp"), world_size=2)


def test_nccl_with_more_ranks_than_gpus_on_a_node_is_bad_input(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"dist_backend=nccl with 2 ranks on this node and 1 visible GPU\(s\): "
                                          r"NCCL refuses two ranks on one device\. Launch --nproc-per-node 1"):
        validate(_job("parallel.dist_backend=nccl"), world_size=2)


@pytest.mark.parametrize("requested,local_rank,ranks,gpus,expected", [
    ("auto", 1, 2, 0, ("gloo", "cpu")),
    ("auto", 1, 2, 2, ("nccl", "cuda:1")),
    ("auto", 1, 2, 1, ("gloo", "cuda:0")),  # two ranks share the one GPU over gloo
    ("auto", 2, 4, 2, ("gloo", "cuda:0")),
    ("nccl", 1, 2, 2, ("nccl", "cuda:1")),
    ("gloo", 0, 2, 2, ("gloo", "cpu")),
])
def test_the_backend_and_device_follow_the_gpus_per_node(requested, local_rank, ranks, gpus, expected):
    from launch.runtime.dist import choose_backend

    backend, device = choose_backend(requested, local_rank, ranks, gpus)
    assert (backend, str(device)) == expected


def _publish(root: Path, step: int, complete: bool = True, tmp: bool = False) -> Path:
    d = root / (f"step_{step:06d}" + (".tmp" if tmp else ""))
    d.mkdir(parents=True)
    if complete:
        (d / ".metadata").write_bytes(b"")
        (d / "train_state.json").write_text(f'{{"step": {step}}}')
    return d


def test_resume_without_checkpoint_is_bad_input(tmp_path):
    cfg = _job("train.resume=true", f"train.checkpoint_dir={tmp_path / 'none'}")
    with pytest.raises(ConfigError, match=r"train\.resume=true but there is no checkpoint in train\.checkpoint_dir="):
        validate(cfg)


def test_resume_past_the_last_step_is_bad_input(tmp_path):
    _publish(tmp_path, 20)
    cfg = _job("train.resume=true", "train.steps=20", f"train.checkpoint_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"already at step 20 >= train\.steps=20"):
        validate(cfg)


def test_fresh_run_refuses_to_mix_with_old_checkpoints(tmp_path):
    _publish(tmp_path, 4)
    cfg = _job("train.checkpoint_every=2", f"train.checkpoint_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"already holds checkpoints of another run.*train\.resume=true"):
        validate(cfg)


def test_latest_checkpoint_never_returns_a_half_written_one(tmp_path):
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    _publish(tmp_path, 3)
    _publish(tmp_path, 6, tmp=True)  # killed while writing
    _publish(tmp_path, 9, complete=False)  # no .metadata: not a checkpoint
    (tmp_path / "latest").write_text("step_000003")
    assert latest_checkpoint(str(tmp_path)).step == 3
    _publish(tmp_path, 5)  # published, then killed before `latest` moved on
    assert latest_checkpoint(str(tmp_path)).step == 5
    (tmp_path / "latest").write_text("step_000042")  # marker to a folder that is gone
    assert latest_checkpoint(str(tmp_path)).step == 5


def test_first_bucket_cap_becomes_a_per_bucket_list():
    assert ddp_bucket_kwargs(_job("ddp.first_bucket_cap_mb=1", "ddp.bucket_cap_mb=4").ddp) == {
        "bucket_cap_mb_list": [1.0, 4.0]}
    assert ddp_bucket_kwargs(_job("ddp.first_bucket_cap_mb=2").ddp) == {"bucket_cap_mb_list": [2.0, 25.0]}
    assert ddp_bucket_kwargs(_job("ddp.bucket_cap_mb_list=[1,3]").ddp) == {"bucket_cap_mb_list": [1.0, 3.0]}
    assert ddp_bucket_kwargs(_job("ddp.bucket_cap_mb=3").ddp) == {"bucket_cap_mb": 3.0}


def test_synthetic_data_is_a_function_of_seed_rank_step():
    cfg = _job()
    a, b = (build_data(cfg.data, seed=7, vocab_size=512) for _ in range(2))
    x1, y1 = a.batch(5, 1, 2, 4, 16)
    x2, y2 = b.batch(5, 1, 2, 4, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1]) and x1.dtype == torch.int64 and x1.shape == (4, 16)
    assert not torch.equal(x1, a.batch(5, 0, 2, 4, 16)[0])
    assert not torch.equal(x1, a.batch(6, 1, 2, 4, 16)[0])
    custom = build_data(_job("data=custom", "train.seed=7").data, seed=0, vocab_size=0)
    assert isinstance(custom, SyntheticTokens) and torch.equal(custom.batch(5, 1, 2, 4, 16)[0], x1)

