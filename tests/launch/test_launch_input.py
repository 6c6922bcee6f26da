"""Bad input the main job refuses before any process group starts: `+` keys the
schema does not have, sizes that cannot fit in memory, folders that cannot be
written, and a custom model or dataset that breaks the job's contract on one tiny
batch. Each refusal is a ConfigError that says what, why and how to fix it."""

from __future__ import annotations

import pytest

from launch.checks.validate import validate
from launch.config.schema import ConfigError

from _jobs import composed as _job


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


# --- sizes against memory -----------------------------------------------------------------


@pytest.mark.parametrize("override", ["train.batch_size=1000000000", "model.n_layer=10000"])
def test_sizes_that_cannot_fit_in_memory_are_refused_with_the_estimate(override):
    cfg = _job("compile.backend=aot_eager", override)
    with pytest.raises(ConfigError, match=r"^the job needs about [\d,.]+ GiB per rank \(parameters [\d,.]+ [MG]iB, "
                                          r"gradients and optimizer state [\d,.]+ [MG]iB, activations [\d,.]+ [MG]iB "
                                          r"for a micro-batch of \d+ x 64 tokens\) but a rank here has about [\d.]+ GiB "
                                          r"\(MemAvailable [\d.]+ GiB shared by 1 rank\(s\) on this machine\).*Lower "
                                          r"train\.batch_size.* set train\.memory_check=false\.$"):
        validate(cfg, world_size=2)
    validate(_job("compile.backend=aot_eager", override, "train.memory_check=false"), world_size=2)


def test_memory_estimate_counts_the_gpt_parameters():
    from launch.checks.rules_resources import gpt_parameters
    from launch.runtime.parallel import build_model

    cfg = _job("model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.vocab_size=100")
    assert gpt_parameters(cfg) == sum(p.numel() for p in build_model(cfg.model).parameters())


# --- folders the job writes -----------------------------------------------------------------


