"""The step gate (Note [Step gate] in compiler/ranks/step_gate.py): a compile on one rank only,
longer than the process group's timeout, is waited for in the store, and training goes on
as eager DDP does; without the gate the same run fails in a collective."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_opt import compile_ddp

PG_TIMEOUT_S = 6.0  # the process group's collective timeout (train.timeout_s in the launcher)
SLEEP_S = 10.0  # rank 1's recompile, longer than it
STEPS, ODD_STEP = 4, 2  # at ODD_STEP only rank 1 sees another batch size: a recompile there alone


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)], nn.Linear(64, 1))


def _batch(rank: int, step: int) -> torch.Tensor:
    rows = 6 if (rank == 1 and step == ODD_STEP) else 8
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank: int, compiled, ddp: DDP, backward) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        loss = compiled(_batch(rank, step)).pow(2).mean()
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in ddp.parameters()]


def _gate_rank(rank, world_size, strategy, share, step_gate):
    """One compile_ddp run whose rank 1 sleeps SLEEP_S in every compile after the first step's,
    and the same data through eager DDP; returns both runs' losses and parameters."""
    from torch._dynamo import lookup_backend

    state = {"first_step_done": False, "slept": 0.0}

    def slow_recompile_on_rank1(gm, example_inputs):
        if rank == 1 and state["first_step_done"] and not state["slept"]:
            state["slept"] = SLEEP_S
            time.sleep(SLEEP_S)
        return lookup_backend("aot_eager")(gm, example_inputs)

    ddp = DDP(_model(), bucket_cap_mb=0.02)
    compiled = compile_ddp(ddp, backend=slow_recompile_on_rank1, strategy=strategy, share=share,
                           step_gate=step_gate)

    def backward(loss):
        compiled.backward(loss)
        state["first_step_done"] = True

    ours = _train(rank, compiled, ddp, backward)
    eager_ddp = DDP(_model(), bucket_cap_mb=0.02)
    reference = _train(rank, eager_ddp, eager_ddp, lambda loss: loss.backward())
    gate = compiled.gate
    return ours, reference, state["slept"], (gate.steps, gate.longest_s) if gate is not None else None


@pytest.mark.parametrize("strategy,share", [("split", True), ("split", False), ("traced", True)])
def test_a_recompile_on_one_rank_longer_than_the_timeout_is_waited_for_at_the_gate(run_ranks, strategy, share):
    results = run_ranks(_gate_rank, strategy, share, True, pg_timeout_s=PG_TIMEOUT_S, timeout=240)
    for rank, ((losses, params), (ref_losses, ref_params), slept, (steps, longest_s)) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), rank
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert steps == STEPS
        if rank == 0:
            assert slept == 0.0 and longest_s >= SLEEP_S - 1.0  # it waited out rank 1's compile at the gate
        else:
            assert slept == SLEEP_S


def test_without_the_gate_the_same_run_fails_in_a_collective(run_ranks):
    # gloo's words for it vary: "Timed out waiting ... for recv", "Application timeout caused pair closure"
    with pytest.raises(AssertionError, match=r"(?is)rank \d failed:.*(timed out|timeout|connection|closed)"):
        run_ranks(_gate_rank, "split", False, False, pg_timeout_s=PG_TIMEOUT_S, timeout=240)


# --- the main job: a shape only rank 1 sees, and a recompile longer than train.timeout_s --------------

JOB_TIMEOUT_S, JOB_SLEEP_S = 8, 12  # the recompile outlasts the timeout by half
JOB = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "train.batch_size=4", "train.seq_len=32",
       "train.steps=5", "ddp.bucket_cap_mb=0.01", f"train.timeout_s={JOB_TIMEOUT_S}", "data=custom",
       "data._target_=_custom_parts.ShortOnRank1", "hydra.run.dir=run"]


@pytest.fixture(scope="module")
def undisturbed_losses(tmp_path_factory, torchrun):
    """The losses of the job whose recompile on rank 1 takes no extra time (compile.share=true;
    sharing decides who compiles, not what, so one reference serves both settings)."""
    from _torchrun import metrics, ok

    cwd = tmp_path_factory.mktemp("plain")
    ok(torchrun(cwd, "compile.backend=slow_recompile_aot_eager", "compile.share=true", *JOB, fault="recompile:1:0"))
    return metrics(cwd / "run")["losses"]


@pytest.mark.parametrize("share", ["true", "false"])
def test_the_job_waits_out_a_recompile_on_one_rank_longer_than_its_timeout(tmp_path, torchrun, share,
                                                                          undisturbed_losses):
    from _torchrun import metrics, ok

    slow = torchrun(tmp_path, "compile.backend=slow_recompile_aot_eager", f"compile.share={share}", *JOB,
                    fault=f"recompile:1:{JOB_SLEEP_S}")
    ok(slow)
    assert f"fault recompile:1:{JOB_SLEEP_S}: a recompile of {JOB_SLEEP_S} s" in slow.stderr  # it happened
    assert metrics(tmp_path / "run")["losses"] == undisturbed_losses


# --- compile_for_ddp (nanoGPT's order): ranks attach in different calls ---------------------------------

def _compile_first_rank(rank, world_size):
    """nanoGPT's flow with one micro-step per step: compile, wrap in DDP, evaluate on rank 0
    only (no_grad) before step 1, then train; a shape only rank 1 sees at step ODD_STEP."""
    from ddp_opt import compile_for_ddp, compiled_ddp_of

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()

        def forward(self, x):
            return self.body(x)

    compiled = compile_for_ddp(Net(), backend="aot_eager")
    model = DDP(compiled, bucket_cap_mb=0.02)
    if rank == 0:
        with torch.no_grad():
            model(_batch(0, -1))  # rank 0 alone: its compiled forward attaches here
    losses = _train(rank, model, model, lambda loss: loss.backward())[0]
    return losses, compiled_ddp_of(compiled).gate.steps


def test_under_compile_for_ddp_every_rank_meets_the_gate_as_often_after_an_evaluation_on_rank_0(run_ranks):
    (_, steps0), (_, steps1) = run_ranks(_compile_first_rank, pg_timeout_s=30, timeout=240)
    assert steps0 == steps1 == STEPS - 1  # from the second synchronised step on, on both ranks
