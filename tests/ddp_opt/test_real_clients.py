"""Real clients, the way their authors write them, on two gloo ranks:

- nanoGPT's ``train.py`` flow (an evaluation under ``no_grad`` on rank 0 only before training
  and every few iterations, gradient accumulation through ``model.require_backward_grad_sync``,
  clipping), run unchanged with eager DDP, with ``compile_ddp`` (wrap, then compile) and with
  ``compile_for_ddp`` (nanoGPT's order: compile, then wrap);
- a hand-written Hugging Face loop: ``LlamaForCausalLM`` from a config, ``labels=``,
  accumulation under ``no_sync()``, bf16 autocast, clipping, a rank-0 evaluation.

Each compiled run must give eager's losses, one all-reduce round per optimizer step,
realigned buckets equal on both ranks, and no warning. (torchtitan's ModuleDict decoder:
tests/fsdp_opt/test_fsdp_apply.py.)"""

import contextlib
import logging
import time
import warnings

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks

pytestmark = pytest.mark.slow  # two gloo ranks, five training runs
# Big enough (~1.7 MiB of gradients) that DDP's default caps make two buckets, as for nanoGPT's GPT-2.
CONFIG = dict(n_layer=2, n_embd=128, n_head=2, vocab_size=64, block_size=16)
EVAL_INTERVAL, EVAL_ITERS, MAX_ITERS, ACCUM = 2, 2, 4, 2


def _get_batch(rank, split, n):
    g = torch.Generator().manual_seed(10_000 * rank + 1_000 * ("train", "val").index(split) + n)
    x = torch.randint(0, CONFIG["vocab_size"], (4, CONFIG["block_size"]), generator=g)
    return x, torch.roll(x, -1, dims=1)


class _Warnings(logging.Handler):
    """Every warning this rank logs or warns while the flow runs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def _watched(handle):
    """Instrumentation, not part of the clients' scripts: count DDP's all-reduces (a comm hook registered
    through ``handle``: the compile_ddp handle, as it asks, else DDP itself) and collect every warning
    warned or logged by the toolkit. Yields the state; ``warnings`` is filled at the end."""
    state = {"calls": 0, "warnings": []}

    def counting_allreduce(state, bucket):
        state["calls"] += 1
        return allreduce_hook(None, bucket)

    handle.register_comm_hook(state, counting_allreduce)
    caught = _Warnings()
    for name in ("ddp_opt", "compiler"):
        logging.getLogger(name).addHandler(caught)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            yield state
    finally:
        for name in ("ddp_opt", "compiler"):
            logging.getLogger(name).removeHandler(caught)
    state["warnings"] = [str(w.message) for w in warned] + caught.seen


def _outcome(ddp, compiled, watched, **measured):
    """What a run returns: its measures, its warnings, and how the compiled run's buckets ended."""
    return dict(
        measured, warnings=watched["warnings"],
        aligned_caps=compiled.aligned_caps if compiled is not None else None,
        realigned=compiled.realignment.fraction if compiled is not None and compiled.realignment is not None
        else None,
        partitions=len(compiled.buckets) if compiled is not None else None,
        runtime_buckets=len(ddp.reducer._get_zeros_like_grad_buckets()),
    )


def _nanogpt_flow(rank, how, evaluate=True):
    """nanoGPT's train.py loop in small; ``how`` is the one line a user changes."""
    from ddp_opt import compile_ddp, compile_for_ddp, compiled_ddp_of
    from launch.models import GPT, GPTConfig

    torch._dynamo.reset()
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**CONFIG))
    if how == "compile_for_ddp":
        model = compile_for_ddp(model, backend="aot_eager")  # was: model = torch.compile(model)
    model = DDP(model)
    ddp = model
    if how == "compile_ddp":
        model = compile_ddp(model, backend="aot_eager")  # added after DDP(...)
    master_process = rank == 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(EVAL_ITERS)
            for k in range(EVAL_ITERS):
                X, Y = _get_batch(rank, split, k)
                logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    evals, losses, rounds, first_step_s = [], [], [], None
    with _watched(model if how == "compile_ddp" else ddp) as hook_state:
        X, Y = _get_batch(rank, "train", 100)
        iter_num, n = 0, 101
        while True:
            if evaluate and iter_num % EVAL_INTERVAL == 0 and master_process:
                evals.append(estimate_loss())
            t0 = time.perf_counter()
            calls_at = []
            for micro_step in range(ACCUM):
                model.require_backward_grad_sync = (micro_step == ACCUM - 1)
                logits, loss = model(X, Y)
                loss = loss / ACCUM
                X, Y = _get_batch(rank, "train", n)
                n += 1
                before = hook_state["calls"]
                loss.backward()
                calls_at.append(hook_state["calls"] - before)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item() * ACCUM)
            rounds.append(calls_at)
            if first_step_s is None:
                first_step_s = time.perf_counter() - t0
            iter_num += 1
            if iter_num > MAX_ITERS:
                break
    compiled = {"compile_ddp": model, "compile_for_ddp": compiled_ddp_of(ddp.module)}.get(how)
    return _outcome(ddp, compiled, hook_state, losses=losses, evals=evals, rounds=rounds, first_step_s=first_step_s)