def test_cache_dir_that_cannot_be_created_is_refused_and_nothing_is_left(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = _job("compile.backend=aot_eager", f"compile.cache_dir={blocker}/cache")
    with pytest.raises(ConfigError, match=rf"^compile\.cache_dir='{blocker}/cache' cannot be written: {blocker} is a "
                                          r"file, not a folder, and the compile cache is written there.*or set "
                                          r"compile\.cache_dir=null"):
        validate(cfg)
    cfg = _job("compile.backend=aot_eager", "compile.cache_dir=/proc/distcompile/cache")
    with pytest.raises(ConfigError, match=r"cannot be written: cannot create a folder in /proc \("):
        validate(cfg)
    fresh = _job("compile.backend=aot_eager", f"compile.cache_dir={tmp_path}/new/cache", "train.checkpoint_every=2",
                 f"train.checkpoint_dir={tmp_path}/ckpt")
    validate(fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # checked without creating anything


# --- a custom dataset and model, tried on one tiny batch ----------------------------------------

CONTRACT = r"batch\(step, rank, world_size, batch_size, seq_len\) must return \(inputs, targets\), int64 tensors"


@pytest.mark.parametrize("target,problem", [
    ("WrongShape", r"the inputs of batch\(\) has shape \(2, 63\), expected \(2, 64\) for batch_size=2, seq_len=64"),
    ("WrongDtype", r"the inputs of batch\(\) has dtype torch\.int32, expected torch\.int64 token ids"),
    ("PastVocab", r"the inputs of batch\(\) holds ids from \d+ to \d+, outside \[0, 512\) \(model\.vocab_size=512\)"),
])
def test_custom_dataset_breaking_the_contract_is_refused(target, problem):
    cfg = _job("compile.backend=aot_eager", "data=custom", f"data._target_=_custom_parts.{target}")
    with pytest.raises(ConfigError, match=rf"^data\._target_='_custom_parts\.{target}': {problem}.*\. {CONTRACT}"):
        validate(cfg, world_size=2)


@pytest.mark.parametrize("out,problem", [
    ("dict", r"forward returned a dict with keys \['logits'\], with no logits to train on"),
    ("scalar", r"forward on a batch of shape \(1, 64\) returned logits of shape \(\) and dtype torch\.float32, "
               r"expected floating-point logits of shape \(1, 64, 512\)"),
])
def test_custom_model_returning_no_logits_is_refused(out, problem):
    cfg = _job("compile.backend=aot_eager", "model=custom", "model._target_=_custom_parts.TinyLM", "~model.kwargs.cfg",
               f"+model.kwargs.out={out}")
    with pytest.raises(ConfigError, match=rf"^model\._target_='_custom_parts\.TinyLM': {problem}"):
        validate(cfg, world_size=2)


def test_custom_model_with_the_wrong_vocabulary_is_refused():
    cfg = _job("compile.backend=aot_eager", "model=custom", "model._target_=_custom_parts.TinyLM", "~model.kwargs.cfg",
               "+model.kwargs.vocab=100")
    with pytest.raises(ConfigError, match=r"returned logits of shape \(1, 64, 100\) .* expected floating-point "
                                          r"logits of shape \(1, 64, 512\).*set model\.vocab_size to the model's"):
        validate(cfg, world_size=2)


def test_readme_custom_model_command_builds_the_users_model():
    # docs/main-job.md, "Choices": model=custom model._target_=my_pkg.MyLM '~model.kwargs.cfg' '+model.kwargs={dim: 32}'
    cfg = _job("compile.backend=aot_eager", "model=custom", "model._target_=_custom_parts.TinyLM", "~model.kwargs.cfg",
               "+model.kwargs={dim: 32}")
    assert cfg.model.kwargs == {"dim": 32}
    validate(cfg, world_size=2)


def test_example_kwargs_left_merged_into_a_users_model_are_named():
    cfg = _job("compile.backend=aot_eager", "model=custom", "model._target_=_custom_parts.TinyLM",
               "+model.kwargs={dim: 32}")
    with pytest.raises(ConfigError, match=r"building the model .* unexpected keyword argument 'cfg'.*\. model\.kwargs still "
                                          r"holds cfg, .* drop it with '~model\.kwargs\.cfg'\."):
        validate(cfg, world_size=2)


# --- the command line before Hydra (Note [Command line before Hydra]) ------------------------------


def test_a_group_typo_names_the_close_valid_choice_and_exits_2(launch_cli):
    proc = launch_cli("modle=gpt_tiny")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("error: 'modle=gpt_tiny': 'modle' is neither a config group nor a setting of the job; "
                             "did you mean 'model'? The groups are compile, data, ddp") == 1, proc.stderr
    assert "+modle" not in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_a_run_directory_that_cannot_be_made_is_named(launch_cli, tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = launch_cli(f"hydra.run.dir={tmp_path / 'a_file' / 'run'}")
    assert proc.returncode == 2, proc.stderr
    assert f"error: hydra.run.dir='{tmp_path / 'a_file' / 'run'}' cannot be created (Not a directory)" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_users_config_that_is_not_yaml_is_one_message_with_the_line(launch_cli, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "bad.yaml").write_text("train:\n  steps: [1\n")
    proc = launch_cli("--config-dir", str(tmp_path / "mine"), "--config-name", "bad")
    assert proc.returncode == 2, proc.stderr
    assert (f"error: the config file {tmp_path / 'mine' / 'bad.yaml'} is not valid YAML at line 3, column 1: "
            "expected ',' or ']'") in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_config_path_with_a_users_config_reuses_the_jobs_groups(launch_cli, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "myjob.yaml").write_text("defaults:\n  - config\n  - _self_\ntrain:\n  steps: 2\n")
    proc = launch_cli("compile=eager", "parallel=none", "--config-path", str(tmp_path / "mine"),
                      "--config-name", "myjob")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: steps 1..2" in proc.stdout


def test_a_group_of_ones_own_config_folder_is_not_taken_for_a_typo(tmp_path):
    from launch.config.argv import check_argv

    (tmp_path / "mine" / "mygroup").mkdir(parents=True)
    _, problem = check_argv(["--config-dir", str(tmp_path / "mine"), "mygroup=a"])
    assert problem is None
    _, problem = check_argv(["mygroup=a"])
    assert problem is not None and "'mygroup' is neither a config group nor a setting of the job" in problem


# --- the share secret ----------------------------------------------------------------------


def test_a_share_secret_file_others_can_read_is_refused_before_the_process_group(tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 32)
    secret.chmod(0o644)
    monkeypatch.setenv("DISTCOMPILE_SHARE_SECRET_FILE", str(secret))
    cfg = _job("compile.backend=aot_eager")
    with pytest.raises(ConfigError, match=rf"^DISTCOMPILE_SHARE_SECRET_FILE={secret}: .*mode 644.*Run chmod 600 "
                                          r".*compile\.share=false turns sharing off\)\.$"):
        validate(cfg, world_size=2)
    validate(_job("compile.backend=aot_eager", "compile.share=false"), world_size=2)  # not read without sharing
    secret.chmod(0o600)
    validate(cfg, world_size=2)
