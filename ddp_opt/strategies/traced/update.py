"""The optimizer in backward under the traced strategy (``compile_ddp(..., strategy="traced",
optimizer=opt)``): each parameter's update traced into the compiled backward graph, after its
gradient's all-reduce (Note [Traced update]).

Note [Traced update]

Background
    Under the traced strategy (Note [Traced strategy]) DDP's python reducer all-reduces
    each gradient from a post-accumulate-grad hook, and compiled autograd traces the
    whole backward, hooks included, into one graph. An update written as tensor code in
    a hook that runs after the reducer's is traced into that graph too, where Inductor
    can fuse it with the gradient's last kernels and schedule it while later gradients
    are computed and reduced. ``torch.optim``'s own ``step`` cannot be traced there: it
    reads ``.grad`` of every parameter and takes the learning rate as a number, so a
    scheduler's new value would be a constant of the graph (a recompile at every change).

Algorithm
    - A closed list of update rules (:data:`RULES`), written from ``torch.optim``'s
      single-tensor code: SGD (momentum, dampening 0, nesterov, weight decay,
      maximize), Adam and AdamW (weight decay, amsgrad, maximize). They read and write
      the user's optimizer's own ``state`` tensors (momentum_buffer; step, exp_avg,
      exp_avg_sq) and its groups' hyper-parameters, so a checkpoint of the optimizer,
      and ``optimizer.step()`` on other parameters, see one optimizer.
    - The learning rate is a 0-dim float64 tensor per group, set from ``group["lr"]``
      before each forward of the DDP model (a forward pre-hook): a scheduler's change is
      a new value of a graph input, not a recompile. The other hyper-parameters are
      copied as numbers into plain dicts the traced hook reads: dynamo guards them, so a
      change recompiles and is never ignored. The hook never touches the optimizer
      object: dynamo guards every hyper-parameter of an optimizer it meets, ``lr`` too.
      Adam's bias corrections are computed in float64 from its ``step`` tensor, as
      ``torch.optim`` computes them from ``step.item()``.
    - The state is made before the first forward, as ``torch.optim`` makes it at the
      first step: zeros and a step of 0 (SGD's first momentum buffer is the gradient
      itself, which zeros give exactly when dampening is 0).
    - One post-accumulate-grad hook per parameter of the DDP module that the optimizer
      holds, registered after DDP's: in a synchronised backward it runs on the reduced
      gradient (in place of ``.grad``), updates the parameter, adds one to a counter
      tensor (``BucketStep.updates`` reads it: a Python counter would be a guarded
      constant of the graph) and sets ``.grad`` to None. In a ``no_sync`` backward it
      returns at once (dynamo guards the flag: compiled autograd keeps one graph of each),
      so gradients accumulate.
    - Inductor's fusion pass (``FuseByPlan``) concatenates a bucket's all-reduces into
      one; the updates of its parameters read that bucket's result, so each runs after
      its bucket's reduction. Inductor forwards a same-dtype write-back copy's readers to
      the wait, which the fusion's filter refused (a wait with one user, a copy): with the
      update in backward the plan fuses with ``any_readers`` (``TracedPlan.updates_in_backward``).
    - ``sink_updates`` (``ddp_opt.strategies.traced.placement``) moves bucket k's wait, its
      updates and their writes into parameters and state to just before bucket k + 2 starts
      to be filled (``UPDATE_LAG``); the last two buckets', to the end of the graph. Rule and
      reason: a wait left at its first update stops backward until that bucket has crossed
      the link (Note [Traced strategy]), so bucket k + 1 is in flight while k is waited for;
      a bucket's buffer lives from its concatenation until its update, so waiting later
      (at the end, as before) keeps every bucket live at once and the update saved no memory.
      A move that would put a write on the other side of a node reading or writing the same
      memory (through views) goes to the end instead: a kernel of backward may read a
      parameter below the fill point although its gradient is final.
    - With ``bucket_cap_mb="auto"`` the plan's buckets are cut to at most an eighth of a
      graph's gradient bytes (``IN_BACKWARD_BUCKETS``, not below ``min_bucket_bytes``).
      Rule and reason: what the update can free is bounded by the gradients live at once,
      about three buckets; the time plan makes one or two large buckets on a slow link.
      Measured (docs/benchmarks/optimizer-in-backward.md, batch 1): the peak fell by 1.09
      and 0.99 of the gradient bytes at 200 and 800 Mbit (0.00 and -0.04 before), the step
      at 0.977 and 0.930 of the same strategy without the update.

Notes
    - An element's update reads only its own gradient and state, so updating parameter
      by parameter gives the single step's result (Note [Optimizer in backward]).
    - Refused (:func:`traced_refusal`), with ``strategy='split'`` (which steps any
      optimizer) as the fix: other optimizer classes (subclasses too: their ``step`` may
      differ), ``differentiable=True``, SGD momentum with dampening, tensor betas,
      complex or sparse parameters.
    - A plain ``loss.backward()`` runs the same hooks eagerly: still correct.
    - A scheduler that changes another hyper-parameter every step (OneCycleLR's momentum
      or betas) recompiles the backward at each change until dynamo's recompile limit,
      after which that backward runs uncompiled: correct, slow.
    - Each parameter is updated in its own hook, not once per bucket: with ``aot_eager``
      (no fusion pass) right after its own all-reduce.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from ...in_backward._torch_internals import ddp_reduced_parameters
from ...in_backward.stepper import BucketStep

log = logging.getLogger(__name__)

__all__ = ["RULES", "TracedUpdate", "attach_traced", "traced_refusal"]


class TracedPlanLike(Protocol):
    """What the update needs of ``strategies.traced.TracedPlan`` (which imports this package)."""

    updates_in_backward: bool


# --- the update rules: torch.optim's single-tensor arithmetic, the learning rate a tensor ----------


def _sgd(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, lr: torch.Tensor) -> None:
    """``torch.optim.SGD``'s update of one parameter (``_single_tensor_sgd``)."""
    if group["maximize"]:
        grad = -grad
    if group["weight_decay"] != 0:
        grad = grad.add(param, alpha=group["weight_decay"])
    momentum = group["momentum"]
    if momentum != 0:
        buf = state["momentum_buffer"]
        buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
        grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
    param.sub_(grad * lr)


