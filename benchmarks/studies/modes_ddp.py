"""The DDP benchmark's modes, one object each, registered in ``DDP_MODES``, and the
runner that carries a mode's DDP model through ``benchmarks.harness.core``.

Every mode wraps the same DDP model (same seed, same bucket cap, on the job's
device: on CUDA the model is moved to the rank's GPU before DDP wraps it, with
``device_ids=[that GPU]``) and gets the simulated-link comm hook (Note [Simulated
link]); what differs is how it compiles,
and so what it can report: partitions, alignment with DDP's buckets, a bucket plan,
the cost model's prediction, and which caps a sweep runs it at.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from compiler import resolve_backend
from ddp_opt import compile_ddp, measure_alignment
from ddp_opt.compression.powersgd import parse_compression, sequenced_powersgd_hook

from .._torch_internals import BuiltinBuckets, python_reducer_ddp, python_reducer_step
from ..harness.core import ModeTable
from .ddp_mode import DEFAULT_CAP, DDPMode, DDPRunner
from ..link.shaping import SimulatedLink
from ..link.peer_hooks import bucket_bf16_hook, per_gradient_bf16_hook

__all__ = ["DDPMode", "DDP_MODES", "DDPRunner", "build_runner", "DEFAULT_CAP"]


def _fraction(r: DDPRunner, plan: list | None) -> float | None:
    measured = measure_alignment(r.ddp, plan)
    return measured.fraction if measured is not None else None


class Eager(DDPMode):
    name, summary, compiled = "eager", "DDP, no compile", False

    def partitions(self, r: DDPRunner) -> int | None:
        return None


class Builtin(DDPMode):
    name, summary = "builtin", "torch.compile(ddp) with PyTorch's splitter (optimize_ddp at its default)"

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        super().wrap(r, backend, cap, link, cost_model)
        # A backend object of its own: dynamo shares compiled code between model
        # instances (parameters are graph inputs) whenever the backends compare
        # equal, and torch's backend wrappers compare by settings. Without this a
        # second builtin runner at another cap would silently run the first one's
        # split graph (partitions planned for the first runner's cap).
        r.fn = torch.compile(r.ddp, backend=functools.partial(resolve_backend(backend)))
        r.builtin_log = BuiltinBuckets()

    def during_step(self, r: DDPRunner) -> ContextManager:
        return r.builtin_log.listening()

    def partitions(self, r: DDPRunner) -> int | None:
        counts = r.builtin_log.counts
        return counts[-1] if counts else 1  # PyTorch logs nothing when it does not split

    def sweep_caps(self, caps: Sequence[float | str]) -> list[float | str]:
        return [c for c in caps if c != "auto"]


class NoSplit(DDPMode):
    name, summary = "nosplit", "compile_ddp(ddp, strategy='whole'): compiled, no splitting at all"

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        super().wrap(r, backend, cap, link, cost_model)
        r.fn = compile_ddp(r.ddp, backend=backend, strategy="whole")

    def alignment(self, r: DDPRunner) -> float | None:
        return _fraction(r, None)  # the whole graph is one partition


class _Planned(DDPMode):
    """compile_ddp with a bucket plan (``.buckets``). It re-creates DDP's reducer to align
    the buckets with the partitions; a hook registered through it survives that."""

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        r.fn = self.compile(r.ddp, backend, cap, link, cost_model)
        r.fn.register_comm_hook(link, SimulatedLink.hook)

    def compile(self, ddp: DDP, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> Callable:
        raise NotImplementedError

    def plan(self, r: DDPRunner) -> list | None:
        return r.fn.buckets

    def alignment(self, r: DDPRunner) -> float | None:
        return _fraction(r, r.fn.buckets)


class Ours(_Planned):
    name, summary = "ours", "compile_ddp(ddp): split at DDP's real buckets"
    plans_auto = True
    step_gate = True  # compile_ddp's default (Note [Step gate])

    def compile(self, ddp: DDP, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> Callable:
        # With cap auto the link is measured through the same simulated link the gradients
        # take; a given cost model plans auto and predicts fixed caps.
        more = {}
        if cap == "auto" or cost_model is not None:
            more = dict(bucket_cap_mb="auto" if cap == "auto" else None,
                        link=cost_model if cost_model is not None else link.probe)
        return compile_ddp(ddp, backend=backend, step_gate=self.step_gate, **more)

    def partitions(self, r: DDPRunner) -> int | None:
        return len(r.fn.buckets) or 1

    def prediction(self, r: DDPRunner) -> Any:
        return getattr(r.fn, "prediction", None)

    def sweep_caps(self, caps: Sequence[float | str]) -> list[float | str]:
        return list(caps)


class OursNoGate(Ours):
    name, summary = "ours_nogate", "compile_ddp(ddp, step_gate=False): ours without the step gate, for its cost"
    step_gate = False


class Regional(_Planned):
    name, summary = "regional", "compile_ddp(ddp, strategy='regional'): each block compiled in place, the rest eager"

    def compile(self, ddp: DDP, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> Callable:
        # A backend object of its own, as for builtin: the blocks never run another runner's compiled code.
        return compile_ddp(ddp, backend=functools.partial(resolve_backend(backend)), strategy="regional")

    def partitions(self, r: DDPRunner) -> int | None:
        return 1  # one block graph, compiled once, run by every block

    def sweep_caps(self, caps: Sequence[float | str]) -> list[float | str]:
        return []  # its buckets are whole blocks: no cap to sweep (BenchConfig rejects it)


class CompiledAutograd(DDPMode):
    name = "compiled_autograd"
    summary = ("PyTorch's python reducer: all-reduces traced into the backward by compiled autograd "
               "(optimize_ddp='python_reducer'), fused by Inductor up to the cap")
    takes_hook = False  # no DDP reducer: its all-reduces never reach a comm hook

    def construct(self) -> ContextManager:
        return python_reducer_ddp()

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        r.compiler = functools.partial(resolve_backend(backend))  # its own object, as for builtin
        r.fn = torch.compile(r.ddp, backend=r.compiler)

    def during_step(self, r: DDPRunner) -> ContextManager:
        return python_reducer_step(r.compiler, r.ddp_cap_mb)

    def sweep_caps(self, caps: Sequence[float | str]) -> list[float | str]:
        return [c for c in caps if c != "auto"]


class OursTraced(Ours):
    name = "ours_traced"
    summary = ("compile_ddp(ddp, strategy='traced'): all-reduces traced into one compiled backward, "
               "fused into buckets of DDP's caps or the cost-model plan")
    takes_hook = False  # the python reducer's all-reduces never reach a comm hook

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        r.fn = self.compile(r.ddp, backend, cap, link, cost_model)

    def compile(self, ddp: DDP, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> Callable:
        more = {}
        if cap == "auto":  # measured on the real link (a traced mode takes no simulated one)
            more = dict(bucket_cap_mb="auto", link=cost_model)
        # A backend object of its own, as for builtin: no runner runs another's compiled backward.
        return compile_ddp(ddp, backend=functools.partial(resolve_backend(backend)), strategy="traced", **more)

    def during_step(self, r: DDPRunner) -> ContextManager:
        return r.fn.backward_context()

    def partitions(self, r: DDPRunner) -> int | None:
        fused = self.fused_bytes(r)
        return len(fused) if fused is not None else None

    def fused_bytes(self, r: DDPRunner) -> list[int] | None:
        fused = r.fn.traced.fused
        # The synchronised backward's; None when Inductor's cache served it (the pass did not run).
        return list(fused[0]) if fused else None

    def plan(self, r: DDPRunner) -> list | None:
        return None

    def alignment(self, r: DDPRunner) -> float | None:
        return None


class OursTracedInBackward(OursTraced):
    name = "ours_traced_oib"
    summary = ("compile_ddp(ddp, strategy='traced', optimizer=opt): traced, each bucket's optimizer step inside the "
               "compiled backward after its all-reduce (the step after backward finds no gradients)")
    in_backward = True

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        more = dict(bucket_cap_mb="auto", link=cost_model) if cap == "auto" else {}
        r.fn = compile_ddp(r.ddp, backend=functools.partial(resolve_backend(backend)), strategy="traced",
                           optimizer=r.opt, **more)

    def sweep_caps(self, caps: Sequence[float | str]) -> list[float | str]:
        return [c for c in caps if c == "auto"]  # the route a user takes: the cap planned for them


# --- gradients all-reduced in bf16: each peer with the hook a user registers, and ours -----------
# No simulated link: a bf16 mode's gradients leave through its own hook (run them on a real or shaped link).


class _BF16Peer(DDPMode):
    """A peer with a bf16 comm hook on its DDP model, in place of the simulated link's."""

    reduce_dtype, takes_hook = "bf16", False

    def register_hook(self, r: DDPRunner, link: SimulatedLink) -> None:
        r.ddp.register_comm_hook(None, bucket_bf16_hook)


