"""A rank that stops answering (SIGSTOP) or dies (SIGKILL) in the middle of a step: its peer
ends by itself with one line naming it, not with gloo's traceback or torchrun's SIGKILL
(Note [Silent peer mid-step] in ``launch.runtime.watchdog``). The OOM kill count of a fake
cgroup tree (Note [OOM kill count] in ``launch.runtime.oom``), the line's text, and the
two-rank run under torchrun."""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from _jobs import REFERENCE
from compiler.ranks.liveness import PeerLost, process_identity, process_state
from launch.runtime.dist import DistEnv
from launch.runtime.oom import memory_cgroup_dirs, oom_kills
from launch.runtime.watchdog import LostPeer, PeerWatchdog, lost_peer_line

TIMEOUT_S = 8  # train.timeout_s of the torchrun run: the silence after which the peer is named


# --- the OOM kill count -----------------------------------------------------------------------


def _tree(tmp_path, proc_cgroup: str, files: dict[str, str]):
    (tmp_path / "cgroup").write_text(proc_cgroup)
    for rel, text in files.items():
        path = tmp_path / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    fs = tmp_path / "fs"
    return dict(proc_cgroup=str(tmp_path / "cgroup"), cgroup_v1=str(fs / "memory"),
                cgroup_v2=(str(fs / "v2"), str(fs / "unified")))