def _hf_loop(rank, how):
    """A hand-written HF training loop; ``how == "compile_ddp"`` adds the one line after DDP(...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ddp_opt import compile_ddp

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = DDP(LlamaForCausalLM(config), bucket_cap_mb=0.25)
    ddp = model
    if how == "compile_ddp":
        model = compile_ddp(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, evals, rounds = [], [], []
    with _watched(model if how == "compile_ddp" else ddp) as hook_state:
        for step in range(3):
            if rank == 0:  # evaluation on the main process only, of the unwrapped model (as accelerate's
                unwrapped = model.module  # unwrap_model): through DDP it would broadcast the rotary buffers
                unwrapped.eval()
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    ids = _get_batch(rank, "val", step)[0]
                    evals.append(unwrapped(input_ids=ids, labels=ids).loss.item())
                unwrapped.train()
            calls_at = []
            for micro in range(ACCUM):
                ids = _get_batch(rank, "train", 10 * step + micro)[0]
                sync = micro == ACCUM - 1
                with (contextlib.nullcontext() if sync else model.no_sync()):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(input_ids=ids, labels=ids).loss / ACCUM
                    before = hook_state["calls"]
                    loss.backward()
                calls_at.append(hook_state["calls"] - before)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item() * ACCUM)
            rounds.append(calls_at)
    return _outcome(ddp, model if how == "compile_ddp" else None, hook_state, losses=losses, evals=evals,
                    rounds=rounds)


def _every_flow(rank, world_size):
    runs = {how: _nanogpt_flow(rank, how) for how in ("eager", "compile_ddp", "compile_for_ddp")}
    runs.update({f"hf_{how}": _hf_loop(rank, how) for how in ("eager", "compile_ddp")})
    return runs


@pytest.fixture(scope="module")
def results():
    return run_ranks(_every_flow, timeout=600)


def test_nanogpt_flow_with_rank0_eval_trains_like_eager_ddp_with_one_allreduce_round_per_step(results):
    for rank, runs in enumerate(results):
        eager = runs["eager"]
        assert eager["runtime_buckets"] >= 2, "the model must give DDP several buckets to test realignment"
        for how in ("compile_ddp", "compile_for_ddp"):
            got = runs[how]
            assert not got["warnings"], f"rank {rank} {how} warned: {got['warnings']}"
            torch.testing.assert_close(got["losses"], eager["losses"], rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {how} training losses: {m}")
            assert len(got["evals"]) == len(eager["evals"]) == (3 if rank == 0 else 0)
            for i, (e, w) in enumerate(zip(got["evals"], eager["evals"])):
                for split in e:
                    assert abs(e[split] - w[split]) < 1e-5, f"rank {rank} {how} eval {i} {split}: {e} vs {w}"
            # require_backward_grad_sync reached DDP: all-reduces only in the last micro-step of each iteration
            assert all(r[:-1] == [0] * (ACCUM - 1) and r[-1] > 0 for r in got["rounds"]), (rank, how, got["rounds"])
            assert [r[-1] for r in got["rounds"][2:]] == [got["partitions"]] * (MAX_ITERS - 1), (rank, how, got)
            # realigned, on both ranks at once, with the same caps: DDP's buckets are the partitions
            assert got["aligned_caps"] is not None and got["realigned"] == 1.0, (rank, how, got)
            assert got["runtime_buckets"] == got["partitions"] >= 2, (rank, how, got)
            assert got["aligned_caps"] == results[0][how]["aligned_caps"], (rank, how)
            assert got["first_step_s"] < 60, f"rank {rank} {how}: first step took {got['first_step_s']:.0f}s (a stall)"
        assert [r[-1] for r in eager["rounds"]] and all(r[:-1] == [0] * (ACCUM - 1) for r in eager["rounds"])


def test_hf_loop_with_no_sync_autocast_and_rank0_eval_trains_like_eager_ddp(results):
    for rank, runs in enumerate(results):
        eager, got = runs["hf_eager"], runs["hf_compile_ddp"]
        assert not got["warnings"], f"rank {rank} warned: {got['warnings']}"
        # bf16 autocast: equal on torch 2.12-2.15; up to 6.1e-4 apart on 2.11 (bf16's step at 4.8 is 0.03). The
        # all-reduce counts below and the fp32 nanoGPT test (1e-5) pin the synchronisation itself.
        torch.testing.assert_close(got["losses"], eager["losses"], rtol=0, atol=2e-3,
                                   msg=lambda m: f"rank {rank} training losses: {m}")
        torch.testing.assert_close(got["evals"], eager["evals"], rtol=0, atol=2e-3,
                                   msg=lambda m: f"rank {rank} eval losses: {m}")
        assert len(got["evals"]) == (3 if rank == 0 else 0)
        assert eager["rounds"] and all(r[:-1] == [0] * (ACCUM - 1) and r[-1] > 0 for r in eager["rounds"])
        assert all(r[:-1] == [0] * (ACCUM - 1) for r in got["rounds"]), (rank, got["rounds"])  # no_sync honoured
        assert [r[-1] for r in got["rounds"][1:]] == [got["partitions"]] * 2, (rank, got)
        assert got["realigned"] == 1.0 and got["runtime_buckets"] == got["partitions"] >= 2, (rank, got)
        assert got["aligned_caps"] == results[0]["hf_compile_ddp"]["aligned_caps"]
