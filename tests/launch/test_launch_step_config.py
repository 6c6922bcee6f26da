"""Config validation of the training-step settings (data.lengths/padding/pad_multiple,
train.precision/grad_accum/no_recompile_after_warmup, compile.optimizer): each bad
value fails with what, why and how to fix, before any process group starts."""

from __future__ import annotations

import pytest
import torch

from launch.checks.validate import validate
from launch.config.schema import ConfigError

from _jobs import composed as _job


def test_defaults_are_fixed_lengths_max_padding_fp32_no_accumulation():
    cfg = _job()
    assert (cfg.data.lengths, cfg.data.padding, cfg.data.pad_multiple) == ("fixed", "max", 8)
    assert (cfg.train.precision, cfg.train.grad_accum, cfg.train.no_recompile_after_warmup) == ("fp32", 1, False)
    assert cfg.compile.optimizer is False
    good = _job("data.lengths=skewed", "data.padding=multiple", "data.pad_multiple=8", "train.precision=bf16",
                "train.grad_accum=2", "train.no_recompile_after_warmup=true", "compile.optimizer=true")
    validate(good, world_size=2)


BAD = [
    (["data.lengths=zipf"], r"^data\.lengths='zipf' is not one of fixed, skewed: .* Use data\.lengths=fixed"),
    (["data.padding=bucket"], r"^data\.padding='bucket' is not one of max, multiple, dynamic: .* Use data\.padding=max"),
    (["data.pad_multiple=0"], r"^data\.pad_multiple=0 is not valid: it must be a positive integer; .*data\.pad_multiple=8"),
    # seq_len 64 in multiples of 4: 16 static shapes > recompile_limit 8; the fix names the smallest multiple (8)
    (["data.padding=multiple", "data.pad_multiple=4"],
     r"^data\.padding=multiple with data\.pad_multiple=4 and train\.seq_len=64 gives 16 padded shapes, more than "
     r"torch\._dynamo\.config\.recompile_limit=8: .*Raise data\.pad_multiple to at least 8, or use data\.padding=dynamic"),
    (["data.padding=multiple", "compile.dynamic=true"],
     r"^data\.padding=multiple with compile\.dynamic=true: .*Leave compile\.dynamic=null"),
    (["train.precision=fp8"], r"^train\.precision='fp8' is not one of fp32, bf16, fp16\. Use train\.precision=fp32"),
    (["train.precision=bf16", "parallel=fsdp"], r"^train\.precision=bf16 with parallel=fsdp: .*fsdp\.mixed_precision=bf16"),
    (["train.grad_accum=0"], r"^train\.grad_accum=0 is not valid: it must be a positive integer"),
    (["train.grad_accum=3"],
     r"^train\.grad_accum=3 does not divide the per-rank batch of 4 sequences \(train\.batch_size=8 over 2 rank\(s\)\)"),
    (["compile=eager", "compile.optimizer=true"], r"^compile\.optimizer=true with compile\.backend=eager: .*compile=aot_eager"),
    (["compile.optimizer=true", "parallel=fsdp"], r"^compile\.optimizer=true is not supported with parallel=fsdp yet"),
    (["compile=eager", "train.no_recompile_after_warmup=true"],
     r"^train\.no_recompile_after_warmup=true with compile\.backend=eager: nothing is compiled"),
]


@pytest.mark.parametrize("overrides,match", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_step_settings_name_the_setting(overrides, match, tmp_path):
    cfg = _job(*overrides, f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=2)


def test_fp16_needs_cuda_and_no_compiled_optimizer(tmp_path, monkeypatch):
    ckpt = f"train.checkpoint_dir={tmp_path / 'ckpt'}"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^train\.precision=fp16 needs a CUDA GPU, and none is visible: .*"
                                          r"Use train\.precision=bf16 on CPU"):
        validate(_job("train.precision=fp16", ckpt), world_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"^train\.precision=fp16 with compile\.optimizer=true is not supported"):
        validate(_job("train.precision=fp16", "compile.optimizer=true", ckpt), world_size=2)