def _adam(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, lr: torch.Tensor,
          decoupled: bool) -> None:
    """``torch.optim.Adam``'s (``decoupled``: AdamW's) update of one parameter (``_single_tensor_adam``)."""
    if group["maximize"]:
        grad = -grad
    beta1, beta2 = group["betas"]
    step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
    step_t.add_(1)
    weight_decay = group["weight_decay"]
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = step_t.to(torch.float64)  # torch.optim: step.item(), a Python float
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    if group["amsgrad"]:
        max_exp_avg_sq = state["max_exp_avg_sq"]
        max_exp_avg_sq.copy_(torch.maximum(max_exp_avg_sq, exp_avg_sq))
        exp_avg_sq = max_exp_avg_sq
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
    param.sub_(exp_avg / denom * step_size)


def _sgd_state(param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    if group["momentum"] == 0:
        return {}
    return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}


def _adam_state(param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    # torch.optim.Adam._init_group: the step on the parameter's device only when capturable or fused.
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    on_device = group.get("capturable") or group.get("fused")
    step = torch.zeros((), dtype=scalar, device=param.device) if on_device else torch.tensor(0.0, dtype=scalar)
    state = {"step": step,
             "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


@dataclass(frozen=True)
class Rule:
    """One optimizer class's traced update and its state as ``torch.optim`` first makes it."""

    update: Callable[[torch.Tensor, torch.Tensor, dict, dict, torch.Tensor], None]
    new_state: Callable[[torch.Tensor, dict], dict[str, torch.Tensor]]


def _adam_by_group(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, lr: torch.Tensor) -> None:
    _adam(param, grad, state, group, lr, group.get("decoupled_weight_decay", False))  # Adam(decoupled_weight_decay=)


def _adamw(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, lr: torch.Tensor) -> None:
    _adam(param, grad, state, group, lr, True)


RULES: dict[type, Rule] = {
    torch.optim.SGD: Rule(_sgd, _sgd_state),
    torch.optim.Adam: Rule(_adam_by_group, _adam_state),
    torch.optim.AdamW: Rule(_adamw, _adam_state),
}


def traced_refusal(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> str | None:
    """Why ``optimizer`` cannot be traced into the backward of ``params``' model, or None."""
    name = type(optimizer).__name__
    if type(optimizer) not in RULES:
        return (f"{name} is not one of the optimizers whose update is traced into the backward graph "
                f"({', '.join(sorted(cls.__name__ for cls in RULES))})")
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return f"{name}(differentiable=True) keeps autograd through its update, which a backward graph cannot"
        if type(optimizer) is torch.optim.SGD and group["momentum"] != 0 and group["dampening"] != 0:
            return (f"SGD(dampening={group['dampening']}) starts its momentum from the first gradient "
                    "undamped, which the traced update does not model")
        if any(isinstance(beta, torch.Tensor) for beta in group.get("betas", ())):
            return f"{name} was given betas as tensors; the traced update takes them as numbers"
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for p in params:
        if id(p) in held and (p.is_complex() or p.is_sparse):
            return f"{name} holds a {'complex' if p.is_complex() else 'sparse'} parameter"
    return None


class TracedUpdate:
    """The hooks of the traced update and what they read (Note [Traced update]).

    The traced hooks never see the optimizer object: dynamo guards every hyper-parameter of an
    optimizer it meets, the learning rate included (a recompile at each scheduler step). They
    read plain containers that :meth:`refresh` keeps in place before each forward.

    Attributes:
        optimizer: the user's optimizer (its state and groups are the ones used).
        params: the DDP module's parameters updated in backward, in hook order.
        lrs: per optimizer group, the 0-dim learning-rate tensor the traced graph reads.
        hyper: per optimizer group, its other hyper-parameters (numbers the graph is specialised on).
        states: per parameter of ``params``, its ``optimizer.state`` entry.
        count: the parameter updates run so far, a 0-dim int64 tensor the traced graph adds to
            (a Python counter there would be a constant of the graph, guarded: a recompile at
            every step).
    """

    def __init__(self, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        self.ddp_model, self.optimizer = ddp_model, optimizer
        self.rule = RULES[type(optimizer)]
        group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.params = [p for p in ddp_reduced_parameters(ddp_model) if id(p) in group_of]
        self._groups = [group_of[id(p)] for p in self.params]
        self.lrs = [torch.zeros((), dtype=torch.float64) for _ in optimizer.param_groups]
        self.hyper: list[dict] = [{} for _ in optimizer.param_groups]
        self.states: list[dict] = [{} for _ in self.params]
        self.count = torch.zeros((), dtype=torch.int64,
                                 device=self.params[0].device if self.params else torch.device("cpu"))
        self._handles = [ddp_model.register_forward_pre_hook(lambda module, args: self.refresh())]
        self._handles += [p.register_post_accumulate_grad_hook(self._hook(k)) for k, p in enumerate(self.params)]
        self.refresh()

    def _hook(self, k: int) -> Callable[[torch.nn.Parameter], None]:
        ddp_model, update, group = self.ddp_model, self.rule.update, self._groups[k]
        lr, hyper, states, count = self.lrs[group], self.hyper[group], self.states, self.count

        def update_after_reduce(param: torch.nn.Parameter) -> None:
            # Traced by compiled autograd (Note [Traced update]); DDP's own hook ran first.
            if not ddp_model.require_backward_grad_sync or param.grad is None:
                return
            with torch.no_grad():
                update(param, param.grad, states[k], hyper, lr)
                count.add_(1)
            param.grad = None

        return update_after_reduce

    def refresh(self) -> None:
        """Before each forward: each group's learning rate into its tensor and its other
        hyper-parameters into ``hyper``; each parameter's state (made as ``torch.optim`` makes
        it at the first step where it has none: the first step, a checkpoint loaded without it)."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.lrs):
            raise RuntimeError(
                f"compile_ddp(optimizer=...): the optimizer now has {len(groups)} param group(s), not the "
                f"{len(self.lrs)} it had when compiled, and the traced update holds one learning rate per group. "
                "Add param groups before compile_ddp, or compile with strategy='split'.")
        with torch.no_grad():
            for lr, hyper, group in zip(self.lrs, self.hyper, groups):
                lr.fill_(group["lr"])
                hyper.update((key, value) for key, value in group.items() if key not in ("params", "lr"))
            for k, p in enumerate(self.params):
                state = self.optimizer.state[p]
                if not state:
                    state.update(self.rule.new_state(p, groups[self._groups[k]]))
                self.states[k] = state  # load_state_dict makes new dicts

    def remove(self) -> None:
        """Take the hooks off: gradients are left for ``optimizer.step()`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def attach_traced(ddp_model: DistributedDataParallel, plan: TracedPlanLike, stepper: BucketStep) -> TracedUpdate:
    """Update ``ddp_model``'s parameters inside its traced backward with ``stepper``'s optimizer
    (Note [Traced update]). Call after ``compile_ddp(strategy="traced")`` switched DDP to its
    python reducer (its hooks must run first).

    Args:
        ddp_model: the DDP module, on its python reducer.
        plan: the traced strategy's plan (its fusion pass buckets the all-reduces the updates read).
        stepper: the user's optimizer, checked by ``BucketStep``.

    Returns:
        The hooks' state (:class:`TracedUpdate`).

    ``compile_ddp`` refuses, before converting DDP, what this cannot run (``traced_refusal`` and
    compression: ``ddp_opt.api``).
    """
    optimizer = stepper.optimizer
    plan.updates_in_backward = True  # the fusion pass lets the updates read the reduced gradients
    update = TracedUpdate(ddp_model, optimizer)
    stepper.traced_count = update.count  # ``stepper.updates`` reads it
    log.info("ddp_opt traced update: %s on %d parameter(s) inside the compiled backward", type(optimizer).__name__,
             len(update.params))
    return update
