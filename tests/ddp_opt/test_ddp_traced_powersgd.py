"""compile_ddp(strategy="traced", compression="powersgd:R:START"): PowerSGD traced into the compiled
backward (Note [Traced PowerSGD]), step by step against eager DDP with PyTorch's hook from the same
first Q, and the collectives it traces."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_opt import compile_ddp
from ddp_opt.compression.powersgd import SequencedState, sequenced_powersgd_hook
from ddp_opt.compression.factors import orthogonalize, project, project_back

RANK, START, STEPS = 4, 3, 7
CAP_MB = 0.03  # 31 KB: below one 96 x 96 layer (36.9 KB), so each bucket closes at one such layer
_ALL_REDUCE = {torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_reduce}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Compressed at rank 4: the 96 x 64 and the three 96 x 96 weights. Sent whole: the biases, and the
    # 4 x 96 head, whose P and Q would be larger than half of it.
    hidden = [m for _ in range(3) for m in (torch.nn.Linear(96, 96), torch.nn.Tanh())]
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), *hidden, torch.nn.Linear(96, 4))


def _train(rank: int, ddp: DDP, call, backward) -> dict:
    model = ddp.module
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    losses, grads = [], []
    for _ in range(STEPS):
        with ddp.no_sync():  # gradient accumulation: a micro-batch reduced with the next one
            backward(call(torch.randn(8, 64, generator=data)).square().mean())
        loss = call(torch.randn(8, 64, generator=data)).square().mean()
        backward(loss)
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads}


def _prefilled(first_qs: list[torch.Tensor | None], params: list[torch.nn.Parameter]):
    """PyTorch's hook (in DDP's order) whose first Q of each bucket is ours: its memories laid out
    as the hook lays them (the bucket's compressed matrices grouped by shape)."""
    index = {id(p): i for i, p in enumerate(params)}

    def hook(state, bucket):
        b = bucket.index()
        if state.iter >= state.start_powerSGD_iter and b not in state.p_memory_dict:
            by_shape = defaultdict(list)
            for param in bucket.parameters():
                q = first_qs[index[id(param)]]
                if q is not None:
                    by_shape[(param.shape[0], param[0].numel())].append(q)
            qs = [q for group in by_shape.values() for q in group]
            state.q_memory_dict[b] = torch.cat([q.reshape(-1) for q in qs])
            state.p_memory_dict[b] = torch.empty(sum(n * q.shape[1] for (n, _), g in by_shape.items() for q in g))
        return sequenced_powersgd_hook(state, bucket)

    return hook


def _parity_rank(rank: int, world_size: int) -> dict:
    traced_graphs = []

    def counting(gm, example_inputs, **kwargs):
        ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _ALL_REDUCE]
        if ops:
            traced_graphs.append(len(ops))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    ddp = DDP(_model(), bucket_cap_mb=CAP_MB)
    compiled = compile_ddp(ddp, backend=counting, strategy="traced", compression=f"powersgd:{RANK}:{START}")
    state = compiled.traced_hook
    first_qs = [None if q is None else q.clone() for q in state.qs]
    ours = _train(rank, ddp, compiled, compiled.backward)

    reference = DDP(_model(), bucket_cap_mb=CAP_MB)
    pytorch = SequencedState(reference.process_group, matrix_approximation_rank=RANK, start_powerSGD_iter=START,
                             use_error_feedback=True, warm_start=True, random_seed=0)
    reference.register_comm_hook(pytorch, _prefilled(first_qs, list(reference.module.parameters())))
    expected = _train(rank, reference, reference, lambda loss: loss.backward())
    return {"ours": ours, "reference": expected, "graphs": traced_graphs, "compressed": state.compressed,
            "steps": state.steps, "layout": state.layout, "errors": [float(e.abs().sum()) for e in state.errors if e is not None]}


def test_traced_powersgd_matches_eager_ddp_with_pytorchs_hook(run_ranks):
    results = run_ranks(_parity_rank, timeout=600)
    for r in results:
        assert r["compressed"] == 4 and r["steps"] == STEPS  # the no_sync backwards are not steps
        # Two synchronised backward graphs: the first START steps' (10 all-reduces: aot_eager does not fuse
        # them), then, compiled once more at step START, four buckets (the head and the fourth layer, then
        # one layer each), each one all-reduce of its P's and whole gradients and one of its Q's: up to
        # three buckets in flight at once.
        assert r["graphs"] == [10, 8] and r["layout"] == (4, 2, 2, 2)
        assert all(e > 0 for e in r["errors"]), r["errors"]  # the error feedback holds what rank 4 left out
        for step, (ours, ref) in enumerate(zip(r["ours"]["grads"], r["reference"]["grads"])):
            for a, b in zip(ours, ref):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        assert r["ours"]["losses"] == pytest.approx(r["reference"]["losses"], rel=1e-5)
    # The ranks saw different batches, and end with the same gradients: the compressed reduction agrees.
    for a, b in zip(results[0]["ours"]["grads"][-1], results[1]["ours"]["grads"][-1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("columns", [1, 2, 4])
def test_orthogonalize_is_pytorchs(columns):
    matrix = torch.randn(50, columns, generator=torch.Generator().manual_seed(3))
    theirs = matrix.clone().unsqueeze(0)
    _orthogonalize(theirs)
    torch.testing.assert_close(orthogonalize(matrix), theirs[0])


@pytest.mark.parametrize("shape", [(1024, 256), (256, 1024), (96, 64)])
def test_the_transposed_products_are_the_plain_ones(shape):
    g = torch.Generator().manual_seed(5)
    matrix = torch.randn(*shape, generator=g)
    q, p = torch.randn(shape[1], 4, generator=g), torch.randn(shape[0], 4, generator=g)
    torch.testing.assert_close(project(matrix, q), matrix @ q, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(project_back(matrix, p), matrix.t() @ p, rtol=1e-5, atol=1e-4)
    assert project(matrix, q).shape == (shape[0], 4) and project_back(matrix, p).shape == (shape[1], 4)


class _LeavesOneOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


_LEFT_OUT = (r"^compile_ddp\(strategy='traced', compression='powersgd:2:2'\): the last backward gave gradients to 2 "
             r"of the 4 parameters DDP reduces, .* freeze the others \(requires_grad=False\) before DDP\(...\) and "
             r"compile_ddp, or use strategy='split' with DDP\(..., find_unused_parameters=True\).$")


def test_a_backward_that_leaves_a_parameter_out_is_refused_before_the_optimizer_step(gloo, clean_dynamo):
    ddp = DDP(_LeavesOneOut())
    compiled = compile_ddp(ddp, backend="aot_eager", strategy="traced", compression="powersgd:2:2")
    x = torch.randn(4, 32)
    for _ in range(2):  # two uncompressed steps
        compiled.backward(compiled(x).sum())
    with pytest.raises(RuntimeError, match=_LEFT_OUT):  # the first compressed one leaves `unused` out
        compiled.backward(compiled(x).sum())
    compiled(x).sum().backward()  # a plain backward: refused at the next forward, which also warns of it
    with pytest.warns(UserWarning, match="without compiled.backward"), pytest.raises(RuntimeError, match=_LEFT_OUT):
        compiled(x)
