"""Preemption of the main job: SIGTERM or SIGINT ends the run at a step boundary,
with a checkpoint, on every rank at the same step.

Note [Preemption]

Background
    Schedulers (Slurm, Kubernetes, spot instances) stop a job with SIGTERM and
    SIGKILL it after a grace period; Ctrl-C sends SIGINT to the foreground
    process group. torchrun's agent, on SIGTERM/SIGINT/SIGHUP/SIGQUIT, sends
    the same signal to every worker, waits ``--shutdown-timeout`` seconds
    (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30) and SIGKILLs the workers
    still alive, then exits 1 itself (its ``SignalException`` is uncaught). With
    Python's default handlers a signalled rank dies mid-step, its peers fail in
    their next collective, and nothing is saved.

Algorithm
    - :class:`Preemption` installs handlers for SIGTERM and SIGINT that only
      record the signal: a handler runs between two bytecodes of the main
      thread, and raising there could leave a collective or a checkpoint write
      half done.
    - The stats all-reduce that ``launch.train._step`` already runs after every
      step carries one more number: 1 when this rank has been signalled. After
      it every rank knows, at the same step, whether any rank was signalled: no
      extra collective.
    - The loop then finishes that step as usual, saves a checkpoint (when
      ``train.checkpoint_every > 0``) and raises :class:`Preempted`; the entry
      point prints one line on rank 0 and every rank exits with
      :data:`EXIT_PREEMPTED`. A resumed run (``train.resume=true``, or a torchrun
      restart) continues from that step exactly as if never stopped (the data
      and the RNG are functions of the step).

Notes
    - Exit code 75 is ``EX_TEMPFAIL`` of ``sysexits.h`` ("temporary failure;
      the user is invited to retry"): distinct from 1 (failure), 2 (bad config)
      and 3 (non-finite loss), so a wrapper script can requeue on it. Under
      torchrun the workers' code shows in the agent's failure table; the agent
      itself exits 1 whichever way it ended badly.
    - A signal repeated (the agent forwards the SIGTERM the whole process group
      already got) changes nothing; the hard stop is the agent's SIGKILL after
      its grace period, or a scheduler's.
    - A signal during setup or warm-up is acted on after the first step; a rank
      blocked in a collective runs the handler only when the collective returns.
      A rank still waiting in the store for a peer's compile (the compile barrier, a
      shared compile) 10 s after the signal stops there: the handler also calls
      ``compiler.liveness.request_stop``, and the rank exits with :data:`EXIT_PREEMPTED`
      and one line, saving nothing new (``launch.runtime.leave``; Note [Peer liveness]),
      before torchrun's SIGKILL 30 s after the signal.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from compiler.liveness import clear_stop, request_stop

__all__ = ["Preemption", "Preempted", "EXIT_PREEMPTED", "SIGNALS"]

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after saving; run again to continue
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(RuntimeError):
    """Every rank stopped after a step because one was signalled; the message is one line."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, step: int, checkpoint: str | None) -> None:
        saved = (f"saved {checkpoint}; continue with train.resume=true" if checkpoint else
                 "no checkpoint saved (train.checkpoint_every=0): a new run starts from step 0; set "
                 "train.checkpoint_every to save one when stopped")
        super().__init__(f"stopped after step {step} on SIGTERM/SIGINT (preemption): {saved} "
                         f"(exit code {EXIT_PREEMPTED}, to requeue on)")
        self.step, self.checkpoint = step, checkpoint


class Preemption:
    """Records SIGTERM/SIGINT while installed (a context manager; main thread only,
    elsewhere it installs nothing and :attr:`requested` stays 0).

    Attributes:
        requested: the first signal received, or 0.
    """

    def __init__(self) -> None:
        self.requested = 0
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            self.requested = signum
            if os.environ.get("RANK", "0") == "0":  # said at once: a long step or compile may be SIGKILLed first
                os.write(2, (f"rank 0: {signal.Signals(signum).name} received: the run stops after the current step, "
                             "with a checkpoint if train.checkpoint_every is set. torchrun SIGKILLs its workers 30 s "
                             "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT) after forwarding a SIGTERM, so a step or a compile "
                             "still running then ends without one.\n").encode())
        # A rank waiting in the store for a peer's compile stops at once (Note [Peer liveness]).
        request_stop(f"{signal.Signals(signum).name} (preemption)")

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        clear_stop()
