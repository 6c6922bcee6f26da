"""``distcompile-train`` (``launch/launcher.py``, Note [Checks before the ranks start]): a bad
setting is one line and exit code 2 before any rank starts; torchrun's flags are told apart from
the job's overrides; a failed rank is one line naming it, its exit code and its own last line
(Note [A failed rank's last line]). The launcher runs in this process here; the two tests at the
end start it for real (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launch.launcher as launcher
from launch.config.compose import compose_job
from launch.config.schema import ConfigError
from launch.runtime import elastic, worker_error
from launch.runtime._torch_internals import FailedWorker

from _jobs import TINY_OVERRIDES
from _torchrun import FAULT_JOB

TWO_RANKS = ["--standalone", "--nproc-per-node", "2"]


@pytest.fixture
def cli(tmp_path, capfd, monkeypatch):
    """``cli(*argv) -> (code, stderr lines, stdout)``: ``distcompile-train ARGV`` in this process,
    from ``tmp_path``; starting the ranks fails the test (nothing may start for a bad setting)."""
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(launcher, "run_agent", lambda args: started.append(args) or 0)

    def run(*argv: str):
        capfd.readouterr()
        code = launcher.launch(list(argv))
        out, err = capfd.readouterr()
        assert not started, f"ranks were started for {argv}"
        return code, err.splitlines(), out

    return run


# --- bad settings: one line, exit code 2, no rank started ---------------------------------------


@pytest.mark.parametrize("override, line", [
    ("ddp.bucket_cap_mb=-1", r"^error: ddp\.bucket_cap_mb=-1\.0 is not valid: it must be a positive size in MiB; .*"
                             r"Give a size in MiB, e\.g\. ddp\.bucket_cap_mb=25"),
    ("ddp.bucket_cap=5", r"^error: 'ddp\.bucket_cap=5': 'bucket_cap' is not a setting of ddp, so nothing would read "
                         r"it\. Did you mean ddp\.bucket_cap_mb or .*The settings of ddp are bucket_cap_mb, "),
    ("train.steps=abc", r"^error: train\.steps=abc is not valid: train\.steps is an integer \(every setting is typed: "
                        r"launch/config/schema\.py\), and 'abc' cannot be read as that\. Give an integer, e\.g\. "
                        r"train\.steps=20 \(the default\)\.$"),
])
def test_a_bad_setting_is_one_line_and_exit_2_before_any_rank_starts(cli, override, line):
    code, err, out = cli(*TWO_RANKS, override)
    assert code == 2 and len(err) == 1 and out == "", err
    assert "Traceback" not in err[0] and re.match(line, err[0]), err[0]


def test_the_checks_see_the_world_size_of_torchruns_flags(cli):
    code, err, _ = cli(*TWO_RANKS, "train.batch_size=7")
    assert code == 2 and err == ["error: train.batch_size=7 does not divide across 2 ranks: it is the global batch "
                                 "and every rank takes an equal share. Use a multiple of 2, e.g. train.batch_size=6."]
    # an elastic job is checked at every size it may run at: 1 machine of 3 ranks, then 2 (6 ranks)
    code, err, _ = cli("--nnodes", "1:2", "--nproc-per-node", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       "localhost:0", "train.batch_size=9")
    assert code == 2 and err[0].startswith("error: train.batch_size=9 does not divide across 6 ranks"), err


def test_the_checks_see_the_local_world_size_and_leave_the_environment_as_it_was(monkeypatch):
    seen = []
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(launcher, "validate", lambda cfg, world_size: seen.append(
        (world_size, os.environ["LOCAL_WORLD_SIZE"])))
    monkeypatch.setattr(launcher, "run_agent", lambda args: 0)
    assert launcher.launch(["--nnodes=1:2", "--nproc-per-node=2", "compile.backend=aot_eager"]) == 0
    assert seen == [(2, "2"), (4, "2")] and "LOCAL_WORLD_SIZE" not in os.environ


@pytest.mark.parametrize("argv, line", [
    (["--standalone", "--nproc-per-node", "two"], r"^error: --nproc-per-node='two': Unsupported nproc_per_node value: "
                                                  r"two\. Give --nproc-per-node a number of ranks per machine"),
    (["--standalone", "--max-restarts", "abc", "train.steps=2"],
     r"^error: torchrun's flags --standalone --max-restarts abc are not valid: argument --max-restarts/--max_restarts: "
     r"invalid int value: 'abc'\. Fix the flag \(torchrun --help lists them\)"),
    (["--standalone", "-m", "launch.train"], r"^error: -m is not a flag of distcompile-train: it runs the main job on "
                                             r"every rank, so the program is chosen already\."),
    (["--standalone", "--nproc-per-node"], r"^error: --nproc-per-node needs a value: it is torchrun's flag"),
    ([*TWO_RANKS, "--multirun", "train.steps=2,3"], r"^error: --multirun is not a setting distcompile-train passes to "
                                                    r"its ranks: .* python -m launch\.train --multirun \.\.\."),
    ([*TWO_RANKS, "model=gpt_huge"], r"^error: model=gpt_huge: the config group model has no option 'gpt_huge', so "
                                     r"there is nothing to compose\. Pick one of its options: custom, gpt_tiny, "
                                     r"hf_gpt2 \(e\.g\. model=gpt_tiny\)\.$"),
])
def test_bad_flags_are_one_line_and_exit_2(cli, argv, line):
    code, err, _ = cli(*argv)
    assert code == 2 and len(err) == 1 and re.match(line, err[0]), err


def test_help_prints_the_usage_and_starts_nothing(cli):
    code, err, out = cli("--help")
    assert code == 0 and out.startswith("usage: distcompile-train [torchrun's flags] [overrides]") and err == []


def test_good_settings_go_to_torchrun_with_the_worker_after_its_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = []
    monkeypatch.setattr(launcher, "run_agent", lambda args: got.append(args) or 0)
    monkeypatch.setattr(launcher, "worker_command", lambda: ["/opt/bin/distcompile-train"])
    assert launcher.launch([*TWO_RANKS, "--max-restarts=1", "compile.backend=aot_eager", "-v"]) == 0
    (args,) = got
    assert args.standalone and args.nproc_per_node == "2" and args.max_restarts == 1 and args.no_python
    assert args.training_script == "/opt/bin/distcompile-train"
    assert args.training_script_args == ["compile.backend=aot_eager", "-v"]  # as given: each rank composes again


# --- torchrun's flags and the job's -----------------------------------------------------------


@pytest.mark.parametrize("argv, flags", [
    (["--standalone", "--nproc-per-node", "2", "a=1", "-v"], ["--standalone", "--nproc-per-node", "2"]),
    (["--nnodes=2", "--rdzv-backend", "c10d", "--rdzv_endpoint=h:29400", "--node-rank", "1", "a=1"],
     ["--nnodes=2", "--rdzv-backend", "c10d", "--rdzv_endpoint=h:29400", "--node-rank", "1"]),
    (["a=1", "--standalone"], []),  # torchrun's flags come first
    (["--standalone", "--config-path", "/x", "a=1"], ["--standalone"]),
])
def test_torchruns_flags_end_at_the_first_argument_that_is_not_one(argv, flags):
    assert elastic.split_argv(argv) == (flags, argv[len(flags):])


def test_the_worker_is_this_console_script_when_it_runs(tmp_path, monkeypatch):
    script = tmp_path / "bin" / "distcompile-train"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(script)])
    assert elastic.worker_command() == [str(script)]
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert elastic.worker_command() == [sys.executable, "-u", "-m", "launch.train"]


def test_under_torchrun_the_console_script_is_the_worker_entry_point(monkeypatch):
    import launch.train

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(launch.train, "main", lambda: calls.append("worker"))
    monkeypatch.setattr(launcher, "launch", lambda argv: pytest.fail("launched from inside a rank"))
    launcher.main()
    assert calls == ["worker"]


# --- Hydra's type errors in our words ---------------------------------------------------------


@pytest.mark.parametrize("override, words", [
    ("train.resume=maybe", "train.resume is true or false (every setting is typed: launch/config/schema.py), and "
                           "'maybe' cannot be read as that. Give true or false, e.g. train.resume=false (the default)."),
    ("model.dropout=x", "model.dropout is a number (every setting is typed: launch/config/schema.py), and 'x' cannot "
                        "be read as that. Give a number, e.g. model.dropout=0.0 (the default)."),
    ("compile.dynamic=maybe", "compile.dynamic is true, false or null (every setting is typed: launch/config/schema.py"
                              "), and 'maybe' cannot be read as that. Give true, false or null, e.g. "
                              "compile.dynamic=true."),
    ("ddp.bucket_cap_mb_list=[a]", "ddp.bucket_cap_mb_list is a list of numbers or null (every setting is typed: "
                                   "launch/config/schema.py), and '[a]' cannot be read as that. Give a list of numbers "
                                   "or null, e.g. ddp.bucket_cap_mb_list=[1,2]."),
    ("profile.steps=5", "profile.steps is a list of integers or null (every setting is typed: launch/config/schema.py"
                        "), and '5' cannot be read as that. Give a list of integers or null, e.g. profile.steps=[1,2]."),
])
def test_a_value_of_the_wrong_type_names_the_key_the_type_and_an_example(override, words):
    with pytest.raises(ConfigError) as e:
        compose_job([override])
    assert str(e.value) == f"{override} is not valid: {words}"


def test_an_override_hydra_cannot_parse_is_one_line():
    with pytest.raises(ConfigError, match=r"^'train\.steps=\[1' cannot be parsed as an override: no viable "
                                          r"alternative at input '\[1'\. Write it as key=value"):
        compose_job(["train.steps=[1"])


def test_python_m_launch_train_gives_the_same_line_for_a_wrong_type(launch_cli):
    proc = launch_cli("train.steps=abc")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: train.steps=abc is not valid: train.steps is an integer (every setting is typed: "
        "launch/config/schema.py), and 'abc' cannot be read as that. Give an integer, e.g. train.steps=20 (the "
        "default)."]


# --- a failed rank's line ---------------------------------------------------------------------


def _failed(rank, exitcode, line=None, at_ns=None, error_file="/tmp/torchelastic_x/r/attempt_0/0/error.json"):
    record = {}
    if line is not None:
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": "1"}}}
        if at_ns is not None:
            record["distcompile"] = {"exit_code": exitcode, "time_ns": at_ns}
    return FailedWorker(rank, rank, 100 + rank, exitcode, error_file if line is not None else None, record)


def test_the_first_rank_to_fail_is_named_with_its_code_its_line_and_its_error_file():
    rank0 = _failed(0, 1, "error: rank 1 is gone", at_ns=2_000)
    rank1 = _failed(1, 1, "RuntimeError: boom", at_ns=1_000)
    first = elastic.first_failure([rank0, rank1])
    assert first is rank1
    assert elastic.failure_line(first, 2) == (
        "error: rank 1 failed first, exit code 1: RuntimeError: boom (its last lines: "
        "/tmp/torchelastic_x/r/attempt_0/0/error.json); 1 other rank(s) here ended too")


def test_a_rank_that_wrote_nothing_is_named_with_its_signal():
    killed, stopped = _failed(0, -9), _failed(1, -15)
    assert elastic.first_failure([stopped, killed]) is killed  # the same: no record; the lower rank
    assert elastic.first_failure([stopped, _failed(2, 3)]).rank == 2  # a rank that exited by itself first
    assert elastic.failure_line(killed) == ("error: rank 0 failed first, killed by SIGKILL (exit code -9), with no "
                                            "error line (a signal leaves none: kill -9 or the OOM killer); its output "
                                            "is above")


def test_the_launcher_exits_with_the_failed_ranks_own_code(monkeypatch, capfd):
    monkeypatch.setattr(elastic, "run_torchrun", lambda args: [_failed(0, 3, "error: the loss is not finite")])
    assert elastic.run_agent(None) == 3
    assert capfd.readouterr().err.startswith("error: rank 0 failed first, exit code 3: the loss is not finite (")
    monkeypatch.setattr(elastic, "run_torchrun", lambda args: [_failed(0, -9)])
    assert elastic.run_agent(None) == 1
    monkeypatch.setattr(elastic, "run_torchrun", lambda args: [])
    assert elastic.run_agent(None) == 0


def test_a_worker_keeps_its_last_stderr_lines_for_its_error_file(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # restored after the test
    assert worker_error.keep_stderr_tail()
    for i in range(worker_error.MAX_LINES + 5):
        print(f"line {i}", file=sys.stderr)
    print("Traceback (most recent call last):\nRuntimeError: boom\n", file=sys.stderr)
    worker_error.write_error_file(0)
    assert not path.exists()  # a rank that finished leaves nothing
    worker_error.write_error_file(1)
    record = json.loads(path.read_text())
    assert worker_error.last_line(record) == "RuntimeError: boom"
    assert record["message"]["extraInfo"]["py_callstack"].splitlines()[0] == "line 8"  # the last MAX_LINES
    assert record["distcompile"]["exit_code"] == 1 and worker_error.failed_at(record) > 0
    path.write_text(json.dumps({"message": {"message": "ConfigError: x", "extraInfo": {"timestamp": "5"}}}))
    worker_error.write_error_file(2)  # a config error's file is left as it is
    assert worker_error.last_line(json.loads(path.read_text())) == "x"


# --- for real -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_console_script_refuses_a_wrong_type_before_any_rank(tmp_path):
    script = Path(sys.executable).with_name("distcompile-train")
    proc = subprocess.run([str(script), *TWO_RANKS, "train.steps=abc"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: train.steps=abc is not valid: train.steps is an integer")


@pytest.mark.slow
def test_a_rank_that_fails_mid_run_is_one_line_with_its_rank_code_and_last_line(tmp_path):
    # Rank 1 raises at the start of step 3 (tests/_fault_job.py); rank 0, waiting for it in step 3's
    # collectives, then fails too: the line names rank 1, the first.
    code = ("import sys; from launch.launcher import launch; "
            f"sys.exit(launch(sys.argv[1:], worker=[sys.executable, '-u', {str(FAULT_JOB)!r}, '3:1:RAISE']))")
    proc = subprocess.run([sys.executable, "-c", code, *TWO_RANKS, "compile.backend=aot_eager", *TINY_OVERRIDES,
                           "train.batch_size=4", "train.seq_len=16", "train.steps=4", "hydra.run.dir=run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: rank 1 failed first, exit code 1: RuntimeError: fault 3:1:RAISE: injected error "
                           "on rank 1 at step 3 (its last lines: /"), proc.stderr[-3000:]
    error_file = last.split("(its last lines: ", 1)[1].split(")", 1)[0]
    assert error_file.endswith("/attempt_0/1/error.json") and "Traceback" in json.loads(
        Path(error_file).read_text())["message"]["extraInfo"]["py_callstack"]
    assert "ChildFailedError" not in proc.stderr and "Root Cause" not in proc.stderr  # torchrun's traceback and table
    assert "step     2/4" in proc.stdout
