"""One job per checkpoint folder (Note [Checkpoint folder lock] in launch/checkpoint/lock.py):
a second job on a held folder exits 2 at once naming the holder and writes nothing; a lock
its holder never released (killed) is taken over with a warning; a job that ends releases it."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from _jobs import tiny_job
from launch.checkpoint.lock import LOCK_NAME, _take
from launch.config.schema import CompileConfig, ConfigError
from launch.train import run

pytestmark = pytest.mark.usefixtures("no_process_group_left")


def _saving_job(tmp_path):
    return tiny_job(tmp_path, compile=CompileConfig(backend="eager"), train=dict(steps=2, checkpoint_every=1))


def test_a_second_job_on_a_held_folder_is_refused_naming_the_holder_and_writes_nothing(tmp_path):
    held, busy = _take(str(tmp_path / "ckpt" / LOCK_NAME))  # another job holds the folder
    assert held is not None and busy == ""
    try:
        with pytest.raises(ConfigError, match=rf"train.checkpoint_dir='.*ckpt' is in use by another job \(host "
                                              rf"\S+, pid {os.getpid()}, started \S+, run id none\): two jobs writing "
                                              r"one folder overwrite each other's checkpoints.*another "
                                              r"train.checkpoint_dir"):
            run(_saving_job(tmp_path))
    finally:
        os.close(held)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [LOCK_NAME]


def test_a_lock_never_released_is_taken_over_with_a_warning_and_released_at_the_end(tmp_path, caplog):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / LOCK_NAME).write_text(json.dumps(
        {"host": "gone-node", "pid": 4242, "started": "2026-11-25T01:02:03", "run_id": "r1", "released": False}))
    with caplog.at_level(logging.WARNING, "launch.checkpoint.lock"):
        run(_saving_job(tmp_path))
    assert ("taking over the lock of host gone-node, pid 4242, started 2026-11-25T01:02:03, run id r1, which ended "
            "without releasing it (killed?)") in caplog.text
    record = json.loads((tmp_path / "ckpt" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["released"] is True
    assert (tmp_path / "ckpt" / "step_000002").is_dir()


def test_a_job_without_checkpoints_takes_no_lock(tmp_path):
    run(tiny_job(tmp_path, compile=CompileConfig(backend="eager"), train=dict(steps=1)))
    assert not (tmp_path / "ckpt").exists()


# --- two torchrun jobs started together on one folder ------------------------------------------------


@pytest.mark.slow
def test_two_torchrun_jobs_on_one_folder_the_second_exits_2_at_once_and_the_first_is_untouched(tmp_path):
    from _torchrun import FAULT_JOB

    small = ["compile.backend=aot_eager", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
             "train.batch_size=4", "train.seq_len=32", "train.steps=6", "train.checkpoint_every=1",
             f"train.checkpoint_dir={tmp_path / 'ckpt'}"]

    def torchrun(*args, **kw):
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, **kw)

    first = torchrun(str(FAULT_JOB), "1:0:PAUSE", *small, "hydra.run.dir=first")  # holds the folder, no checkpoint yet
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "paused at step 1" not in line and time.monotonic() < deadline and first.poll() is None:
            line = first.stdout.readline()
        assert "paused at step 1" in line, first.stderr.read()[-3000:] if first.poll() is not None else "no pause"
        t0 = time.monotonic()
        second = torchrun("-m", "launch.train", *small, "train.seed=7", "hydra.run.dir=second")
        out, err = second.communicate(timeout=120)
        took = time.monotonic() - t0
        assert second.returncode != 0, out[-2000:]
        assert err.count("is in use by another job (host") >= 1, err[-3000:]
        assert "launch/" not in "".join(ln for ln in err.splitlines() if ln.strip().startswith("File ")), \
            err[-3000:]  # no traceback of a worker (the agent prints its own ChildFailedError's)
        assert f"pid {first.pid}" not in err  # the holder is rank 0 of the first job, not its agent
        os.killpg(first.pid, signal.SIGTERM)  # the first job stops as preempted after step 1, with its checkpoint
        first.communicate(timeout=90)
        assert first.returncode != 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    # Only the first job's checkpoint is there, under the first job's identity.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_000001"]
    fields = json.loads((tmp_path / "ckpt" / "step_000001" / "identity.json").read_text())["fields"]
    seeds = {k: v for k, v in fields.items() if k.endswith("seed")}
    assert seeds and 7 not in seeds.values(), seeds  # the first job's seed (the default), not the second's
    print(f"the second job ended {took:.1f}s after it started")


@pytest.mark.slow
def test_two_jobs_of_two_nodes_each_on_one_folder_the_second_exits_2_on_both_nodes(tmp_path):
    # Two nodes per job (two torchrun agents joined by a c10d rendezvous, one rank each), as on two
    # machines sharing the checkpoint folder: the lock is rank 0's, its outcome reaches the other node.
    import _dist
    from _torchrun import FAULT_JOB

    small = ["compile.backend=aot_eager", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
             "train.batch_size=4", "train.seq_len=32", "train.steps=6", "train.checkpoint_every=1",
             f"train.checkpoint_dir={tmp_path / 'ckpt'}"]

    def job(entry, port, run_dir):
        return [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
             *entry, *small, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for _ in range(2)]

    import threading

    first = job([str(FAULT_JOB), "1:0:PAUSE"], _dist.free_port(), "first")
    lines: list[str] = []
    for p in first:  # either node may hold rank 0: read both without blocking on one
        threading.Thread(target=lambda p=p: lines.extend(p.stdout), daemon=True).start()
    second: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 120
        while not any("paused at step 1" in ln for ln in list(lines)) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in first), "the first job ended before step 1"
            time.sleep(0.2)
        assert any("paused at step 1" in ln for ln in lines), "the first job never reached step 1"
        second = job(["-m", "launch.train", "train.seed=7"], _dist.free_port(), "second")
        outs = [p.communicate(timeout=120) for p in second]
        assert all(p.returncode != 0 for p in second), [o[1][-2000:] for o in outs]
        assert sum("is in use by another job (host" in err for _, err in outs) >= 1, [o[1][-2000:] for o in outs]
        for p in first:
            os.killpg(p.pid, signal.SIGTERM)
        for p in first:
            p.wait(timeout=90)
    finally:
        for p in first + second:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_000001"]