class EagerBF16(_BF16Peer, Eager):
    name, summary = "eager_bf16", "DDP, no compile, PyTorch's bf16_compress_hook (registered under another name)"


class BuiltinBF16(_BF16Peer, Builtin):
    name, summary = "builtin_bf16", "torch.compile(ddp) with PyTorch's splitter and its bf16_compress_hook"


class CompiledAutogradBF16(CompiledAutograd):
    name = "compiled_autograd_bf16"
    summary = ("PyTorch's compiled-autograd reducer with a per-gradient bf16 hook (cast, functional all-reduce, "
               "cast back)")
    reduce_dtype = "bf16"

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        r.ddp.register_comm_hook(None, per_gradient_bf16_hook)  # the python reducer calls it per gradient
        CompiledAutograd.wrap(self, r, backend, cap, link, cost_model)


class OursBF16(Ours):
    name, summary = "ours_bf16", "compile_ddp(ddp, reduce_dtype=torch.bfloat16): ours, gradients all-reduced in bf16"
    reduce_dtype, takes_hook = "bf16", False

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        # At auto, compile_ddp measures the link itself, in bf16 (the sweep's shared cost model is fp32's).
        more = dict(bucket_cap_mb="auto") if cap == "auto" else {}
        r.fn = compile_ddp(r.ddp, backend=backend, reduce_dtype=torch.bfloat16, **more)


