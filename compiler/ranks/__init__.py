"""The cross-rank role of ``compiler``: what the ranks of one job do together around a compile.
One rank compiles a graph and the others load it (``CompileShare``, Note [Shared compile]),
under the job's secret (``cluster_secret``); ranks hold at a step together (``StepGate``);
each rank watches its peers' heartbeats and stops instead of hanging (Note [Peer liveness]);
and the serial link between them is measured for the plans (``LinkEstimate``).

Outside ``compiler`` these names are imported from here; the modules are this package's own."""

from .cputime import cpu_seconds
from .link import LinkEstimate, best_seconds, broadcast_floats, fit_link, time_sizes
from .liveness import (PeerLost, PeerMonitor, WaitInterrupted, clear_stop, dead_after_s, on_default_store,
                       request_stop)
from .share import CompileShare, share_for_group
from .share_secret import ShareSecretError, cluster_secret
from .step_gate import StepGate, gate_for_group

__all__ = [
    "CompileShare", "share_for_group", "ShareSecretError", "cluster_secret", "StepGate", "gate_for_group",
    "PeerLost", "PeerMonitor", "WaitInterrupted", "on_default_store", "clear_stop", "request_stop", "dead_after_s",
    "LinkEstimate", "best_seconds", "broadcast_floats", "fit_link", "time_sizes", "cpu_seconds",
]
