"""The main job with a fault installed, for the restart and resume tests:

    torchrun ... tests/_fault_job.py STEP[:RANK[:ACTION]] [overrides]

At the start of STEP, on the first attempt only (TORCHELASTIC_RESTART_COUNT unset
or 0), through the loop's step callbacks, RANK (default 0) does ACTION: KILL (the
default) SIGKILLs itself, TERM or INT sends itself that signal, PAUSE prints
"paused at step STEP" and waits until the process is signalled (for a test to
signal the agent or the process group at a known step; 120 s at most), RAISE
raises a RuntimeError (an error on one rank while the others go on),
BACKWARD_STOP or BACKWARD_KILL sends itself SIGSTOP or SIGKILL inside that step's backward
(when the gradient of the model's first parameter, the last one backward makes, is computed:
its peers wait for it inside the gradient all-reduce), after printing
"fault ...: SIG<STOP|KILL> in backward at step STEP (pid PID)";
everything else is ``python -m launch.train [overrides]``.

    python tests/_fault_job.py compile:RANK:ACTION compile.backend=fault_aot_eager [overrides]

registers the dynamo backend ``fault_aot_eager`` (``aot_eager``, except that RANK does
ACTION, KILL or STOP, at its first compile: a rank that dies or is stopped in the
middle of the first compile, as its peers wait for it at the compile barrier; SLEEP:
a first compile of 120 s).

    python tests/_fault_job.py recompile:RANK:SECONDS compile.backend=slow_recompile_aot_eager [overrides]

registers ``slow_recompile_aot_eager``: ``aot_eager``, except that RANK's first compile
after step 1 (a recompile) sleeps SECONDS first."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

# Run by path, this file has tests/ first on sys.path, where tests/launch/, tests/compiler/, ...
# (folders without __init__.py) would import as empty namespace packages: with the checkout's
# root on the path too, the packages themselves win.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from launch.runtime.dist import restarted_by_torchrun  # noqa: E402
from launch.train import Job, main  # noqa: E402


def kill_at(spec: str):
    """A step callback that does ACTION at the start of the step ``spec`` names."""
    parts = spec.split(":")
    fault_step, fault_rank, action = parts[0], (parts[1:2] or ["0"])[0], (parts[2:3] or ["KILL"])[0]

    def fault(job: Job, step: int) -> None:
        rank = job.env.rank
        if step != int(fault_step) or rank != int(fault_rank or 0) or restarted_by_torchrun():
            return
        if action == "PAUSE":
            print(f"[rank {rank}] paused at step {step}", flush=True)
            deadline = time.monotonic() + 120
            while not job.preemption.requested and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        if action == "RAISE":
            raise RuntimeError(f"fault {spec}: injected error on rank {rank} at step {step}")
        if action.startswith("BACKWARD_"):
            _in_backward(job, spec, step, action.removeprefix("BACKWARD_"))
            return
        what = "killing myself" if action == "KILL" else f"sending myself SIG{action}"
        print(f"[rank {rank}] fault {spec}: {what} at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{action}"))

    return fault


# A stopped rank cannot act on the SIGTERM torchrun sends it once a peer has failed; torchrun SIGKILLs it 30 s
# later, a wait TORCH_ELASTIC_SHUTDOWN_TIMEOUT does not shorten on this path (torch 2.13 to 2.15). This watcher,
# started before the rank stops itself, SIGKILLs it as soon as that SIGTERM is pending, as torchrun would after
# the wait; it ends with the rank, or after 10 minutes.
_SIGKILL_ON_PENDING_SIGTERM = """
import os, signal, sys, time
pid, bit, deadline = int(sys.argv[1]), 1 << (signal.SIGTERM - 1), time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    except (FileNotFoundError, ProcessLookupError):
        break
    if (int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)) & bit:
        os.kill(pid, signal.SIGKILL)
        break
    time.sleep(0.1)
"""


def _in_backward(job: Job, spec: str, step: int, sig: str) -> None:
    """SIG``sig`` to this process when backward computes the first parameter's gradient, once."""
    first = next(job.wrapped.module.parameters())
    handle = None

    def hook(grad):
        handle.remove()
        print(f"[rank {job.env.rank}] fault {spec}: SIG{sig} in backward at step {step} (pid {os.getpid()})",
              file=sys.stderr, flush=True)
        if sig == "STOP":
            import subprocess

            subprocess.Popen([sys.executable, "-c", _SIGKILL_ON_PENDING_SIGTERM, str(os.getpid())],
                             start_new_session=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
        return grad

    handle = first.register_hook(hook)


def register_compile_fault(spec: str) -> None:
    """The backend ``fault_aot_eager``: aot_eager, with RANK doing ACTION at its first compile."""
    import torch
    from torch._dynamo import register_backend  # the documented way to add a backend name

    _, fault_rank, action = spec.split(":")

    @register_backend(name="fault_aot_eager")
    def fault_aot_eager(gm, example_inputs):
        if int(os.environ.get("RANK", "0")) == int(fault_rank) and not restarted_by_torchrun():
            if action == "SLEEP":  # a first compile longer than torchrun's shutdown grace
                print(f"[rank {fault_rank}] fault {spec}: a 120 s compile", file=sys.stderr, flush=True)
                time.sleep(120)
            else:
                print(f"[rank {fault_rank}] fault {spec}: SIG{action} in the first compile", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{action}"))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def register_slow_recompile(spec: str):
    """The backend ``slow_recompile_aot_eager`` and the step callback that tells it step 1 is over."""
    import torch
    from torch._dynamo import register_backend

    _, rank, seconds = spec.split(":")
    state = {"past_step_1": False, "slept": False}

    @register_backend(name="slow_recompile_aot_eager")
    def slow_recompile_aot_eager(gm, example_inputs):
        if int(os.environ.get("RANK", "0")) == int(rank) and state["past_step_1"] and not state["slept"]:
            state["slept"] = True
            print(f"[rank {rank}] fault {spec}: a recompile of {seconds} s", file=sys.stderr, flush=True)
            time.sleep(float(seconds))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def mark(job: Job, step: int) -> None:
        state["past_step_1"] = step >= 2

    return mark


if __name__ == "__main__":
    spec = sys.argv.pop(1)
    if spec.startswith("recompile:"):
        main(step_callbacks=[register_slow_recompile(spec)])
    elif spec.startswith("compile:"):
        register_compile_fault(spec)
        main()
    else:
        main(step_callbacks=[kill_at(spec)])
