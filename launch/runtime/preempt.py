"""Preemption of the main job: SIGTERM or SIGINT ends the run at a step boundary,
with a checkpoint, on every rank at the same step.

Note [Preemption]

Background
    Schedulers stop a job with SIGTERM and SIGKILL it after a grace period; Ctrl-C sends
    SIGINT. torchrun's agent forwards either to every worker, waits
    ``--shutdown-timeout`` seconds and SIGKILLs the rest. With Python's default handlers
    a signalled rank dies mid-step, its peers fail in their next collective, and
    nothing is saved.

Algorithm
    - :class:`Preemption`'s handlers for SIGTERM and SIGINT only record the signal:
      raising between two bytecodes could leave a collective or a checkpoint write
      half done.
    - The per-step stats all-reduce carries one more number, 1 when this rank was
      signalled, so every rank learns at the same step whether any was: no extra
      collective.
    - The loop finishes that step, saves a checkpoint (when ``checkpoint_every > 0``)
      and raises :class:`Preempted`; rank 0 prints one line and every rank exits with
      :data:`EXIT_PREEMPTED`. A resume continues from that step exactly (the data and
      the RNG are functions of the step).

Notes
    - Exit code 75 is ``EX_TEMPFAIL`` ("retry"), distinct from 1, 2 and 3, so a wrapper
      can requeue on it; torchrun's agent itself exits 1.
    - A repeated signal changes nothing. A signal during setup is acted on after the
      first step; a rank blocked in a collective sees it when the collective returns.
      A rank waiting in the store for a peer's compile stops there after a short grace
      (``compiler.ranks.liveness.request_stop``, Note [Peer liveness]), before torchrun's SIGKILL.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from compiler.ranks import clear_stop, request_stop

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