def test_cgroup_v1_counts_oom_kills_in_this_process_memory_cgroup(tmp_path):
    paths = _tree(tmp_path, "4:memory:/job/slice\n1:cpu:/\n0::/\n", {
        "memory/job/slice/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        "memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 9\n"})  # the host's: not ours
    assert memory_cgroup_dirs(**paths) == [(1, str(tmp_path / "fs" / "memory" / "job" / "slice"))]
    assert oom_kills(**paths) == 2


def test_cgroup_v2_counts_oom_kills_from_memory_events(tmp_path):
    paths = _tree(tmp_path, "0::/user.slice/job\n", {
        "v2/cgroup.controllers": "cpu memory\n",
        "v2/user.slice/job/memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n"})
    assert oom_kills(**paths) == 1


def test_a_cgroup_path_outside_the_mount_is_read_at_its_root(tmp_path):
    # A cgroup namespace: /proc/self/cgroup names the host's path, the container mounts its own cgroup as the root.
    paths = _tree(tmp_path, "4:memory:/kubepods/pod1/abc\n", {"memory/memory.oom_control": "oom_kill 4\n"})
    assert oom_kills(**paths) == 4


def test_no_cgroup_to_read_is_no_count(tmp_path):
    assert oom_kills(proc_cgroup=str(tmp_path / "missing")) is None
    paths = _tree(tmp_path, "4:memory:/job\n", {"memory/job/memory.usage_in_bytes": "1\n"})  # a kernel before 4.13
    assert oom_kills(**paths) is None


# --- the process of a peer, seen from this machine ------------------------------------------------


def test_a_peer_process_on_this_machine_is_seen_stopped_gone_or_running(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink("pid:[4026531836]", proc / "self" / "ns" / "pid")
    (proc / "sys" / "kernel" / "random").mkdir(parents=True)
    (proc / "sys" / "kernel" / "random" / "boot_id").write_text("boot-1\n")
    here = process_identity(str(proc)).rpartition("@")[0].rpartition(":")[0]
    for pid, state in ((101, "T"), (102, "Z"), (103, "S")):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "stat").write_text(f"{pid} (python -m x) {state} 1 2 3\n")
    assert process_state(f"{here}:101@host", str(proc)) == "stopped"
    assert process_state(f"{here}:102@host", str(proc)) == "gone"  # a zombie not yet reaped
    assert process_state(f"{here}:103@host", str(proc)) == "running"
    assert process_state(f"{here}:104@host", str(proc)) == "gone"
    assert process_state("boot-2:pid:[4026531836]:101@other", str(proc)) is None  # another machine: unknown


# --- the line ---------------------------------------------------------------------------------


def _lost(**kw) -> LostPeer:
    return LostPeer(**{**dict(peer=1, rank=0, where="step 20", silent_s=21.4, state="stopped", closed=False,
                              timeout_s=20.0), **kw})


def test_the_line_for_a_stopped_peer_names_it_the_step_the_limit_and_what_to_do():
    line = lost_peer_line(_lost())
    assert "\n" not in line
    assert re.fullmatch(r"rank 1 stopped answering 21s ago \(no heartbeat; its process is stopped: SIGSTOP or a "
                        r"debugger\) while rank 0 waited for it in step 20; rank 0 ends instead of waiting for it "
                        r"\(the limit is train\.timeout_s=20; a larger value waits longer for a silent peer\)\. Find "
                        r"what stopped it, then restart the job; with checkpoints, resume with train\.resume=true .*",
                        line), line
    remote = lost_peer_line(_lost(state=None))
    assert "it was stopped (SIGSTOP, a debugger), hangs, or its machine or network was lost" in remote


def test_the_line_for_a_dead_peer_says_so_and_blames_the_oom_killer_only_on_its_count():
    plain = lost_peer_line(_lost(state="gone", silent_s=0.4))
    assert plain.startswith("rank 1 died in step 20 (its process is gone; no heartbeat for 0s): it was killed "
                            "(kill -9, the out-of-memory killer) or ended on an error of its own"), plain
    oom = lost_peer_line(_lost(state="gone", oom_kills=1))
    assert re.search(r"^rank 1 died in step 20 .*probably killed by the out-of-memory killer: this machine's memory "
                     r"cgroup counted 1 OOM kill\(s\) since the run started; rank 0 stops too\. Use less memory per "
                     r"rank \(a smaller train\.batch_size or train\.seq_len, or more ranks\)", oom), oom
    assert "its connection closed" in lost_peer_line(_lost(state=None, closed=True))  # on another machine


# --- the watchdog in one process: the error that leaves the run ---------------------------------


class _Group:
    """A "default group" of two ranks on a HashStore whose rank 1 is this test (it beats or not)."""

    def __init__(self, monkeypatch):
        import compiler.ranks.liveness as liveness

        self.store = dist.HashStore()
        self.store.set_timeout(timedelta(seconds=2))
        monkeypatch.setattr("launch.runtime.watchdog.on_default_store", lambda ranks: (self.store, 0, [0, 1]))
        monkeypatch.setattr(liveness, "CHECK_S", 0.1)

    def beat(self):
        self.store.add("distcompile/alive/1", 1)


def _env() -> DistEnv:
    import torch
    return DistEnv(0, 2, 0, "gloo", torch.device("cpu"))


def test_a_collective_error_while_a_peer_is_silent_becomes_one_line_naming_it(monkeypatch):
    group = _Group(monkeypatch)
    group.beat()  # rank 1 beat once, then stopped
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation")
    with pytest.raises(PeerLost, match=r"^rank 1 stopped answering \d+s ago \(no heartbeat; .*\) while rank 0 waited "
                                       r"for it in step 3; .*train\.timeout_s=2") as caught:
        with PeerWatchdog(_env(), timeout_s=2.0) as watchdog:
            watchdog.at_step(None, 3)
            raise gloo
    assert caught.value.__cause__ is gloo


def test_an_error_of_this_rank_while_its_peer_beats_stays_as_it_was(monkeypatch):
    group = _Group(monkeypatch)
    beating = True

    def beat():
        while beating:
            group.beat()
            time.sleep(0.05)

    import threading
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="^Timed out waiting 2000ms"):
            with PeerWatchdog(_env(), timeout_s=2.0):
                raise RuntimeError("Timed out waiting 2000ms for recv operation")  # a live peer, slow
        with pytest.raises(ValueError, match="^a bug"):
            with PeerWatchdog(_env(), timeout_s=2.0):
                raise ValueError("a bug")
    finally:
        beating = False
        thread.join()


# --- two ranks under torchrun: SIGSTOP / SIGKILL in backward ---------------------------------------


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
@pytest.mark.alone  # the watchdog's silence limit and the collective's timeout are both train.timeout_s
@pytest.mark.parametrize("sig,said", [
    ("STOP", r"rank 1 stopped answering \d+s ago \(no heartbeat; its process is stopped: SIGSTOP or a debugger\) "
             r"while rank 0 waited for it in step 3; .*train\.timeout_s=8"),
    ("KILL", r"rank 1 died in step 3 \(its process is gone; .*\): it was killed \(kill -9, the out-of-memory killer\)"),
])
def test_a_rank_stopped_or_killed_in_backward_ends_its_peer_with_one_line_naming_it(tmp_path, torchrun, sig, said):
    t0 = time.monotonic()
    proc = torchrun(tmp_path, *REFERENCE, "train.steps=5", f"train.timeout_s={TIMEOUT_S}", "hydra.run.dir=run",
                    fault=f"3:1:BACKWARD_{sig}", timeout=300)
    stopped = re.search(rf"fault 3:1:BACKWARD_{sig}: SIG{sig} in backward at step 3 \(pid (\d+)\)", proc.stderr)
    if stopped:
        _end(int(stopped.group(1)))  # torchrun killed it already; never leave a stopped process behind
    print(f"torchrun ended {time.monotonic() - t0:.1f}s after it started")
    assert stopped, proc.stderr[-4000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and re.match(f"error: {said}", errors[0]), proc.stderr[-4000:]
    assert not re.search(r'File "[^"]*/(launch|compiler|ddp_opt|tests)/', proc.stderr), proc.stderr[-4000:]
    # rank 0 exited by itself with our code (torchrun's failure table), not by torchrun's SIGKILL (-9)
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 1 ", proc.stderr), proc.stderr[-4000:]