class OursTracedBF16(OursTraced):
    name = "ours_traced_bf16"
    summary = "compile_ddp(ddp, strategy='traced', reduce_dtype=torch.bfloat16): the bf16 cast in the compiled backward"
    reduce_dtype = "bf16"

    def compile(self, ddp: DDP, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> Callable:
        more = dict(bucket_cap_mb="auto") if cap == "auto" else {}  # the link measured in bf16, as OursBF16's
        return compile_ddp(ddp, backend=functools.partial(resolve_backend(backend)), strategy="traced",
                           reduce_dtype=torch.bfloat16, **more)


# --- PowerSGD: eager DDP with PyTorch's hook at the same rank and start, and ours ------------------
# Start 2: the measured rounds are compressed (realignment's layout changes come before:
# Note [PowerSGD compression]).
POWERSGD = "powersgd:4:2"


class EagerPowerSGD(Eager):
    name = "eager_powersgd"
    summary = (f"DDP, no compile, PyTorch's powerSGD_hook ({POWERSGD}), each bucket's hook in DDP's order (as "
               "registered, its ranks' collectives go out of order on gloo)")
    compression, takes_hook = POWERSGD, False

    def register_hook(self, r: DDPRunner, link: SimulatedLink) -> None:
        r.ddp.register_comm_hook(parse_compression(POWERSGD).state(r.ddp.process_group), sequenced_powersgd_hook)

    def sweep_caps(self, caps: Sequence[float | str]) -> list[float | str]:
        return sorted({*(c for c in caps if c != "auto"), DEFAULT_CAP})


class OursPowerSGD(Ours):
    name, summary = "ours_powersgd", f"compile_ddp(ddp, compression={POWERSGD!r}): ours, PowerSGD gradients"
    compression, takes_hook = POWERSGD, False

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        more = dict(bucket_cap_mb="auto") if cap == "auto" else {}  # the link probed by compile_ddp, as PowerSGD sends
        r.fn = compile_ddp(r.ddp, backend=backend, compression=POWERSGD, **more)


class OursTracedPowerSGD(OursTraced):
    name = "ours_traced_powersgd"
    summary = (f"compile_ddp(ddp, strategy='traced', compression={POWERSGD!r}): PowerSGD's power iteration and "
               "all-reduces in the compiled backward")
    compression = POWERSGD

    def compile(self, ddp: DDP, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> Callable:
        more = dict(bucket_cap_mb="auto") if cap == "auto" else {}  # the link probed by compile_ddp, as OursPowerSGD's
        return compile_ddp(ddp, backend=functools.partial(resolve_backend(backend)), strategy="traced",
                           compression=POWERSGD, **more)

    def partitions(self, r: DDPRunner) -> int | None:
        return len(r.fn.traced_hook.layout) or None  # the buckets of the compressed backward

    def fused_bytes(self, r: DDPRunner) -> list[int] | None:
        return None  # the plan's fusion pass sees the uncompressed steps only


DDP_MODES: ModeTable[DDPMode] = ModeTable([Eager(), Builtin(), NoSplit(), Ours(), OursNoGate(), Regional(),
                                           CompiledAutograd(), OursTraced(), OursTracedInBackward(),
                                           EagerBF16(), BuiltinBF16(),
                                           CompiledAutogradBF16(), OursBF16(), OursTracedBF16(), EagerPowerSGD(),
                                           OursPowerSGD(), OursTracedPowerSGD()],
                                          default=("eager", "builtin", "nosplit", "ours"))


def build_runner(name: str, cfg: Any, cap: float | str, link: SimulatedLink, cost_model: Any = None) -> DDPRunner:
    """Mode ``name`` on a new GPT (same seed for every mode) in DDP at bucket cap ``cap``.

    ``cfg`` is a ``ddp_bench.BenchConfig``; ``cost_model`` (a ``ddp_opt.CostModel``):
    a mode that ``plans_auto`` plans with it at cap auto and predicts with it at fixed caps.
    """
    mode = DDP_MODES[name]
    auto = cap == "auto"
    if auto and not mode.plans_auto:
        takes = [m for m in DDP_MODES.names if DDP_MODES[m].plans_auto]
        raise ValueError(f"cap 'auto' is compile_ddp's cost-model plan, and mode {name!r} has no such option: "
                         f"only {', '.join(takes)} plan(s) with a cost model. Give {name} numeric caps.")
    model = cfg.new_model()  # already on this rank's device
    device = next(model.parameters()).device
    with mode.construct():
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=None if auto else cap)
    r = DDPRunner(mode=mode, ddp=ddp, fn=ddp, opt=torch.optim.SGD(model.parameters(), lr=cfg.lr), ddp_cap_mb=cap)
    mode.wrap(r, cfg.backend, cap, link, cost_model)
    return r
