"""Workers die with their torchrun agent.

Note [Workers die with their agent]

Background
    torchrun's agent starts each worker in a process group of its own. When the
    agent is killed with SIGKILL (an OOM kill, a scheduler's hard stop, ``kill -9``),
    nothing is forwarded: the workers go on training, writing checkpoints, and a
    requeued job resumes from a checkpoint these orphans have just written, then
    trains beside them on the same folder.

Algorithm
    A worker started by torchrun (``TORCHELASTIC_RUN_ID`` set) asks the kernel, with
    ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, to SIGKILL it when its parent, the agent,
    dies: no step finishes, nothing is saved (the agent's death is not a preemption:
    a new job may already be starting). A worker whose parent is already gone when it
    asks (its parent is init) exits at once. Linux only; elsewhere nothing is done.
    ``python -m launch.train`` without torchrun is left alone: its parent is a shell,
    which may end while the job goes on (``nohup``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

__all__ = ["die_with_agent", "PR_SET_PDEATHSIG"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_agent() -> bool:
    """Under torchrun on Linux: be SIGKILLed when the agent dies (see the Note). Returns
    whether the kernel took the request."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        log.warning("could not ask to end with the torchrun agent (prctl: %s): a worker may outlive a killed agent", e)
        return False
    if os.getppid() == 1:  # the agent died before the request: this worker is an orphan already
        print(f"rank {os.environ.get('RANK', '?')}: the torchrun agent is gone; ending without saving",
              file=sys.stderr, flush=True)
        os._exit(1)
    return True
