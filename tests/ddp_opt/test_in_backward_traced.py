"""The optimizer in backward under compile_ddp(strategy="traced") (Note [Traced update]): the
update traced into the compiled backward graph, step by step equal to a plain
``optimizer.step()`` after backward (SGD momentum, AdamW; with and without ``no_sync``
accumulation; fp32 and bf16 all-reduce; an LR scheduler), and the optimizers it refuses."""

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _graph_caches import compile_every_graph

from compiler import SettingError
from ddp_opt import compile_ddp

STEPS = 4
VOCAB, WIDTH, SEQ = 64, 32, 16


class _TiedNet(torch.nn.Module):
    """A small language model with a tied head, called as the example GPT is (``model(x, y) -> (logits,
    loss)``). Not the GPT: its attention's key bias has a gradient of rounding noise only, which Adam
    scales up to a full step, so compiled and eager gradients' last bits would decide its update."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(),
                                          torch.nn.Linear(2 * WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x, y):
        h = self.embed(x)
        logits = self.head(h + self.blocks(h))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
# Parameters and losses: the update's arithmetic is torch.optim's, with the learning rate and Adam's bias
# corrections as 0-dim tensors (float64, as torch.optim's Python floats) instead of numbers, so the two
# differ in float32's last bit (fused multiply-adds). With gradients all-reduced in bf16 such a bit can move
# a gradient element across a bf16 rounding boundary at the next step: one bf16 ulp of one gradient element,
# 2**-7 of it at the bottom of a binade and 2**-8 at the top, so up to lr * |g| / 128 on its parameter (momentum
# carries it on, each step's learning rate half the last's). ATOL_BF16 is twice the 2e-5 first set for
# lr * |g| / 256, at which SGD failed by one element of 2048 (2.44e-5 off, step 2) on an AMD EPYC host; a wrong
# update is off by about lr * |g|, some 100 times more.
RTOL, ATOL, ATOL_BF16 = 1e-5, 1e-6, 4e-5


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2)
    if name == "nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-2, amsgrad=True, foreach=True)


def _batch(rank, step, batch=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _train(rank, name, reduce_dtype, accumulate, backend, in_backward, reload=False):
    """STEPS steps of one model, each (with ``accumulate``) a no_sync micro-batch and a synchronised
    one, the learning rate halved by a scheduler at each; the update in backward, or
    ``optimizer.step()`` after it. ``backend=None``: eager DDP. Returns per step the loss, the
    parameters, whether backward left gradients and how many backward graphs were compiled so far,
    and the optimizer's state at the end; and the traced plan's fused all-reduces (``TracedPlan.fused``).
    ``reload``: the optimizer loads a copy of its own state dict (new state tensors) after step 1."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TiedNet()
    ddp = DDP(model, bucket_cap_mb=0.005)
    compiled, compiles = ddp, []
    opt = _optimizer(name, model.parameters())
    if backend is not None:
        compiled = compile_ddp(ddp, backend=backend, strategy="traced", reduce_dtype=reduce_dtype,
                               optimizer=opt if in_backward else None)
        compile_backward = compiled.traced.backend_fn
        compiled.traced.backend_fn = lambda *a, **kw: compiles.append(1) or compile_backward(*a, **kw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    backward = compiled.backward if backend is not None else (lambda loss: loss.backward())
    steps = []
    for step in range(STEPS):
        (x0, y0), (x1, y1) = _batch(rank, 2 * step), _batch(rank, 2 * step + 1)
        accumulated = True
        if accumulate:
            with compiled.no_sync():
                backward(compiled(x0, y0)[1])
            accumulated = all(p.grad is not None for p in model.parameters())
        loss = compiled(x1, y1)[1]
        backward(loss)
        left = [n for n, p in model.named_parameters() if p.grad is not None]
        opt.step()  # after an update in backward: finds no gradient, changes nothing
        opt.zero_grad()
        scheduler.step()
        if reload and step == 1:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        steps.append(dict(loss=loss.item(), left=left, accumulated=accumulated,
                          params={n: p.detach().clone() for n, p in model.named_parameters()},
                          compiles=len(compiles), state=copy.deepcopy(opt.state_dict()["state"])))
    return steps, (compiled.traced.fused if backend is not None else None)


def _compare(rank, got, want, what, atol=ATOL):
    for step, (g, w) in enumerate(zip(got, want)):
        assert g["loss"] == pytest.approx(w["loss"], rel=RTOL, abs=ATOL), f"{what}: rank {rank} step {step} loss"
        for name, p in g["params"].items():
            torch.testing.assert_close(p, w["params"][name], rtol=RTOL, atol=atol,
                                       msg=lambda m: f"{what}: rank {rank} step {step} parameter {name}: {m}")


def _parity_rank(rank, world_size, name):
    """Every combination of reduce dtype and accumulation: the update in the traced backward against
    a plain step after backward (fp32: eager DDP; bf16: the traced strategy with the same reduce dtype)."""
    checked = []
    for reduce_dtype in (None, torch.bfloat16):
        for accumulate in (False, True):
            what = f"{name} reduce_dtype={reduce_dtype} accumulate={accumulate}"
            got, _ = _train(rank, name, reduce_dtype, accumulate, "aot_eager", in_backward=True)
            want, _ = _train(rank, name, reduce_dtype, accumulate, None if reduce_dtype is None else "aot_eager",
                             in_backward=False)
            _compare(rank, got, want, what, ATOL if reduce_dtype is None else ATOL_BF16)
            for step, g in enumerate(got):
                assert g["left"] == [], f"{what}: step {step}: backward left gradients of {g['left']}"
                assert g["accumulated"], f"{what}: step {step}: the no_sync backward updated (freed gradients)"
            # The scheduler changed the learning rate at every step; the backward compiled in the first step only.
            assert got[-1]["compiles"] == got[0]["compiles"] > 0, (what, [g["compiles"] for g in got])
            worst = max((g["params"][n] - w["params"][n]).abs().max().item()
                        for g, w in zip(got, want) for n in g["params"])  # the largest difference, to report
            checked.append((what, got[0]["loss"], worst))
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_two_rank_update_in_traced_backward_matches_a_step_after_backward(run_ranks, name):
    results = run_ranks(_parity_rank, name, timeout=900)
    assert len(results[0]) == len(results[1]) == 4, results
    for (what, loss0, _), (_, loss1, _) in zip(*results):
        assert loss0 != loss1, what  # the ranks saw different data (and stayed in sync: compared to DDP's)


def test_one_rank_nesterov_and_amsgrad_adam_match_a_step_after_backward(gloo, clean_dynamo):
    # In process (one gloo rank): the rules' other branches, without accumulation and with it. The
    # optimizer reloads its state dict midway (a resume): the update goes on in the new state tensors.
    for name, accumulate in (("nesterov", False), ("adam", True)):
        got, _ = _train(0, name, None, accumulate, "aot_eager", in_backward=True, reload=True)
        want, _ = _train(0, name, None, accumulate, None, in_backward=False, reload=True)
        _compare(0, got, want, name)
        assert all(g["left"] == [] for g in got)
        for step, (g, w) in enumerate(zip(got, want)):
            assert g["state"].keys() == w["state"].keys()
            for index, state in g["state"].items():
                assert state.keys() == w["state"][index].keys(), (step, index)
                for key, value in state.items():
                    torch.testing.assert_close(value, w["state"][index][key], rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"{name} step {step} state {index} {key}: {m}")


def _refused(optimizer_fn, **compile_kwargs):
    torch.manual_seed(0)
    ddp = DDP(_TiedNet())
    compile_ddp(ddp, backend="aot_eager", strategy="traced", optimizer=optimizer_fn(ddp.parameters()),
                **compile_kwargs)


def test_optimizers_the_traced_update_does_not_model_are_refused_with_the_fix(gloo, clean_dynamo):
    fix = r"Compile with strategy='split', which steps any optimizer inside backward, or drop optimizer="
    with pytest.raises(SettingError, match=r"strategy='traced', optimizer=\.\.\.\): RMSprop is not one of the "
                                           r"optimizers whose update is traced .*\(Adam, AdamW, SGD\)\. " + fix):
        _refused(lambda params: torch.optim.RMSprop(params))
    with pytest.raises(SettingError, match=r"SGD\(dampening=0\.5\) starts its momentum from the first gradient "
                                           r"undamped.*\. " + fix):
        _refused(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5))
    with pytest.raises(SettingError, match=r"compression='powersgd:1:10' writes each gradient after its hook "
                                           r"returned, so an update right after it would read it unreduced\. " + fix):
        _refused(lambda params: torch.optim.SGD(params, lr=0.1), compression="powersgd:1:10")


def _inductor_rank(rank, world_size):
    compile_every_graph()  # the fusion is recorded when the pass runs (Note [Graph caches off, kernel files kept])
    return [_train(rank, "adamw", None, True, "inductor", in_backward) for in_backward in (True, False)]


@pytest.mark.slow
def test_two_rank_inductor_fuses_the_buckets_with_the_update_in_backward(run_ranks):
    # Inductor's fusion pass found the reduced gradients read by the update (Note [Traced update]): the
    # buckets are those of the same backward without it. Against the traced strategy with a step after
    # backward (the same compiled forward and backward): only where the update runs differs.
    for rank, ((got, fused), (want, want_fused)) in enumerate(run_ranks(_inductor_rank, timeout=900)):
        assert len(fused) == 1 and len(fused[0]) > 1 and fused == want_fused, (fused, want_fused)
        _compare(rank, got, want, "inductor adamw")
        assert all(g["left"] == [] and g["accumulated"] for g in got)
