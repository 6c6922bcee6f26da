"""The token file's identity (Note [Token files]): a resume on a changed file is refused naming
it (unless train.allow_data_change=true), a copy of the same file resumes, and a file rewritten
under a running job stops it with one message instead of SIGBUS."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from _jobs import tiny_job
from launch.checkpoint.run_identity import CheckpointError
from launch.config.schema import CompileConfig, DataConfig
from launch.data.tokens import TokenFileChanged
from launch.train import run

pytestmark = pytest.mark.usefixtures("no_process_group_left")

VOCAB = 256


def _tokens(path, seed):
    np.random.default_rng(seed).integers(0, VOCAB, 20_000, dtype=np.uint16).tofile(path)


def _job(tmp_path, path, **train):
    return tiny_job(tmp_path, compile=CompileConfig(backend="eager"), model=dict(vocab_size=VOCAB),
                    data=DataConfig(name="tokens", path=str(path)), train=dict(checkpoint_every=2, **train))


def test_a_resume_on_a_regenerated_token_file_is_refused_naming_it(tmp_path, capsys):
    data = tmp_path / "tokens.bin"
    _tokens(data, 0)
    run(_job(tmp_path, data, steps=2))
    _tokens(data, 1)  # regenerated: same size, other tokens
    with pytest.raises(CheckpointError, match=r"train.resume=true but data.path='.*tokens.bin' changed since "
                                              r"checkpoint \S+step_000002 was written \(then 40000 bytes, sampled "
                                              r"sha256 \w+, now 40000 bytes, sampled sha256 \w+\).*"
                                              r"train.allow_data_change=true"):
        run(_job(tmp_path, data, steps=4, resume=True))
    metrics = run(_job(tmp_path, data, steps=4, resume=True, allow_data_change=True))
    assert [s for s, _ in metrics["losses"]] == [3, 4]
    assert "resuming on the new file as asked (train.allow_data_change=true)" in capsys.readouterr().out


def test_a_copy_of_the_same_file_resumes(tmp_path):
    data = tmp_path / "tokens.bin"
    _tokens(data, 0)
    run(_job(tmp_path, data, steps=2))
    copy = tmp_path / "copy.bin"
    shutil.copy(data, copy)
    data.unlink()
    copy.rename(data)  # the same tokens, a new file (another mtime and inode)
    assert [s for s, _ in run(_job(tmp_path, data, steps=4, resume=True))["losses"]] == [3, 4]


def test_a_file_rewritten_under_the_running_job_stops_it_with_one_message(tmp_path):
    data = tmp_path / "tokens.bin"
    _tokens(data, 0)

    def rewrite(job, step):
        if step == 3:
            with open(data, "r+b") as f:
                f.truncate(1000)  # in place: a memory map of it would now SIGBUS

    with pytest.raises(TokenFileChanged, match=r"data.path='.*tokens.bin' changed under the running job: it had "
                                               r"40000 bytes when the job started and has 1000 now"):
        run(_job(tmp_path, data, steps=5), step_callbacks=[rewrite])

