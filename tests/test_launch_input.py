"""Bad input the main job refuses before any process group starts: `+` keys the
schema does not have, sizes that cannot fit in memory, folders that cannot be
written, and a custom model or dataset that breaks the job's contract on one tiny
batch. Each refusal is a ConfigError that says what, why and how to fix it."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from launch.schema import ConfigError, JobConfig, register_configs, to_job_config
from launch.validate import validate


def _job(*overrides: str) -> JobConfig:
    register_configs()
    with initialize_config_module("configs", version_base="1.3"):
        return to_job_config(compose(config_name="config", overrides=list(overrides)))


# --- `+` keys ----------------------------------------------------------------------------


def test_unknown_top_level_key_is_refused_with_the_valid_keys():
    with pytest.raises(ConfigError, match=r"^foo is not a setting of this job: .* silently ignored\. "
                                          r"Remove the override\. Valid keys: model, parallel"):
        _job("+foo=1")


def test_misspelt_nested_key_names_the_key_it_is_close_to():
    with pytest.raises(ConfigError, match=r"^train\.stepz is not a setting.* Did you mean train\.steps\? Set it "
                                          r"without the `\+` \(e\.g\. train\.steps=\.\.\.\)"):
        _job("+train.stepz=5")


def test_free_form_sections_take_any_key():
    cfg = _job("compile.backend=aot_eager", "+compile.options.anything=1", "+data.kwargs.max_stride=3")
    assert cfg.compile.options == {"anything": 1} and cfg.data.kwargs == {"max_stride": 3}
