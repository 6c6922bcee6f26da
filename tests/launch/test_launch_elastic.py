"""An elastic job (``torchrun --nnodes 1:2``) that loses a node: two torchrun agents on this
machine joined by a c10d rendezvous, one rank each; the second agent is killed mid-run,
and the survivor's restarted worker, now alone, resumes the job's last checkpoint on one
rank and finishes (Note [Checkpoint identity and manifest]: under DDP the world size may
change on resume)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import _dist

STEPS = 100  # the node is killed once step 20 is printed: 80 steps and 16 checkpoints (seconds) before the run ends
SMALL = ["compile.backend=aot_eager", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
         "train.batch_size=4", "train.seq_len=32", f"train.steps={STEPS}", "train.checkpoint_every=5",
         "train.timeout_s=20"]  # the survivor's step gate gives the silent peer up after 20 s (Note [Peer liveness])


@pytest.mark.slow
def test_an_elastic_job_that_loses_a_node_resumes_its_checkpoint_on_the_ranks_left(tmp_path):
    port = _dist.free_port()

    def agent(name: str) -> subprocess.Popen:
        host = int(name == "first")  # the first agent hosts the rendezvous store: it is the one that stays
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
             # keep-alives every second, a node dead after 3 missed: the restart's rendezvous gives the killed node up
             # after 3 s, not torch's default 15 s (5 s x 3)
             "--rdzv-conf", f"last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3,is_host={host}",
             "--max-restarts", "1", "-m", "launch.train", *SMALL,
             f"train.checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={name}"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    lines: dict[str, list[str]] = {"first": [], "second": []}
    agents, readers = {}, []
    try:
        for name in ("first", "second"):
            agents[name] = agent(name)
            readers.append(threading.Thread(target=lambda n=name: lines[n].extend(agents[n].stdout), daemon=True))
            readers[-1].start()
            time.sleep(1)  # the second joins inside the first one's last call: one round of 2 nodes

        def steps_done() -> int:
            found = [int(m.group(1)) for n in lines for ln in list(lines[n])
                     if (m := re.match(rf"step +(\d+)/{STEPS}", ln))]
            return max(found, default=0)

        deadline = time.monotonic() + 180
        while steps_done() < 20 and time.monotonic() < deadline:
            assert all(a.poll() is None for a in agents.values()), f"an agent ended before step 20: {lines}"
            time.sleep(0.2)
        assert steps_done() >= 20, "the 2-node job never reached step 20"
        os.killpg(agents["second"].pid, signal.SIGKILL)  # the node is gone: agent and worker
        agents["first"].wait(timeout=240)
    finally:
        for a in agents.values():
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    for reader in readers:
        reader.join(timeout=30)  # every line read before the checks
    out = "".join(lines["first"])
    assert agents["first"].returncode == 0, out[-4000:]
    assert "distcompile main job: 1 rank(s)" in out, out[-4000:]
    assert ("torchrun restart (elastic): resuming a checkpoint written by 2 rank(s) on 1: train.batch_size=4 stays "
            "the global batch, 4 per rank (was 2)") in out
    resumed = int(re.search(r"resumed from .*step_(\d+) \(step \d+\)", out).group(1))
    assert resumed >= 5 and resumed % 5 == 0  # a checkpoint written by the 2-rank job, not a fresh start
    assert re.search(rf"done: steps {resumed + 1}\.\.{STEPS}, final loss \d", out), out[-2000:]
